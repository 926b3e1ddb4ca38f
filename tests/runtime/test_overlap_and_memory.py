"""What only a GPU shows of the unit schedule (2 and 4 GPUs, NCCL): the prefetched all-gathers and the
reduce-scatters overlap the GEMMs (profiler timeline), and the forward's and backward's peak memory stays
within a few units' gathered weights.

Run on a GPU machine: ``pytest -m gpu tests/runtime/test_overlap_and_memory.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mfsdp_ext import MixedPrecisionPolicy, fully_shard
from mfsdp_ext.testing.models import Block, rank_device, run_profiled

pytestmark = pytest.mark.gpu
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _stack(n_blocks: int, dim: int, ffn: int, **shard_kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim, ffn) for _ in range(n_blocks)])
    for b in model:
        fully_shard(b, mp_policy=BF16, **shard_kwargs)
    return fully_shard(model, mp_policy=BF16, **shard_kwargs)


def _overlapping(kind: str, kernels) -> tuple[int, int]:
    """(number of `kind` NCCL kernels, how many of them overlap a GEMM kernel in time)."""
    gemm = [(s, e) for n, s, e in kernels if any(k in n.lower() for k in ("gemm", "nvjet", "xmma", "cutlass"))]
    comm = [(s, e) for n, s, e in kernels if kind in n]
    hits = sum(1 for cs, ce in comm if any(min(ce, ge) > max(cs, gs) for gs, ge in gemm))
    return len(comm), hits


def _timeline(kernels, limit: int = 60) -> list[str]:
    """Kernels in start order, as 'start_us +dur name' relative to the first: for reading a failure."""
    kernels = sorted(kernels, key=lambda k: k[1])
    t0 = kernels[0][1] if kernels else 0
    return [f"{(s - t0):9.1f} +{(e - s):7.1f} {n[:60]}" for n, s, e in kernels[:limit]]


def _case_overlap(n_blocks: int):
    dev = rank_device()
    # Blocks large enough that each all-gather (~1 ms on 2 H200) outlasts the host's gap between issuing the
    # prefetch and the next GEMM (~0.45 ms under the profiler on a slow host): at dim 4096 / ffn 8192 a 2-GPU gather
    # took 0.27 ms and could end before Python launched the GEMM it was meant to hide behind.
    dim = 8192
    model = _stack(n_blocks, dim, 2 * dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2, 1024, dim, device=dev)
    for _ in range(2):  # the first iteration records the execution order that prefetching follows
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    loss, fwd_kernels = run_profiled(lambda: model(x).float().square().mean())
    _, bwd_kernels = run_profiled(loss.backward)
    fwd_ag, fwd_ag_overlap = _overlapping("AllGather", fwd_kernels)
    bwd_rs, bwd_rs_overlap = _overlapping("ReduceScatter", bwd_kernels)
    result = {"forward_all_gathers": fwd_ag, "overlapping_gemm": fwd_ag_overlap,
              "backward_reduce_scatters": bwd_rs, "rs_overlapping_gemm": bwd_rs_overlap,
              "forward_timeline": _timeline(fwd_kernels)}
    print({k: v for k, v in result.items() if k != "forward_timeline"}, flush=True)
    assert fwd_ag == n_blocks and fwd_ag_overlap >= n_blocks - 1, result
    assert bwd_rs == n_blocks and bwd_rs_overlap >= n_blocks - 1, result
    return result


def test_overlap_profile(gpu_pool):
    print(gpu_pool.run(_case_overlap, 6)[0])


# ----------------------------------------------------------------------------------------------- memory
FORWARD_BOUND_UNITS = 3  # the unit computing, the one prefetched, one freed in stream order
BACKWARD_BOUND_UNITS = 6  # gathered + prefetched units, this unit's grads, the pending reduction's buffers


def _case_peak_memory():
    dev = rank_device()
    n_blocks, dim = 6, 4096
    model = _stack(n_blocks, dim, dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(1, 16, dim, device=dev)  # tiny activations: the gathered weights dominate
    for _ in range(2):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    unit = model[0]._mfsdp_unit.groups[0].layout.total_numel * 2  # bf16 gathered bytes of one block
    slack = 16 << 20
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = model(x).float().square().mean()
    torch.cuda.synchronize()
    fwd = torch.cuda.max_memory_allocated() - base
    base_bwd = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    bwd = torch.cuda.max_memory_allocated() - base_bwd
    # The gradient shards the backward creates are its result, not its working set: zero_grad let the last ones
    # go (as FSDP2 frees its sharded grads), so each unit's reduction allocates its shard again.
    grads = sum(g.grads.main_grad.data.untyped_storage().nbytes() for m in model.modules() if hasattr(m, "_mfsdp_unit")
                for g in m._mfsdp_unit.groups if g.grads.main_grad is not None)
    result = {"unit_MiB": unit / 2**20, "forward_peak_units": fwd / unit, "backward_peak_units": bwd / unit,
              "gradient_shard_units": grads / unit}
    assert fwd <= FORWARD_BOUND_UNITS * unit + slack, result
    assert bwd - grads <= BACKWARD_BOUND_UNITS * unit + slack, result
    return result


def test_peak_memory_bound(gpu_pool):
    print(gpu_pool.run(_case_peak_memory)[0])
