"""The multi_gpu suite's arithmetic and report, from made-up process results
(no GPU): the aggregate spans from the first start to the last end, and the
start skew says how much of that span the processes did not start together."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, multi_gpu  # noqa: E402

GB = 10**9


def _process(rank, pause, resume, nbytes=50 * GB):
    cycle = {"pause": pause, "resume": resume, "verified": True, "pause_faults": 7, "huge_bytes_paused": 0, "smaps_walk_s": 0.1 + rank / 100}
    return {"rank": rank, "bytes": nbytes, "cycles": [cycle]}


def test_start_skew_explains_an_aggregate_below_the_sum():
    # Both pause at 50 GB/s, the second starting 30 ms late: the aggregate's
    # window is 1.03 s, so 100 GB over it reads 97.1 GB/s, and the skew says why.
    res = [_process(0, (10.0, 11.0), (20.0, 21.0)), _process(1, (10.03, 11.03), (20.0, 21.0))]
    cyc = multi_gpu._cycle(res, 0)
    assert cyc["pause"]["per_gpu"] == pytest.approx([50.0, 50.0])
    assert cyc["pause"]["aggregate"] == pytest.approx(100 / 1.03)
    assert cyc["pause"]["start_skew_s"] == pytest.approx(0.03)
    assert cyc["resume"]["aggregate"] == pytest.approx(100.0)
    assert cyc["resume"]["start_skew_s"] == 0
    assert cyc["pause"]["spans"] == [(10.0, 11.0), (10.03, 11.03)]


def test_report_shows_the_skew_of_each_operation():
    res = [_process(0, (10.0, 11.0), (20.0, 21.0)), _process(1, (10.03, 11.03), (20.002, 21.0))]
    report = {"meta": {"device_name": "Made-up GPU"}, "gpus": 2, "share_gpu": False, "gib_per_gpu": 1.0, "cycles": 1,
              "copy_threads_per_process": 2, "cpus": 4, "limits_last": False, "limit_d2h": {"per_gpu": [55, 55], "aggregate": 110},
              "rows": [{"config": "mmap_retained", "library": "ours", "exit_codes": [0, 0],
                        "cycles": [multi_gpu._cycle(res, 0)]}]}
    text = multi_gpu._markdown(report)
    row = next(line for line in text.splitlines() if line.startswith("| mmap_retained |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(line for line in text.splitlines() if line.startswith("| backup |"))
    names = [c.strip() for c in header.strip("|").split("|")]
    assert len(cells) == len(names)
    assert cells[names.index("start skew pause / resume ms")] == "30.0 / 2.0"
    assert cells[names.index("pause aggregate (× limit)")] == "97.1 (0.88× d2h)"
    assert cells[names.index("exit codes")] == "[0, 0]"
    assert "took 100.0–110.0 ms per process after a pause, outside every clock" in text


def test_host_copy_limit_reads_every_block_of_each_share():
    # Two threads, two blocks each: each thread's slots end up holding its
    # own share's two blocks (the buffers start zeroed, so a block skipped or
    # read from the wrong share shows).
    import ctypes
    import threading

    block = multi_gpu.COPY_BLOCK
    addr, fill, unmap = multi_gpu._fill_fresh(4 * block, 2)
    try:
        for k in range(4):
            ctypes.memset(addr + k * block, 10 + k, block)
        buffers = [ctypes.create_string_buffer(2 * block) for _ in range(2)]
        start, end, n = multi_gpu._timed(multi_gpu._copy_out(addr, 4 * block, buffers), threading.Barrier(1),
                                         4 * block)
        assert n == 4 * block and end >= start
        assert [[set(b.raw[:block]), set(b.raw[block:])] for b in buffers] == [[{10}, {11}], [{12}, {13}]]
    finally:
        unmap()


def test_resume_of_a_non_retained_mmap_backup_is_measured_against_the_host_copy_too():
    res = [_process(0, (10.0, 11.0), (20.0, 21.0), nbytes=40 * GB)]
    report = {"meta": {"device_name": "Made-up GPU"}, "gpus": 1, "share_gpu": False, "gib_per_gpu": 1.0, "cycles": 1,
              "copy_threads_per_process": 2, "cpus": 4, "limits_last": False,
              "limit_fill": {"per_gpu": [50], "aggregate": 50}, "limit_copy": {"per_gpu": [44], "aggregate": 44},
              "limit_d2h": {"per_gpu": [55], "aggregate": 55}, "limit_h2d": {"per_gpu": [50], "aggregate": 50},
              "rows": [{"config": config, "library": "ours", "exit_codes": [0], "cycles": [multi_gpu._cycle(res, 0)]}
                       for config in ("mmap", "mmap_retained")]}
    text = multi_gpu._markdown(report)
    header = next(line for line in text.splitlines() if line.startswith("| backup |"))
    names = [c.strip() for c in header.strip("|").split("|")]

    def cell(config, name):
        row = next(line for line in text.splitlines() if line.startswith(f"| {config} |"))
        return [c.strip() for c in row.strip("|").split("|")][names.index(name)]

    assert cell("mmap", "resume aggregate (× limit)") == "40.0 (0.80× h2d, 0.91× copy)"
    assert cell("mmap_retained", "resume aggregate (× limit)") == "40.0 (0.80× h2d)"
    assert cell("mmap", "pause aggregate (× limit)") == "40.0 (0.80× fill)"
    assert "| host copy out of filled memory, 4 MiB blocks (median of 3) | 44.0 | 44.0 |" in text


def test_report_names_the_tensor_size():
    res = [_process(0, (10.0, 11.0), (20.0, 21.0))]
    report = {"meta": {"device_name": "Made-up GPU"}, "gpus": 1, "share_gpu": False, "gib_per_gpu": 4.0, "cycles": 1,
              "copy_threads_per_process": 2, "cpus": 4, "limits_last": False,
              "rows": [{"config": "pinned", "library": "ours", "exit_codes": [0], "cycles": [multi_gpu._cycle(res, 0)]}]}
    assert "4.0 GiB per GPU in 2 MiB tensors" in multi_gpu._markdown(dict(report, tensor_mib=2.0))
    assert "4.0 GiB per GPU in 512 MiB tensors" in multi_gpu._markdown(report)  # reports from before the option


def test_tensor_size_option_reaches_the_workers(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(multi_gpu, "_run", lambda fn, args, n, share: (seen.append(args), ([], [0]))[1])
    monkeypatch.setattr(multi_gpu, "_limits", lambda *a: None)
    monkeypatch.setattr(common, "no_gpu", lambda: None)  # a GPU, as far as the refusal without one is concerned
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Made-up GPU")
    assert multi_gpu.main(["--gpus", "1", "--share-gpu", "--configs", "pinned", "--tensor-mib", "2",
                           "--out", str(tmp_path)]) == 0
    assert seen and seen[0][:4] == ("pinned", 24, 3, 2.0)
    assert (tmp_path / "multi_gpu_Made-up-GPU-1procs-on-1.md").exists()
