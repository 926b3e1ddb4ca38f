"""What the native extension ``mfsdp_ext._C`` is compiled from and with: one answer for both builds.

setup.py (ahead of time) imports this file by its path, before the package exists; mfsdp_ext/_native/jit.py (just in
time, at first import) imports it as a module. Both call ``extension_spec`` and so compile the same sources with the
same flags:

  * always: the C++ CPU kernels, the bindings and the symmetric pool's offset allocator (csrc/*.cpp: bindings,
    build_info, {pack,cast,quantize,optim}.cpp and *_cpu.cpp, host_agree, symm_offset_allocator, symm_comm), with
    -fopenmp where torch's ATen parallelizes with OpenMP (at::parallel_for needs it to use more than one thread);
  * CUDA kernels (csrc/*_cuda.cu, -DMFSDP_WITH_CUDA) when torch has CUDA and nvcc is found (CUDA_HOME);
  * NCCL code (in symm_comm.cpp and build_info.cpp, -DMFSDP_WITH_NCCL, linked with -l:libnccl.so.2) when, in
    addition, nccl.h is found: $NCCL_INCLUDE_DIR, $NCCL_HOME, the ``nvidia.nccl`` Python package, CUDA_HOME, then
    the system.
  * fp8_gemm on cuBLASLt (fp8_gemm.cpp, -DMFSDP_WITH_CUBLASLT, linked with libcublasLt.so.N) when, with CUDA,
    cublasLt.h is found in torch's ``nvidia`` wheels or CUDA_HOME; otherwise fp8_gemm runs torch._scaled_mm.

Environment:
  TORCH_CUDA_ARCH_LIST   CUDA architectures (torch's syntax); default: -gencode=arch=compute_90a,code=sm_90a
  MFSDP_NO_CUDA=1        build the CPU kernels only
  MFSDP_JIT_CUDA=1       the just-in-time build compiles CUDA also where no GPU is visible (default: CPU only there)
  MFSDP_NO_NCCL=1        leave the NCCL code out
  MFSDP_NO_CUBLASLT=1    fp8_gemm runs torch._scaled_mm instead of its own cuBLASLt call
  MFSDP_PTXAS_VERBOSE=1  print registers / spills of every kernel (-Xptxas -v)

Needs torch importable (it asks torch for CUDA_HOME and its CUDA version); imports nothing of mfsdp_ext.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field

import torch
from torch.utils.cpp_extension import CUDA_HOME

# csrc/README.md: which file holds what
SOURCES = ("bindings.cpp", "build_info.cpp", "capture_info.cpp", "pack.cpp", "pack_cpu.cpp", "cast.cpp",
           "cast_cpu.cpp", "quantize.cpp", "quantize_cpu.cpp", "fp8_gemm.cpp", "fp8_linear.cpp", "optim.cpp",
           "optim_cpu.cpp", "host_agree.cpp", "symm_offset_allocator.cpp", "symm_comm.cpp")
# Not pack.cu / cast.cu: torch names object files by stem, so they would clash with pack.o / cast.o.
CUDA_SOURCES = ("pack_cuda.cu", "cast_cuda.cu", "quantize_cuda.cu", "optim_cuda.cu")
SOURCE_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")  # what csrc/ holds; all of it ships in the wheel and the sdist


@dataclass
class ExtensionSpec:
    sources: list[str]
    include_dirs: list[str]
    cxx_flags: list[str]
    nvcc_flags: list[str]
    link_args: list[str]
    with_cuda: bool
    notes: list[str] = field(default_factory=list)  # what was found or left out, and why

    @property
    def summary(self) -> str:
        """e.g. "CPU + CUDA sm_90a + NCCL" or "CPU only (torch 2.13.0+cpu has no CUDA)"."""
        parts = ["CPU"]
        if self.with_cuda:
            arch = next(f for f in self.cxx_flags if f.startswith("-DMFSDP_CUDA_ARCHS=")).split("=", 1)[1]
            parts.append("CUDA " + arch.replace("__", ","))
        if "-DMFSDP_WITH_NCCL" in self.cxx_flags:
            parts.append("NCCL")
        why = "" if self.with_cuda else f" ({self.notes[0]})" if self.notes else ""
        return " + ".join(parts) + (" only" if len(parts) == 1 else "") + why


def find_nvcc(notes: list[str], jit: bool = False) -> str | None:
    if os.environ.get("MFSDP_NO_CUDA") == "1":
        notes.append("MFSDP_NO_CUDA=1")
        return None
    if torch.version.cuda is None:
        notes.append(f"torch {torch.__version__} has no CUDA")
        return None
    if jit and not torch.cuda.is_available() and os.environ.get("MFSDP_JIT_CUDA") != "1":
        # the just-in-time build serves the machine that imports: without a GPU, CUDA kernels only cost build time
        # (and a CUDA toolkit that does not match torch's wheels can fail it)
        notes.append("no GPU visible; MFSDP_JIT_CUDA=1 compiles CUDA anyway")
        return None
    if CUDA_HOME is None:
        notes.append("nvcc not found: set CUDA_HOME")
        return None
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    if not os.path.exists(nvcc):
        notes.append(f"{nvcc} does not exist")
        return None
    # cuda_runtime.h includes crt/host_config.h, which comes with nvcc: an nvcc whose toolkit lacks it (e.g. a
    # /usr/local/bin/nvcc script calling a toolkit elsewhere, beside torch's CUDA wheels, which do not ship it)
    # cannot compile our CUDA code. Where no GPU is visible that is a CPU build's business; with a GPU the build
    # goes on and its compiler error says what is missing.
    include_dirs = [inc for inc, _ in _cublaslt_candidates()]
    if not torch.cuda.is_available() and not any(os.path.exists(os.path.join(inc, "crt", "host_config.h"))
                                                 for inc in include_dirs):
        notes.append(f"no crt/host_config.h in {CUDA_HOME}/include or torch's CUDA wheels: an incomplete CUDA "
                     "toolkit; set CUDA_HOME to a whole one")
        return None
    return nvcc


def _nccl_candidates():
    if os.environ.get("NCCL_INCLUDE_DIR"):
        yield os.environ["NCCL_INCLUDE_DIR"], os.environ.get("NCCL_LIB_DIR")
    if os.environ.get("NCCL_HOME"):
        yield os.path.join(os.environ["NCCL_HOME"], "include"), os.path.join(os.environ["NCCL_HOME"], "lib")
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


def find_nccl(notes: list[str]) -> tuple[str, str | None] | None:
    """(include dir, lib dir) of NCCL, or None."""
    if os.environ.get("MFSDP_NO_NCCL") == "1":
        notes.append("MFSDP_NO_NCCL=1: no NCCL code")
        return None
    for inc, lib in _nccl_candidates():
        if inc and os.path.exists(os.path.join(inc, "nccl.h")):
            if lib and not any(os.path.exists(os.path.join(lib, n)) for n in ("libnccl.so.2", "libnccl.so")):
                lib = None  # rely on the linker's default paths
            return inc, lib
    notes.append("nccl.h not found: no NCCL code")
    return None


def _cublaslt_candidates():
    """(include dir, lib dir) pairs: torch's own cuBLAS wheel (nvidia/cu13, nvidia/cublas) first, then CUDA_HOME."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        for sub in sorted(os.listdir(loc)) if os.path.isdir(loc) else []:
            yield os.path.join(loc, sub, "include"), os.path.join(loc, sub, "lib")
    if CUDA_HOME:
        yield os.path.join(CUDA_HOME, "include"), os.path.join(CUDA_HOME, "lib64")


