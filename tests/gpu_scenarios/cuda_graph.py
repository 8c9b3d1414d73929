"""Scenario 8: a CUDA graph captured with torch_memory_saver.cuda_graph() keeps
its private-pool memory (the intermediates) in a tag: pause releases it, and
after resume the graph replays correctly on new input (its addresses are the
same). In torch mode cuda_graph passes the tag's MemPool as the graph pool."""
import sys

import torch

from _common import (MiB, begin, check, check_equal, check_released, check_states, check_taken,
                     graph_body, say, tag_bytes, warm_up)

TAG = "graph"


def main(hook_mode):
    tms = begin("cuda_graph", hook_mode)

    x = torch.randn(32 * MiB, device="cuda")    # static input, 128 MiB, ordinary memory
    warm_up(graph_body, x)
    torch.cuda.empty_cache()

    graph = torch.cuda.CUDAGraph()
    with tms.cuda_graph(graph, tag=TAG):
        out = graph_body(x)
    held = tag_bytes(TAG)
    say(f"captured: tag '{TAG}' holds {held / MiB:.0f} MiB (input {x.nbytes / MiB:.0f} MiB, two intermediates "
        f"of that size live at the peak)")
    check(held >= x.nbytes, f"the graph's memory in tag {TAG!r} is {held} bytes, less than one intermediate "
                            f"({x.nbytes}): the private pool did not go through the library")

    graph.replay()
    first = out.cpu()
    check_equal(first, graph_body(x).cpu(), "first replay vs eager")
    say("first replay matches eager computation")
    out_ptr = out.data_ptr()

    report = tms.pause(TAG)
    check_states(TAG, "paused")
    check_released(report, held, f"pause('{TAG}')")
    check_taken(tms.resume(TAG), held, f"resume('{TAG}')")

    x.copy_(torch.randn(x.shape, device="cuda"))
    graph.replay()
    check(out.data_ptr() == out_ptr, "the graph's output tensor moved")
    check_equal(out, graph_body(x).cpu(), "replay after resume on new input vs eager")
    check(not torch.equal(out.cpu(), first), "the output did not change with the new input")
    say("replay after pause/resume on new input matches eager computation")

    # And once more, to be sure the graph stays replayable across cycles.
    tms.pause(TAG)
    tms.resume(TAG)
    x.mul_(-1.0)
    graph.replay()
    check_equal(out, graph_body(x).cpu(), "replay after a second cycle vs eager")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
