"""`make bench` compares discard-mode pause/resume with the driver's own loop
cycled beside it in the same process (the paired floor): a floor measured in a
process of its own moves, for one large allocation, from one process to the
next. No GPU here: the cycles run on the host backend beside a stand-in for
floor.Paired, and the report is fed made-up figures."""
import ctypes
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import run  # noqa: E402

LOG = []  # what the stand-in and the library's pauses did, in order (in the child)


class StandIn:
    """floor.Paired without a GPU: figures made up from the cycle's number."""

    def __init__(self, lib, count, size):
        if lib == "no room":
            raise RuntimeError("vmm_floor_hold(%d, %d): out of memory" % (count, size))
        self.shape, self.fail_at = (count, size), (3 if lib == "fails" else None)
        # Resident memory of its own, as the floor's device memory: a pause
        # frees the tag's bytes, not the floor's (past the check's 64 MiB slack).
        self.held = bytearray(256 << 20)
        ctypes.memset((ctypes.c_char * len(self.held)).from_buffer(self.held), 1, len(self.held))
        LOG.append(("hold", count, size))

    def cycle(self, value, idle_s=0.0):
        if value == self.fail_at:
            raise RuntimeError("vmm_floor_cycle: device lost")
        LOG.append(("floor", value))
        return 0.001 * (value + 1), 0.002 * (value + 1)

    def close(self):
        self.held = None
        LOG.append(("close",))


def _each_floor(run_one):
    """{floor library: {"entry"/"point": what run_one returned, "log": LOG}} for a floor
    that pairs, one that has no room and one that fails mid-way; as JSON has it, as the
    benchmark's report would."""
    from benchmarks import floor

    floor.Paired = StandIn
    out = {}
    for lib in ("lib.so", "no room", "fails"):
        del LOG[:]
        out[lib] = {**run_one(lib), "log": LOG[:]}
    return json.loads(json.dumps(out))


def cycles_beside_a_stand_in():
    """benchmarks.cycles.latency's cycles, each paired with a stand-in floor's."""
    from benchmarks import cycles
    from benchmarks.common import Deadline
    from benchmarks.envs import HostEnv

    env = HostEnv("torch")
    real_pause = env.tms.pause
    env.tms.pause = lambda tag: (LOG.append(("pause",)), real_pause(tag))[1]

    def one(lib):
        params = {"shapes": [[3, 2 << 20]], "cycles": 4, "warmup": 1, "floor_lib": lib}
        (entry,) = cycles.latency(env, params, Deadline(1e18))["shapes"]
        return {"entry": entry}
    return _each_floor(one)


def alloc_count_beside_a_stand_in():
    """benchmarks.alloc_count's worker pairs its cycles through the same floor.Beside."""
    from benchmarks import alloc_count
    from torch_memory_saver import torch_memory_saver as tms

    real_pause = tms.pause
    tms.pause = lambda tag: (LOG.append(("pause",)), real_pause(tag))[1]
    return _each_floor(lambda lib: {"point": alloc_count.worker([2], 4, 1, True, floor_lib=lib)["points"][0]})


def speed_beside_a_stand_in():
    """benchmarks.speed's discard and allocation cycles through the same floor.Beside, and the rows made of them."""
    from benchmarks import speed
    from benchmarks.envs import HostEnv

    env = HostEnv("torch")
    real_pause = env.tms.pause
    env.tms.pause = lambda tag: (LOG.append(("pause",)), real_pause(tag))[1]

    def one(lib):
        (lat,), alloc = speed._latency(env, env.tms, [(3, 2 << 20)], 4, lib), speed._alloc(env, env.tms, [2 << 20] * 2,
                                                                                           4, lib)
        worker = {"library": lib, "label": "ours", "mode": "torch", "init": False,
                  "sections": {"latency": [lat], "alloc": alloc}}
        return {"lat": lat, "alloc": alloc, "rows": speed.figures({"workers": [worker]})[("ours", "torch", False)]}
    return _each_floor(one)


@pytest.fixture
def run_cycles(in_child):
    return lambda: in_child(cycles_beside_a_stand_in, timeout=120)


def test_each_library_cycle_runs_beside_one_floor_cycle_before_and_after_in_turn(run_cycles):
    out = run_cycles()["lib.so"]
    entry, log = out["entry"], [tuple(x) for x in out["log"]]
    size = entry["reserved_size"]
    assert log[0] == ("hold", entry["allocations"], size) and log[-1] == ("close",)
    # Cycle 0 (warm-up): floor first; cycle 1: library first; and so on.
    assert log[1:-1] == [("floor", 0), ("pause",), ("pause",), ("floor", 1), ("floor", 2), ("pause",), ("pause",),
                         ("floor", 3), ("floor", 4), ("pause",)]
    # The warm-up cycle's floor figures are dropped with the library's.
    assert entry["paired_pause_s"] == [0.002, 0.003, 0.004, 0.005]
    assert entry["paired_resume_s"] == [0.004, 0.006, 0.008, 0.010]
    assert entry["paired_pause_median_s"] == 0.0035 and entry["paired_resume_median_s"] == 0.007
    assert entry["paired_pause_min_s"] == 0.002 and entry["paired_resume_min_s"] == 0.004
    assert len(entry["pause_s"]) == 4 and entry["pause_median_s"] > 0
    assert entry["freed_ok"] is True, entry["freed_bytes"]  # the floor's memory, held throughout, is not the tag's


def test_without_a_paired_floor_the_library_figures_stay_and_a_note_says_why(run_cycles):
    out = run_cycles()
    for lib, why in (("no room", "no paired floor: vmm_floor_hold("), ("fails", "no paired floor: vmm_floor_cycle: "
                                                                              "device lost")):
        entry = out[lib]["entry"]
        assert entry["paired_note"].startswith(why), entry
        assert "paired_pause_median_s" not in entry
        assert len(entry["pause_s"]) == 4 and entry["freed_ok"] is True


