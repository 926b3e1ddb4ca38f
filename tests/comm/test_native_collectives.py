"""fully_shard(native_collectives=True) and the communicator behind it (mfsdp_ext.comm.native.NcclTransport),
on 1, 2 and 4 GPUs: parity with the torch.distributed path, no ProcessGroupNCCL collective in a step, the
all-to-all and the grouped collectives against torch.distributed's, the communicator's own memory.

Run on a GPU machine: ``pytest -m gpu tests/comm/test_native_collectives.py``.
"""

from __future__ import annotations

import pytest
import torch

from mfsdp_ext import MixedPrecisionPolicy
from mfsdp_ext.testing.models import batch, lm_loss, rank_device
from tests.comm.test_symm_mem import BF16, _train_side_by_side
from tests.conftest import get_pool

pytestmark = pytest.mark.gpu


def _pg_collectives_in_backward(model) -> list[str]:
    """The ProcessGroupNCCL collectives (c10d:: ops) one forward + backward of ``model`` calls."""
    from torch.profiler import ProfilerActivity, profile

    tokens, targets = batch(0, 48, device=rank_device())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lm_loss(model, tokens, targets).backward()
        torch.cuda.synchronize()
    model.zero_grad()
    return [e.name for e in prof.events() if e.name.startswith("c10d::")]


def _case_native_collectives(mode: str, k: int):
    """native_collectives=True trains as the torch.distributed path does (fp32: to 1e-6), every sharded group
    uses the native transport, and a forward + backward calls no ProcessGroupNCCL collective."""
    from mfsdp_ext import Fp8Policy

    mp = {"fp32": MixedPrecisionPolicy(), "bf16": BF16,
          "fp8": MixedPrecisionPolicy(param_dtype=torch.bfloat16, fp8=Fp8Policy(compute=True))}[mode]
    # 48 sequences of 6 tokens: every microbatch's GEMMs have M a multiple of 16 (FP8)
    plain, native, loss_err, param_err, a, b = _train_side_by_side(22, mp, k, 48, native_collectives=True)
    groups = [g for u in native._mfsdp_unit.context.units for g in u.groups if g.world > 1]
    names = [(g.collectives.all_gather.name, g.collectives.reduce_scatter.name) for g in groups]
    assert names and all(ag == rs == "native" for ag, rs in names), names
    assert mode != "fp8" or any(g.fp8 for g in groups)
    pg_plain, pg_native = _pg_collectives_in_backward(plain), _pg_collectives_in_backward(native)
    assert pg_plain and not pg_native, (pg_plain, pg_native)
    if mode == "fp32":
        assert loss_err <= 1e-6 and param_err <= 1e-5, (loss_err, param_err, a, b)
    else:  # bf16 / FP8 rounding: losses agree to their precision (params drift under AdamW)
        assert loss_err <= 2e-2, (loss_err, a, b)
    return {"loss_err": loss_err, "param_err": param_err, "torch collectives per fwd+bwd (plain)": len(pg_plain)}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp8"])
def test_native_collectives_parity(gpu_pool, mode, k):
    print(gpu_pool.run(_case_native_collectives, mode, k)[0])


def _case_native_all_to_all():
    """Our communicator's all-to-all (reduce_comm_dtype's exchange) equals torch.distributed's, bf16 and FP8 bytes,
    and refuses two dtypes, or a numel the world size does not divide."""
    import torch.distributed as dist

    from mfsdp_ext.comm.native import NcclTransport

    world, rank = dist.get_world_size(), dist.get_rank()
    transport = NcclTransport(dist.group.WORLD, rank_device())
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        src = (torch.arange(world * 1000, device=rank_device(), dtype=torch.float32) + 10_000 * rank).to(dtype)
        got, want = torch.empty_like(src), torch.empty_like(src)
        transport.all_to_all_into(got, src, dist.group.WORLD)
        dist.all_to_all_single(want.view(torch.uint8), src.view(torch.uint8))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype
    x = torch.empty(world * 10, device=rank_device())
    with pytest.raises(RuntimeError, match="must have one dtype"):
        transport.all_to_all_into(torch.empty_like(x, dtype=torch.bfloat16), x, dist.group.WORLD)
    if world > 1:
        odd = torch.empty(world * 10 + 1, device=rank_device())
        with pytest.raises(RuntimeError, match="divisible by the world size"):
            transport.all_to_all_into(torch.empty_like(odd), odd, dist.group.WORLD)
    return {"world": world}


