"""Packaging: a build that cannot import torch installs pure Python plus the C++/CUDA sources, and the installed
package compiles mfsdp_ext._C at first import (mfsdp_ext/_native/jit.py), caches it, and says what it loaded.

test_sdist_wheel_just_in_time compiles the extension once (a minute or more on 2 cores): the chain a user without
``--no-build-isolation`` goes through, sdist -> wheel -> install -> import.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile

import pytest

from mfsdp_ext._native import jit as _jit
from tests.conftest import ROOT

SETUP_WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; "
                       "runpy.run_path('setup.py', run_name='__main__')")


def _source_copy(dst: str) -> str:
    """The checkout's files as a fresh clone has them (no build outputs, no in-place _C)."""
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".pytest_cache")
    shutil.copytree(ROOT, dst, ignore=ignore)
    return dst


@pytest.mark.parametrize("mode,ok,message", [
    ("", True, "torch is not importable in this build environment"),
    ("0", True, "MFSDP_BUILD_EXT=0: mfsdp_ext._C will be compiled at first import"),
    ("1", False, "MFSDP_BUILD_EXT=1, but torch cannot be imported"),
    ("yes", False, "MFSDP_BUILD_EXT='yes': use 1"),
])
def test_setup_without_torch(mode, ok, message):
    """pip's isolated build has no torch: setup.py must still produce the package, unless told to insist."""
    env = {**os.environ, "MFSDP_BUILD_EXT": mode}
    out = subprocess.run([sys.executable, "-c", SETUP_WITHOUT_TORCH], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert (out.returncode == 0) == ok and message in out.stdout + out.stderr, out.stdout + out.stderr
    if ok:
        assert out.stdout.strip().endswith("0.1.0")


def test_missing_toolchain_is_named(monkeypatch):
    spec = _jit.build_config.extension_spec(_jit.source_dir())
    monkeypatch.setenv("CXX", "no-such-compiler-mfsdp")
    monkeypatch.setitem(sys.modules, "ninja", None)  # pip's ninja package absent
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ImportError) as err:
        _jit.check_toolchain(spec)
    assert "ninja (pip install ninja)" in str(err.value)
    assert "'no-such-compiler-mfsdp' is not on PATH" in str(err.value)
    assert "--no-build-isolation" in str(err.value)


