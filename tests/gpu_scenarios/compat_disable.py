"""Drop-in (issue 10): memory allocated inside disable() and freed before the block ends goes
back to the driver when the block exits (inside a region, after a pause, outside regions, and
nested); what is allocated inside is ordinary memory that CUDA IPC shares with a child process
(torch.multiprocessing)."""
import sys

import torch
import torch.multiprocessing as mp

from _common import GiB, MiB, begin, check, check_equal, check_installed, free_bytes, owner, say


def ipc_child(inbox, outbox):
    try:
        t = inbox.get()
        outbox.put(("ok", t.cpu().numpy().tobytes()))   # plain bytes: this process may end first
    except BaseException as e:  # reported by the parent
        outbox.put(("error", repr(e)))


def in_and_out(tms, what, nbytes=2 * GiB):
    """Allocates and frees nbytes under disable(); free memory must be back within 10 MiB."""
    before = free_bytes()
    with tms.disable():
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t.fill_(9)
        check(owner(t) is None, f"{what}: a tensor allocated under disable() is pauseable")
        del t
    after = free_bytes()
    say(f"  {what}: free memory moved by {(after - before) / MiB:.1f} MiB")
    check(abs(after - before) <= 10 * MiB,
          f"{what}: {(before - after) / MiB:.0f} MiB held after disable() (2 GiB allocated and freed inside)")


def main(hook_mode):
    tms = begin("compat_disable", hook_mode)
    check_installed()
    torch.empty(MiB, dtype=torch.uint8, device="cuda").fill_(9)   # CUDA context and the fill kernel loaded
    free_bytes()
    in_and_out(tms, "outside any region")
    with tms.region(tag="w", enable_cpu_backup=True):
        w = torch.randn(64 * MiB, device="cuda")
        in_and_out(tms, "inside a region")
        with tms.disable():
            with tms.region(tag="inner"):
                inner = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
            in_and_out(tms, "nested disable() inside disable()")
        after_disable = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    check(owner(inner) is not None and owner(inner)["tag"] == "inner", "region inside disable() not pauseable")
    check(owner(after_disable) is not None and owner(after_disable)["tag"] == "w",
          "the region does not continue after disable()")
    expected = w.cpu()
    tms.pause("w")
    in_and_out(tms, "while the tag is paused")
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
