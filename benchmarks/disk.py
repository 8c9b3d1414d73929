"""Disk backup: pause/resume with enable_disk_backup=True of
params['bytes'] in params['tensors'] tensors, median of params['cycles'] cycles,
contents verified after every resume, host RSS sampled through each pause; next to
the same directory's own limit, measured first in the same process: a parallel
O_DIRECT writer and reader (as many threads as the library's copy workers, the
same block size and file layout).

  disk:disk   the directory is on a disk ($TMS_BENCH_DISK_DIR, else the temp dir)
  disk:tmpfs  the directory is on a tmpfs ($TMS_BENCH_TMPFS_DIR, else /dev/shm)
"""
import itertools
import mmap
import os
import shutil
import tempfile
import threading
import time

from .common import GiB, MiB, fmt_bytes, log, median, rss_bytes

BLOCK = 8 * MiB  # the library's disk block: its staging slot (transfer.c)


def _fs_type(path):
    """Filesystem type of the mount holding path (longest matching mount point)."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def _copy_threads():
    n = os.environ.get("TMS_BACKUP_THREADS")
    return int(n) if n else max(2, min(16, os.cpu_count() or 2))


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
    threads = _copy_threads()
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
            try:
                os.unlink(p)
            except OSError:
                pass
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


def _cached_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run(env, target, params, deadline):
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
                rss0, cached0 = rss_bytes(), _cached_bytes()
                with _PeakRss() as peak:
                    t0 = time.perf_counter()
                    tms.pause(tag)
                    t1 = time.perf_counter()
                cached1 = _cached_bytes()
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
