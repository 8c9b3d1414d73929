"""Drop-in, slime's call shapes: the process starts with
LD_PRELOAD=<site-packages>/torch_memory_saver_hook_mode_preload_cu13.abi3.so (the name slime
hard-codes), TMS_INIT_ENABLE=1 and TMS_INIT_ENABLE_CPU_BACKUP=1; the model is allocated
outside any region (tag "default", backed up); Megatron's buffers in nested
region(tag="grad_buffer"/"param_buffer", enable_cpu_backup=False); a communication buffer
allocated with cudaMalloc while tracking is switched off through
torch_memory_saver._impl._binary_wrapper.cdll.tms_set_interesting_region(False) (slime's
DeepEP patch) is not paused; untagged pause()/resume(); get_cpu_backup(x, zero_copy=True);
weight updates under disable() give their memory back."""
import os
import sys

import torch
import torch_memory_saver as tms_module

from _common import (GiB, MiB, begin, check, check_disable_gives_memory_back, check_equal, check_installed,
                     check_owned, check_released, check_taken, core, free_bytes, owner, raw_cuda_free,
                     raw_cuda_malloc, raw_tensor, say, tag_bytes)

SLIME_NAME = "torch_memory_saver_hook_mode_preload_cu13.abi3.so"


def main(hook_mode):
    check(hook_mode == "preload", "slime runs in preload mode")
    site = os.path.dirname(os.path.dirname(tms_module.__file__))
    check(os.environ.get("LD_PRELOAD") == os.path.join(site, SLIME_NAME),
          f"LD_PRELOAD is {os.environ.get('LD_PRELOAD')!r}, not slime's {os.path.join(site, SLIME_NAME)!r}")
    check(os.environ.get("TMS_INIT_ENABLE") == "1" and os.environ.get("TMS_INIT_ENABLE_CPU_BACKUP") == "1",
          "run with TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1")
    tms = begin("compat_slime", hook_mode)   # checks this library's cudaMalloc is the process's
    check_installed()
    tms.memory_margin_bytes = 1 << 30
    free_bytes()

    params = [torch.randn(64 * MiB, device="cuda") for _ in range(4)]       # 1 GiB, tag "default"
    expected = [p.cpu() for p in params]
    for i, p in enumerate(params):
        check_owned(p, "default", f"parameter {i}")
    with tms.region(tag="param_buffer", enable_cpu_backup=False):
        param_buffer = torch.zeros(128 * MiB, dtype=torch.uint8, device="cuda")
        with tms.region(tag="grad_buffer", enable_cpu_backup=False):
            grad_buffer = torch.zeros(256 * MiB, dtype=torch.uint8, device="cuda")
        check(core().get_region() == (True, "param_buffer", False, "mmap", False, None, None), f"inner exit: {core().get_region()}")
    check(core().get_region() == (True, "default", True, "mmap", False, None, None), f"outer exit: {core().get_region()}")
    check_owned(param_buffer, "param_buffer", "param buffer")
    check_owned(grad_buffer, "grad_buffer", "grad buffer")

    # slime's DeepEP patch: tracking off around the communication buffer's allocation.
    tms_module.torch_memory_saver._ensure_initialized()
    check(tms_module.torch_memory_saver._impl is not None, "_impl is None after _ensure_initialized()")
    cdll = tms_module.torch_memory_saver._impl._binary_wrapper.cdll
    check(cdll.tms_get_interesting_region() is True, "tms_get_interesting_region() is not True under TMS_INIT_ENABLE")
    cdll.tms_set_interesting_region(False)
    comm_bytes = 96 * MiB + 4096
    comm = raw_cuda_malloc(comm_bytes)
    torch.cuda.synchronize()
    cdll.tms_set_interesting_region(True)
    check(owner(comm) is None, "the buffer allocated with tracking off is a torch_memory_saver allocation")
    comm_view = raw_tensor(comm, comm_bytes)
    comm_data = torch.randint(0, 256, (comm_bytes,), dtype=torch.uint8)   # host: the default tag pauses too
    comm_view.copy_(comm_data)
    say("communication buffer allocated with tracking off is ordinary memory")

    check_disable_gives_memory_back(tms, "while active", 4 * GiB)
    held = sum(tag_bytes(t) for t in ("default", "param_buffer", "grad_buffer"))
    check_released(tms.pause(), held, "pause() of every tag")
    check_equal(comm_view, comm_data, "communication buffer while paused")
    for i, p in enumerate(params):
        check_equal(tms.get_cpu_backup(p, zero_copy=True), expected[i], f"get_cpu_backup(param {i}, zero_copy)")
    check(tms.get_cpu_backup(grad_buffer) is None, "grad buffer (no backup) has a CPU backup")
    check_disable_gives_memory_back(tms, "while paused", 4 * GiB)

    check_taken(tms.resume(), held, "resume() of every tag")
    torch.cuda.synchronize()
    for i, p in enumerate(params):
        check_equal(p, expected[i], f"parameter {i} after resume")
    grad_buffer.fill_(5)
    check(int(grad_buffer[::4096].min()) == 5, "grad buffer not usable after resume")
    raw_cuda_free(comm)
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
