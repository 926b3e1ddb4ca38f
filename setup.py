"""Builds the native extension ``mfsdp_ext._C`` (metadata lives in pyproject.toml).

    pip install --no-build-isolation -e .            # CPU machine / CI
    pip install --no-build-isolation --no-deps -e .  # GPU machine

What gets compiled:
  * always: the bindings, the kernels' entry points and CPU kernels and the symmetric pool's offset allocator
    (csrc/*.cpp: bindings, build_info, {pack,cast,quantize}.cpp and *_cpu.cpp, symm_offset_allocator, symm_comm);
  * CUDA kernels (csrc/*_cuda.cu, -DMFSDP_WITH_CUDA) when torch has CUDA and nvcc is found (CUDA_HOME);
  * NCCL code (in csrc/symm_comm.cpp and build_info.cpp, -DMFSDP_WITH_NCCL, linked with -l:libnccl.so.2) when,
    in addition, nccl.h is found: $NCCL_INCLUDE_DIR, $NCCL_HOME, the ``nvidia.nccl`` Python package, CUDA_HOME,
    then the system.

Environment:
  TORCH_CUDA_ARCH_LIST   CUDA architectures (torch's syntax); default: -gencode=arch=compute_90a,code=sm_90a
  MFSDP_NO_CUDA=1        build the CPU kernels only
  MFSDP_NO_NCCL=1        leave the NCCL code out
  MFSDP_PTXAS_VERBOSE=1  print registers / spills of every kernel (-Xptxas -v)
  MAX_JOBS               parallel compile jobs (torch's BuildExtension)
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"


def log(msg: str) -> None:
    print(f"[mfsdp_ext setup] {msg}", file=sys.stderr)


def find_nvcc() -> str | None:
    if os.environ.get("MFSDP_NO_CUDA") == "1":
        log("MFSDP_NO_CUDA=1: CPU kernels only")
        return None
    if torch.version.cuda is None:
        log(f"torch {torch.__version__} has no CUDA: CPU kernels only")
        return None
    if CUDA_HOME is None:
        log("nvcc not found (set CUDA_HOME): CPU kernels only")
        return None
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    if not os.path.exists(nvcc):
        log(f"{nvcc} does not exist: CPU kernels only")
        return None
    return nvcc


def _nccl_candidates():
    env_home = os.environ.get("NCCL_HOME")
    if os.environ.get("NCCL_INCLUDE_DIR"):
        yield os.environ["NCCL_INCLUDE_DIR"], os.environ.get("NCCL_LIB_DIR")
    if env_home:
        yield os.path.join(env_home, "include"), os.path.join(env_home, "lib")
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            yield os.path.join(loc, "include"), os.path.join(loc, "lib")
    if CUDA_HOME:
        yield os.path.join(CUDA_HOME, "include"), os.path.join(CUDA_HOME, "lib64")
    yield "/usr/include", "/usr/lib/x86_64-linux-gnu"
    yield "/usr/local/include", "/usr/local/lib"


def find_nccl() -> tuple[str, str | None] | None:
    """(include dir, lib dir) of NCCL, or None."""
    if os.environ.get("MFSDP_NO_NCCL") == "1":
        log("MFSDP_NO_NCCL=1: no NCCL code")
        return None
    for inc, lib in _nccl_candidates():
        if inc and os.path.exists(os.path.join(inc, "nccl.h")):
            if lib and not any(os.path.exists(os.path.join(lib, n)) for n in ("libnccl.so.2", "libnccl.so")):
                lib = None  # rely on the linker's default paths
            return inc, lib
    log("nccl.h not found: no NCCL code")
    return None


def cuda_arch_flags() -> tuple[list[str], str]:
    """nvcc -gencode flags (empty when TORCH_CUDA_ARCH_LIST is set: torch adds them) and a name list."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if archs:
        names = []
        for tok in re.split(r"[;\s,]+", archs):
            m = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", tok.strip())
            if m:
                names.append(f"sm_{m.group(1)}{m.group(2)}{m.group(3)}")
        return [], "__".join(names) or "unknown"
    return ["-gencode=arch=compute_90a,code=sm_90a"], "sm_90a"


def loaded_libstdcxx() -> str | None:
    """Path of the libstdc++ this process (Python with torch imported) runs with, on Linux; else None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


class Build(BuildExtension):
    """torch's BuildExtension, logging the link command."""

    def build_extensions(self):
        log("link command: " + " ".join(getattr(self.compiler, "linker_so", None) or []))
        super().build_extensions()


def make_extension():
    # symm_comm.cpp always: without NCCL it compiles to nothing (csrc/README.md says which file holds what)
    sources = [os.path.join(CSRC, f) for f in ("bindings.cpp", "build_info.cpp", "pack.cpp", "pack_cpu.cpp",
                                               "cast.cpp", "cast_cpu.cpp", "quantize.cpp", "quantize_cpu.cpp",
                                               "symm_offset_allocator.cpp", "symm_comm.cpp")]
    cxx = ["-O3", "-ffp-contract=off"]
    nvcc_flags = ["-O3", "-fmad=true"]  # kernels use explicit __fmul_rn / __fmaf_rn where rounding matters
    include_dirs = [os.path.join(ROOT, CSRC)]
    # Link the process's shared libstdc++ ahead of the compiler's own. A compiler whose directory holds
    # only libstdc++.a (the GPU machine's /opt/gcc) otherwise copies parts of libstdc++ into _C, and with
    # -Bsymbolic-functions (Debian/Ubuntu Python's LDSHARED) _C then formats numbers with its private copy,
    # whose locale tables were never set up: every error message with a number in it crashed.
    libstdcxx = loaded_libstdcxx()
    link_args: list[str] = [libstdcxx] if libstdcxx else []

    nvcc = find_nvcc()
    if nvcc is None:
        return CppExtension(
            name="mfsdp_ext._C",
            sources=sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx},
            extra_link_args=link_args,
        )

    gencode, arch_names = cuda_arch_flags()
    defines = ["-DMFSDP_WITH_CUDA", f"-DMFSDP_CUDA_ARCHS={arch_names}"]
    # Not pack.cu / cast.cu: torch names object files by stem, so they would clash with pack.o / cast.o.
    sources += [os.path.join(CSRC, f) for f in ("pack_cuda.cu", "cast_cuda.cu", "quantize_cuda.cu")]
    nvcc_flags += gencode
    if os.environ.get("MFSDP_PTXAS_VERBOSE") == "1":
        nvcc_flags += ["-Xptxas", "-v"]
    log(f"CUDA kernels for {arch_names} with {nvcc}")

    nccl = find_nccl()
    if nccl is not None:
        inc, lib = nccl
        log(f"NCCL: include {inc}, lib {lib or '(linker default)'}")
        defines.append("-DMFSDP_WITH_NCCL")
        include_dirs.append(inc)
        if lib:
            link_args += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
        link_args.append("-l:libnccl.so.2")

    return CUDAExtension(
        name="mfsdp_ext._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx + defines, "nvcc": nvcc_flags + defines},
        extra_link_args=link_args,
    )


setup(
    ext_modules=[make_extension()],
    cmdclass={"build_ext": Build},
)
