"""The run suite's pause/resume cycles (sections 2 and 3 of its report):

- latency: discard-mode pause/resume of 8 GiB in several shapes, beside the paired floor,
- backup: backed-up pause/resume of 8 GiB in 16 tensors, contents verified,
- disk: the same with disk backup, beside the directory's own parallel O_DIRECT rate.

Every timing calls the public singleton's pause(tag)/resume(tag); the library's own view of a tag (allocation count,
reserved bytes, bytes copied) comes from its stats() and allocations().
"""
import collections
import contextlib
import itertools
import mmap
import os
import shutil
import tempfile
import threading
import time

from . import floor
from .common import GiB, MiB, copy_threads, error_record, fmt_bytes, log, median, meminfo, rss_bytes

FREE_MARGIN = 2 * GiB  # what must stay free on the device beside a measurement
BLOCK = 8 * MiB  # the library's disk block: its staging slot (transfer.c)


def _alloc_shape(env, tag):
    """(count, common reserved size, total reserved, size histogram) of the tag's allocations."""
    allocs = env.tag_allocs(tag)
    hist = collections.Counter(a["reserved"] for a in allocs)
    common = hist.most_common(1)[0][0] if hist else 0
    return {"allocations": len(allocs), "reserved_size": common, "reserved_bytes": sum(a["reserved"] for a in allocs),
            "requested_bytes": sum(a["size"] for a in allocs),
            "reserved_size_histogram": {str(k): v for k, v in sorted(hist.items())}}


def _fits(env, nbytes):
    free = env.free_bytes()
    return free is None or nbytes + FREE_MARGIN <= free, free


def _paired_floor(params, shape):
    """The driver's own loop on as many allocations of the tag's size, cycled in this process beside the library's
    cycles (floor.Beside): the driver's release or create of a large allocation is fast in one cycle and many times
    slower in the next, floor and library alike. Inactive without a floor library; with a reason where the tag's sizes
    differ, the device has no room or a floor call fails."""
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
    """Times pause(tag)/resume(tag) cycles; returns per-cycle lists. One floor cycle (paired, a floor.Beside) runs
    beside each, before or after it in turn, its times into paired.times."""
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


def latency(env, params, deadline):
    """Discard-mode pause/resume latency for each shape (count x size tensors)."""
    cycles, warmup = int(params["cycles"]), int(params.get("warmup", 1))
    out = {"shapes": [], "cycles_requested": cycles, "warmup": warmup}
    for count, size in params["shapes"]:
        count, size = int(count), int(size)
        name = f"{count}x{fmt_bytes(size).replace(' ', '')}"
        entry = {"shape": name, "tensors": count, "tensor_bytes": size, "total_bytes": count * size}
        out["shapes"].append(entry)
        ok, free = _fits(env, count * size)
        if not ok:
            entry["skipped"] = f"needs {fmt_bytes(count * size)} + {fmt_bytes(FREE_MARGIN)}, {fmt_bytes(free)} free"
            continue
        if not deadline.allows(5):
            entry["skipped"] = "time budget"
            continue
        try:
            _latency_shape(env, entry, params, cycles, warmup, deadline)
        except Exception as e:  # one shape failing must not lose the others
            entry.update(error_record(e))
            log(f"latency {name}: FAILED: {entry['error']}")
    return out


