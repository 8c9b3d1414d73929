"""One worker process of a suite: `python -m benchmarks.worker SUITE RESULT ARGS`.

Calls benchmarks.SUITE.worker(**ARGS, save=...) and writes the document it returns to RESULT as JSON. A suite that
saves as it goes (speed, after each row) leaves its partial results there when the process dies or is killed. Suites
start it through common.run_row, which also puts the preload library on LD_PRELOAD for the workers that measure the
preload hook mode.
"""
import importlib
import json
import sys

from .common import write_json_atomic


def main(argv=None):
    suite, result, args = argv if argv is not None else sys.argv[1:]
    module = importlib.import_module(f"benchmarks.{suite}")
    doc = module.worker(**json.loads(args), save=lambda d: write_json_atomic(result, d))
    write_json_atomic(result, doc)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
