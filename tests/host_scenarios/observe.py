# Tests the native module too: mem_get_info, the emulated device's free bytes.
"""What the library reports (tests/test_observe.py): stats() after every state change,
memory_summary(), the pause/resume log lines and the progress lines of a long copy."""
import faulthandler
import logging
import os
import signal
import sys
import threading
import time

import torch_memory_saver
from _prelude import MiB, core, fill, read, run_cases, start, states, tms


def stats_follow_every_state_change():
    """Gauges and counters per device and tag, as allocations pause, resume and go."""
    native = core()
    G = 2 * MiB                                        # host backend granularity
    with tms.region("kv"):
        kv = tms.malloc(3 * MiB)                       # reserves 4 MiB
    with tms.region("w", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        w = tms.malloc(5 * MiB + 1)                    # reserves 6 MiB
    with tms.region("p", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        tms.malloc(1, 1)                               # device 1, reserves 2 MiB
    s = torch_memory_saver.stats()
    assert s[0]["kv"]["allocations"] == 1 and s[0]["kv"]["bytes_requested"] == 3 * MiB, s
    assert s[0]["kv"]["bytes_reserved"] == 2 * G and s[0]["kv"]["bytes_mapped"] == 2 * G, s
    assert s[0]["w"]["bytes_reserved"] == 3 * G and s[1]["p"]["bytes_reserved"] == G, s
    assert s[0]["w"]["bytes_paused"] == 0 and s[0]["w"]["pauses"] == 0, s
    fill(w, 5 * MiB + 1)

    tms.pause()
    s = torch_memory_saver.stats()
    assert s[0]["kv"]["bytes_mapped"] == 0 and s[0]["kv"]["bytes_paused"] == 2 * G, s
    assert s[0]["kv"]["bytes_backup_mmap"] == 0 and s[0]["kv"]["bytes_to_host"] == 0, s
    assert s[0]["w"]["bytes_backup_mmap"] == 5 * MiB + 1 and s[0]["w"]["bytes_to_host"] == 5 * MiB + 1, s
    assert s[1]["p"]["bytes_backup_pinned"] == 1 and s[1]["p"]["bytes_backup_mmap"] == 0, s
    for dev, tag in ((0, "kv"), (0, "w"), (1, "p")):
        assert s[dev][tag]["pauses"] == 1 and s[dev][tag]["pause_ns"] > 0, (tag, s)
    # the emulated device's free bytes agree with the gauges
    for dev in (0, 1):
        free, total = native.mem_get_info(dev)
        assert total - free == sum(r["bytes_mapped"] for r in s[dev].values()) == 0, (dev, free, total, s)

    tms.resume("w")
    s = torch_memory_saver.stats()
    free, total = native.mem_get_info(0)
    assert total - free == s[0]["w"]["bytes_mapped"] == 3 * G, (free, total, s)
    assert s[0]["w"]["bytes_mapped"] == 3 * G and s[0]["w"]["bytes_backup_mmap"] == 0, s
    assert s[0]["w"]["resumes"] == 1 and s[0]["w"]["bytes_to_device"] == 5 * MiB + 1, s
    assert s[0]["kv"]["resumes"] == 0, s               # other tags untouched
    tms.free(kv)
    s = torch_memory_saver.stats()
    assert s[0]["kv"]["allocations"] == 0 and s[0]["kv"]["bytes_reserved"] == 0, s
    assert s[0]["kv"]["bytes_paused"] == 0 and s[0]["kv"]["pauses"] == 1, s   # counters stay
    print("done")


def memory_summary():
    """Prints memory_summary() with tag kv_cache (3 MiB, active) and weights (5 MiB, paused, backed up)."""
    start()
    assert "no allocations yet" in torch_memory_saver.memory_summary()
    with tms.region("kv_cache"):
        tms.malloc(3 * MiB)
    with tms.region("weights", enable_cpu_backup=True):
        tms.malloc(5 * MiB)
    tms.pause("weights")
    print(torch_memory_saver.memory_summary())


def log_lines():
    """Logs at DEBUG to stdout: a pause and a resume of 8 MiB, then a pause with the logger at WARNING."""
    start()
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(levelname)s %(name)s %(message)s")
    with tms.region("w", enable_cpu_backup=True):
        tms.malloc(8 * MiB)
    tms.pause("w")
    tms.resume("w")
    logging.getLogger("torch_memory_saver").setLevel(logging.WARNING)
    tms.pause("w")                                     # silent


def progress_lines():
    """A 256 MiB backed-up pause and resume with progress on, lines every 0.05 s, logged to
    stdout. The pause's first copy waits at the gate (TMS_HOST_COPY_GATE) until the first
    progress line is out: there is one however fast the machine copies."""
    import torch_memory_saver._observe as observe

    faulthandler.dump_traceback_later(60, exit=True)   # no progress line: the pause waits, and fails here
    gate_path = os.environ["TMS_HOST_COPY_GATE"]
    gate = os.open(gate_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # empty: shut until a byte is in it

    class OpenGate(logging.Handler):
        def emit(self, record):
            if "% (" in record.getMessage() and not self.opened:
                self.opened = True
                os.write(gate, b"x")

    opener = OpenGate()
    opener.opened = False
    start()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    logging.getLogger("torch_memory_saver").addHandler(opener)
    assert tms.progress is False                       # off by default
    tms.progress = True
    observe.PROGRESS_AFTER_S = 0.05
    observe.PROGRESS_EVERY_S = 0.05
    with tms.region("w", enable_cpu_backup=True):
        p = tms.malloc(256 * MiB)
    d = fill(p, 256 * MiB)
    tms.pause("w")
    assert opener.opened
    tms.resume("w")
    assert read(p, 256 * MiB) == d
    faulthandler.cancel_dump_traceback_later()


def progress_needs_a_bool():
    start()
    try:
        tms.progress = "yes"
    except TypeError as e:
        assert "progress must be a bool" in str(e)
    else:
        raise AssertionError("no TypeError")
    # Set on the module as on the singleton: both name the same setting.
    import torch_memory_saver as module
    module.progress = True
    assert tms.progress is True and module.progress is True
    module.progress = False
    assert tms.progress is False
    try:
        module.progress = 1
    except TypeError as e:
        assert "progress must be a bool" in str(e)
    else:
        raise AssertionError("no TypeError on the module")


def _interrupt_handler(on_interrupt):
    """Installs a SIGINT handler that runs on_interrupt() in the main thread and then
    raises KeyboardInterrupt, as Python's own handler does; returns the main thread's id."""
    def handler(signum, frame):
        on_interrupt()
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, handler)
    return threading.main_thread().ident


def interrupt_mid_call(op, progress):
    """Ctrl-C while a 64 MiB backed-up pause (op=pause) or resume (op=resume) runs, with
    progress lines on or off: prints the state after the KeyboardInterrupt, the summary
    lines logged and whether the bytes came back. pause: its first copy waits at the
    gate (TMS_HOST_COPY_GATE) until the interrupt has reached Python. resume (progress
    on): the call waits in its thread until then; the gate opens when the handler runs."""
    import torch_memory_saver._observe as observe

    faulthandler.dump_traceback_later(60, exit=True)
    progress = progress == "on"
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("torch_memory_saver").addHandler(Keep())
    logging.getLogger("torch_memory_saver").setLevel(logging.INFO)
    observe.PROGRESS_AFTER_S = observe.PROGRESS_EVERY_S = 0.05
    tms.progress = progress
    with tms.region("w", enable_cpu_backup=True):
        p = tms.malloc(64 * MiB)
    d = fill(p, 64 * MiB)
    reached = threading.Event()
    if op == "pause":
        gate = os.open(os.environ["TMS_HOST_COPY_GATE"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        main = _interrupt_handler(lambda: (reached.set(), os.write(gate, b"x")))
        if progress:
            class Interrupt(logging.Handler):  # the first progress line: the copy waits at the gate
                def emit(self, record):
                    if "% (" in record.getMessage() and not reached.is_set():
                        signal.pthread_kill(main, signal.SIGINT)
            logging.getLogger("torch_memory_saver").addHandler(Interrupt())
        else:
            def interrupt_once_pausing():  # the main thread is in the core's pause, held at the gate
                while states() != [("w", "pausing")]:
                    time.sleep(0.005)
                signal.pthread_kill(main, signal.SIGINT)
                os.write(gate, b"x")  # the handler runs once the call returns
            threading.Thread(target=interrupt_once_pausing, daemon=True).start()
    else:
        assert progress, "a resume is interrupted with progress on only"
        tms.pause("w")
        lines.clear()
        main = _interrupt_handler(reached.set)
        native = core()
        real = native.resume

        def gated(*args):  # the progress thread's call: starts once the interrupt reached Python
            signal.pthread_kill(main, signal.SIGINT)
            assert reached.wait(30)
            return real(*args)
        native.resume = gated
    try:
        getattr(tms, op)("w")
    except KeyboardInterrupt:
        print("KeyboardInterrupt", states())
    else:
        print("no KeyboardInterrupt", states())
    for line in lines:
        if "% (" not in line:
            print("logged:", line.split(" copied")[0])
    if op == "pause":
        tms.resume("w")
    print("same bytes:", read(p, 64 * MiB) == d)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    run_cases(globals(), sys.argv)


def report_fields_on_both_levels():
    """A resume reports what it mapped as mapped_bytes (and, as README says, in
    released_bytes too; a pause maps nothing); Report has the job's fields as sums
    (reused_bytes, lenders) and DeviceReport the call's fingerprint time and why nothing
    was skipped."""
    start()
    with tms.region("r", enable_cpu_backup=True):
        p = core().malloc(4 * MiB)
    data = fill(p, 4 * MiB)
    r = tms.pause("r")
    assert (r.released_bytes, r.mapped_bytes, r.copied_bytes) == (4 * MiB, 0, 4 * MiB), r.as_dict()
    r = tms.resume("r")
    assert (r.released_bytes, r.mapped_bytes, r.reused_bytes, r.lenders) == (4 * MiB, 4 * MiB, 0, {}), r.as_dict()
    (d,) = r.devices.values()
    assert (d.mapped_bytes, d.reused_bytes, d.lenders) == (4 * MiB, 0, {}), d
    assert d.fingerprint_seconds == r.fingerprint_seconds and d.why_not_skipped == r.why_not_skipped, d
    assert read(p, 4 * MiB) == data
    core().free(p)
