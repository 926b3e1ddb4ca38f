import pytest
import torch

from .dist_pool import RankPool

_POOLS: dict = {}


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
