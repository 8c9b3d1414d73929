"""Region tensors shared with another process on the GPU: a tensor of a backed-up
region goes through a torch.multiprocessing (spawn) queue; the child reads the same
bytes and its writes are seen here; a pause while the child holds it is refused
naming the tag and the child's pid; once the child lets go the pause releases every
byte of the allocation (its report, with nothing unconfirmed), and the resume brings
back the child's bytes. Then the same through
share() / open_shared(), on the other GPU too where there are two."""
import gc
import sys

import torch

from _common import MiB, begin, check, check_released, check_taken, free_bytes, say, tag_bytes

TAG = "weights"
N = 16 * MiB  # int32 elements: 64 MiB


def child(hook_mode, inbox, outbox):
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    while True:
        msg = inbox.get()
        if msg[0] == "exit":
            return
        if msg[0] == "tensor":  # through PyTorch's own reductions
            _, x, expected = msg
        else:  # ("shared", handle, expected, device)
            _, shared, expected, device = msg
            x = tms.open_shared(shared, device=device)
        outbox.put(("read", bool(torch.equal(x.cpu(), expected)), x.device.index))
        x.fill_(7)
        torch.cuda.synchronize()
        outbox.put(("wrote",))
        inbox.get()  # "release"
        del x, msg  # the message holds the received tensor too
        gc.collect()
        torch.cuda.synchronize()
        outbox.put(("released",))


def expect_refused(tms, pid):
    try:
        tms.pause(TAG)
    except Exception as e:  # torch_memory_saver.Error
        text = str(e)
        check(f"tag '{TAG}'" in text and "is mapped by 1 other process" in text and f"pid {pid}" in text, text)
        say(f"pause while the child holds it: refused ({text[:90]}...)")
        return
    raise AssertionError("pause of memory another process maps was not refused")


def check_let_go(report, held, what):
    """The pause released every byte of the allocation, none of it unconfirmed: the
    child said it let go (a receiver that hung up without saying so is listed apart
    and its bytes are not counted released)."""
    check(report.unconfirmed == [], f"{what}: unconfirmed {report.unconfirmed}")
    check_released(report, held, what)


def round_trip(tms, inbox, outbox, proc, msg, what):
    inbox.put(msg)
    got = outbox.get(timeout=120)
    check(got[0] == "read" and got[1], f"{what}: the child read other bytes than were written: {got}")
    check(outbox.get(timeout=120) == ("wrote",), f"{what}: the child did not write")
    return got[2]


def main(hook_mode):
    tms = begin("share_ipc", hook_mode)
    free_bytes()
    with tms.region(TAG, enable_cpu_backup=True):
        t = torch.randint(-2**31, 2**31 - 1, (N,), dtype=torch.int32, device="cuda")
    held = tag_bytes(TAG)
    ctx = torch.multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(hook_mode, inbox, outbox), daemon=True)  # a failure here ends it too
    proc.start()

    # torch.multiprocessing: the reductions call the runtime's IPC functions on our memory.
    round_trip(tms, inbox, outbox, proc, ("tensor", t, t.cpu()), "torch.multiprocessing")
    check(bool((t == 7).all()), "the child's writes are not seen here")
    say("torch.multiprocessing: the child read the bytes, its writes are seen here")
    expect_refused(tms, proc.pid)
    inbox.put(("release",))
    check(outbox.get(timeout=120) == ("released",), "the child did not let go")
    check_let_go(tms.pause(TAG), held, "pause after the child let go")
    check_taken(tms.resume(TAG), held, "resume after the child let go")
    check(bool((t == 7).all()), "the resume did not bring back the child's bytes")

    # share() / open_shared(): a view at an offset, on each device there is.
    view = t[N // 4:].view(torch.float32)
    view.copy_(torch.randn(view.shape, device="cuda"))
    devices = [0, 1] if torch.cuda.device_count() > 1 else [0]
    for device in devices:
        shared = tms.share(view)
        opened_on = round_trip(tms, inbox, outbox, proc, ("shared", shared, view.cpu(), device), "share()")
        check(opened_on == device, f"open_shared(device={device}) gave a tensor on device {opened_on}")
        check(bool((view == 7).all()), "the child's writes are not seen here")
        expect_refused(tms, proc.pid)
        inbox.put(("release",))
        check(outbox.get(timeout=120) == ("released",), "the child did not let go")
        check_let_go(tms.pause(TAG), held, f"pause after open_shared on device {device}")
        check_taken(tms.resume(TAG), held, f"resume after open_shared on device {device}")
        view.copy_(torch.randn(view.shape, device="cuda"))
        say(f"share()/open_shared() on device {device}: bytes equal both ways, pause frees after the close")
    if len(devices) == 1:
        say("one GPU: open_shared on another device not tried")
    inbox.put(("exit",))
    proc.join(timeout=120)
    check(proc.exitcode == 0, f"the child exited with {proc.exitcode}")
    say("OK")


if __name__ == "__main__":
    main(sys.argv[1])