def test_alloc_count_pairs_its_cycles_in_turn_and_drops_a_failed_pairing(in_child):
    # The worker says its progress on stderr, as a benchmark does.
    out = in_child(alloc_count_beside_a_stand_in, timeout=120, stderr_empty=False)
    point, log = out["lib.so"]["point"], [tuple(x) for x in out["lib.so"]["log"]]
    assert log[0] == ("hold", point["allocations"], 2 << 20) and log[-1] == ("close",)
    assert log[1:-1] == [("floor", 0), ("pause",), ("pause",), ("floor", 1), ("floor", 2), ("pause",), ("pause",),
                         ("floor", 3), ("floor", 4), ("pause",)]
    assert point["pause_paired"] == [0.002, 0.003, 0.004, 0.005]  # the warm-up cycle's dropped
    assert point["resume_paired"] == [0.004, 0.006, 0.008, 0.010]
    assert "paired_error" not in point
    for lib, why in (("no room", f"vmm_floor_hold({point['allocations']}, 2097152): out of memory"),
                     ("fails", "vmm_floor_cycle: device lost")):
        point = out[lib]["point"]
        assert point["paired_error"] == why
        assert point["pause_paired"] == [] and point["resume_paired"] == []
        assert len(point["pause"]) == 4 and len(point["resume"]) == 4  # the library's figures stay


def _results(paired):
    shape = {"shape": "1x8GiB", "tensors": 1, "allocations": 1, "reserved_size": 8 << 30, "reserved_bytes": 8 << 30,
             "pause_median_s": 0.0045, "resume_median_s": 0.00052, "pause_min_s": 0.0027, "resume_min_s": 0.00046,
             "freed_bytes": [8 << 30], "freed_ok": True, "same_addresses": True, "cycles": 7}
    if paired:
        shape.update(paired_pause_median_s=0.004, paired_resume_median_s=0.0005, paired_pause_min_s=0.0025,
                     paired_resume_min_s=0.0004)
    else:
        shape.update(paired_note="no paired floor: vmm_floor_hold(1, 8589934592): out of memory")
    return {"meta": {}, "errors": [], "latency": {"preload": {"shapes": [shape]}}}


def _row(text, first):
    header = next(line for line in text.splitlines() if line.startswith("| tensors |"))
    names = [c.strip() for c in header.strip("|").split("|")]
    row = next(line for line in text.splitlines() if line.startswith(f"| {first} |"))
    return list(zip(names, [c.strip() for c in row.strip("|").split("|")]))


def test_report_holds_the_library_to_the_paired_floor():
    row = _row(run.markdown(_results(paired=True)), "1x8GiB")
    assert [v for n, v in row if n in ("pause ms", "resume ms", "paired floor ms", "ratio")] == \
        ["4.500", "4.000", "1.12×", "0.520", "0.500", "1.04×"]
    assert dict(row)["fastest cycle × paired floor's pause / resume"] == "1.08× / 1.15×"
    assert dict(row)["freed (mem_get_info)"] == "8.00 of 8.00 GiB yes" and dict(row)["note"] == "addresses kept: yes"


def test_report_without_a_paired_floor_says_why():
    row = dict(_row(run.markdown(_results(paired=False)), "1x8GiB"))
    assert row["paired floor ms"] == "-" and row["ratio"] == "-"
    assert row["fastest cycle × paired floor's pause / resume"] == "- / -"
    assert row["note"] == "addresses kept: yes; no paired floor: vmm_floor_hold(1, 8589934592): out of memory"


def test_speed_pairs_its_discard_and_allocation_cycles_and_reports_the_floor_beside_them(in_child):
    out = in_child(speed_beside_a_stand_in, timeout=120)
    got, log = out["lib.so"], [tuple(x) for x in out["lib.so"]["log"]]
    assert log == [("hold", 3, 2 << 20), ("pause",), ("floor", 0), ("floor", 1), ("pause",), ("pause",), ("floor", 2),
                   ("floor", 3), ("pause",), ("pause",), ("floor", 4), ("close",), ("hold", 2, 2 << 20)] + \
        [("floor", c) for c in range(5)] + [("close",)]
    times = [[0.001 * (c + 1), 0.002 * (c + 1)] for c in range(1, 5)]  # the warm-up cycle's dropped
    assert got["lat"]["floor"] == {"times": times, "error": None} and got["alloc"]["floor"]["times"] == times
    assert [len(got["alloc"][k]) for k in ("backed", "region", "plain")] == [4, 4, 4]
    rows = got["rows"]
    assert rows["driver floor: unmap + release 3 x 2 MiB (ms)"] == pytest.approx(3.5)
    assert rows["driver floor: create + map 3 x 2 MiB (ms)"] == pytest.approx(7.0)
    assert rows["driver floor: create + map 2 x 2 MiB (ms)"] == pytest.approx(7.0)
    assert rows["discard pause, 3 x 2 MiB over its floor"] == pytest.approx(rows["discard pause, 3 x 2 MiB (ms)"] / 3.5)
    assert rows["allocate 2 x 2 MiB alone, backed-up region over its floor"] == pytest.approx(
        rows["allocate 2 x 2 MiB alone, backed-up region (ms)"] / 7.0)
    for lib, why in (("no room", "vmm_floor_hold(3, 2097152): out of memory"), ("fails", "vmm_floor_cycle: device lost")):
        assert out[lib]["lat"]["floor"] == {"times": [], "error": why}
        assert not any(k.startswith("driver floor") for k in out[lib]["rows"]) and "discard pause, 3 x 2 MiB (ms)" in \
            out[lib]["rows"]
