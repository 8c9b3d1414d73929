"""Command line: `python -m torch_memory_saver {demo,info,memory-report,preload-path,run}`."""
import argparse
import os
import sys

from . import _library, _preload


def _cmd_preload_path(args):
    print(_library.path("preload"))
    return 0


def _cmd_run(args):
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("torch_memory_saver run: give a command after --", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["LD_PRELOAD"] = _preload.preload_env_value(env.get("LD_PRELOAD", ""))
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"torch_memory_saver run: cannot run {command[0]!r}: {e.strerror or e}", file=sys.stderr)
        return 127


def _cmd_info(args):
    from . import __version__

    print(f"torch_memory_saver {__version__}")
    print(f"python            {sys.version.split()[0]}")
    for mode in _library.HOOK_MODES:
        try:
            print(f"{mode + ' library':<18}{_library.path(mode)}")
        except ImportError as e:
            print(f"{mode + ' library':<18}missing ({e})")
    core = _library.load("preload")
    try:
        backend = core.backend()
    except Exception as e:  # the reason is the information here
        backend = f"unavailable: {e}"
    print(f"backend           {backend}")
    print(f"preload active    {core.preload_active()[0]}")
    print(f"defaults          {core.defaults()}")
    from ._observe import budget_line

    print(f"budget            {budget_line(core.host_budget())}")
    return 0


def _cmd_memory_report(args):
    from . import _demo, _report, torch_memory_saver as tms

    if args.hook_mode:
        tms.hook_mode = args.hook_mode
    devices = [0]
    if _demo.gpu_available():
        import torch

        devices = range(torch.cuda.device_count())
    print(_report.format_memory_report(tms.memory_report(devices)))
    return 0


def _cmd_demo(args):
    from . import _demo

    if args.hook_mode == "preload" and _demo.gpu_available() and not _library.load("preload").preload_active()[0]:
        # The preload hook must be in place when the process starts: start again under it.
        if os.environ.get("TMS_DEMO_REEXEC"):
            print("torch_memory_saver demo: the preload library is still not active after restarting under it",
                  file=sys.stderr)
            return 1
        env = dict(os.environ, TMS_DEMO_REEXEC="1")
        env["LD_PRELOAD"] = _preload.preload_env_value(env.get("LD_PRELOAD", ""))
        cmd = [sys.executable, "-m", "torch_memory_saver", "demo", "--hook-mode", "preload"]
        sys.stdout.flush()
        os.execve(sys.executable, cmd, env)
    return _demo.main(args.hook_mode)


def _prog():
    """The name this was started as: the console script, or `python -m`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and name != "__main__.py" else "python -m torch_memory_saver"


def _parser():
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="torch_memory_saver: release the GPU memory behind chosen tensors and give it back later "
                    "at the same addresses. These commands show what the library does and how it is installed.")
    parser.add_argument("--version", action="version", version=f"torch_memory_saver {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{demo,info,memory-report,preload-path,run}")
    from . import _demo

    demo = sub.add_parser("demo", help=f"{_demo.what_it_does()}, printing free memory (the host backend: "
                                       f"RSS) and timings")
    demo.add_argument("--hook-mode", choices=_library.HOOK_MODES, default="preload",
                      help="how allocations reach the library: 'preload' (LD_PRELOAD interposition of cudaMalloc, "
                           "the library's default; the demo restarts itself under it) or 'torch' (a PyTorch "
                           "pluggable allocator). Default: %(default)s")
    demo.set_defaults(fn=_cmd_demo)
    sub.add_parser("info", help="version, libraries, backend, defaults").set_defaults(fn=_cmd_info)
    sub.add_parser("preload-path", help="print the preload library's path").set_defaults(fn=_cmd_preload_path)
    report = sub.add_parser("memory-report", help="each device's memory as the driver counts it, and who holds it "
                                                  "(in a program: torch_memory_saver.memory_report())")
    report.add_argument("--hook-mode", choices=_library.HOOK_MODES, default=None, help=argparse.SUPPRESS)
    report.set_defaults(fn=_cmd_memory_report)
    run = sub.add_parser("run", help="run a command with the preload library on LD_PRELOAD: run -- CMD [ARGS...]",
                         description="Run CMD with the preload library added to LD_PRELOAD. Put -- before the "
                                     "command so that its own options are not read as ours.")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(fn=_cmd_run)
    return parser


def main(argv=None):
    from ._errors import Error

    args = _parser().parse_args(argv)
    try:
        rc = args.fn(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # A reader that stops early (`info | head`) is not an error of ours; point
        # stdout at /dev/null so that the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    except (Error, OSError, ValueError) as e:
        # What the library says is the whole message: no GPU, a bad setting, a path.
        print(f"{_prog()} {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
