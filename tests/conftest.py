import importlib.util
import os
import sys
from types import ModuleType

import pytest
import torch

from .dist_pool import RankPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_POOLS: dict = {}


def load_script_modules(folder: str, *names: str) -> list[ModuleType]:
    """Modules of a scripts folder of the repository (``examples``, ``benchmarks``: scripts and their siblings, not
    a package), loaded from their files in the order given and registered in sys.modules under their own names, as
    the scripts import each other when run from that folder: list a module after the siblings it imports
    (``load_script_modules("examples", "checkpointing", "training")``). One already loaded from the same file is
    reused. The one way the tests reach into those folders; the scripts themselves find their siblings on sys.path,
    where Python puts a script's folder. Code shared by name lives in mfsdp_ext.testing instead."""
    loaded = []
    for name in names:
        path = os.path.join(ROOT, folder, f"{name}.py")
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # before it runs: a sibling that imports it finds this one
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        elif os.path.realpath(getattr(module, "__file__", "") or "") != os.path.realpath(path):
            raise ImportError(f"{name} is already imported from {getattr(module, '__file__', None)}, not {path}")
        loaded.append(module)
    return loaded


def get_pool(world: int, backend: str = "gloo") -> RankPool:
    key = (world, backend)
    if key not in _POOLS:
        if backend == "nccl" and torch.cuda.device_count() < world:
            pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
        _POOLS[key] = RankPool(world, backend)
    return _POOLS[key]


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(params=[2, 4], ids=lambda w: f"{w}ranks")
def cpu_pool(request):
    return get_pool(request.param, "gloo")


@pytest.fixture(params=[2, 4], ids=lambda w: f"{w}gpus")
def gpu_pool(request):
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return get_pool(request.param, "nccl")


@pytest.fixture(params=[1, 2, 4], ids=lambda w: f"{w}gpus")
def gpu_pool_from_one(request):
    """gpu_pool, with one GPU too (a one-rank NCCL group): for what must hold on 1, 2 and 4 GPUs."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return get_pool(request.param, "nccl")