@pytest.mark.parametrize("world", [1, 2])
def test_native_all_to_all(world):
    print(get_pool(world, "nccl").run(_case_native_all_to_all)[0])


def _case_grouped_collectives():
    """A unit's groups share one call (collectives.all_gather_together / reduce_scatter_together): an all-gather of
    bf16 and uint8 (FP8 bytes) pairs and a grouped reduce-scatter of two float32 pairs, through torch.distributed
    (ProcessGroupNCCL's coalesced calls) and through our communicator, equal to one collective per pair."""
    import torch.distributed as dist

    from mfsdp_ext.comm.collectives import TORCH_TRANSPORT
    from mfsdp_ext.comm.native import NcclTransport

    world, rank, dev = dist.get_world_size(), dist.get_rank(), rank_device()
    group = dist.group.WORLD
    for transport in (TORCH_TRANSPORT, NcclTransport(group, dev)):
        inputs = [(torch.arange(1000, device=dev) + 1000 * rank).to(torch.bfloat16),
                  (torch.arange(777, device=dev) % 251 + rank).to(torch.uint8)]
        outputs = [torch.empty(world * x.numel(), dtype=x.dtype, device=dev) for x in inputs]
        transport.all_gather_into(outputs, inputs, group)
        for out, x in zip(outputs, inputs):
            want = torch.empty_like(out)
            dist.all_gather_into_tensor(want, x)
            assert torch.equal(out, want), (transport.name, x.dtype)
        packed = [torch.randn(world * n, device=dev, generator=torch.Generator(dev).manual_seed(rank * 10 + n))
                  for n in (4096, 333)]
        reduced = [torch.empty(x.numel() // world, device=dev) for x in packed]
        transport.grouped_reduce_scatter_into(reduced, packed, group)
        for out, x in zip(reduced, packed):
            want = torch.empty_like(out)
            dist.reduce_scatter_tensor(want, x.clone())
            assert torch.equal(out, want), transport.name
    return {"world": world}


@pytest.mark.parametrize("world", [1, 2])
def test_grouped_collectives(world):
    print(get_pool(world, "nccl").run(_case_grouped_collectives)[0])


def _case_native_comm_memory():
    """Our own communicator's device memory (NCCL's, outside PyTorch's allocator, so no peak in step.py shows it):
    the free memory lost by creating it and running a first all-gather, reduce-scatter and all-reduce, minus what
    PyTorch's allocator reserved meanwhile. Also checks the three collectives' results."""
    import torch.distributed as dist

    from mfsdp_ext.comm.native import NcclTransport

    dev, world, n = rank_device(), dist.get_world_size(), 1 << 20
    torch.cuda.synchronize()
    free0, reserved0 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
    transport = NcclTransport(dist.group.WORLD, dev)
    full = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
    transport.all_gather_into([full], [torch.full((n,), dist.get_rank() + 1.0, dtype=torch.bfloat16, device=dev)], None)
    reduced = torch.empty(n, device=dev)
    transport.reduce_scatter_into(reduced, torch.ones(world * n, device=dev), None)
    amax = torch.tensor([float(dist.get_rank()), 1.0], device=dev)
    transport.all_reduce_max(amax, None)
    torch.cuda.synchronize()
    free1, reserved1 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
    assert torch.equal(full.view(world, n)[:, 0].float().cpu(), torch.arange(1.0, world + 1))
    assert reduced.eq(world).all() and amax.tolist() == [world - 1.0, 1.0]
    nccl_mib = ((free0 - free1) - (reserved1 - reserved0)) / 2**20
    assert nccl_mib < 2048, nccl_mib
    return {"native communicator MiB": round(nccl_mib, 1)}


def test_native_comm_memory(gpu_pool):
    print(gpu_pool.run(_case_native_comm_memory))
