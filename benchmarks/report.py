"""The one report writer of every suite: the run's facts (device, date, commit, command line), then
<suite>_<device>[-<variant>].json and .md (and the suite's PNGs) in the output folder, and README.md there, the
index of the reports it holds.

A report's name carries no date: a new run of a suite on the same device replaces the last one (git keeps the
history), so the folder holds the latest report per suite and device.
"""
import datetime
import os
import re
import shlex
import subprocess
import sys

from .common import (DRY_RUN_OUT, REPO, RESULTS, GiB, error_record, meminfo, proc_field, read_json, write_json_atomic)

SUITES = ("run", "multi_gpu", "alloc_count", "speed", "switch")
DRY_RUN_DEVICE = "host backend (dry run)"


def _run_text(cmd, timeout=20):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.stdout.strip() if p.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def git_commit():
    """(commit, dirty). TMS_BENCH_COMMIT names the commit of a copied tree whose git metadata is not its own (a tree
    copied beside the .git of an earlier copy); whether such a tree is dirty is then unknown (None)."""
    named = os.environ.get("TMS_BENCH_COMMIT")
    if named:
        return named, None
    commit = _run_text(["git", "-C", REPO, "rev-parse", "HEAD"])
    status = _run_text(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"])
    dirty = None if status is None else any(line and "benchmarks/results" not in line for line in status.splitlines())
    return commit or "unknown", dirty


def _nvidia_smi():
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    index = visible if visible.isdigit() else "0"
    fields = ["name", "driver_version", "memory.total", "pcie.link.gen.max", "pcie.link.width.max"]
    text = _run_text(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", index])
    if not text:
        return {}
    out = dict(zip(fields, (v.strip() for v in text.splitlines()[0].split(","))))
    return {"device_name": out.get("name"), "driver_version": out.get("driver_version"),
            "nvidia_smi_memory_total_mib": out.get("memory.total"),
            "pcie": f"gen{out.get('pcie.link.gen.max')} x{out.get('pcie.link.width.max')}"}


def collect_meta(suite, argv, dry_run):
    """What every report says about its run; the suite adds device_name where
    nvidia-smi could not tell it."""
    mem = meminfo("MemTotal", "/proc/meminfo")
    meta = {"suite": suite, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "dry_run": bool(dry_run), "command": shlex.join(["python", "-m", "benchmarks", suite, *argv]),
            "python": sys.version.split()[0], "kernel": os.uname().release,
            "cpu_model": proc_field("/proc/cpuinfo", "model name"), "cpu_count": os.cpu_count(),
            "host_mem_gib": mem / GiB if mem else None,
            "environment": {k: v for k, v in sorted(os.environ.items())
                            if k.startswith("TMS_") or k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")}}
    meta["git_commit"], meta["git_dirty"] = git_commit()
    try:
        from torch_memory_saver import __version__

        meta["tms_version"] = __version__
    except Exception as e:
        meta["tms_version"] = f"import failed: {e}"
    if dry_run:
        meta["device_name"] = DRY_RUN_DEVICE
    else:
        meta.update({k: v for k, v in _nvidia_smi().items() if v})
    return meta


def slug(text):
    return re.sub(r"[^A-Za-z0-9]+", "-", text or "gpu").strip("-") or "gpu"


def publish(args, doc, title, body, plots=None, variant=None, extra_rows=()):
    """write() into --out (or the default folder) under the suite's name, then
    prints the report; body is text, or a function of the plots' images."""
    md = write(out_dir(args.out, args.dry_run), name(doc["meta"], variant), doc, title,
               body if callable(body) else lambda images: body, plots, extra_rows)
    print(open(md).read())
    print(f"written: {md}")
    return md


def name(meta, variant=None):
    """<suite>_<device>[-<variant>]: the variant names what makes a run of the
    suite another report on the same device (processes per GPU, options)."""
    return f"{meta['suite']}_{slug(meta.get('device_name'))}" + (f"-{variant}" if variant else "")


def out_dir(requested, dry_run):
    """--out, else benchmarks/results; a dry run's figures mean nothing, so by
    default they go to build/bench-dry-run instead."""
    path = os.path.abspath(requested or (DRY_RUN_OUT if dry_run else RESULTS))
    os.makedirs(path, exist_ok=True)
    return path


def table(head, rows, align=None):
    """A Markdown table; align is one letter per column (l or r), default the
    first column left and the rest right."""
    align = align or "l" + "r" * (len(head) - 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def header(meta, title, extra_rows=()):
    if meta.get("dry_run"):
        title += " — DRY RUN (host backend, no GPU: figures are not GPU figures)"
    commit = f"`{meta.get('git_commit', '-')}`" + (" (dirty)" if meta.get("git_dirty") else "")
    rows = [["device", meta.get("device_name", "-")], ["date (UTC)", meta.get("date", "-")], ["commit", commit],
            ["command", f"`{meta.get('command', '-')}`"], *extra_rows]
    return f"# {title}\n\n" + table(["", ""], rows) + "\n\n"


def write(out, stem, doc, title, body, plots=None, extra_rows=()):
    """Writes stem.json (doc, which holds "meta") and stem.md (the header, then body(images)); then plots(out, stem) ->
    {name: PNG file name}, and both again with the images, so that a plot that fails costs no figures; then the index.
    Returns the Markdown path."""
    md_path = os.path.join(out, f"{stem}.md")
    # The plots of the report this one replaces go with it (older reports named one, stem.png).
    before = read_json(os.path.join(out, f"{stem}.json")).get("plots") or {"plot": f"{stem}.png"}

    def save(images):
        write_json_atomic(os.path.join(out, f"{stem}.json"), doc, strip=REPO + os.sep)
        try:
            text = body(images)
        except Exception as e:  # the figures are in the JSON; say why the text is not
            r = error_record(e)
            text = f"Markdown report failed: {r['error']}\n\n```\n{r['traceback']}\n```\n"
        with open(md_path, "w") as f:
            f.write(header(doc["meta"], title, extra_rows() if callable(extra_rows) else extra_rows) + text)

    save({})
    if plots:
        try:
            images = plots(out, stem)
        except Exception as e:
            images = {}
            doc.setdefault("errors", []).append({"where": "report/plots", **error_record(e)})
        if images:
            doc["plots"] = images
        save(images)
    for f in {os.path.join(out, os.path.basename(f)) for f in before.values()} - \
            {os.path.join(out, f) for f in doc.get("plots", {}).values()}:
        if os.path.exists(f):
            os.remove(f)
    write_index(out)
    return md_path


def _report_facts(path, suite, stem, files):
    """Device (with the variant its name adds), date, commit and plots of a
    report; reports written before this writer kept them at the top level."""
    doc = read_json(path)
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else doc
    device = meta.get("device_name") or meta.get("device") or "-"
    key = stem[len(suite) + 1:]
    variant = key[len(slug(device)) + 1:] if key.startswith(slug(device) + "-") else ""
    plots = doc.get("plots") or ({"plot": stem + ".png"} if stem + ".png" in files else {})
    return {"device": device + (f" ({variant})" if variant else ""), "date": meta.get("date") or "-",
            "commit": (meta.get("git_commit") or "not recorded")[:12],
            "plots": {k: f for k, f in plots.items() if f in files}}


def write_index(out):
    """README.md of the folder: each report there, with its device, date, commit and plots."""
    files = set(os.listdir(out))
    rows = []
    for suite in SUITES:
        for stem in sorted(f[:-len(".json")] for f in files if f.startswith(suite + "_") and f.endswith(".json")):
            facts = _report_facts(os.path.join(out, stem + ".json"), suite, stem, files)
            md = f"[{stem}.md]({stem}.md)" if f"{stem}.md" in files else "-"
            rows.append([f"`{suite}`", facts["device"], facts["date"], f"`{facts['commit']}`", md,
                         ", ".join(f"[{k}]({f})" for k, f in facts["plots"].items()) or "-"])
    text = ("# Benchmark reports\n\n"
            "The latest report of each suite on each device, written by `python -m benchmarks <suite>` "
            "(`make bench SUITE=<suite>`); a new run replaces its suite's report for that device, and git "
            "keeps the earlier ones. Each report names the commit it measured and its command line.\n\n"
            + table(["suite", "device", "date (UTC)", "commit", "report", "plots"], rows, "llllll") + "\n")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)
