"""The run suite's figures: its raw results turned into ratios (derive), the
report's Markdown body and its PNG plots."""
import os

from .common import GiB, MiB, fmt_bytes, median, pyplot, save_png
from .report import table as _table

# Backup targets for 8 GiB in 16 tensors (GB/s): a backup should run near the copy link.
BACKUP_TARGETS = {
    "mmap": {"pause": 35.0, "resume": 40.0, "which": "first and steady cycles"},
    "mmap_retained": {"pause": 50.0, "resume": 50.0, "which": "steady cycles"},
    "pinned_retained": {"pause": 50.0, "resume": 50.0, "which": "steady cycles"},
}
PASSTHROUGH_TARGET_NS_PER_CALL = 1000.0
CONTENTION_TARGET_P99_US = 100.0  # pass-through calls on another thread must not wait for a backed-up pause
CONTENTION_OPS = {"pair_hook": "cudaMalloc+cudaFree 2 MiB, hook", "pair_direct": "cudaMalloc+cudaFree 2 MiB, libcudart",
                  "foreign_free_hook": "cudaFree of a host address, hook",
                  "foreign_free_direct": "cudaFree of a host address, libcudart", "stats": "stats()"}
FLOOR_RATIO_TARGET = 1.2
# Disk backup against the directory's own parallel O_DIRECT rate; on a tmpfs an
# absolute rate (the pipeline is not the limit); RSS growth per pause.
DISK_TARGET_VS_LIMIT = 0.9
DISK_TARGET_TMPFS_GBPS = 20.0
DISK_TARGET_RSS_BYTES = 512 * MiB


