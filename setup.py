"""The C half of the build (metadata is in pyproject.toml): three extension modules
on CPython's stable ABI, and the upstream library's file names as small shims at
the site root. `pip install .`, `pip wheel .`, `pip install -e .` and, for the
in-tree development build, `python setup.py build_ext --inplace` (`make build`).

Flags: -Werror only with TMS_WERROR=1 (make and CI set it, a user's install never
does); CFLAGS/LDFLAGS from the environment apply as setuptools applies them;
TMS_EXTRA_CFLAGS adds compile and link flags to the two variants (sanitizer builds)."""
import os
import platform
import shlex
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1 has it in the wheel package (pip installs both when it isolates)
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

ROOT = Path(__file__).resolve().parent
NAME = "torch_memory_saver"
LIMITED_API = ("Py_LIMITED_API", "0x030A0000")  # CPython 3.10 and later, one abi3 build
MANYLINUX = "manylinux_2_28"  # src/platform/glibc_compat.h keeps every glibc symbol at or below 2.28
# The upstream library's file names, at the site-packages root: frameworks put
# them on LD_PRELOAD or load them with ctypes. Each needs the real library of
# its variant (src/hooks/shim.c).
UPSTREAM_SUFFIXES = ("", "_cu12", "_cu13")


def build_description():
    """src/build.txt as {key: [values]}; a variant's value is (name, file)."""
    desc = {}
    for line in (ROOT / "src" / "build.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split(None, 1)
            desc.setdefault(key, []).append(value.strip())
    return desc


BUILD = build_description()
VARIANTS = {name: file for name, file in (v.split() for v in BUILD["variant"])}


def src(paths):
    return [f"src/{p}" for p in paths]


# Every header: a change to one rebuilds the extensions (setuptools compares times).
HEADERS = sorted(str(p.relative_to(ROOT)) for p in [*(ROOT / "src").rglob("*.h"), *(ROOT / "include").glob("*.h")])
# What a module is built from besides its sources: a changed link flag relinks it.
DEPENDS = HEADERS + ["src/build.txt"]


def upstream_names(variant):
    return [f"torch_memory_saver_hook_mode_{variant}{suffix}.abi3.so" for suffix in UPSTREAM_SUFFIXES]


def _compile_flags(sanitized=True):
    flags = BUILD["cflags"][0].split() + ["-I" + str(ROOT / "src"), "-include", str(ROOT / "src" / BUILD["first"][0])]
    if os.environ.get("TMS_WERROR") == "1":
        flags.append("-Werror")
    if sanitized:
        flags += shlex.split(os.environ.get("TMS_EXTRA_CFLAGS", ""))
    return flags


def _variant(variant):
    return Extension(
        f"{NAME}._tms_{variant}",
        sources=src(BUILD["core"] + BUILD["hooks"] + [VARIANTS[variant]] + BUILD["face"]),
        include_dirs=["include"],
        depends=DEPENDS,
        define_macros=[("TMS_VARIANT", variant), LIMITED_API],
        extra_compile_args=_compile_flags(),
        extra_link_args=[BUILD["soname"][0].format(variant=variant)] + BUILD["ldflags"][0].split()
        + shlex.split(os.environ.get("TMS_EXTRA_CFLAGS", "")),
        py_limited_api=True,
    )


# _tms_env checks the TMS_* variables at package import without loading a core.
# Not sanitized: it loads before torch, and a sanitizer runtime loaded that early
# breaks torch's static initialisers; its sources are sanitized in the variants.
ENV_MODULE = Extension(f"{NAME}._tms_env", sources=src(BUILD["env"]), depends=DEPENDS, define_macros=[LIMITED_API],
                       extra_compile_args=_compile_flags(sanitized=False),
                       extra_link_args=BUILD["ldflags"][0].split(),
                       py_limited_api=True)


def _depfile_inputs(path):
    """The files a `-MMD` dependency file lists (the source and every header it read)."""
    text = path.read_text().replace("\\\n", " ")
    return text.split(":", 1)[1].split() if ":" in text else []


def _whole_elf(path):
    """True if path is an ELF file at least as long as its headers say. A truncated
    library or object is newer than its sources, so setuptools would keep it, and
    linking against it fails ("file too short") without saying what to do."""
    try:
        with open(path, "rb") as f:
            head, size = f.read(64), os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2):
        return False
    order = "little" if head[5] == 1 else "big"

    def field(at, n):
        return int.from_bytes(head[at:at + n], order)

    if head[4] == 2:  # 64-bit: program and section header tables' offsets, entry sizes, counts
        tables = [(field(32, 8), field(54, 2), field(56, 2)), (field(40, 8), field(58, 2), field(60, 2))]
    else:
        tables = [(field(28, 4), field(42, 2), field(44, 2)), (field(32, 4), field(46, 2), field(48, 2))]
    return all(offset + entry * count <= size for offset, entry, count in tables)


