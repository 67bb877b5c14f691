"""Build script for the ``bytescale._C`` extension.

The source list lives in ``csrc/sources.txt`` (shared with CMakeLists.txt).  CUDA
sources are compiled when the installed torch is a CUDA build and nvcc is found;
a CPU-only torch gives a CPU-only extension with the same Python API.

Rebuilding is incremental however it is started (``pip install -e .``, ``python setup.py
build_ext --inplace``): ninja's build directory stays in the tree (``build/temp.<platform>``, see
``BuildExt``), so only sources whose inputs changed recompile and an unchanged tree relinks nothing.
Compiles go through ccache when it is installed, nvcc's included (``PYTORCH_NVCC``).

Environment knobs:
  BYTESCALE_NO_CUDA=1   build the CPU-only extension even with a CUDA torch.
  BYTESCALE_DEBUG=1     -O0 -g (a release build is -O3 -g0).
  MAX_JOBS=N            parallel compile jobs (ninja).
  TORCH_CUDA_ARCH_LIST  CUDA targets; default: the visible GPUs, or 8.0;9.0+PTX when none is visible.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
# CUDA targets when no GPU is visible at build time: Ampere (A100) and Hopper (H100/H200) machine
# code, plus Hopper PTX that newer GPUs JIT-compile.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


def read_sources() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for raw in (ROOT / "csrc" / "sources.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
        elif current is None:
            raise SystemExit(f"csrc/sources.txt: source {line!r} outside a section")
        else:
            sections[current].append(line)
    return sections


def find_cuda_home() -> str | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").exists():
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(os.path.realpath(nvcc)).parent.parent
        if (real / "include" / "cuda_runtime_api.h").exists():
            return str(real)
    return None


def nccl_paths() -> tuple[str, str] | None:
    """Include and lib dirs of the nvidia-nccl wheel torch depends on (one NCCL per process)."""
    try:
        import nvidia.nccl  # type: ignore

        base = Path(list(nvidia.nccl.__path__)[0])
    except Exception:
        return None
    inc, lib = base / "include", base / "lib"
    if (inc / "nccl.h").exists() and (lib / "libnccl.so.2").exists():
        return str(inc), str(lib)
    return None


def build_extension():
    import torch
    from torch.utils import cpp_extension

    src = read_sources()
    sources = src.get("core", []) + src.get("torch", [])
    debug = os.environ.get("BYTESCALE_DEBUG") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # No -std here: torch.utils.cpp_extension picks the standard the installed torch needs
    # (C++17 up to torch 2.9, C++20 after).
    cxx_flags = [*opt, "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
    if not debug:
        cxx_flags += ["-march=x86-64-v2"] if os.uname().machine == "x86_64" else []
        # Python's CFLAGS carry -g; with torch's headers it made every object ~16x larger and its
        # compile ~30% slower (benchmarks/RESULTS.md, "Building"). Release builds go without.
        cxx_flags += ["-g0"]
    define_macros = []
    include_dirs = [str(ROOT / "csrc")]
    library_dirs: list[str] = []
    libraries: list[str] = []
    extra_link = []

    cuda_home = find_cuda_home()
    want_cuda = (
        torch.version.cuda is not None
        and cuda_home is not None
        and os.environ.get("BYTESCALE_NO_CUDA") != "1"
    )
    nccl = nccl_paths() if want_cuda else None
    if want_cuda and nccl is None:
        print("bytescale: CUDA torch but no nvidia-nccl wheel found; building CPU-only", file=sys.stderr)
        want_cuda = False

    if want_cuda:
        # With no GPU visible and no TORCH_CUDA_ARCH_LIST, torch derives an EMPTY arch list from
        # the visible devices and fails inside cpp_extension (IndexError in _get_cuda_arch_flags):
        # exactly CI's and a build machine's case. Pick the data-centre targets ourselves.
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
            print(f"bytescale: no GPU visible, TORCH_CUDA_ARCH_LIST={DEFAULT_CUDA_ARCHS}", file=sys.stderr)
        os.environ["CUDA_HOME"] = cuda_home  # cpp_extension reads it at import in some versions
        cpp_extension.CUDA_HOME = cuda_home
        sources += src.get("cuda", [])
        define_macros.append(("BYTESCALE_WITH_CUDA", "1"))
        inc, lib = nccl
        include_dirs.append(inc)
        library_dirs.append(lib)
        # Link by soname so the process shares the libnccl.so.2 torch already loaded.
        extra_link += [f"-l:libnccl.so.2", f"-Wl,-rpath,{lib}"]
        ext_cls = cpp_extension.CUDAExtension
        # nvcc through ccache: recent torch (2.14.1 here) wraps it itself, older versions only
        # through PYTORCH_NVCC (used as given in build.ninja). TORCH_NO_COMPILER_WRAPPER=1: neither.
        ccache = shutil.which("ccache")
        if ccache and "PYTORCH_NVCC" not in os.environ and not os.environ.get("TORCH_NO_COMPILER_WRAPPER"):
            os.environ["PYTORCH_NVCC"] = shlex.join([ccache, str(Path(cuda_home) / "bin" / "nvcc")])
        extra = {
            "cxx": cxx_flags,
            "nvcc": [*opt, "--expt-relaxed-constexpr", "-lineinfo"],
        }
    else:
        ext_cls = cpp_extension.CppExtension
        extra = {"cxx": cxx_flags}

    print(f"bytescale: building with CUDA={'yes' if want_cuda else 'no'}, {len(sources)} sources", file=sys.stderr)
    return ext_cls(
        name="bytescale._C",
        sources=sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        library_dirs=library_dirs,
        libraries=libraries,
        extra_compile_args=extra,
        extra_link_args=extra_link,
    )


def build_ext_class(root: Path = ROOT):
    """torch's BuildExtension with a build directory that survives and a link that is skipped
    when nothing changed (``root``: the project's tree; tests/build/test_setup.py builds a small
    extension with it).

    * ``pip install -e .`` (setuptools' editable_wheel) points ``build_temp`` at a fresh temporary
      directory on every run, so ninja found no earlier objects and recompiled every source, and
      ccache missed as well: Python's CFLAGS carry ``-g`` and ccache hashes the working directory
      (ninja's, the temporary one) into the key of every ``-g`` compile. A ``build_temp`` outside
      the tree is therefore replaced by the tree's own ``build/temp.<platform>-<python>`` (where
      ``python setup.py build_ext`` builds too), and release builds compile with ``-g0``. The
      library is linked in ``build/lib.<platform>-<python>`` for the same reason (then copied into
      the package, which is what the editable install imports).
    * torch sets ``force`` so that ninja, which tracks headers and command lines, decides what to
      compile; the link would then run every time. It runs only when an object is newer than the
      library or the link inputs (objects, flags, libraries, output) changed.
    """
    from torch.utils.cpp_extension import BuildExtension

    class BuildExt(BuildExtension):
        def finalize_options(self) -> None:
            super().finalize_options()
            top = root.resolve()
            tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            for attr, name in (("build_temp", "temp"), ("build_lib", "lib")):
                path = Path(getattr(self, attr)).resolve()
                if path != top and top not in path.parents:
                    setattr(self, attr, str(top / "build" / f"{name}.{tag}"))

        def build_extension(self, ext) -> None:
            out = Path(self.get_ext_fullpath(ext.name)).resolve()
            stamp = Path(self.build_temp) / f"{ext.name}.link.json"
            key = json.dumps({"output": str(out), "sources": list(ext.sources),
                              "link": list(ext.extra_link_args or []), "libraries": list(ext.libraries or []),
                              "library_dirs": list(ext.library_dirs or []),
                              "compile": ext.extra_compile_args, "macros": ext.define_macros}, sort_keys=True)
            same = stamp.exists() and stamp.read_text() == key
            self.compiler.force = not same  # link only if an object is newer or the inputs changed
            before = out.stat().st_mtime_ns if out.exists() else None
            super().build_extension(ext)
            if before is None or out.stat().st_mtime_ns != before:
                self._relinked.add(str(out))
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(key)

        def run(self) -> None:
            self._relinked: set = set()
            super().run()

        def copy_file(self, infile, outfile, *args, **kwargs):
            # --inplace copies the library into the package after every build; an unchanged one is
            # left alone (rewriting truncates a file that running processes have mapped).
            src, dst = Path(infile), Path(outfile)
            if str(src.resolve()) not in self._relinked and dst.exists() and src.exists():
                a, b = src.stat(), dst.stat()  # copy_file keeps the mtime (whole seconds)
                if a.st_size == b.st_size and int(a.st_mtime) == int(b.st_mtime):
                    return str(dst), False
            return super().copy_file(infile, outfile, *args, **kwargs)

    return BuildExt.with_options(use_ninja=True)


def main():
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    setup(
        packages=find_packages(include=["bytescale", "bytescale.*"]),
        ext_modules=[build_extension()],
        cmdclass={"build_ext": build_ext_class()},
        zip_safe=False,
    )


if __name__ == "__main__":
    main()
