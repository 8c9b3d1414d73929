"""What the library holds and did: stats(), memory_summary(), pause/resume log lines."""
import _thread
import logging
import sys
import threading
import time

logger = logging.getLogger("torch_memory_saver")

def stats(core):
    """{device: {tag: {field: value}}} from the core's counters (no driver call)."""
    out = {}
    for row in core.stats():
        row = dict(row)
        device, tag = row.pop("device"), row.pop("tag")
        out.setdefault(device, {})[tag] = row
    return out


def tag_bytes(core):
    """{tag: (bytes mapped, bytes paused)} over every device, from the counters."""
    out = {}
    for r in core.stats():
        mapped, paused = out.get(r["tag"], (0, 0))
        out[r["tag"]] = (mapped + r["bytes_mapped"], paused + r["bytes_paused"])
    return out


def _fmt_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def memory_summary(core) -> str:
    """A table of every (device, tag): allocations, mapped, paused, backups by kind, cycles."""
    rows = sorted(core.stats(), key=lambda r: (r["device"], r["tag"]))
    head = ("device", "tag", "allocs", "reserved", "mapped", "paused", "backup (pinned)", "backup (mmap)",
            "backup (disk)", "pauses", "resumes")
    table = [head]
    for r in rows:
        table.append((str(r["device"]), r["tag"], str(r["allocations"]), _fmt_bytes(r["bytes_reserved"]),
                      _fmt_bytes(r["bytes_mapped"]), _fmt_bytes(r["bytes_paused"]),
                      _fmt_bytes(r["bytes_backup_pinned"]), _fmt_bytes(r["bytes_backup_mmap"]),
                      _fmt_bytes(r["bytes_backup_disk"]), str(r["pauses"]), str(r["resumes"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["torch_memory_saver memory summary"]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.rjust(w) if j >= 2 else cell.ljust(w)
                               for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if len(table) == 1:
        lines.append("(no allocations yet)")
    lines.append(budget_line(core.host_budget()))
    return "\n".join(lines)


def budget_line(b):
    """One line on the host backup budget (host_budget())."""
    if b["limit"]:
        return (f"host backup budget '{b['name']}': {_fmt_bytes(b['limit'])}, {_fmt_bytes(b['reserved'])} reserved "
                f"({_fmt_bytes(b['mine'])} by this process), spill to disk {'on' if b['spill_to_disk'] else 'off'}")
    keep = "5 % of host memory kept available" if b["safety"] else "no check"
    return f"host backups: {_fmt_bytes(b['mine'])} by this process, no budget ({keep})"


def _selects(tag, row_tag):
    """Does tag (None: every tag, a str, or a list of them) select row_tag?"""
    return tag is None or row_tag == tag or (isinstance(tag, (list, tuple)) and row_tag in tag)


def _name(tag):
    return "<all>" if tag is None else tag if isinstance(tag, str) else ",".join(tag)


PROGRESS_AFTER_S = 1.0
PROGRESS_EVERY_S = 0.5


def _call_keeping_result(fn, args):
    """(fn(*args), None), or (its result, the KeyboardInterrupt) if Ctrl-C came while
    it ran: the core finishes a pause or resume whatever the signal (it runs without
    the GIL), and the interpreter raises the interrupt as soon as the call returns,
    before a Python-level assignment could keep the result. list.extend() over map()
    stores it in C first, so the report survives to be logged."""
    box = []
    try:
        box.extend(map(fn, *([a] for a in args)))
    except KeyboardInterrupt as interrupt:
        if not box:
            raise  # it came before the call started: nothing was done
        return box[0], interrupt
    return box[0], None


def _to_stderr(fmt, *args):
    """A line on stderr, for progress where logging would not show it, and for Ctrl-C."""
    sys.stderr.write(f"torch_memory_saver: {fmt % args}\n")  # one write: a line is never split
    sys.stderr.flush()


def _ack(op, tag):
    _to_stderr("Ctrl-C noted: the %s of tag=%s finishes first, then KeyboardInterrupt is raised", op, _name(tag))


def _run_with_progress(core, fn, args, op, tag, say):
    """(result, KeyboardInterrupt or None, whether a line was said): runs fn(*args)
    in a thread (the core releases the GIL) and, once it has taken PROGRESS_AFTER_S,
    says the copy progress every PROGRESS_EVERY_S. Ctrl-C does not abandon the call:
    the first one is acknowledged on stderr at once, the call finishes and the
    interrupt is returned with its result (more interrupts while it runs are the
    same request)."""
    outcome = {}
    finished = threading.Event()

    def run():
        try:
            outcome["result"] = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e
        finally:
            finished.set()

    # A plain thread started from C: an interrupt can come at any line of
    # Thread.start(), after which nothing would say whether the thread runs.
    started, interrupt = [], None
    try:
        started.extend(map(_thread.start_new_thread, [run], [()]))
    except KeyboardInterrupt as e:
        if not started:
            raise  # it came before the thread started: nothing was done
        interrupt = e
    t0 = time.perf_counter()
    wait, said = PROGRESS_AFTER_S, False
    # The acknowledgement is written in the loop, not in the handler: a second Ctrl-C
    # while it is written is then caught like the first.
    acknowledge = interrupt is not None
    while not finished.is_set():
        try:
            if acknowledge:
                _ack(op, tag)
                acknowledge = False
            if finished.wait(wait):
                break
            wait = PROGRESS_EVERY_S
            done, total = core.copy_progress()
            if total:
                say("%s tag=%s: %.0f%% (%s of %s copied, %.1f s)", op, _name(tag),
                    100.0 * done / total, _fmt_bytes(done), _fmt_bytes(total), time.perf_counter() - t0)
                said = True
        except KeyboardInterrupt as e:
            acknowledge = acknowledge or interrupt is None
            interrupt = interrupt or e
    if acknowledge:  # it came as the call ended: said all the same, so every interrupt gets its line
        try:
            _ack(op, tag)
        except KeyboardInterrupt:
            pass  # a second one: the same request
    if "error" in outcome:
        if interrupt is not None:
            interrupt.__context__ = outcome["error"]  # Ctrl-C still stops the program; the failure shows with it
            raise interrupt
        raise outcome["error"]
    return outcome["result"], interrupt, said


def logs_calls():
    """Is the summary line of a pause or resume logged (INFO enabled)?"""
    return logger.isEnabledFor(logging.INFO)


def logged(core, fn, args, op, tag, report, progress):
    """Runs fn(*args) (the core's pause or resume of tag) and returns
    report(its result), logging a summary at INFO and the allocations at DEBUG,
    only when those levels are enabled. With progress, progress lines while it
    runs: logged at INFO where a handler would show them, else on stderr, the
    summary then following them there. A Ctrl-C while it runs is raised once the
    call has finished and its summary is out."""
    logs = logger.isEnabledFor(logging.INFO)
    if not logs and not progress:
        return report(fn(*args))
    if progress:
        # Unconfigured logging shows warnings only: progress asked for is shown anyway.
        shown = logs and logger.hasHandlers()
        result, interrupt, said = _run_with_progress(core, fn, args, op, tag, logger.info if shown else _to_stderr)
        say = logger.info if shown else _to_stderr if said or interrupt is not None else None
    else:
        result, interrupt = _call_keeping_result(fn, args)
        say = logger.info
    out = report(result)
    if say is not None:
        say(*_summary(op, tag, out))
    if logger.isEnabledFor(logging.DEBUG):
        for a in core.allocations():
            if _selects(tag, a["tag"]):
                logger.debug("  0x%x %s tag=%s device=%d %s backup=%s", a["ptr"], _fmt_bytes(a["size"]), a["tag"],
                             a["device"], a["state"],
                             a["cpu_backup_backend"] if a["has_cpu_backup"] or a["has_disk_backup"] else "none")
    if interrupt is not None:
        raise interrupt
    return out


def _summary(op, tag, out):
    """The summary line of a pause or resume (format and arguments) from its report."""
    moved, seconds = out.copied_bytes, out.seconds
    rate = f", {out.gb_per_s:.1f} GB/s" if out.gb_per_s else ""
    skipped = f", {_fmt_bytes(out.skipped_bytes)} skipped as free" if out.skipped_bytes else ""
    if out.unchanged_bytes:
        skipped += f", {_fmt_bytes(out.unchanged_bytes)} unchanged (found in {out.fingerprint_seconds * 1e3:.1f} ms)"
    if out.why_not_skipped:
        skipped += f", copied whole: {out.why_not_skipped}"
    what = "released" if op == "pause" else "mapped"
    return ("%s tag=%s: %s %s, %s copied in %.1f ms%s%s", op, _name(tag), what,
            _fmt_bytes(out.released_bytes), _fmt_bytes(moved), seconds * 1e3, rate, skipped)
