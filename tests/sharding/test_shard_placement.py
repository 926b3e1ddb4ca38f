"""shard_placement_fn answering Shard(1) on GPUs: every collective path (plain, native, symmetric memory, a
bf16 compute copy) trains as the default Shard(0) model does, and the strategies' Shard(1) case on 4 GPUs
(the CPU cases: tests/runtime/test_strategies.py::test_shard_dim1).

Run on a GPU machine: ``pytest -m gpu tests/sharding/test_shard_placement.py``.
"""

from __future__ import annotations

import pytest

from mfsdp_ext import MixedPrecisionPolicy
from tests.comm.test_symm_mem import BF16, _train_side_by_side
from tests.conftest import get_pool
from tests.runtime import test_strategies as st

pytestmark = pytest.mark.gpu


def _case_shard_dim1(mode: str):
    """shard_placement_fn answering Shard(1) for every matrix, with each collective path (the plain grouped
    all-gather into the staging area, the native transport, symmetric memory's rank-major gather unpacked by column
    runs; a bf16 compute copy): the numbers of the default Shard(0) model on the same path (fp32: each path sums
    the ranks' gradients in its own order)."""
    from torch.distributed.tensor import Shard

    kwargs = {"plain": {}, "native": dict(native_collectives=True), "symm": dict(use_symm_mem=True)}.get(mode, {})
    mp = BF16 if mode == "bf16" else MixedPrecisionPolicy()
    rows, columns, loss_err, param_err, a, b = _train_side_by_side(
        23, mp, 3, 24, reference=kwargs, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None, **kwargs)
    assert columns.emb.weight.placements == (Shard(1),), columns.emb.weight.placements
    if mode == "bf16":  # the same bf16 casts of the same weights; sums in another order
        assert loss_err <= 2e-2, (loss_err, a, b)
    else:
        assert loss_err <= 1e-6 and param_err <= 1e-5, (loss_err, param_err, a, b)
    if mode == "symm":
        columns.release_symmetric_memory()
        rows.release_symmetric_memory()
    return {"loss_err": loss_err, "param_err": param_err}


@pytest.mark.parametrize("mode", ["plain", "native", "symm", "bf16"])
def test_shard_dim1(gpu_pool, mode):
    print(gpu_pool.run(_case_shard_dim1, mode)[0])


def test_shard_dim1_strategies():
    print(get_pool(4, "nccl").run(st._case_shard_dim1)[0])
