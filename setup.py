"""Builds mfsdp_ext (metadata in pyproject.toml). The native extension ``mfsdp_ext._C`` is compiled

  * ahead of time, here, when this build can import torch:
        pip install --no-build-isolation .            # or PIP_NO_BUILD_ISOLATION=0 pip install .
        pip install --no-build-isolation --no-deps -e .  # development (scripts/install.sh, the GPU machine)
  * otherwise just in time, at the first ``import mfsdp_ext`` (mfsdp_ext/_native/jit.py), with the same sources and
    flags: a plain ``pip install .`` builds in an isolated environment without torch, so it installs the Python
    package and the C++/CUDA sources only.

MFSDP_BUILD_EXT: unset = ahead of time when torch imports here; 1 = ahead of time, or fail; 0 = never (just in time).
What is compiled, and the variables that steer it: mfsdp_ext/_native/build_config.py. MAX_JOBS: parallel compile jobs.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def log(msg: str) -> None:
    print(f"[mfsdp_ext setup] {msg}", file=sys.stderr)


def load_build_config():
    """mfsdp_ext/_native/build_config.py by its path: importing the package would import _C, which is being built."""
    spec = importlib.util.spec_from_file_location("_mfsdp_build_config",
                                                  os.path.join(ROOT, "mfsdp_ext", "_native", "build_config.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def native_extension():
    """([the CppExtension / CUDAExtension of _C], cmdclass), or ([], {}) for a pure-Python build."""
    mode = os.environ.get("MFSDP_BUILD_EXT", "")
    if mode not in ("", "0", "1"):
        raise SystemExit(f"MFSDP_BUILD_EXT={mode!r}: use 1 (ahead of time), 0 (just in time) or leave it unset")
    if mode == "0":
        log("MFSDP_BUILD_EXT=0: mfsdp_ext._C will be compiled at first import")
        return [], {}
    try:
        import torch  # noqa: F401
    except ImportError:
        if mode == "1":
            raise SystemExit("MFSDP_BUILD_EXT=1, but torch cannot be imported in this build environment: install "
                             "torch first and build with `pip install --no-build-isolation .`") from None
        log("torch is not importable in this build environment (pip's isolated build): installing the Python "
            "package and the sources; mfsdp_ext._C will be compiled at first import")
        return [], {}

    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    class Build(BuildExtension):
        """torch's BuildExtension, logging the link command."""

        def build_extensions(self):
            log("link command: " + " ".join(getattr(self.compiler, "linker_so", None) or []))
            super().build_extensions()

    spec = load_build_config().extension_spec("csrc")  # relative: setuptools refuses absolute source paths
    for note in spec.notes:
        log(note)
    log(f"ahead-of-time build of mfsdp_ext._C: {spec.summary}")
    kwargs = dict(name="mfsdp_ext._C", sources=spec.sources, include_dirs=spec.include_dirs,
                  extra_link_args=spec.link_args)
    if spec.with_cuda:
        ext = CUDAExtension(extra_compile_args={"cxx": spec.cxx_flags, "nvcc": spec.nvcc_flags}, **kwargs)
    else:
        ext = CppExtension(extra_compile_args={"cxx": spec.cxx_flags}, **kwargs)
    return [ext], {"build_ext": Build}


ext_modules, cmdclass = native_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