def find_cublaslt(notes: list[str]) -> tuple[str, str, str] | None:
    """(include dir, lib dir, library file name) of cuBLASLt, or None (fp8_gemm then runs torch._scaled_mm)."""
    if os.environ.get("MFSDP_NO_CUBLASLT") == "1":
        notes.append("MFSDP_NO_CUBLASLT=1: fp8_gemm runs torch._scaled_mm")
        return None
    for inc, lib in _cublaslt_candidates():
        if not os.path.exists(os.path.join(inc, "cublasLt.h")) or not os.path.isdir(lib):
            continue
        # the versioned name (libcublasLt.so.13) is what torch has loaded; a wheel ships no unversioned link
        names = sorted(n for n in os.listdir(lib) if re.fullmatch(r"libcublasLt\.so(\.\d+)?", n))
        if names:
            return inc, lib, names[-1]
    notes.append("cublasLt.h not found: fp8_gemm runs torch._scaled_mm")
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


def extension_spec(csrc: str, jit: bool = False) -> ExtensionSpec:
    """Sources (under ``csrc``, as given: setup.py passes a relative path), flags and libraries of ``_C``.
    ``jit``: for the just-in-time build, which compiles CUDA only where a GPU is visible."""
    notes: list[str] = []
    # Link the process's shared libstdc++ ahead of the compiler's own. A compiler whose directory holds
    # only libstdc++.a (the GPU machine's /opt/gcc) otherwise copies parts of libstdc++ into _C, and with
    # -Bsymbolic-functions (Debian/Ubuntu Python's LDSHARED) _C then formats numbers with its private copy,
    # whose locale tables were never set up: every error message with a number in it crashed.
    libstdcxx = loaded_libstdcxx()
    spec = ExtensionSpec(sources=[os.path.join(csrc, f) for f in SOURCES],
                         include_dirs=[os.path.abspath(csrc)],
                         cxx_flags=["-O3", "-ffp-contract=off"],
                         nvcc_flags=["-O3", "-fmad=true"],  # kernels use __fmul_rn / __fmaf_rn where rounding matters
                         link_args=[libstdcxx] if libstdcxx else [], with_cuda=False, notes=notes)
    if torch.backends.openmp.is_available():
        # ATen's OpenMP at::parallel_for is an inline `#pragma omp parallel`: compiled without -fopenmp it runs every
        # CPU kernel on one thread. libgomp.so.1 then resolves to the one torch loaded (same soname), so our kernels
        # share torch's thread pool and follow torch.set_num_threads.
        spec.cxx_flags.append("-fopenmp")
        spec.link_args.append("-fopenmp")
    nvcc = find_nvcc(notes, jit)
    if nvcc is None:
        return spec

    gencode, arch_names = cuda_arch_flags()
    defines = ["-DMFSDP_WITH_CUDA", f"-DMFSDP_CUDA_ARCHS={arch_names}"]
    spec.with_cuda = True
    spec.sources += [os.path.join(csrc, f) for f in CUDA_SOURCES]
    spec.nvcc_flags += gencode
    if os.environ.get("MFSDP_PTXAS_VERBOSE") == "1":
        spec.nvcc_flags += ["-Xptxas", "-v"]
    notes.append(f"CUDA kernels for {arch_names} with {nvcc}")

    nccl = find_nccl(notes)
    if nccl is not None:
        inc, lib = nccl
        notes.append(f"NCCL: include {inc}, lib {lib or '(linker default)'}")
        defines.append("-DMFSDP_WITH_NCCL")
        spec.include_dirs.append(inc)
        if lib:
            spec.link_args += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
        spec.link_args.append("-l:libnccl.so.2")
    cublaslt = find_cublaslt(notes)
    if cublaslt is not None:
        inc, lib, name = cublaslt
        notes.append(f"cuBLASLt: include {inc}, {lib}/{name}")
        defines.append("-DMFSDP_WITH_CUBLASLT")
        spec.include_dirs.append(inc)
        spec.link_args += [f"-L{lib}", f"-Wl,-rpath,{lib}", f"-l:{name}"]
    spec.cxx_flags += defines
    spec.nvcc_flags += defines
    return spec
