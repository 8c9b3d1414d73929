"""In-tree PEP 517 backend: compiles the two _tms variants with the C compiler, no
build dependencies, so `pip install .` works offline with or without build isolation."""
import base64
import hashlib
import io
import os
import shlex
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

NAME = "torch_memory_saver"
VERSION = "0.1.0"
ROOT = Path(__file__).resolve().parent.parent
CORE_SOURCES = ["abi.c", "error.c", "driver.c", "driver_cuda.c", "driver_hip.c", "driver_host.c", "config.c", "log.c", "backup.c", "transfer.c", "chunks.c", "core.c", "pause.c", "hook.c"]
VARIANTS = ("preload", "torch")
# _tms_env: the TMS_* variables checked at package import without loading a core.
ENV_SOURCES = ["module_env.c", "config.c", "error.c"]
# The upstream library's file names, at the site-packages root: frameworks put
# them on LD_PRELOAD or load them with ctypes (issue 10). Each is a shim that
# needs the real library of its variant (src/shim.c).
UPSTREAM_SUFFIXES = ("", "_cu12", "_cu13")


def upstream_names(variant):
    return [f"torch_memory_saver_hook_mode_{variant}{suffix}.abi3.so" for suffix in UPSTREAM_SUFFIXES]
CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-O2", "-g", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra"]


def _compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def compile_variant(variant, out_path):
    """Builds one variant as a single shared object: CPython module + hook + core."""
    flags = _flags()
    sources = [str(ROOT / "src" / s) for s in CORE_SOURCES + [f"hook_{variant}.c", "module.c"]]
    cmd = _compiler() + flags + [
        f"-DTMS_VARIANT={variant}",
        "-I" + str(ROOT / "include"),
        "-I" + sysconfig.get_paths()["include"],
        # The shims' NEEDED entry names the library by this soname.
        "-shared", f"-Wl,-soname,{Path(out_path).name}", "-o", str(out_path), *sources, "-ldl", "-lpthread",
    ]
    subprocess.run(cmd, check=True)


def _flags():
    flags = list(CFLAGS)
    if os.environ.get("TMS_WERROR", "1") != "0":
        flags.append("-Werror")
    return flags + shlex.split(os.environ.get("TMS_EXTRA_CFLAGS", ""))


def compile_env_module(out_path):
    """Without TMS_EXTRA_CFLAGS: this module loads at package import, before torch,
    and a sanitizer runtime loaded that early breaks torch's static initialisers
    (make sanitize-python); its sources are sanitized inside the variants."""
    sources = [str(ROOT / "src" / s) for s in ENV_SOURCES]
    flags = list(CFLAGS) + (["-Werror"] if os.environ.get("TMS_WERROR", "1") != "0" else [])
    cmd = _compiler() + flags + ["-I" + sysconfig.get_paths()["include"], "-shared", "-o", str(out_path),
                                    *sources, "-lpthread"]
    subprocess.run(cmd, check=True)


def compile_shims(variant, library, out_dir):
    """The upstream-named files of one variant in out_dir, each needing `library`,
    which lies in out_dir/torch_memory_saver/. Returns their paths."""
    paths = []
    for name in upstream_names(variant):
        out = Path(out_dir) / name
        flags = list(CFLAGS) + (["-Werror"] if os.environ.get("TMS_WERROR", "1") != "0" else [])
        cmd = _compiler() + flags + [f"-DTMS_SHIM_{variant.upper()}", "-shared", "-o", str(out),
                                     str(ROOT / "src" / "shim.c"), "-Wl,--no-as-needed", str(library),
                                     "-Wl,-rpath,$ORIGIN/" + NAME, "-ldl"]
        subprocess.run(cmd, check=True)
        paths.append(out)
    return paths


def extension_name(variant):
    """File name of a variant's module (variant "env": the _tms_env module)."""
    return f"_tms_{variant}" + sysconfig.get_config_var("EXT_SUFFIX")


def build_in_place():
    """Compiles both variants next to the package sources and their upstream-named
    shims at the repository root, which is the site root of editable installs."""
    compile_env_module(ROOT / NAME / extension_name("env"))
    for variant in VARIANTS:
        library = ROOT / NAME / extension_name(variant)
        compile_variant(variant, library)
        compile_shims(variant, library, ROOT)


def _wheel_tag():
    impl = f"cp{sys.version_info.major}{sys.version_info.minor}"
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{impl}-{impl}-{plat}"


def _metadata():
    readme = (ROOT / "README.md").read_text(encoding="utf-8") if (ROOT / "README.md").exists() else ""
    return (
        "Metadata-Version: 2.1\n"
        f"Name: {NAME}\nVersion: {VERSION}\n"
        "Summary: Pause and resume the GPU memory behind PyTorch tensors at the same addresses\n"
        "License: MIT\nRequires-Python: >=3.9\n"
        "Description-Content-Type: text/markdown\n\n" + readme
    )


def _dist_info():
    return f"{NAME}-{VERSION}.dist-info"


class _Wheel:
    def __init__(self, path):
        self.zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self.records = []

    def add(self, arcname, data):
        if isinstance(data, str):
            data = data.encode()
        self.zip.writestr(arcname, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.records.append(f"{arcname},sha256={digest},{len(data)}")

    def close(self, tag):
        info = _dist_info()
        self.add(f"{info}/METADATA", _metadata())
        self.add(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: tms_build\nRoot-Is-Purelib: false\nTag: {tag}\n")
        self.add(f"{info}/entry_points.txt", "[console_scripts]\ntorch-memory-saver = torch_memory_saver.__main__:main\n")
        record = f"{info}/RECORD"
        self.zip.writestr(record, "\n".join(self.records + [f"{record},,"]) + "\n")
        self.zip.close()


def _wheel_name():
    return f"{NAME}-{VERSION}-{_wheel_tag()}.whl"


# ---- PEP 517 hooks --------------------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _wheel_name()
    wheel = _Wheel(Path(wheel_directory) / name)
    for pattern in ("*.py", "*.pyi", "py.typed"):
        for f in sorted((ROOT / NAME).rglob(pattern)):
            wheel.add(f.relative_to(ROOT).as_posix(), f.read_bytes())
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / NAME).mkdir()
        env_module = Path(tmp) / NAME / extension_name("env")
        compile_env_module(env_module)
        wheel.add(f"{NAME}/{env_module.name}", env_module.read_bytes())
        for variant in VARIANTS:
            out = Path(tmp) / NAME / extension_name(variant)
            compile_variant(variant, out)
            wheel.add(f"{NAME}/{out.name}", out.read_bytes())
            for shim in compile_shims(variant, out, tmp):
                wheel.add(shim.name, shim.read_bytes())
    wheel.add(f"{NAME}/include/torch_memory_saver.h", (ROOT / "include" / "torch_memory_saver.h").read_bytes())
    wheel.close(_wheel_tag())
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    build_in_place()
    name = _wheel_name()
    wheel = _Wheel(Path(wheel_directory) / name)
    wheel.add(f"__editable__.{NAME}.pth", str(ROOT) + "\n")
    wheel.close(_wheel_tag())
    return name


def build_sdist(sdist_directory, config_settings=None):
    base = f"{NAME}-{VERSION}"
    name = f"{base}.tar.gz"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    with tarfile.open(Path(sdist_directory) / name, "w:gz") as tar:
        for f in files:
            tar.add(ROOT / f, arcname=f"{base}/{f}")
        pkg_info = _metadata().encode()
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return name


if __name__ == "__main__":
    build_in_place()
