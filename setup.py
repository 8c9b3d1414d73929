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
        sources=src(BUILD["core"] + [VARIANTS[variant]] + BUILD["face"]),
        include_dirs=["include"],
        depends=HEADERS,
        define_macros=[("TMS_VARIANT", variant), LIMITED_API],
        extra_compile_args=_compile_flags(),
        extra_link_args=[BUILD["soname"][0].format(variant=variant)] + BUILD["ldflags"][0].split()
        + shlex.split(os.environ.get("TMS_EXTRA_CFLAGS", "")),
        py_limited_api=True,
    )


# _tms_env checks the TMS_* variables at package import without loading a core.
# Not sanitized: it loads before torch, and a sanitizer runtime loaded that early
# breaks torch's static initialisers; its sources are sanitized in the variants.
ENV_MODULE = Extension(f"{NAME}._tms_env", sources=src(BUILD["env"]), depends=HEADERS, define_macros=[LIMITED_API],
                       extra_compile_args=_compile_flags(sanitized=False),
                       extra_link_args=BUILD["ldflags"][0].split(),
                       py_limited_api=True)


class BuildExt(build_ext):
    """The extensions, then the shims beside the package and the public header in it."""

    def build_extensions(self):
        # The interpreter's own link flags may carry an rpath to its build tree
        # (pyenv, conda): no path of the build machine goes into the libraries.
        self.compiler.linker_so = [a for a in self.compiler.linker_so if not a.startswith("-Wl,-rpath")]
        super().build_extensions()

    def run(self):
        super().run()
        site_root = ROOT if self.inplace else Path(self.build_lib)
        for variant in VARIANTS:
            library = Path(self.get_ext_fullpath(f"{NAME}._tms_{variant}"))
            for name in upstream_names(variant):
                self._link_shim(variant, library, site_root / name)
        header = site_root / NAME / "include" / "torch_memory_saver.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "include" / "torch_memory_saver.h", header)

    def _link_shim(self, variant, library, out):
        objects = self.compiler.compile([str(ROOT / "src" / BUILD["shim"][0])], output_dir=self.build_temp,
                                        macros=[(f"TMS_SHIM_{variant.upper()}", None)],
                                        extra_postargs=_compile_flags(sanitized=False))
        # --no-as-needed first: the shim references nothing in the library, and
        # loading it is the shim's whole job.
        self.compiler.link_shared_object(objects + [str(library)], str(out), extra_preargs=["-Wl,--no-as-needed"],
                                         extra_postargs=["-Wl,-rpath,$ORIGIN/" + NAME, "-ldl"])


COMMANDS = {"build_ext": BuildExt}
if bdist_wheel is not None:

    class BdistWheel(bdist_wheel):
        """One wheel for every CPython from 3.10 (abi3), tagged with the glibc it needs."""

        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            return "cp310", "abi3", f"{MANYLINUX}_{platform.machine()}"

    COMMANDS["bdist_wheel"] = BdistWheel

setup(license="MIT", ext_modules=[ENV_MODULE] + [_variant(v) for v in VARIANTS], cmdclass=COMMANDS)