def _latency_shape(env, entry, params, cycles, warmup, deadline):
    """Discard cycles of the entry's shape, beside the paired floor where there can be one: their times, the bytes
    each pause freed and whether the addresses stayed, into entry."""
    name, tag = entry["shape"], f"lat-{entry['shape']}"
    t0 = time.perf_counter()
    block = env.alloc(tag, [entry["tensor_bytes"]] * entry["tensors"])
    entry["alloc_s"] = time.perf_counter() - t0
    try:
        entry.update(_alloc_shape(env, tag))
        addrs = env.addresses(block)
        paired = _paired_floor(params, entry)
        try:
            p, r, freed, truncated = _cycle_discard(env, env.tms, tag, block, cycles, warmup, deadline, paired)
        finally:
            paired.close()
        entry.update(pause_s=p, resume_s=r, pause_median_s=median(p), resume_median_s=median(r),
                     pause_min_s=min(p, default=None), resume_min_s=min(r, default=None), cycles=len(p),
                     truncated=truncated, **_paired_summary(paired))
        entry["freed_bytes"] = freed
        entry["freed_source"] = "torch.cuda.mem_get_info" if env.free_bytes() is not None else "VmRSS (host backend)"
        expected = entry["reserved_bytes"]
        # >= 95 % of the reserved bytes, as the GPU tests require: the driver
        # keeps a little of a large pause's memory for its own bookkeeping.
        tol = max(64 * MiB, expected // 20)
        entry["freed_ok"] = bool(freed) and all(abs(f - expected) <= tol for f in freed)
        entry["freed_fraction_min"] = min(freed) / expected if freed and expected else None
        entry["same_addresses"] = env.addresses(block) == addrs
        log(f"latency {name}: {entry['allocations']} allocations, pause {entry['pause_median_s'] * 1e3:.2f} ms, "
            f"resume {entry['resume_median_s'] * 1e3:.2f} ms, freed ok {entry['freed_ok']}")
    finally:
        env.dispose(block, tag)


# name: (cpu_backup_backend, retain_cpu_backup); multi_gpu's --configs too, in this order
BACKUP_CONFIGS = {"mmap": ("mmap", False), "pinned": ("pinned", False), "mmap_retained": ("mmap", True),
                  "pinned_retained": ("pinned", True)}


def backup(env, config, params, deadline):
    """Backed-up pause/resume of params['bytes'] in params['tensors'] tensors: GB/s per cycle, contents verified after
    each resume (fresh random data every cycle, so a stale backup cannot pass), host RSS around each cycle."""
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
        env.fill_random(block, 1)
        snap = env.snapshot(block, env.can_keep_copy(total))
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
            rec = {"cycle": c + 1, "pause_s": t1 - t0, "resume_s": t3 - t2, "pause_gbps": total / (t1 - t0) / 1e9,
                   "resume_gbps": total / (t3 - t2) / 1e9, "verified": verified, "rss_before": rss_before,
                   "rss_paused": rss_paused, "rss_after": rss_after, "free_device_paused": free_paused,
                   "bytes_to_host": st_paused.get("bytes_to_host", 0) - st0.get("bytes_to_host", 0),
                   "bytes_to_device": st1.get("bytes_to_device", 0) - st_paused.get("bytes_to_device", 0),
                   "backup_bytes_paused": st_paused.get("bytes_backup_pinned", 0)
                   + st_paused.get("bytes_backup_mmap", 0),
                   "backup_bytes_after": st1.get("bytes_backup_pinned", 0) + st1.get("bytes_backup_mmap", 0)}
            recs.append(rec)
            log(f"backup {config} cycle {c + 1}: pause {rec['pause_gbps']:.1f} GB/s, resume {rec['resume_gbps']:.1f} "
                f"GB/s, verified {verified}, RSS {rss_before / GiB:.2f} -> {rss_paused / GiB:.2f} -> "
                f"{rss_after / GiB:.2f} GiB")
            env.fill_random(block, c + 2)
            snap = env.resnapshot(block, snap)
        out["per_cycle"] = recs
        if recs:
            first, steady = recs[0], recs[1:]
            out.update({f"first_{k}": first[k] for k in ("pause_s", "resume_s", "pause_gbps", "resume_gbps")})
            for op in ("pause", "resume") if steady else ():
                out[f"steady_{op}_s"] = median([r[f"{op}_s"] for r in steady])
                out[f"steady_{op}_gbps"] = total / out[f"steady_{op}_s"] / 1e9
            out.update(all_verified=all(r["verified"] for r in recs), rss_before_first_pause=recs[0]["rss_before"],
                       rss_before_last=recs[-1]["rss_before"], rss_paused_last=recs[-1]["rss_paused"],
                       rss_after_last_resume=recs[-1]["rss_after"],
                       copied_bytes_ok=all(r["bytes_to_host"] == total and r["bytes_to_device"] == total
                                           for r in recs))
    finally:
        if snap is not None:
            env.drop_snapshot(snap)
        env.dispose(block, tag, pause=False)
        tms.retain_cpu_backup = False
    return out


def _fs_type(path):
    """Filesystem type of the mount holding path (longest matching mount point)."""
    path = os.path.realpath(path)
    best, kind = "", None
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def _directory(target):
    if target == "disk":
        base = os.environ.get("TMS_BENCH_DISK_DIR") or tempfile.gettempdir()
    else:
        base = os.environ.get("TMS_BENCH_TMPFS_DIR") or "/dev/shm"
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="tms-bench-disk-", dir=base)


