"""Sections 2, 3 and 5: pause/resume cycles.

- latency: discard-mode pause/resume of 8 GiB in several shapes (section 2),
- backup: backed-up pause/resume of 8 GiB in 16 tensors, contents verified (section 3),
- scaling_count / scaling_bytes: the cost law vs allocation count and total bytes (section 5).

Every timing calls the public singleton's pause(tag)/resume(tag); the library's
own view of a tag (allocation count, reserved bytes, bytes copied) comes from
its stats() and allocations().
"""
import collections
import time

from . import floor
from .common import GiB, MiB, error_record, fmt_bytes, log, median, rss_bytes, shape_name

FREE_MARGIN = 2 * GiB  # what must stay free on the device beside a measurement


def _ms(seconds):
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _alloc_shape(env, tag):
    """(count, common reserved size, total reserved, size histogram) of the tag's allocations."""
    allocs = env.tag_allocs(tag)
    hist = collections.Counter(a["reserved"] for a in allocs)
    common = hist.most_common(1)[0][0] if hist else 0
    return {
        "allocations": len(allocs),
        "reserved_size": common,
        "reserved_bytes": sum(a["reserved"] for a in allocs),
        "requested_bytes": sum(a["size"] for a in allocs),
        "reserved_size_histogram": {str(k): v for k, v in sorted(hist.items())},
    }


def _fits(env, nbytes):
    free = env.free_bytes()
    return free is None or nbytes + FREE_MARGIN <= free, free


def _paired_floor(params, shape):
    """The driver's own loop on as many allocations of the tag's size, held in
    this process and cycled beside the library's cycles (floor.Beside): both
    see the same driver state and idle time, as the driver's release or create
    of a large allocation is fast in one cycle and many times slower in the next,
    floor and library alike. Inactive where the runner
    built no floor library; with a reason where the tag's sizes differ, the
    device has no room or a floor call fails."""
    lib, sizes = params.get("floor_lib"), shape["reserved_size_histogram"]
    why_not = f"allocation sizes differ ({sizes})" if lib and len(sizes) != 1 else None
    return floor.Beside(lib, shape["allocations"], shape["reserved_size"], why_not)


def _paired_summary(paired):
    if not paired.times:
        return {"paired_note": f"no paired floor: {paired.error}"} if paired.error else {}
    pauses, resumes = [p for p, _ in paired.times], [r for _, r in paired.times]
    return {"paired_pause_s": pauses, "paired_resume_s": resumes,
            "paired_pause_median_s": median(pauses), "paired_resume_median_s": median(resumes),
            "paired_pause_min_s": min(pauses), "paired_resume_min_s": min(resumes)}


def _cycle_discard(env, tms, tag, block, cycles, warmup, deadline, paired):
    """Times pause(tag)/resume(tag) cycles; returns per-cycle lists. One
    floor cycle (paired, a floor.Beside) runs beside each, before or after it
    in turn, its times into paired.times."""
    pause_s, resume_s, freed = [], [], []
    truncated = False
    last = 0.0

    def baseline():  # with the floor's own allocations held, if any: a pause frees the tag's
        return env.free_bytes(), rss_bytes()

    def floor_cycle(c):
        nonlocal free0, rss0
        times = paired.cycle(c)
        if paired.let_go:
            paired.let_go = False
            free0, rss0 = baseline()
        return times

    free0, rss0 = baseline()
    for c in range(warmup + cycles):
        if c >= warmup + 3 and not deadline.allows(2 * last + 1.0):
            truncated = True
            break
        if c % 2 == 0:
            fp = floor_cycle(c)
        env.sync()
        t0 = time.perf_counter()
        tms.pause(tag)
        t1 = time.perf_counter()
        freed_now = env.free_bytes() - free0 if free0 is not None else rss0 - rss_bytes()
        t2 = time.perf_counter()
        tms.resume(tag)
        t3 = time.perf_counter()
        env.touch(block, c)
        if c % 2 == 1:
            fp = floor_cycle(c)
        last = t3 - t0
        if c >= warmup:
            pause_s.append(t1 - t0)
            resume_s.append(t3 - t2)
            freed.append(freed_now)
            if fp is not None:
                paired.times.append(fp)
    return pause_s, resume_s, freed, truncated


