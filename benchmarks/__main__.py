"""`python -m benchmarks <suite> [options]`: runs one suite (`--help` after the suite's name lists its options). Every
suite writes its report through benchmarks/report.py and has a --dry-run on the host backend."""
import importlib
import sys

from .report import SUITES

ABOUT = {
    "run": "one GPU, both hook modes: limits, latency beside the driver floor, backup and disk bandwidth (make bench)",
    "multi_gpu": "every GPU of the host pausing and resuming together, one process per GPU, against the host's limits",
    "alloc_count": "pause/resume of 1 to 10,000 allocations against the raw driver loop",
    "speed": "side by side with the upstream library (--upstream DIR): the rows users compare, and README's plot",
    "switch": "a trainer and a rollout trading one GPU as RL stacks do, phase by phase against floors and upstream",
}


def usage():
    return "usage: python -m benchmarks <suite> [options]\n\nsuites:\n" + "".join(
        f"  {s:<14} {ABOUT[s]}\n" for s in SUITES)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if argv else 2
    suite = argv[0].replace("-", "_")
    if suite not in SUITES:
        print(f"python -m benchmarks: unknown suite {argv[0]!r}\n\n{usage()}", end="", file=sys.stderr)
        return 2
    return importlib.import_module(f"benchmarks.{suite}").main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