def _get(d, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _ok(section):
    return isinstance(section, dict) and "error" not in section


# ---- derive -----------------------------------------------------------------------

def _floor_index(floor):
    idx = {}
    for s in _get(floor, "shapes", default=[]) or []:
        if s.get("error") or s.get("pause_median_s") is None:
            continue
        idx[(int(s["count"]), int(s["reserved_size"]))] = s
    return idx


def floor_shapes_for(results):
    """COUNTxBYTES strings of the allocation shapes the run observed, so the
    driver floor is measured for exactly what the library held."""
    shapes = []
    for mode in ("torch", "preload"):
        for e in _get(results, "latency", mode, "shapes", default=[]) or []:
            if e.get("allocations") and e.get("reserved_size"):
                shapes.append((e["allocations"], e["reserved_size"]))
    for p in _get(results, "scaling", "count", "points", default=[]) or []:
        if p.get("allocations") and p.get("reserved_size"):
            shapes.append((p["allocations"], p["reserved_size"]))
    for p in _get(results, "scaling", "bytes", "points", default=[]) or []:
        if p.get("allocations") and p.get("reserved_size"):
            shapes.append((p["allocations"], p["reserved_size"]))
    return shapes


def _fit_line(xs, ys):
    """Least squares y = a + b x; None if fewer than 2 points."""
    pts = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return {"intercept": my - b * mx, "slope": b, "points": n}


def _vs_floors(e, f):
    """A measured shape's or point's times, and their ratios to the own-process
    floor f (None where it did not run) and to the paired floor."""
    out = {"pause_ms": e["pause_median_s"] * 1e3, "resume_ms": e["resume_median_s"] * 1e3}
    for what in ("pause", "resume"):
        out[f"floor_{what}_ms"] = f[f"{what}_median_s"] * 1e3 if f else None
        out[f"{what}_vs_floor"] = _ratio(e[f"{what}_median_s"], f[f"{what}_median_s"]) if f else None
    return {**out, **_paired(e)}


def _paired(e):
    """The paired floor's figures and the ratios to it, for a measured shape or point."""
    fp, fr = e.get("paired_pause_median_s"), e.get("paired_resume_median_s")
    mp, mr = e.get("paired_pause_min_s"), e.get("paired_resume_min_s")
    return {"paired_pause_ms": fp * 1e3 if fp else None, "paired_resume_ms": fr * 1e3 if fr else None,
            "pause_vs_paired": _ratio(e["pause_median_s"], fp) if fp else None,
            "resume_vs_paired": _ratio(e["resume_median_s"], fr) if fr else None,
            # The driver's create or release of a large allocation is either fast or tens of times slower
            # from one cycle to the next, floor and library alike: a median of a few cycles may land on
            # either, the fastest cycles do not.
            "pause_fastest_vs_paired": _ratio(e.get("pause_min_s"), mp) if mp and e.get("pause_min_s") else None,
            "resume_fastest_vs_paired": _ratio(e.get("resume_min_s"), mr) if mr and e.get("resume_min_s") else None,
            "paired_note": e.get("paired_note")}


def vs_floor(row, what):
    """(ratio, which floor) of row's pause or resume: the paired floor where
    it ran, else the own-process one."""
    if row.get(f"{what}_vs_paired") is not None:
        return row[f"{what}_vs_paired"], "paired"
    return row.get(f"{what}_vs_floor"), "own-process"


def derive(results):
    d = {}
    lim = results.get("limits") or {}
    floor = _floor_index(results.get("vmm_floor"))
    pinned_h2d, pinned_d2h = lim.get("pinned_h2d_gbps"), lim.get("pinned_d2h_gbps")

    d["limits"] = {
        "pinned_h2d_gbps": pinned_h2d,
        "pinned_d2h_gbps": pinned_d2h,
        "pageable_h2d_gbps": lim.get("pageable_h2d_gbps"),
        "pageable_d2h_gbps": lim.get("pageable_d2h_gbps"),
        "pageable_h2d_vs_pinned": _ratio(lim.get("pageable_h2d_gbps"), pinned_h2d),
        "pageable_d2h_vs_pinned": _ratio(lim.get("pageable_d2h_gbps"), pinned_d2h),
        "pin_s": lim.get("pin_s"),
        "pin_bytes": lim.get("bytes"),
        "pin_gbps": lim.get("pin_gbps"),
        "pin_gbps_vs_pinned_d2h": _ratio(lim.get("pin_gbps"), pinned_d2h),
        "host_register_s": lim.get("host_register_s"),
        "pageable_first_touch_gbps": lim.get("pageable_first_touch_gbps"),
    }

    rows = []
    for mode in ("torch", "preload"):
        lat = _get(results, "latency", mode)
        if not _ok(lat):
            continue
        for e in lat.get("shapes", []):
            row = {"mode": mode, "shape": e.get("shape"), "tensors": e.get("tensors"),
                   "allocations": e.get("allocations"), "reserved_size": e.get("reserved_size"),
                   "skipped": e.get("skipped") or e.get("error")}
            if e.get("pause_median_s") is not None:
                f = floor.get((int(e["allocations"]), int(e["reserved_size"]))) if e.get("allocations") else None
                n = max(1, int(e.get("allocations") or 1))
                row.update({
                    **_vs_floors(e, f),
                    "pause_per_alloc_us": e["pause_median_s"] / n * 1e6,
                    "resume_per_alloc_us": e["resume_median_s"] / n * 1e6,
                    "freed_gib": (median(e.get("freed_bytes") or []) or 0) / GiB,
                    "reserved_gib": (e.get("reserved_bytes") or 0) / GiB,
                    "freed_ok": e.get("freed_ok"),
                    "same_addresses": e.get("same_addresses"),
                    "cycles": e.get("cycles"),
                })
            rows.append(row)
    d["latency"] = rows

    brows = []
    for config in ("pinned", "mmap", "mmap_retained", "pinned_retained"):
        b = _get(results, "backup", config)
        row = {"config": config}
        if not _ok(b):
            row["error"] = (b or {}).get("error", "not run") if isinstance(b, dict) else "not run"
            brows.append(row)
            continue
        row.update({k: b.get(k) for k in ("first_pause_gbps", "steady_pause_gbps", "first_resume_gbps",
                                          "steady_resume_gbps", "all_verified", "verify_method", "bytes",
                                          "tensors", "rss_before_first_pause", "rss_before_last", "rss_paused_last",
                                          "rss_after_last_resume", "copied_bytes_ok", "cycle_error",
                                          "truncated")})
        row["cycles"] = len(b.get("per_cycle") or [])
        for k in ("first_pause_gbps", "steady_pause_gbps"):
            row[k.replace("_gbps", "_vs_pinned")] = _ratio(b.get(k), pinned_d2h)
        for k in ("first_resume_gbps", "steady_resume_gbps"):
            row[k.replace("_gbps", "_vs_pinned")] = _ratio(b.get(k), pinned_h2d)
        per = b.get("per_cycle") or []
        if per and not b.get("retain_cpu_backup"):
            tol = max(512 * MiB, int(0.05 * (b.get("bytes") or 0)))
            row["rss_returns"] = all(abs(r["rss_after"] - r["rss_before"]) <= tol for r in per)
        t = BACKUP_TARGETS.get(config)
        if t:
            if config == "mmap":
                pauses = [b.get("first_pause_gbps"), b.get("steady_pause_gbps")]
                resumes = [b.get("first_resume_gbps"), b.get("steady_resume_gbps")]
            else:
                pauses = [b.get("steady_pause_gbps")]
                resumes = [b.get("steady_resume_gbps")]
            pauses = [x for x in pauses if x is not None]
            resumes = [x for x in resumes if x is not None]
            row["target_pause_gbps"], row["target_resume_gbps"] = t["pause"], t["resume"]
            row["target_applies_to"] = t["which"]
            row["target_met"] = bool(pauses and resumes and min(pauses) >= t["pause"] and min(resumes) >= t["resume"])
        brows.append(row)
    d["backup"] = brows

    disk_rows = []
    for target, r in sorted((results.get("disk") or {}).items()):
        if not _ok(r) or r.get("pause_gbps") is None:
            disk_rows.append({"target": target, "error": (r or {}).get("error") or "no cycle measured"})
            continue
        row = {k: r.get(k) for k in ("directory", "fs_type", "bytes", "tensors", "pause_gbps", "resume_gbps",
                                     "first_pause_gbps", "first_resume_gbps", "pause_vs_limit_write",
                                     "resume_vs_limit_read", "rss_peak_growth_max", "all_verified", "files_ok",
                                     "verify_method")}
        row.update(target=target, limit_write_gbps=_get(r, "limit", "write_gbps"),
                   limit_read_gbps=_get(r, "limit", "read_gbps"), limit_o_direct=_get(r, "limit", "o_direct"),
                   cycles=len(r.get("per_cycle") or []),
                   page_cache_growth_max=max((c.get("page_cache_growth") or 0 for c in r.get("per_cycle") or []),
                                             default=None))
        rss_ok = row["rss_peak_growth_max"] is not None and row["rss_peak_growth_max"] <= DISK_TARGET_RSS_BYTES
        if target == "tmpfs":
            row["target_text"] = f"≥{DISK_TARGET_TMPFS_GBPS:.0f} GB/s both ways, RSS ≤ {fmt_bytes(DISK_TARGET_RSS_BYTES)}"
            row["target_met"] = (r["pause_gbps"] >= DISK_TARGET_TMPFS_GBPS and r["resume_gbps"] >= DISK_TARGET_TMPFS_GBPS
                                 and rss_ok)
        else:
            row["target_text"] = (f"≥{DISK_TARGET_VS_LIMIT}× the directory's write/read, RSS ≤ "
                                  f"{fmt_bytes(DISK_TARGET_RSS_BYTES)}")
            row["target_met"] = ((row["pause_vs_limit_write"] or 0) >= DISK_TARGET_VS_LIMIT
                                 and (row["resume_vs_limit_read"] or 0) >= DISK_TARGET_VS_LIMIT and rss_ok)
        disk_rows.append(row)
    d["disk"] = disk_rows

    arows = []
    plain_nopreload = _get(results, "alloc_overhead", "torch", "plain_alloc_median_us")
    for mode in ("torch", "preload"):
        a = _get(results, "alloc_overhead", mode)
        if not _ok(a):
            continue
        arows.append({
            "mode": mode,
            "allocation_bytes": a.get("allocation_bytes"),
            "region_us": a.get("region_alloc_median_us"),
            "plain_us": a.get("plain_alloc_median_us"),
            "plain_free_us": a.get("plain_free_median_us"),
            "region_vs_plain": _ratio(a.get("region_alloc_median_us"), a.get("plain_alloc_median_us")),
            "region_minus_plain_us": (a["region_alloc_median_us"] - a["plain_alloc_median_us"])
            if a.get("region_alloc_median_us") is not None and a.get("plain_alloc_median_us") is not None else None,
            "region_vs_plain_without_preload": _ratio(a.get("region_alloc_median_us"), plain_nopreload),
        })
    d["alloc_overhead"] = arows

    pt = {}
    plain, pre = _get(results, "passthrough", "torch"), _get(results, "passthrough", "preload")
    for v in ("null", "2MiB"):
        a = plain.get(f"{v}_pair_median_ns") if _ok(plain) else None
        b = pre.get(f"{v}_pair_median_ns") if _ok(pre) else None
        direct = pre.get(f"{v}_direct_pair_median_ns") if _ok(pre) else None
        same = (b - direct) if b is not None and direct is not None else None
        cross = (b - a) if a is not None and b is not None else None
        best = same if same is not None else cross
        pt[v] = {"plain_process_ns_per_pair": a, "preload_direct_ns_per_pair": direct, "preload_hook_ns_per_pair": b,
                 "overhead_ns_per_call_same_process": same / 2 if same is not None else None,
                 "overhead_ns_per_call_vs_plain_process": cross / 2 if cross is not None else None,
                 "hook_vs_direct": _ratio(b, direct),
                 "hook_vs_plain_process": _ratio(b, a),
                 "target_ns_per_call": PASSTHROUGH_TARGET_NS_PER_CALL,
                 "target_met": (best / 2 < PASSTHROUGH_TARGET_NS_PER_CALL) if best is not None else None}
    d["passthrough"] = pt

    ct = _get(results, "contention", "preload")
    if _ok(ct) and ct.get("during_pause_foreign_free_hook", {}).get("p99_us") is not None:
        p99 = {k: ct.get(f"during_pause_{k}", {}).get("p99_us") for k in CONTENTION_OPS}
        added = (p99["pair_hook"] - p99["pair_direct"]) if p99["pair_hook"] is not None else None
        d["contention"] = {
            "bytes": ct.get("bytes"), "pause_ms": median(ct.get("pause_s") or [0]) * 1e3,
            "rows": {k: {"idle": ct.get(f"idle_{k}", {}), "during": ct.get(f"during_pause_{k}", {})}
                     for k in CONTENTION_OPS},
            "pair_hook_minus_direct_p99_us": added,
            "target_p99_us": CONTENTION_TARGET_P99_US,
            # The library's part: the hook's own lookup (foreign free) and what the
            # hook adds to CUDA's pair; CUDA's own pair during the copies is not ours.
            "target_met": p99["foreign_free_hook"] < CONTENTION_TARGET_P99_US
            and (added is None or added < CONTENTION_TARGET_P99_US),
        }

    for key, xkey in (("count", "allocations"), ("bytes", "bytes")):
        sc = _get(results, "scaling", key)
        pts = []
        if _ok(sc):
            for p in sc.get("points", []):
                if p.get("pause_median_s") is None:
                    pts.append({"x": p.get(xkey) or p.get("requested_allocations"),
                                "skipped": p.get("skipped") or p.get("error")})
                    continue
                f = floor.get((int(p["allocations"]), int(p["reserved_size"])))
                pts.append({"x": p.get(xkey), "allocations": p.get("allocations"),
                            "reserved_size": p.get("reserved_size"), **_vs_floors(p, f)})
        good = [p for p in pts if p.get("pause_ms") is not None]
        scale = 1.0 if key == "count" else 1.0 / GiB
        fits = {}
        for what in ("pause_ms", "resume_ms", "floor_pause_ms", "floor_resume_ms", "paired_pause_ms", "paired_resume_ms"):
            fits[what] = _fit_line([p["x"] * scale for p in good], [p.get(what) for p in good])
        d[f"scaling_{key}"] = {"points": pts, "fit": fits,
                               "fit_x_unit": "allocations" if key == "count" else "GiB",
                               "fit_y_unit": "ms"}
    return d


# ---- markdown ---------------------------------------------------------------------

def _f(x, fmt="{:.2f}", none="-"):
    if x is None:
        return none
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    try:
        return fmt.format(x)
    except (ValueError, TypeError):
        return str(x)


def _ratio_cell(x):
    return "-" if x is None else f"{x:.2f}×"


def _both_ratios(p, what):
    return f"{_ratio_cell(p.get(f'{what}_vs_paired'))} / {_ratio_cell(p.get(f'{what}_vs_floor'))}"


PAIRED_TEXT = ("The paired floor is the raw driver loop on as many allocations of the same size, held in the same "
               "process and cycled once beside each of the library's cycles (before it and after it in turn), so "
               "both see the same driver state and idle time; the own-process floor is `vmm_floor` in a process of "
               "its own (section 1).")


def header_rows(meta):
    """What the run's report header adds to the common one."""
    return [["driver", f"{meta.get('driver_version', '-')} (CUDA driver API {meta.get('cuda_driver_api', '-')})"],
            ["torch / CUDA", f"{meta.get('torch_version', '-')} / {meta.get('torch_cuda_version', '-')}"],
            ["host", f"{meta.get('cpu_count', '-')} CPUs, {_f(meta.get('host_mem_gib'), '{:.0f}')} GiB RAM"],
            ["wall time", f"{_f(meta.get('wall_s'), '{:.0f}')} s"]]


def markdown(results, images):
    """The report's body, below the header report.write puts above it."""
    d = results.get("derived") or derive(results)
    out = []
    out.append("Medians unless noted; GB/s = 10⁹ bytes/s; every ratio is against a limit this run measured "
               "on this machine.\n")
    summary = _summary_lines(d)
    if summary:
        out.append("**Summary**\n")
        out.extend(f"- {line}" for line in summary)
        out.append("")

    L = d.get("limits", {})
    out.append("## 1. Limits of this machine\n")
    if (results.get("limits") or {}).get("stand_in"):
        out.append(f"_Stand-in: {results['limits']['stand_in']}._\n")
    if not _ok(results.get("limits")):
        out.append(f"**Not measured**: {(results.get('limits') or {}).get('error', 'not run')}\n")
    out.append(_table(["limit", "value", "ratio"], [
        ["pinned host→device copy", f"{_f(L.get('pinned_h2d_gbps'), '{:.1f}')} GB/s", "1.00× (reference)"],
        ["pinned device→host copy", f"{_f(L.get('pinned_d2h_gbps'), '{:.1f}')} GB/s", "1.00× (reference)"],
        ["pageable host→device copy", f"{_f(L.get('pageable_h2d_gbps'), '{:.1f}')} GB/s",
         f"{_ratio_cell(L.get('pageable_h2d_vs_pinned'))} of pinned"],
        ["pageable device→host copy", f"{_f(L.get('pageable_d2h_gbps'), '{:.1f}')} GB/s",
         f"{_ratio_cell(L.get('pageable_d2h_vs_pinned'))} of pinned"],
        [f"pinning {fmt_bytes(L.get('pin_bytes'))} (`torch.empty(pin_memory=True)`)", f"{_f(L.get('pin_s'))} s",
         f"{_f(L.get('pin_gbps'), '{:.1f}')} GB/s = {_ratio_cell(L.get('pin_gbps_vs_pinned_d2h'))} of pinned D→H"],
        ["first touch of fresh pageable memory", f"{_f(L.get('pageable_first_touch_gbps'), '{:.1f}')} GB/s", ""],
        [f"`cudaHostRegister` of {fmt_bytes(L.get('pin_bytes'))} populated", f"{_f(L.get('host_register_s'))} s", ""],
    ]))
    fl = results.get("vmm_floor") or {}
    out.append("")
    if fl.get("ok"):
        rows = []
        for s in fl.get("shapes", []):
            if s.get("pause_median_s") is None:
                rows.append([f"{s['count']} × {fmt_bytes(s['reserved_size'])}", "-", "-", "-", "-",
                             s.get("error") or ""])
                continue
            n = s["count"]
            rows.append([f"{n} × {fmt_bytes(s['reserved_size'])}", _f(s["pause_median_s"] * 1e3, "{:.3f}"),
                         _f(s["resume_median_s"] * 1e3, "{:.3f}"), _f(s["pause_median_s"] / n * 1e6, "{:.1f}"),
                         _f(s["resume_median_s"] / n * 1e6, "{:.1f}"), ""])
        out.append(f"Raw driver VMM floor (`benchmarks/vmm_floor.c`, median of {fl.get('shapes', [{}])[0].get('cycles', '?')} "
                   f"cycles; pause = `cuMemUnmap`+`cuMemRelease`, resume = `cuMemCreate`+`cuMemMap`+`cuMemSetAccess`; "
                   f"one idle `cuCtxSynchronize` = {_f((fl.get('ctx_synchronize_median_s') or 0) * 1e6, '{:.1f}')} µs):\n")
        out.append(_table(["shape", "pause ms", "resume ms", "pause µs/alloc", "resume µs/alloc", "note"], rows))
    else:
        out.append(f"Raw driver VMM floor: **not measured**: {fl.get('error', 'not run')}")
    out.append("")

    out.append("## 2. Pause/resume latency without backup\n")
    out.append(f"Tensors of the given shape; `allocations` is what the library holds (PyTorch's caching "
               f"allocator carves 1–10 MiB tensors out of 20 MiB segments). {PAIRED_TEXT} Ratios are of medians, "
               f"and of the fastest cycles: the driver's own release or create of a large allocation takes either "
               f"well under a millisecond or tens of milliseconds from one cycle to the next, in the floor as in the "
               f"library. Target: within {FLOOR_RATIO_TARGET}× of the floor.\n")
    rows = []
    for r in d.get("latency", []):
        if r.get("pause_ms") is None:
            rows.append([r["shape"], r["mode"], _f(r.get("allocations"), "{}"), "-", "-", "-", "-", "-", "-", "-", "-",
                         "-", r.get("skipped") or "not measured"])
            continue
        rows.append([r["shape"], r["mode"], f"{r['allocations']} × {fmt_bytes(r['reserved_size'])}",
                     _f(r["pause_ms"], "{:.3f}"), _f(r.get("paired_pause_ms"), "{:.3f}"),
                     _ratio_cell(r.get("pause_vs_paired")),
                     _f(r["resume_ms"], "{:.3f}"), _f(r.get("paired_resume_ms"), "{:.3f}"),
                     _ratio_cell(r.get("resume_vs_paired")),
                     f"{_ratio_cell(r.get('pause_fastest_vs_paired'))} / {_ratio_cell(r.get('resume_fastest_vs_paired'))}",
                     f"{_ratio_cell(r.get('pause_vs_floor'))} / {_ratio_cell(r.get('resume_vs_floor'))}",
                     f"{_f(r.get('freed_gib'))} of {_f(r.get('reserved_gib'))} GiB {_f(r.get('freed_ok'))}",
                     "; ".join(x for x in (f"addresses kept: {_f(r.get('same_addresses'))}", r.get("paired_note")) if x)])
    out.append(_table(["tensors", "mode", "allocations", "pause ms", "paired floor ms", "ratio", "resume ms",
                       "paired floor ms", "ratio", "fastest cycle × paired floor's pause / resume",
                       "× own-process floor pause / resume", "freed (mem_get_info)", "note"],
                      rows) if rows else "_not measured_")
    out.append("")
    if images.get("latency"):
        out.append(f"![latency vs floor]({images['latency']})\n")

    b0 = next((b for b in (results.get("backup") or {}).values() if _ok(b)), {})
    out.append(f"## 3. Backup bandwidth ({fmt_bytes(b0.get('bytes'))} in {b0.get('tensors', '-')} tensors)\n")
    out.append(f"Pause GB/s against the pinned device→host copy ({_f(L.get('pinned_d2h_gbps'), '{:.1f}')} GB/s), "
               f"resume against pinned host→device ({_f(L.get('pinned_h2d_gbps'), '{:.1f}')} GB/s). First = "
               f"cycle 1; steady = median of cycles 2..N. Contents are refilled with fresh random data before every "
               f"cycle and compared after every resume. RSS = this process's VmRSS.\n")
    rows = []
    for r in d.get("backup", []):
        if r.get("error"):
            rows.append([r["config"]] + ["-"] * 9 + [f"error: {r['error'][:120]}"])
            continue
        target = "-"
        if r.get("target_pause_gbps"):
            target = (f"≥{r['target_pause_gbps']:.0f}/≥{r['target_resume_gbps']:.0f} "
                      f"({r['target_applies_to']}): {'met' if r.get('target_met') else '**missed**'}")
        rss = (f"{_f((r.get('rss_before_last') or 0) / GiB)} → {_f((r.get('rss_paused_last') or 0) / GiB)} → "
               f"{_f((r.get('rss_after_last_resume') or 0) / GiB)}")
        rows.append([
            r["config"],
            f"{_f(r.get('first_pause_gbps'), '{:.1f}')} ({_ratio_cell(r.get('first_pause_vs_pinned'))})",
            f"{_f(r.get('steady_pause_gbps'), '{:.1f}')} ({_ratio_cell(r.get('steady_pause_vs_pinned'))})",
            f"{_f(r.get('first_resume_gbps'), '{:.1f}')} ({_ratio_cell(r.get('first_resume_vs_pinned'))})",
            f"{_f(r.get('steady_resume_gbps'), '{:.1f}')} ({_ratio_cell(r.get('steady_resume_vs_pinned'))})",
            _f(r.get("cycles"), "{}"),
            f"{_f(r.get('all_verified'))} ({r.get('verify_method')})",
            rss,
            _f(r.get("rss_returns")) if "rss_returns" in r else "retained",
            target,
            (r.get("cycle_error") or "") + (" (cut short: time budget)" if r.get("truncated") else ""),
        ])
    out.append(_table(["backend", "pause first GB/s", "pause steady GB/s", "resume first GB/s",
                       "resume steady GB/s", "cycles", "contents exact", "RSS GiB before → paused → after (last cycle)",
                       "RSS back", "target", "note"], rows))
    out.append("")
    if images.get("backup"):
        out.append(f"![backup bandwidth]({images['backup']})\n")

    if d.get("disk"):
        r0 = next((r for r in d["disk"] if not r.get("error")), {})
        out.append(f"### Disk backup ({fmt_bytes(r0.get('bytes'))} in {r0.get('tensors', '-')} tensors, "
                   f"`enable_disk_backup=True`)\n")
        out.append("Each directory's limit is measured first in the same process: a parallel O_DIRECT writer and "
                   "reader with as many threads as the library's copy workers, 8 MiB blocks taken in turns across "
                   "one file per tensor. Pause/resume GB/s are medians of all cycles; contents are refilled with "
                   "fresh random data before every cycle and compared after every resume. RSS growth is the peak "
                   "VmRSS sampled every 2 ms during each pause minus VmRSS before it; page cache growth is the "
                   "system's `Cached:` across the pause (a tmpfs counts there by nature).\n")
        rows = []
        for r in d["disk"]:
            if r.get("error"):
                rows.append([r["target"]] + ["-"] * 8 + [f"error: {str(r['error'])[:120]}"])
                continue
            rows.append([
                f"{r['target']} ({r.get('fs_type')})",
                f"{_f(r.get('limit_write_gbps'))} / {_f(r.get('limit_read_gbps'))}"
                + ("" if r.get("limit_o_direct") else " (buffered)"),
                f"{_f(r.get('pause_gbps'))} ({_ratio_cell(r.get('pause_vs_limit_write'))})",
                f"{_f(r.get('resume_gbps'))} ({_ratio_cell(r.get('resume_vs_limit_read'))})",
                f"{_f(r.get('first_pause_gbps'))} / {_f(r.get('first_resume_gbps'))}",
                _f(r.get("cycles"), "{}"),
                f"{_f(r.get('all_verified'))} ({r.get('verify_method')})",
                f"{fmt_bytes(r.get('rss_peak_growth_max'))} / {fmt_bytes(r.get('page_cache_growth_max'))}",
                f"{r['target_text']}: {'met' if r.get('target_met') else '**missed**'}",
                "" if r.get("files_ok") else "**not one file per allocation**",
            ])
        out.append(_table(["directory", "limit write / read GB/s", "pause GB/s (vs write)", "resume GB/s (vs read)",
                           "first pause / resume GB/s", "cycles", "contents exact", "RSS / page cache growth (max)",
                           "target", "note"], rows))
        out.append("")

    out.append("## 4. Allocation overhead\n")
    rows = []
    for r in d.get("alloc_overhead", []):
        rows.append([r["mode"], fmt_bytes(r.get("allocation_bytes")), _f(r.get("region_us"), "{:.1f}"),
                     _f(r.get("plain_us"), "{:.1f}"), _ratio_cell(r.get("region_vs_plain")),
                     _f(r.get("region_minus_plain_us"), "{:+.1f}")])
    out.append("Cost of one allocation that reaches the allocator (fresh tensors, none cached), inside a region vs "
               "plain PyTorch in the same process (in the preload process plain allocations pass through the "
               "hook):\n")
    out.append(_table(["hook mode", "size", "region µs/alloc", "plain µs/alloc", "ratio", "difference µs"], rows)
               if rows else "_not measured_")
    out.append("")
    pt = d.get("passthrough", {})
    rows = []
    for v, label in (("null", "`cudaMalloc(&p, 0)` + `cudaFree(NULL)`"), ("2MiB", "`cudaMalloc` + `cudaFree` of 2 MiB")):
        r = pt.get(v, {})
        rows.append([label, _f(r.get("preload_direct_ns_per_pair"), "{:.0f}"),
                     _f(r.get("preload_hook_ns_per_pair"), "{:.0f}"),
                     f"{_f(r.get('overhead_ns_per_call_same_process'), '{:+.0f}')} "
                     f"({_ratio_cell(r.get('hook_vs_direct'))})",
                     _f(r.get("plain_process_ns_per_pair"), "{:.0f}"),
                     f"{_f(r.get('overhead_ns_per_call_vs_plain_process'), '{:+.0f}')} "
                     f"({_ratio_cell(r.get('hook_vs_plain_process'))})",
                     f"< {PASSTHROUGH_TARGET_NS_PER_CALL:.0f} ns/call: "
                     + ("-" if r.get("target_met") is None else ("met" if r["target_met"] else "**missed**"))])
    out.append("Preload pass-through: `cudaMalloc`/`cudaFree` outside any region, called through ctypes (ns per "
               "call pair, median of interleaved batches). In the preloaded process, through the hook "
               "(`ctypes.CDLL(None)`, what every library gets) vs libcudart's own functions; and a process "
               "without preload calling libcudart:\n")
    out.append(_table(["call pair", "preload process: libcudart ns", "preload process: hook ns",
                       "hook adds ns/call (ratio)", "no-preload process ns", "vs no-preload ns/call (ratio)",
                       "target"], rows))
    out.append("")

    ct = d.get("contention")
    if ct:
        out.append(f"Calls on a second thread, idle and while the main thread pauses {fmt_bytes(ct['bytes'])} with "
                   f"backup (median pause {ct['pause_ms']:.0f} ms); hook and libcudart interleaved on that thread. "
                   "During the copies CUDA's own cudaFree waits for the device; what the library adds is the "
                   "hook's row minus libcudart's:\n")
        rows = []
        for key, label in CONTENTION_OPS.items():
            r = ct["rows"].get(key, {})
            i, w = r.get("idle") or {}, r.get("during") or {}
            rows.append([label, _f(i.get("p50_us"), "{:.1f}"), _f(i.get("p99_us"), "{:.1f}"), _f(w.get("samples"), "{}"),
                         _f(w.get("p50_us"), "{:.1f}"), _f(w.get("p99_us"), "{:.1f}"), _f(w.get("max_us"), "{:.1f}")])
        out.append(_table(["call", "idle p50 µs", "idle p99 µs", "samples in pause", "p50 µs", "p99 µs", "max µs"],
                          rows))
        out.append(f"\nTarget: during the pause, the hook's lookup (foreign free) p99 and what the hook "
                   f"adds to the pair's p99 < {CONTENTION_TARGET_P99_US:.0f} µs: "
                   + ("met" if ct["target_met"] else "**missed**") + "\n")

    out.append("## 5. Scaling (torch hook mode)\n")
    out.append("Ratios: against the paired floor / the own-process floor (section 2 says how each runs).\n")
    sc = d.get("scaling_count", {})
    rows = []
    for p in sc.get("points", []):
        if p.get("pause_ms") is None:
            rows.append([_f(p.get("x"), "{}"), "-", "-", "-", "-", "-", "-", p.get("skipped") or ""])
            continue
        n = max(1, p["allocations"])
        rows.append([p["allocations"], _f(p["pause_ms"], "{:.3f}"), _f(p["pause_ms"] / n * 1e3, "{:.1f}"),
                     _both_ratios(p, "pause"), _f(p["resume_ms"], "{:.3f}"),
                     _f(p["resume_ms"] / n * 1e3, "{:.1f}"), _both_ratios(p, "resume"), p.get("paired_note") or ""])
    out.append("Pause/resume vs number of 2 MiB allocations:\n")
    out.append(_table(["allocations", "pause ms", "µs/alloc", "vs floor", "resume ms", "µs/alloc", "vs floor",
                       "note"], rows) if rows else "_not measured_")
    out.append("\n" + _fit_text(sc.get("fit", {}), "per allocation", 1e3, "µs"))
    sb = d.get("scaling_bytes", {})
    rows = []
    for p in sb.get("points", []):
        if p.get("pause_ms") is None:
            rows.append([fmt_bytes(p.get("x")), "-", "-", "-", "-", p.get("skipped") or ""])
            continue
        rows.append([fmt_bytes(p["x"]), _f(p["pause_ms"], "{:.3f}"), _both_ratios(p, "pause"),
                     _f(p["resume_ms"], "{:.3f}"), _both_ratios(p, "resume"), p.get("paired_note") or ""])
    out.append("\nPause/resume vs total bytes in one allocation:\n")
    out.append(_table(["bytes", "pause ms", "vs floor", "resume ms", "vs floor", "note"], rows)
               if rows else "_not measured_")
    out.append("\n" + _fit_text(sb.get("fit", {}), "per GiB", 1.0, "ms"))
    for key, alt in (("scaling_count", "pause/resume vs allocation count"), ("scaling_bytes", "pause/resume vs bytes")):
        if images.get(key):
            out.append(f"\n![{alt}]({images[key]})")
    out.append("")

    errs = results.get("errors") or []
    if errs:
        out.append("## Errors and failed checks\n")
        for e in errs:
            out.append(f"- **{e.get('where')}**: {str(e.get('error'))[:400]}")
        out.append("")
    for key, heading, field in (("skipped", "Skipped", "why"), ("notes", "Notes", "note")):
        if results.get(key):
            out.append(f"## {heading}\n")
            for e in results[key]:
                out.append(f"- **{e.get('where')}**: {str(e.get(field))[:400]}")
            out.append("")
    return "\n".join(out) + "\n"


def _summary_lines(d):
    lines = []
    for r in d.get("backup", []):
        if r.get("error") or r.get("first_pause_gbps") is None:
            continue
        text = (f"backup `{r['config']}`: pause {_f(r.get('first_pause_gbps'), '{:.1f}')} GB/s first / "
                f"{_f(r.get('steady_pause_gbps'), '{:.1f}')} steady ({_ratio_cell(r.get('first_pause_vs_pinned'))} / "
                f"{_ratio_cell(r.get('steady_pause_vs_pinned'))} of pinned D→H), resume "
                f"{_f(r.get('first_resume_gbps'), '{:.1f}')} / {_f(r.get('steady_resume_gbps'), '{:.1f}')} GB/s "
                f"({_ratio_cell(r.get('first_resume_vs_pinned'))} / {_ratio_cell(r.get('steady_resume_vs_pinned'))} "
                f"of pinned H→D), contents exact: {_f(r.get('all_verified'))}")
        if "target_met" in r:
            text += f"; target {'met' if r['target_met'] else '**missed**'}"
        lines.append(text)
    for r in d.get("disk", []):
        if r.get("error"):
            continue
        lines.append(f"disk backup to {r['target']} ({r.get('fs_type')}): pause {_f(r.get('pause_gbps'))} GB/s "
                     f"({_ratio_cell(r.get('pause_vs_limit_write'))} of its parallel O_DIRECT write), resume "
                     f"{_f(r.get('resume_gbps'))} GB/s ({_ratio_cell(r.get('resume_vs_limit_read'))} of its read), "
                     f"RSS +{fmt_bytes(r.get('rss_peak_growth_max'))} at most, contents exact: "
                     f"{_f(r.get('all_verified'))}; target {'met' if r.get('target_met') else '**missed**'}")
    lat = [r for r in d.get("latency", []) if vs_floor(r, "pause")[0] is not None]
    if lat:
        worst = {what: max(lat, key=lambda r: vs_floor(r, what)[0] or 0) for what in ("pause", "resume")}
        lines.append("discard pause/resume vs raw driver floor: " + ", ".join(
            f"worst {what} {_ratio_cell(vs_floor(r, what)[0])} of the {vs_floor(r, what)[1]} floor "
            f"({r['shape']}, {r['mode']})" for what, r in worst.items()) + f"; target ≤ {FLOOR_RATIO_TARGET}×")
        fastest = [r for r in lat if r.get("pause_fastest_vs_paired") is not None]
        if fastest:
            lines[-1] += "; fastest cycles against the paired floor's: " + ", ".join(
                f"worst {what} {_ratio_cell(r[f'{what}_fastest_vs_paired'])} ({r['shape']}, {r['mode']})"
                for what, r in ((w, max(fastest, key=lambda r: r[f"{w}_fastest_vs_paired"] or 0))
                                for w in ("pause", "resume")))
    pt = d.get("passthrough", {}).get("2MiB", {})
    if pt.get("overhead_ns_per_call_same_process") is not None or pt.get("overhead_ns_per_call_vs_plain_process") is not None:
        lines.append(f"preload pass-through (cudaMalloc/cudaFree outside regions) adds "
                     f"{_f(pt.get('overhead_ns_per_call_same_process'), '{:+.0f}')} ns per call vs libcudart in the "
                     f"same process ({_f(pt.get('overhead_ns_per_call_vs_plain_process'), '{:+.0f}')} ns vs a process "
                     f"without preload); target < {PASSTHROUGH_TARGET_NS_PER_CALL:.0f} ns")
    ct = d.get("contention")
    if ct:
        r = ct["rows"]
        lines.append(f"calls on another thread during a {fmt_bytes(ct['bytes'])} backed-up pause, p99: hook's lookup "
                     f"(cudaFree of a foreign address) {_f(r['foreign_free_hook']['during'].get('p99_us'), '{:.1f}')} µs; "
                     f"cudaMalloc+cudaFree 2 MiB {_f(r['pair_hook']['during'].get('p99_us'), '{:.0f}')} µs through the "
                     f"hook vs {_f(r['pair_direct']['during'].get('p99_us'), '{:.0f}')} µs libcudart directly; stats() "
                     f"{_f(r['stats']['during'].get('p99_us'), '{:.1f}')} µs; target < {CONTENTION_TARGET_P99_US:.0f} µs "
                     + ("met" if ct["target_met"] else "**missed**"))
    for r in d.get("alloc_overhead", []):
        lines.append(f"allocation inside a region ({r['mode']} mode): {_f(r.get('region_us'), '{:.1f}')} µs vs "
                     f"{_f(r.get('plain_us'), '{:.1f}')} µs plain ({_ratio_cell(r.get('region_vs_plain'))})")
    fit = d.get("scaling_count", {}).get("fit", {})
    if fit.get("pause_ms") and fit.get("resume_ms"):
        lines.append(f"cost law (torch mode, 2 MiB allocations): pause ≈ {fit['pause_ms']['slope'] * 1e3:.1f} µs and "
                     f"resume ≈ {fit['resume_ms']['slope'] * 1e3:.1f} µs per allocation"
                     + (f" (driver: {fit['floor_pause_ms']['slope'] * 1e3:.1f} / "
                        f"{fit['floor_resume_ms']['slope'] * 1e3:.1f} µs"
                        + (f"; paired: {fit['paired_pause_ms']['slope'] * 1e3:.1f} / "
                           f"{fit['paired_resume_ms']['slope'] * 1e3:.1f} µs"
                           if fit.get("paired_pause_ms") and fit.get("paired_resume_ms") else "") + ")"
                        if fit.get("floor_pause_ms") and fit.get("floor_resume_ms") else ""))
    return lines


def _fit_text(fit, per, mul, unit):
    parts = []
    for what, label in (("pause_ms", "library pause"), ("resume_ms", "library resume"),
                        ("floor_pause_ms", "driver pause"), ("floor_resume_ms", "driver resume"),
                        ("paired_pause_ms", "paired driver pause"), ("paired_resume_ms", "paired driver resume")):
        f = fit.get(what)
        if f:
            parts.append(f"{label} ≈ {f['intercept']:.3f} ms + {f['slope'] * mul:.2f} {unit} {per}")
    return ("Least-squares cost law: " + "; ".join(parts) + ".") if parts else ""


# ---- plots ------------------------------------------------------------------------

def plots(results, out_dir, stem):
    """Writes the PNGs; returns ({name: file name}, [errors])."""
    d = results.get("derived") or derive(results)
    images, errors = {}, []
    plt = pyplot()
    if plt is None:
        return images, ["matplotlib unavailable"]

    def save(fig, name):
        save_png(plt, fig, os.path.join(out_dir, f"{stem}-{name}.png"))
        images[name] = f"{stem}-{name}.png"

    for key, xlabel, xscale in (("scaling_count", "allocations (2 MiB each)", 1.0),
                                ("scaling_bytes", "bytes in one allocation (GiB)", 1.0 / GiB)):
        try:
            pts = [p for p in d.get(key, {}).get("points", []) if p.get("pause_ms") is not None]
            if not pts:
                continue
            fig, ax = plt.subplots(figsize=(7, 4.5))
            xs = [p["x"] * xscale for p in pts]
            for what, style, label in (("pause_ms", "o-", "pause (library)"), ("resume_ms", "s-", "resume (library)"),
                                       ("floor_pause_ms", "o--", "pause (driver floor)"),
                                       ("floor_resume_ms", "s--", "resume (driver floor)")):
                ys = [p.get(what) for p in pts]
                xy = [(x, y) for x, y in zip(xs, ys) if y]
                if xy:
                    ax.plot([x for x, _ in xy], [y for _, y in xy], style, label=label)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("time (ms)")
            ax.set_title(("Discard-mode pause/resume vs allocation count" if key == "scaling_count"
                          else "Discard-mode pause/resume vs size") + f"\n{results.get('meta', {}).get('device_name', '')}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            save(fig, key)
        except Exception as e:
            errors.append(f"plot {key}: {type(e).__name__}: {e}")

    try:
        rows = [r for r in d.get("backup", []) if not r.get("error")]
        if rows:
            fig, ax = plt.subplots(figsize=(8, 4.8))
            series = (("first_pause_gbps", "pause, first"), ("steady_pause_gbps", "pause, steady"),
                      ("first_resume_gbps", "resume, first"), ("steady_resume_gbps", "resume, steady"))
            width = 0.8 / len(series)
            for i, (k, label) in enumerate(series):
                xs = [j + (i - 1.5) * width for j in range(len(rows))]
                ax.bar(xs, [r.get(k) or 0 for r in rows], width, label=label)
            L = d.get("limits", {})
            if L.get("pinned_d2h_gbps"):
                ax.axhline(L["pinned_d2h_gbps"], color="k", ls="-", lw=1,
                           label=f"pinned D→H limit {L['pinned_d2h_gbps']:.1f}")
            if L.get("pinned_h2d_gbps"):
                ax.axhline(L["pinned_h2d_gbps"], color="k", ls="--", lw=1,
                           label=f"pinned H→D limit {L['pinned_h2d_gbps']:.1f}")
            if L.get("pageable_d2h_gbps"):
                ax.axhline(L["pageable_d2h_gbps"], color="gray", ls=":", lw=1,
                           label=f"pageable D→H {L['pageable_d2h_gbps']:.1f}")
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels([r["config"].replace("_", "\n") for r in rows])
            ax.set_ylabel("GB/s")
            ax.set_title(f"Backup bandwidth, {fmt_bytes(rows[0].get('bytes'))} in {rows[0].get('tensors')} tensors\n"
                         f"{results.get('meta', {}).get('device_name', '')}")
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
            ax.grid(True, axis="y", alpha=0.3)
            save(fig, "backup")
    except Exception as e:
        errors.append(f"plot backup: {type(e).__name__}: {e}")

    try:
        rows = [r for r in d.get("latency", []) if r.get("pause_ms") is not None]
        if rows:
            shapes = []
            for r in rows:
                if r["shape"] not in shapes:
                    shapes.append(r["shape"])
            fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=False)
            for ax, what in zip(axes, ("pause", "resume")):
                bars = []
                for mode in ("torch", "preload"):
                    bars.append((f"{mode}", [next((r[f"{what}_ms"] for r in rows
                                                   if r["shape"] == s and r["mode"] == mode), 0) for s in shapes]))
                bars.append(("driver floor", [next((r.get(f"floor_{what}_ms") or 0 for r in rows
                                                    if r["shape"] == s), 0) for s in shapes]))
                width = 0.8 / len(bars)
                for i, (label, ys) in enumerate(bars):
                    ax.bar([j + (i - 1) * width for j in range(len(shapes))], ys, width, label=label)
                ax.set_xticks(range(len(shapes)))
                ax.set_xticklabels(shapes)
                ax.set_yscale("log")
                ax.set_ylabel("ms")
                ax.set_title(f"{what} (discard)")
                ax.grid(True, axis="y", which="both", alpha=0.3)
            axes[0].legend(fontsize=8)
            fig.suptitle(f"Discard-mode pause/resume latency vs driver floor — {results.get('meta', {}).get('device_name', '')}")
            save(fig, "latency")
    except Exception as e:
        errors.append(f"plot latency: {type(e).__name__}: {e}")
    return images, errors
