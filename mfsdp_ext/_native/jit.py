"""Builds ``mfsdp_ext._C`` just in time, at first import, when no ahead-of-time build was installed.

DeepSpeed's convention: torch's ``cpp_extension.load`` compiles the shipped sources (mfsdp_ext/csrc/ in a wheel,
csrc/ in the repository) with ninja, with the sources and flags setup.py would use (mfsdp_ext/build_config.py).
The result is cached under ``$TORCH_EXTENSIONS_DIR/mfsdp_ext`` (default ``~/.cache/mfsdp_ext``), in a folder named
by the torch version, its CUDA, the Python version and a hash of the sources and flags; a later import finds it
there and loads it without compiling (nor needing ninja or a compiler). Ranks that start together share one build:
torch's lock file makes the others wait for it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import types

import torch

from . import build_config

NAME = "mfsdp_ext_C"  # the module torch builds (PyInit_mfsdp_ext_C); _native registers it as mfsdp_ext._C


def source_dir() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package: mfsdp_ext/
    for candidate in (os.path.join(here, "csrc"), os.path.join(os.path.dirname(here), "csrc")):
        if os.path.exists(os.path.join(candidate, build_config.SOURCES[0])):
            return candidate
    raise ImportError(f"mfsdp_ext: the C++/CUDA sources are missing (neither {here}/csrc nor the repository's "
                      "csrc/ holds them), so mfsdp_ext._C cannot be built; reinstall mfsdp_ext")


def cache_root() -> str:
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "mfsdp_ext")
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mfsdp_ext")


def build_dir(spec: build_config.ExtensionSpec, csrc: str) -> str:
    """One folder per torch / CUDA / Python and per content: another version or other flags never reuse a build."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(csrc)):
        if name.endswith(build_config.SOURCE_SUFFIXES):
            with open(os.path.join(csrc, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    h.update(repr((spec.cxx_flags, spec.nvcc_flags, spec.link_args, spec.include_dirs[1:])).encode())
    tag = f"torch{torch.__version__}-{'cu' + torch.version.cuda if torch.version.cuda else 'cpu'}" \
          f"-py{sys.version_info[0]}{sys.version_info[1]}-{h.hexdigest()[:12]}"
    return os.path.join(cache_root(), tag)


def check_toolchain(spec: build_config.ExtensionSpec) -> None:
    """Name what is missing before torch fails somewhere in the middle of a build."""
    try:  # pip's ninja package: its binary is in the environment's bin/, which need not be on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except (ImportError, AttributeError):
        pass
    missing = []
    if shutil.which("ninja") is None:
        missing.append("ninja (pip install ninja)")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        missing.append(f"a C++17 compiler ({cxx!r} is not on PATH; set CXX, or install g++)")
    python_h = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(python_h):
        missing.append(f"Python's headers ({python_h}; e.g. apt-get install python3-dev)")
    torch_h = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "extension.h")
    if not os.path.exists(torch_h):
        missing.append(f"torch's C++ headers ({torch_h})")
    if missing:
        raise ImportError("mfsdp_ext: no ahead-of-time build of mfsdp_ext._C is installed, and building it now needs "
                          + "; ".join(missing) + ". Or install mfsdp_ext with the extension compiled: "
                          "`pip install --no-build-isolation .` where torch and a compiler are.")


def _import_built(path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> types.ModuleType:
    """The cached build, or a new one (one line on stderr while it compiles)."""
    csrc = source_dir()
    spec = build_config.extension_spec(csrc, jit=True)
    out = build_dir(spec, csrc)
    library = os.path.join(out, NAME + ".so")
    # Written once a build here has completed. Not torch's "lock" file: up to torch 2.13 it exists only while a
    # build runs, from 2.14 on it stays (an advisory lock), so its absence no longer says the library is whole.
    # Without the mark (or while another process builds), go through torch, which waits for that build.
    built = os.path.join(out, "built")
    if os.path.exists(library) and os.path.exists(built):
        return _import_built(library)

    check_toolchain(spec)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per machine, not one per rank
        print(f"mfsdp_ext: compiling the native extension ({spec.summary}) for torch {torch.__version__} into "
              f"{out}; first import only, this takes a minute or two", file=sys.stderr, flush=True)
    os.makedirs(out, exist_ok=True)
    from torch.utils import cpp_extension  # imports setuptools: only when compiling

    try:
        module = cpp_extension.load(name=NAME, sources=[os.path.abspath(s) for s in spec.sources],
                                    extra_cflags=spec.cxx_flags, extra_cuda_cflags=spec.nvcc_flags,
                                    extra_ldflags=spec.link_args, extra_include_paths=spec.include_dirs,
                                    build_directory=out, with_cuda=spec.with_cuda, verbose=False)
    except Exception as exc:  # torch raises RuntimeError with the compiler's output
        raise ImportError(f"mfsdp_ext: compiling mfsdp_ext._C in {out} failed ({spec.summary}):\n{exc}") from exc
    open(built, "w").close()
    return module
