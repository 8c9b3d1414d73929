"""Drop-in, Megatron-LM / NeMo-RL: torch mode set at import, no LD_PRELOAD; the
inference model is built in region(tag=..., enable_cpu_backup=True); pause(tag)/resume(tag)
around training; the model's output is unchanged. A tag never used pauses as a no-op."""
import os
import sys

from torch_memory_saver import torch_memory_saver

torch_memory_saver.hook_mode = "torch"         # as Megatron's dynamic_context does at import

import torch  # noqa: E402

from _common import (begin, check, check_equal, check_installed, check_owned, check_released, check_taken,  # noqa: E402
                     free_bytes, tag_bytes)

TAG = "nemo_rl_megatron_inference_model"


def main(hook_mode):
    check(hook_mode == "torch", "Megatron uses torch mode")
    check("torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""), "torch mode must run without LD_PRELOAD")
    tms = begin("compat_megatron", hook_mode)
    check_installed()
    free_bytes()
    with tms.region(tag=TAG, enable_cpu_backup=True):
        model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, dtype=torch.bfloat16) for _ in range(8)]).cuda()
    check_owned(model[0].weight, TAG, "a parameter")
    x = torch.randn(32, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = model(x).cpu()
    tms.pause("rl_inference_model")              # a tag never used: no-op
    held = tag_bytes(TAG)
    check_released(tms.pause(TAG), held, f"pause('{TAG}')")
    check_taken(tms.resume(TAG), held, f"resume('{TAG}')")
    with torch.no_grad():
        check_equal(model(x), out, "model output after resume")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
