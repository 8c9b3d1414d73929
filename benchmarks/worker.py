"""One benchmark process: runs the named sections in one hook mode and writes their
results to a JSON file after each section (a crash or a kill keeps what was done).

  python -m benchmarks.worker --mode torch --sections latency,passthrough \
      --result /tmp/r.json --deadline <unix time> --params '<json>' [--dry-run]

For the preload hook mode the runner starts it as
  python -m torch_memory_saver run -- python -m benchmarks.worker --mode preload ...
"""
import argparse
import json
import os
import sys
import time

from .common import Deadline, error_record, log, set_log_prefix, write_json_atomic


def _section_fn(name):
    from . import cycles, disk, limits, overhead

    if name == "limits":
        return limits.run
    if name == "latency":
        return cycles.latency
    if name == "scaling_count":
        return cycles.scaling_count
    if name == "scaling_bytes":
        return cycles.scaling_bytes
    if name == "alloc_overhead":
        return overhead.alloc_overhead
    if name == "passthrough":
        return overhead.passthrough
    if name == "contention":
        return overhead.contention
    if name.startswith("disk:"):
        target = name.split(":", 1)[1]
        return lambda env, params, deadline: disk.run(env, target, params, deadline)
    if name.startswith("backup:"):
        config = name.split(":", 1)[1]
        return lambda env, params, deadline: cycles.backup(env, config, params, deadline)
    raise ValueError(f"unknown section {name!r}")


def _param_key(name):
    return name.split(":", 1)[0] if name.startswith(("backup:", "disk:")) else name


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.worker")
    ap.add_argument("--mode", choices=("torch", "preload", "none"), required=True)
    ap.add_argument("--sections", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--deadline", type=float, required=True)
    ap.add_argument("--params", default="{}")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)

    sections = [s for s in args.sections.split(",") if s]
    params = json.loads(args.params)
    deadline = Deadline(args.deadline)
    tag = f"{args.mode}"
    set_log_prefix(f"worker:{tag}")
    result = {"mode": args.mode, "pid": os.getpid(), "python": sys.version.split()[0], "sections": {},
              "current": None, "env": None, "started": time.time()}
    write_json_atomic(args.result, result)

    def say(msg):
        log(msg, prefix=f"worker:{tag}")

    try:
        from .envs import make_env

        env = make_env(None if args.mode == "none" else args.mode, args.dry_run, use_tms=args.mode != "none")
        result["env"] = env.info()
        if args.mode == "preload":
            result["env"]["ld_preload"] = os.environ.get("LD_PRELOAD")
        result["env"]["tms_backup_threads"] = os.environ.get("TMS_BACKUP_THREADS")
    except Exception as e:
        rec = error_record(e)
        say(f"cannot set up: {rec['error']}")
        for name in sections:
            result["sections"][name] = dict(rec, error=f"setup failed: {rec['error']}")
        write_json_atomic(args.result, result)
        return 1

    for name in sections:
        result["current"] = name
        write_json_atomic(args.result, result)
        p = params.get(_param_key(name), {})
        say(f"{name}: start ({deadline.left():.0f} s left in this process's budget)")
        t0 = time.time()
        if deadline.left() <= 0:
            out = {"error": "skipped: time budget exhausted"}
        else:
            try:
                out = _section_fn(name)(env, p, deadline)
            except Exception as e:
                out = error_record(e)
                say(f"{name}: FAILED: {out['error']}")
        out["wall_s"] = time.time() - t0
        result["sections"][name] = out
        result["current"] = None
        write_json_atomic(args.result, result)
        say(f"{name}: done in {out['wall_s']:.1f} s")
    result["finished"] = time.time()
    write_json_atomic(args.result, result)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