def _timed_cycles(env, tms, tag, block, entry, params, cycles, warmup, deadline):
    """Discard cycles of tag beside the paired floor where there can be one,
    their summary into entry; returns the bytes freed per cycle."""
    paired = _paired_floor(params, entry)
    try:
        p, r, freed, truncated = _cycle_discard(env, tms, tag, block, cycles, warmup, deadline, paired)
    finally:
        paired.close()
    entry.update(_summary(p, r))
    entry.update(_paired_summary(paired))
    entry["truncated"] = truncated
    return freed


def _summary(pause_s, resume_s):
    return {
        "pause_s": pause_s,
        "resume_s": resume_s,
        "pause_median_s": median(pause_s),
        "resume_median_s": median(resume_s),
        "pause_min_s": min(pause_s) if pause_s else None,
        "resume_min_s": min(resume_s) if resume_s else None,
        "cycles": len(pause_s),
    }


def latency(env, params, deadline):
    """Discard-mode pause/resume latency for each shape (count x size tensors)."""
    tms = env.tms
    cycles, warmup = int(params["cycles"]), int(params.get("warmup", 1))
    out = {"shapes": [], "cycles_requested": cycles, "warmup": warmup}
    for count, size in params["shapes"]:
        count, size = int(count), int(size)
        name = shape_name(count, size)
        entry = {"shape": name, "tensors": count, "tensor_bytes": size, "total_bytes": count * size}
        out["shapes"].append(entry)
        ok, free = _fits(env, count * size)
        if not ok:
            entry["skipped"] = f"needs {fmt_bytes(count * size)} + {fmt_bytes(FREE_MARGIN)}, {fmt_bytes(free)} free"
            continue
        if not deadline.allows(5):
            entry["skipped"] = "time budget"
            continue
        tag = f"lat-{name}"
        try:
            _latency_shape(env, tms, tag, name, entry, count, size, params, cycles, warmup, deadline)
        except Exception as e:  # one shape failing must not lose the others
            entry.update(error_record(e))
            log(f"latency {name}: FAILED: {entry['error']}")
    return out