def _up_to_date(obj, command):
    """True if obj was compiled by this very command and no input it read changed since."""
    obj = Path(obj)
    stamp, deps = obj.with_suffix(".cmd"), obj.with_suffix(".d")
    try:
        if stamp.read_text() != command or not _whole_elf(obj):
            return False
        built = obj.stat().st_mtime_ns
        return all(Path(f).stat().st_mtime_ns <= built for f in _depfile_inputs(deps))
    except OSError:
        return False


def _incremental_parallel(compiler):
    """Makes `compiler.compile` skip objects whose inputs did not change (a dependency
    file per object, written by the compiler) and compile the others in parallel:
    setuptools alone recompiles every source of an extension when one changes."""

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            src, ext = build[obj]
            command = shlex.join(compiler.compiler_so + cc_args + extra_postargs + [src])
            if _up_to_date(obj, command):
                return
            Path(obj).with_suffix(".cmd").unlink(missing_ok=True)
            deps = ["-MMD", "-MF", str(Path(obj).with_suffix(".d"))]
            compiler._compile(obj, src, ext, cc_args, extra_postargs + deps, pp_opts)
            Path(obj).with_suffix(".cmd").write_text(command)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(one, [obj for obj in objects if obj in build]))
        return objects

    compiler.compile = compile


class BuildExt(build_ext):
    """The extensions, then the shims beside the package and the public header in it."""

    def build_extensions(self):
        # The interpreter's own link flags may carry an rpath to its build tree
        # (pyenv, conda): no path of the build machine goes into the libraries.
        self.compiler.linker_so = [a for a in self.compiler.linker_so if not a.startswith("-Wl,-rpath")]
        _incremental_parallel(self.compiler)
        # One extension at a time (each compiles its sources in parallel already):
        # build_extension points build_temp at the variant's own folder, which
        # setuptools' --parallel would change under another variant's build.
        self.parallel = None
        # A link flag changed in build.txt relinks what is otherwise up to date.
        need_link, build_txt = self.compiler._need_link, str(ROOT / "src" / "build.txt")
        self.compiler._need_link = lambda objects, output: need_link([*objects, build_txt], output)
        super().build_extensions()

    def build_extension(self, ext):
        # The two variants compile the same sources with different macros: each
        # keeps its objects in a folder of its own.
        shared_temp = self.build_temp
        self.build_temp = os.path.join(shared_temp, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared_temp

    def run(self):
        # A broken library (a truncated file, a build cut short) is removed, so it is
        # built again rather than kept as up to date and linked against.
        site_root = ROOT if self.inplace else Path(self.build_lib)
        outputs = [Path(self.get_ext_fullpath(ext.name)) for ext in self.extensions]
        for path in outputs + [site_root / name for variant in VARIANTS for name in upstream_names(variant)]:
            if path.exists() and not _whole_elf(path):
                print(f"{path} is not a whole ELF library: building it again")
                path.unlink()
        super().run()
        for variant in VARIANTS:
            library = Path(self.get_ext_fullpath(f"{NAME}._tms_{variant}"))
            for name in upstream_names(variant):
                self._link_shim(variant, library, site_root / name)
        header = site_root / NAME / "include" / "torch_memory_saver.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "include" / "torch_memory_saver.h", header)

    def _link_shim(self, variant, library, out):
        objects = self.compiler.compile([str(ROOT / "src" / BUILD["shim"][0])],
                                        output_dir=os.path.join(self.build_temp, f"shim_{variant}"),
                                        macros=[(f"TMS_SHIM_{variant.upper()}", None)],
                                        extra_postargs=_compile_flags(sanitized=False))
        # --no-as-needed first: the shim references nothing in the library, and
        # loading it is the shim's whole job.
        self.compiler.link_shared_object(objects + [str(library)], str(out), extra_preargs=["-Wl,--no-as-needed"],
                                         extra_postargs=["-Wl,-rpath,$ORIGIN/" + NAME, "-ldl"])


COMMANDS = {"build_ext": BuildExt}
if bdist_wheel is None:
    from setuptools import Command

    class NoBdistWheel(Command):
        """Stands in for bdist_wheel where neither setuptools (>= 70.1) nor the wheel
        package has it: pip's wheel and metadata steps ask for it, and setuptools'
        own message ("invalid command 'bdist_wheel'") does not say what is missing."""

        user_options = []

        def initialize_options(self):
            import setuptools

            raise SystemExit(f"error: building a wheel of torch_memory_saver with setuptools {setuptools.__version__} "
                             f"needs the 'wheel' package, which this environment lacks: `pip install wheel` (or "
                             f"setuptools >= 70.1), then install again; or leave out --no-build-isolation, so that "
                             f"pip fetches both")

        def finalize_options(self):
            pass

        def run(self):
            pass

    COMMANDS["bdist_wheel"] = NoBdistWheel
else:

    class BdistWheel(bdist_wheel):
        """One wheel for every CPython from 3.10 (abi3), tagged with the glibc it needs."""

        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            return "cp310", "abi3", f"{MANYLINUX}_{platform.machine()}"

    COMMANDS["bdist_wheel"] = BdistWheel

setup(license="MIT", ext_modules=[ENV_MODULE] + [_variant(v) for v in VARIANTS], cmdclass=COMMANDS)