def _io_rate(paths, size, threads, write, direct=True):
    """GB/s of writing (or reading) size bytes to each path, blocks of BLOCK taken
    in turns across the files by `threads` threads."""
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fds = [os.open(p, flags, 0o600) for p in paths]
    jobs = [(i, off) for off in range(0, size, BLOCK) for i in range(len(paths))]
    counter = itertools.count()
    errors = []

    def worker():
        buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
        buf.write(os.urandom(BLOCK))
        try:
            for k in iter(lambda: next(counter), None):
                if k >= len(jobs):
                    return
                i, off = jobs[k]
                n = os.pwritev(fds[i], [buf], off) if write else os.preadv(fds[i], [buf], off)
                if n != BLOCK:
                    raise OSError(f"{'write' if write else 'read'} of {BLOCK} bytes at {off} moved {n}")
        except Exception as e:  # reported by the caller
            errors.append(e)
        finally:
            buf.close()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    if errors:
        raise errors[0]
    return len(paths) * size / seconds / 1e9


def _limit(d, total, files, reps):
    """The directory's parallel O_DIRECT write and read rates (median of reps)."""
    size = max(BLOCK, total // files // BLOCK * BLOCK)
    paths = [os.path.join(d, f"limit-{i}.bin") for i in range(files)]
    threads = copy_threads()
    try:
        direct = True
        try:
            os.close(os.open(paths[0], os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        except OSError:
            direct = False  # no O_DIRECT here (older tmpfs): the library falls back the same way
        writes, reads = [], []
        for _ in range(reps):
            writes.append(_io_rate(paths, size, threads, True, direct))
            reads.append(_io_rate(paths, size, threads, False, direct))
    finally:
        for p in paths:
            with contextlib.suppress(OSError):
                os.unlink(p)
    return {"threads": threads, "block_bytes": BLOCK, "files": files, "bytes": size * files, "o_direct": direct,
            "write_gbps": median(writes), "read_gbps": median(reads), "write_gbps_reps": writes,
            "read_gbps_reps": reads}


class _PeakRss:
    """Samples VmRSS every 2 ms on a thread (the pause releases the GIL)."""

    def __init__(self):
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def disk(env, target, params, deadline):
    """Disk backup (enable_disk_backup=True) of params['bytes'] in params['tensors'] tensors, median of
    params['cycles'] cycles, contents verified after every resume, host RSS sampled through each pause;
    next to the directory's own limit, measured first in the same process: a parallel O_DIRECT writer and
    reader (as many threads as the library's copy workers, the same block size and file layout). target
    "disk": a directory on a disk ($TMS_BENCH_DISK_DIR, else the temp dir); "tmpfs": on a tmpfs
    ($TMS_BENCH_TMPFS_DIR, else /dev/shm)."""
    tms = env.tms
    total, ntensors, cycles = int(params["bytes"]), int(params["tensors"]), int(params["cycles"])
    size = total // ntensors
    total = size * ntensors
    d = _directory(target)
    out = {"target": target, "directory": d, "fs_type": _fs_type(d), "bytes": total, "tensors": ntensors,
           "tensor_bytes": size, "cycles_requested": cycles, "unit": "GB/s = 1e9 bytes/s"}
    try:
        free_disk = shutil.disk_usage(d).free
        if free_disk < total + max(total // 8, GiB):
            raise RuntimeError(f"{d} ({out['fs_type']}) has {fmt_bytes(free_disk)} free; needs {fmt_bytes(total)} "
                               f"and a margin")
        out["limit"] = _limit(d, total, ntensors, int(params.get("limit_reps", 2)))
        log(f"disk {target}: {d} ({out['fs_type']}) parallel O_DIRECT write {out['limit']['write_gbps']:.2f} GB/s, "
            f"read {out['limit']['read_gbps']:.2f} GB/s")
        tms.set_disk_backup_dir(d)
        tag = f"disk-{target}"
        block = env.alloc(tag, [size] * ntensors, disk=True)
        snap = None
        try:
            env.fill_random(block, 1)
            snap = env.snapshot(block, env.can_keep_copy(total))
            out["verify_method"] = snap["kind"]
            recs = []
            for c in range(cycles):
                if c >= 1 and not deadline.allows(1.5 * (recs[-1]["pause_s"] + recs[-1]["resume_s"]) + 2.0):
                    out["truncated"] = True
                    break
                env.sync()
                rss0, cached0 = rss_bytes(), meminfo("Cached", "/proc/meminfo")
                with _PeakRss() as peak:
                    t0 = time.perf_counter()
                    tms.pause(tag)
                    t1 = time.perf_counter()
                cached1 = meminfo("Cached", "/proc/meminfo")
                files = len([n for n in os.listdir(d) if n.endswith(".bin")])
                st = env.tag_stats(tag)
                t2 = time.perf_counter()
                tms.resume(tag)
                env.sync()
                t3 = time.perf_counter()
                verified = env.verify(block, snap)
                rec = {"cycle": c + 1, "pause_s": t1 - t0, "resume_s": t3 - t2,
                       "pause_gbps": total / (t1 - t0) / 1e9, "resume_gbps": total / (t3 - t2) / 1e9,
                       "verified": verified, "files": files, "bytes_backup_disk": st.get("bytes_backup_disk"),
                       "rss_before": rss0, "rss_peak_growth": peak.peak - rss0,
                       "page_cache_growth": cached1 - cached0 if cached0 is not None and cached1 is not None else None}
                recs.append(rec)
                log(f"disk {target} cycle {c + 1}: pause {rec['pause_gbps']:.2f} GB/s, resume "
                    f"{rec['resume_gbps']:.2f} GB/s, RSS peak +{rec['rss_peak_growth'] / MiB:.0f} MiB, page cache "
                    f"{(rec['page_cache_growth'] or 0) / MiB:+.0f} MiB, {files} files, verified {verified}")
                env.fill_random(block, c + 2)
                snap = env.resnapshot(block, snap)
            out["per_cycle"] = recs
            if recs:
                out["pause_gbps"] = median([r["pause_gbps"] for r in recs])
                out["resume_gbps"] = median([r["resume_gbps"] for r in recs])
                out["first_pause_gbps"] = recs[0]["pause_gbps"]
                out["first_resume_gbps"] = recs[0]["resume_gbps"]
                out["rss_peak_growth_max"] = max(r["rss_peak_growth"] for r in recs)
                out["all_verified"] = all(r["verified"] for r in recs)
                out["files_ok"] = all(r["files"] == ntensors and r["bytes_backup_disk"] == total for r in recs)
                lim = out["limit"]
                out["pause_vs_limit_write"] = out["pause_gbps"] / lim["write_gbps"] if lim["write_gbps"] else None
                out["resume_vs_limit_read"] = out["resume_gbps"] / lim["read_gbps"] if lim["read_gbps"] else None
        finally:
            if snap is not None:
                env.drop_snapshot(snap)
            env.dispose(block, tag, pause=False)
    finally:
        shutil.rmtree(d, ignore_errors=True)  # the library removes its files at exit; the limit files went above
    return out
