"""Drop-in, AReaL's call shapes: the process starts with
LD_PRELOAD=<site-packages>/torch_memory_saver_hook_mode_preload.abi3.so, TMS_INIT_ENABLE=1 and
TMS_INIT_ENABLE_CPU_BACKUP=1; the engine sets hook_mode = "preload" and offloads/onloads with
untagged pause()/resume(). The model's memory is released and comes back bit-exact."""
import os
import sys

import torch
import torch_memory_saver

from _common import (begin, check, check_equal, check_installed, check_owned, check_released, check_taken,
                     free_bytes, say, tag_bytes)

AREAL_NAME = "torch_memory_saver_hook_mode_preload.abi3.so"


def main(hook_mode):
    check(hook_mode == "preload", "AReaL runs in preload mode")
    dynlib = os.path.join(os.path.dirname(os.path.dirname(torch_memory_saver.__file__)), AREAL_NAME)
    check(os.environ.get("LD_PRELOAD") == dynlib, f"LD_PRELOAD {os.environ.get('LD_PRELOAD')!r}, not {dynlib!r}")
    tms = begin("compat_areal", hook_mode)     # sets hook_mode = "preload" as AReaL's engine does
    check_installed()
    free_bytes()

    model = torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 8192)).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 8192, device="cuda")
    model(x).sum().backward()
    optimizer.step()                                     # optimizer state allocated too
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out = model(x).detach().cpu()
    check_owned(model[0].weight, "default", "a parameter")

    held = tag_bytes("default")
    check_released(tms.pause(), held, "offload: pause()")   # offload()
    check_taken(tms.resume(), held, "onload: resume()")     # onload()
    torch.cuda.synchronize()
    for k, v in model.state_dict().items():
        check_equal(v.detach(), state[k], f"parameter {k} after onload")
    check_equal(model(x).detach(), out, "model output after onload")
    model(x).sum().backward()
    optimizer.step()
    say("training step after onload runs")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