def _latency_shape(env, tms, tag, name, entry, count, size, params, cycles, warmup, deadline):
    t0 = time.perf_counter()
    block = env.alloc(tag, [size] * count)
    entry["alloc_s"] = time.perf_counter() - t0
    try:
        entry.update(_alloc_shape(env, tag))
        addrs = env.addresses(block)
        freed = _timed_cycles(env, tms, tag, block, entry, params, cycles, warmup, deadline)
        entry["freed_bytes"] = freed
        entry["freed_source"] = "torch.cuda.mem_get_info" if env.free_bytes() is not None else "VmRSS (host backend)"
        expected = entry["reserved_bytes"]
        # >= 95 % of the reserved bytes, as the GPU tests require: the driver
        # keeps a little of a large pause's memory for its own bookkeeping.
        tol = max(64 * MiB, expected // 20)
        entry["freed_ok"] = bool(freed) and all(abs(f - expected) <= tol for f in freed)
        entry["freed_fraction_min"] = min(freed) / expected if freed and expected else None
        entry["same_addresses"] = env.addresses(block) == addrs
        log(f"latency {name}: {entry['allocations']} allocations, pause {_ms(entry['pause_median_s'])}, "
            f"resume {_ms(entry['resume_median_s'])}, freed ok {entry['freed_ok']}")
    finally:
        env.dispose(block, tag)


BACKUP_CONFIGS = {
    # name: (cpu_backup_backend, retain_cpu_backup)
    "pinned": ("pinned", False),
    "mmap": ("mmap", False),
    "mmap_retained": ("mmap", True),
    "pinned_retained": ("pinned", True),
}


def backup(env, config, params, deadline):
    """Backed-up pause/resume of params['bytes'] in params['tensors'] tensors:
    GB/s per cycle, contents verified after each resume (fresh random data
    every cycle, so a stale backup cannot pass), host RSS around each cycle."""
    tms = env.tms
    backend, retain = BACKUP_CONFIGS[config]
    total, ntensors, cycles = int(params["bytes"]), int(params["tensors"]), int(params["cycles"])
    size = total // ntensors
    total = size * ntensors
    out = {"config": config, "cpu_backup_backend": backend, "retain_cpu_backup": retain, "bytes": total,
           "tensors": ntensors, "tensor_bytes": size, "cycles_requested": cycles, "unit": "GB/s = 1e9 bytes/s"}
    ok, free = _fits(env, total)
    if not ok:
        raise RuntimeError(f"needs {fmt_bytes(total)} + {fmt_bytes(FREE_MARGIN)} free, {fmt_bytes(free)} free")
    tms.retain_cpu_backup = retain
    tag = f"bk-{config}"
    out["rss_at_start"] = rss_bytes()
    block = env.alloc(tag, [size] * ntensors, backup=True, backend=backend)
    snap = None
    try:
        out.update(_alloc_shape(env, tag))
        seed = 1
        env.fill_random(block, seed)
        keep = env.can_keep_copy(total)
        snap = env.snapshot(block, keep)
        out["verify_method"] = snap["kind"]
        recs = []
        last = 0.0
        for c in range(cycles):
            if c >= 2 and not deadline.allows(1.5 * last + 2.0):
                out["truncated"] = True
                break
            try:
                env.sync()
                st0 = env.tag_stats(tag)
                rss_before = rss_bytes()
                t0 = time.perf_counter()
                tms.pause(tag)
                t1 = time.perf_counter()
                rss_paused = rss_bytes()
                st_paused = env.tag_stats(tag)
                free_paused = env.free_bytes()
                t2 = time.perf_counter()
                tms.resume(tag)
                env.sync()
                t3 = time.perf_counter()
                rss_after = rss_bytes()
                st1 = env.tag_stats(tag)
                verified = env.verify(block, snap)
            except Exception as e:  # keep the cycles already measured
                out["cycle_error"] = f"cycle {c + 1}: " + error_record(e)["error"]
                log(f"backup {config} cycle {c + 1}: FAILED: {out['cycle_error']}")
                break
            last = t3 - t0
            rec = {
                "cycle": c + 1,
                "pause_s": t1 - t0,
                "resume_s": t3 - t2,
                "pause_gbps": total / (t1 - t0) / 1e9,
                "resume_gbps": total / (t3 - t2) / 1e9,
                "verified": verified,
                "rss_before": rss_before,
                "rss_paused": rss_paused,
                "rss_after": rss_after,
                "free_device_paused": free_paused,
                "bytes_to_host": st_paused.get("bytes_to_host", 0) - st0.get("bytes_to_host", 0),
                "bytes_to_device": st1.get("bytes_to_device", 0) - st_paused.get("bytes_to_device", 0),
                "backup_bytes_paused": st_paused.get("bytes_backup_pinned", 0) + st_paused.get("bytes_backup_mmap", 0),
                "backup_bytes_after": st1.get("bytes_backup_pinned", 0) + st1.get("bytes_backup_mmap", 0),
            }
            recs.append(rec)
            log(f"backup {config} cycle {c + 1}: pause {rec['pause_gbps']:.1f} GB/s, resume {rec['resume_gbps']:.1f} "
                f"GB/s, verified {verified}, RSS {rss_before / GiB:.2f} -> {rss_paused / GiB:.2f} -> "
                f"{rss_after / GiB:.2f} GiB")
            seed += 1
            env.fill_random(block, seed)
            snap = env.resnapshot(block, snap)
        out["per_cycle"] = recs
        if recs:
            first, steady = recs[0], recs[1:]
            out["first_pause_s"] = first["pause_s"]
            out["first_resume_s"] = first["resume_s"]
            out["first_pause_gbps"] = first["pause_gbps"]
            out["first_resume_gbps"] = first["resume_gbps"]
            if steady:
                out["steady_pause_s"] = median([r["pause_s"] for r in steady])
                out["steady_resume_s"] = median([r["resume_s"] for r in steady])
                out["steady_pause_gbps"] = total / out["steady_pause_s"] / 1e9
                out["steady_resume_gbps"] = total / out["steady_resume_s"] / 1e9
            out["all_verified"] = all(r["verified"] for r in recs)
            out["rss_before_first_pause"] = recs[0]["rss_before"]
            out["rss_before_last"] = recs[-1]["rss_before"]
            out["rss_paused_last"] = recs[-1]["rss_paused"]
            out["rss_after_last_resume"] = recs[-1]["rss_after"]
            out["copied_bytes_ok"] = all(r["bytes_to_host"] == total and r["bytes_to_device"] == total for r in recs)
    finally:
        if snap is not None:
            env.drop_snapshot(snap)
        env.dispose(block, tag, pause=False)
        tms.retain_cpu_backup = False
    return out


def scaling_count(env, params, deadline):
    """Pause/resume time vs number of allocations of one granule (2 MiB)."""
    cycles, warmup = int(params["cycles"]), int(params.get("warmup", 1))
    out = {"points": [], "allocation_bytes": 2 * MiB}
    est = 0.0
    for n in params["counts"]:
        n = int(n)
        point = {"requested_allocations": n}
        out["points"].append(point)
        ok, free = _fits(env, n * 2 * MiB)
        if not ok:
            point["skipped"] = f"needs {fmt_bytes(n * 2 * MiB)}, {fmt_bytes(free)} free"
            continue
        est = n * 150e-6 * (cycles + warmup + 2)  # a generous cost per driver step: a point never overruns
        if not deadline.allows(est + 1.0):
            point["skipped"] = "time budget"
            continue
        try:
            _measure_point(env, f"sc-{n}", point, lambda tag: env.alloc_granules(tag, n), params, cycles, warmup,
                           deadline)
            log(f"scaling count {point['allocations']}: pause {_ms(point['pause_median_s'])}, "
                f"resume {_ms(point['resume_median_s'])}")
        except Exception as e:
            point.update(error_record(e))
            log(f"scaling count {n}: FAILED: {point['error']}")
    return out


def _measure_point(env, tag, point, make, params, cycles, warmup, deadline):
    t0 = time.perf_counter()
    block = make(tag)
    point["alloc_s"] = time.perf_counter() - t0
    try:
        point.update(_alloc_shape(env, tag))
        _timed_cycles(env, env.tms, tag, block, point, params, cycles, warmup, deadline)
    finally:
        env.dispose(block, tag)


def scaling_bytes(env, params, deadline):
    """Pause/resume time vs total bytes in one allocation."""
    cycles, warmup = int(params["cycles"]), int(params.get("warmup", 1))
    out = {"points": []}
    for size in params["sizes"]:
        size = int(size)
        point = {"bytes": size}
        out["points"].append(point)
        ok, free = _fits(env, size)
        if not ok:
            point["skipped"] = f"needs {fmt_bytes(size)} + {fmt_bytes(FREE_MARGIN)}, {fmt_bytes(free)} free"
            continue
        if not deadline.allows(3.0):
            point["skipped"] = "time budget"
            continue
        try:
            _measure_point(env, f"sb-{size}", point, lambda tag: env.alloc(tag, [size]), params, cycles, warmup,
                           deadline)
            log(f"scaling bytes {fmt_bytes(size)}: pause {_ms(point['pause_median_s'])}, "
                f"resume {_ms(point['resume_median_s'])}")
        except Exception as e:
            point.update(error_record(e))
            log(f"scaling bytes {fmt_bytes(size)}: FAILED: {point['error']}")
    return out
