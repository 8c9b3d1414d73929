"""Scenario 10: pause() right after launching a long chain of kernels that write
a region tensor on a side stream, without synchronizing. Pause must wait for
them: the backed-up contents are the chain's final result (equal to the same
chain run on a reference copy), and a region without backup does not fault."""
import sys

import torch

from _common import MiB, begin, check, check_equal, check_filled, check_owned, free_bytes, say

STEPS = 200  # 400 kernels over 256 MiB: tens of ms of GPU work, launched in a few ms


def launch_chain(t, stream):
    with torch.cuda.stream(stream):
        for _ in range(STEPS):
            t.mul_(1.0001).add_(1.0)


def main(hook_mode):
    tms = begin("pause_during_kernel", hook_mode)
    free_bytes()
    side = torch.cuda.Stream()
    warm = torch.ones(1024, device="cuda")
    launch_chain(warm, side)   # kernels loaded before anything is timed
    torch.cuda.synchronize()

    say("-- region with backup: the backup holds the chain's final result")
    with tms.region(tag="k", enable_cpu_backup=True):
        t = torch.rand(64 * MiB, device="cuda")            # 256 MiB
    check_owned(t, "k", "region tensor")
    reference = t.clone()                                   # ordinary memory, same values
    torch.cuda.synchronize()
    side.wait_stream(torch.cuda.current_stream())
    launch_chain(t, side)
    in_flight = not side.query()
    tms.pause("k")                                          # no synchronize before it
    say(f"pause() called with the chain {'still running' if in_flight else 'ALREADY FINISHED'}")
    check(in_flight, "the kernel chain finished before pause(); the scenario did not test a pause during work")
    tms.resume("k")

    launch_chain(reference, side)                          # the same kernels on the reference copy
    torch.cuda.synchronize()
    check_equal(t, reference.cpu(), "tensor after pause/resume vs the chain run on a reference copy")
    say("restored contents are the chain's final result")

    say("-- region without backup: pausing under running kernels must not fault")
    with tms.region(tag="k_discard"):
        u = torch.rand(64 * MiB, device="cuda")
    check_owned(u, "k_discard", "region tensor without backup")
    torch.cuda.synchronize()
    side.wait_stream(torch.cuda.current_stream())
    launch_chain(u, side)
    in_flight = not side.query()
    tms.pause("k_discard")
    check(in_flight, "the kernel chain finished before pause(); the scenario did not test a pause during work")
    tms.resume("k_discard")
    torch.cuda.synchronize()   # a fault of the chain would surface here as a CUDA error
    u.fill_(1.0)
    check_filled(u, 1.0, "tensor without backup after resume")
    check_equal(t, reference.cpu(), "backed-up tensor after the other tag's cycle")
    say("no fault; memory usable after resume")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