def test_jit_build_compiles_cuda_only_where_a_gpu_is_visible(monkeypatch, tmp_path):
    """A torch with CUDA and an nvcc, but no GPU: the just-in-time build takes the CPU kernels only (the machine
    that imports cannot run the CUDA ones); the ahead-of-time build, and MFSDP_JIT_CUDA=1, still compile them."""
    cfg = _jit.build_config
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    (tmp_path / "include" / "crt").mkdir(parents=True)
    (tmp_path / "include" / "crt" / "host_config.h").write_text("")
    monkeypatch.setattr(cfg.torch.version, "cuda", "13.0")
    monkeypatch.setattr(cfg.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cfg, "CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("MFSDP_NO_CUDA", raising=False)
    monkeypatch.delenv("MFSDP_JIT_CUDA", raising=False)
    jit = cfg.extension_spec(_jit.source_dir(), jit=True)
    assert not jit.with_cuda and "no GPU visible" in jit.summary, jit.summary
    assert cfg.extension_spec(_jit.source_dir()).with_cuda
    monkeypatch.setenv("MFSDP_JIT_CUDA", "1")
    assert cfg.extension_spec(_jit.source_dir(), jit=True).with_cuda


def test_incomplete_cuda_toolkit_builds_cpu_only(monkeypatch, tmp_path):
    """Where no GPU is visible, an nvcc whose toolkit has no crt/host_config.h (nor do torch's CUDA wheels) cannot
    compile CUDA code: the ahead-of-time build takes the CPU kernels only and says why, instead of failing."""
    cfg = _jit.build_config
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setattr(cfg.torch.version, "cuda", "13.0")
    monkeypatch.setattr(cfg.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cfg, "CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(cfg, "_cublaslt_candidates", lambda: iter([(str(tmp_path / "include"), "")]))
    monkeypatch.delenv("MFSDP_NO_CUDA", raising=False)
    spec = cfg.extension_spec(_jit.source_dir())
    assert not spec.with_cuda and "incomplete CUDA toolkit" in spec.summary, spec.summary


# in a fresh interpreter: which build loads, and one kernel against torch's own rounding
_IMPORT = """
import json, sys, time
t0 = time.perf_counter()
import mfsdp_ext, torch
from mfsdp_ext import _native
seconds = time.perf_counter() - t0
src = torch.randn(1000, generator=torch.Generator().manual_seed(0))
dst = torch.empty(1000, dtype=torch.bfloat16)
_native.cast(src, dst)
print(json.dumps({"info": mfsdp_ext.build_info(), "file": mfsdp_ext.__file__, "seconds": seconds,
                  "cast_ok": bool(torch.equal(dst, src.to(torch.bfloat16)))}))
"""


def _import(site: str, cache: str, cwd: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": site, "TORCH_EXTENSIONS_DIR": cache}
    env.pop("LOCAL_RANK", None)
    out = subprocess.run([sys.executable, "-c", _IMPORT], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_sdist_wheel_just_in_time(tmp_path):
    src = _source_copy(str(tmp_path / "src"))
    dist, site, cache = (str(tmp_path / d) for d in ("dist", "site", "cache"))
    env = {**os.environ, "MFSDP_BUILD_EXT": "0"}  # what pip's isolated build does (it cannot import torch)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", dist], cwd=src, env=env, check=True,
                   capture_output=True, timeout=300)
    (sdist,) = [os.path.join(dist, f) for f in os.listdir(dist)]
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"csrc/bindings.cpp", "csrc/pack_cuda.cu", "csrc/kernel_utils.cuh", "mfsdp_ext/_native/build_config.py",
            "mfsdp_ext/_native/jit.py", "setup.py", "MANIFEST.in"} <= names, sorted(names)

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", dist,
                    sdist], env=env, check=True, capture_output=True, timeout=600)
    (wheel,) = [os.path.join(dist, f) for f in os.listdir(dist) if f.endswith(".whl")]
    assert wheel.endswith("-py3-none-any.whl"), wheel  # pure Python: no _C inside
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"mfsdp_ext/csrc/bindings.cpp", "mfsdp_ext/csrc/cast_cuda.cu", "mfsdp_ext/csrc/float_formats.h"} <= names
    assert not any(n.endswith(".so") for n in names), sorted(names)
    package = os.path.join(src, "mfsdp_ext")
    modules = {os.path.relpath(os.path.join(d, f), src).replace(os.sep, "/")
               for d, _, files in os.walk(package) for f in files if f.endswith(".py")}
    assert modules <= names, f"missing from the wheel (list subpackages in pyproject.toml): {sorted(modules - names)}"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
                   check=True, capture_output=True, timeout=300)

    first, log = _import(site, cache, str(tmp_path))
    assert first["file"].startswith(site), first  # the installed package, not this checkout
    info = first["info"]
    assert info["build"] == "just-in-time" and info["path"].startswith(os.path.join(cache, "mfsdp_ext")), info
    assert info["native"] and info["cpu"] and first["cast_ok"], first
    assert log.count("mfsdp_ext: compiling the native extension") == 1, log

    t0 = time.perf_counter()
    again, log = _import(site, cache, str(tmp_path))
    assert again["info"]["path"] == info["path"] and "compiling" not in log, (again, log)  # the cached build
    print({"first_import_s": round(first["seconds"], 1), "cached_import_s": round(again["seconds"], 1),
           "second_process_s": round(time.perf_counter() - t0, 1), "path": info["path"]})


def test_ahead_of_time_build_found_through_dotdot_path(tmp_path):
    """A sys.path entry such as ``benchmarks/..`` (a user's script that puts its parent folder on sys.path; the
    repository's own scripts no longer do) still finds the checkout's ahead-of-time build: the loader compares real
    paths, so it does not compile a just-in-time copy instead."""
    package = os.path.join(ROOT, "mfsdp_ext")
    if not any(f.startswith("_C.") and f.endswith(".so") for f in os.listdir(package)):
        pytest.skip("this checkout has no ahead-of-time build (bash scripts/install.sh makes one)")
    # inserted at run time, as such a script does (site.py would normalise the same entry given in PYTHONPATH)
    code = f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'benchmarks', '..')!r})\n" + _IMPORT
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    env.pop("LOCAL_RANK", None)
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert "/benchmarks/../" in info["file"], info  # the un-normalised path was the one used
    assert info["info"]["build"] == "ahead-of-time" and "compiling" not in out.stderr, (info, out.stderr)
    assert os.path.realpath(info["info"]["path"]).startswith(os.path.realpath(package)), info
