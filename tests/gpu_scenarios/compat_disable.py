"""Drop-in: memory allocated inside disable() and freed before the block ends goes
back to the driver when the block exits (inside a region, after a pause, outside regions, and
nested); what is allocated inside is ordinary memory that CUDA IPC shares with a child process
(torch.multiprocessing)."""
import sys

import torch
import torch.multiprocessing as mp

from _common import (GiB, MiB, begin, check, check_disable_gives_memory_back, check_equal, check_installed,
                     free_bytes, owner, say)


def ipc_child(inbox, outbox):
    try:
        t = inbox.get()
        outbox.put(("ok", t.cpu().numpy().tobytes()))   # plain bytes: this process may end first
    except BaseException as e:  # reported by the parent
        outbox.put(("error", repr(e)))


def main(hook_mode):
    tms = begin("compat_disable", hook_mode)
    check_installed()
    torch.empty(MiB, dtype=torch.uint8, device="cuda").fill_(9)   # CUDA context and the fill kernel loaded
    free_bytes()
    check_disable_gives_memory_back(tms, "outside any region", 2 * GiB)
    with tms.region(tag="w", enable_cpu_backup=True):
        w = torch.randn(64 * MiB, device="cuda")
        check_disable_gives_memory_back(tms, "inside a region", 2 * GiB)
        with tms.disable():
            with tms.region(tag="inner"):
                inner = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
            check_disable_gives_memory_back(tms, "nested disable() inside disable()", 2 * GiB)
        after_disable = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    check(owner(inner) is not None and owner(inner)["tag"] == "inner", "region inside disable() not pauseable")
    check(owner(after_disable) is not None and owner(after_disable)["tag"] == "w",
          "the region does not continue after disable()")
    expected = w.cpu()
    tms.pause("w")
    check_disable_gives_memory_back(tms, "while the tag is paused", 2 * GiB)
    tms.resume("w")
    check_equal(w, expected, "region tensor after resume")

    # Ordinary memory: CUDA IPC hands it to another process.
    with tms.disable():
        shared = torch.randint(-2**31, 2**31 - 1, (MiB,), dtype=torch.int32, device="cuda")
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=ipc_child, args=(inbox, outbox))
    child.start()
    inbox.put(shared)
    status, got = outbox.get(timeout=240)
    child.join(60)
    check(status == "ok", f"child could not read the shared tensor: {got}")
    check(got == shared.cpu().numpy().tobytes(), "the child read other bytes than the shared tensor holds")
    check(child.exitcode == 0, f"IPC child exited {child.exitcode}")
    say("tensor allocated under disable() shared through CUDA IPC")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
