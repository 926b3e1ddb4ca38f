"""MixedPrecisionPolicy(reduce_comm_dtype=bf16): gradients sent in bf16 (one all-to-all), summed in fp32 on arrival;
the default (None) does so on NCCL shard groups of one host and reduce-scatters in fp32 elsewhere (gloo here).

Against the same model with the plain fp32 reduce-scatter: on 2 ranks the losses and weights are the same bits (one
rounding of s*a + s*b either way); on 4 ranks (a fixed rank-order fp32 sum against gloo's) within fp32 rounding.
The collectives are logged by wrapping mfsdp_ext.comm.dist_ops (models.intercept_collectives). The GPU tests at the
end compare the two on NCCL (2 GPUs, native collectives, HSDP on 4).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_ext import MixedPrecisionPolicy, fully_shard, microbatch
from mfsdp_ext.interop.checkpoint import full_state_dict
from mfsdp_ext.runtime.summary import unit_lines
from mfsdp_ext.testing.models import TinyLM, intercept_collectives, rank_device, rel_err, shard_tiny_lm, train
from tests.conftest import get_pool
from tests.test_fully_shard import GLOBAL_BATCH, STEPS

FP32_SUM = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                reduce_comm_dtype=torch.float32)
DEFAULT = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16_WIRE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                 reduce_comm_dtype=torch.bfloat16)


@contextlib.contextmanager
def wire_log():
    """(collective name, dtype of what it sends) for every all-to-all and reduce-scatter issued."""
    log = []
    with intercept_collectives(("all_to_all_into", "reduce_scatter_into"),
                               lambda name, args: log.append((name, args[1].dtype))):  # args: (output, input, group)
        yield log


def _case_matches_fp32_reduce_scatter(strategy: str, microbatches: int, hsdp: bool, native: bool = False):
    """native: both models on fully_shard(native_collectives=True) (NCCL), whose collectives do not pass through
    dist_ops: the collectives are not logged then."""
    torch.manual_seed(41)
    base = TinyLM()
    kwargs = dict(sharding_strategy=strategy, native_collectives=native)
    world = dist.get_world_size()
    if hsdp:
        kwargs["mesh"] = init_device_mesh(rank_device().type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    plain = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=FP32_SUM, **kwargs)
    wire = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=BF16_WIRE, **kwargs)
    default = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=DEFAULT, **kwargs)
    with wire_log() as default_log:  # one step: which collectives the default chose
        train(default, 1, GLOBAL_BATCH, sharded=True, microbatches=microbatches, microbatch_ctx=microbatch)
    with wire_log() as plain_log:
        plain_losses = train(plain, STEPS, GLOBAL_BATCH, sharded=True, microbatches=microbatches,
                             microbatch_ctx=microbatch)
    with wire_log() as wire_log_:
        wire_losses = train(wire, STEPS, GLOBAL_BATCH, sharded=True, microbatches=microbatches,
                            microbatch_ctx=microbatch)
    shard_world = world // 2 if hsdp else world
    # the plain run reduce-scatters fp32; the other sends bf16 by all-to-all and reduce-scatters nothing
    if not native:
        assert plain_log and all(entry == ("reduce_scatter_into", torch.float32) for entry in plain_log), plain_log
        assert len(wire_log_) == len(plain_log), (wire_log_, plain_log)
        assert all(entry == ("all_to_all_into", torch.bfloat16) for entry in wire_log_), wire_log_
        # the default: the bf16 all-to-all on NCCL (every test machine's GPUs share one host), fp32 on gloo
        sent = torch.bfloat16 if dist.get_backend() == "nccl" else torch.float32
        assert default_log and {dtype for _, dtype in default_log} == {sent}, default_log
    lines = unit_lines(wire, [m._mfsdp_unit for m in wire.modules() if hasattr(m, "_mfsdp_unit")])
    assert all("(sent in bf16)" in line and "all-to-all + sum" in line for line in lines), lines
    got, want = full_state_dict(wire), full_state_dict(plain)
    if shard_world == 2 and rank_device().type == "cpu":  # one rounding of s*a + s*b on both paths: the same bits
        assert wire_losses == plain_losses, (wire_losses, plain_losses)
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
        return {"losses": wire_losses}
    # more ranks: a rank-order fp32 sum against gloo's own order, both fp32; on GPUs the two models' own kernels
    # (e.g. atomics in an embedding's backward) need not repeat bit for bit either
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(wire_losses, plain_losses))
    param_err = max(rel_err(got[k], want[k]) for k in want)
    assert loss_err <= 1e-5 and param_err <= 1e-5, (loss_err, param_err)
    return {"loss_err": loss_err, "param_err": param_err}


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim"])
def test_bf16_wire_matches_fp32_reduce_scatter(cpu_pool, strategy):
    print(cpu_pool.run(_case_matches_fp32_reduce_scatter, strategy, 2, False)[0])


def test_bf16_wire_hsdp():
    print(get_pool(4, "gloo").run(_case_matches_fp32_reduce_scatter, "optim_grads_params", 2, True)[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(reduce_dtype=torch.float32, reduce_comm_dtype=torch.bfloat16), "param_dtype of that dtype"),
    (dict(param_dtype=torch.bfloat16, reduce_comm_dtype=torch.bfloat16), "reduce_dtype=torch.float32"),
    (dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, reduce_comm_dtype=torch.float16), "float16"),
    (dict(param_dtype=torch.float32, reduce_dtype=torch.float32, reduce_comm_dtype=torch.bfloat16), "bfloat16 or"),
    (dict(param_dtype=torch.bfloat16, reduce_comm_dtype=torch.float32), "reduce_dtype=torch.float32"),
])
def test_reduce_comm_dtype_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MixedPrecisionPolicy(**kwargs)


@pytest.mark.parametrize("policy, narrow_wins, sent", [
    (DEFAULT, True, torch.bfloat16),     # bf16 grads summed in fp32 on a group where the all-to-all wins
    (DEFAULT, False, torch.float32),     # elsewhere (gloo, several hosts): the fp32 reduce-scatter
    (FP32_SUM, True, torch.float32),     # the opt-out holds everywhere
    (BF16_WIRE, False, torch.bfloat16),  # the opt-in too
    (MixedPrecisionPolicy(param_dtype=torch.bfloat16), True, torch.bfloat16),  # reduced in bf16: nothing to choose
    (MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32), True, torch.float16),
    (MixedPrecisionPolicy(reduce_dtype=torch.float32), True, torch.float32),  # fp32 compute: fp32 grads
])
def test_default_comm_dtype(policy, narrow_wins, sent):
    assert policy.reduction_comm_dtype(torch.float32, narrow_wins) == sent


def _case_one_host():
    from mfsdp_ext.comm import dist_ops
    group = dist.new_group(list(range(dist.get_world_size())))
    return dist_ops.on_one_host(group), dist_ops.on_one_host(group)  # the second from the cache, no collective


def test_on_one_host(cpu_pool):
    """Ranks of one machine are found on one host, by their host names (no LOCAL_WORLD_SIZE in the pool)."""
    results = cpu_pool.run(_case_one_host)
    assert len(results) >= 2 and all(r == (True, True) for r in results), results


@pytest.mark.parametrize("value,expected", [("4", 4), ("", None), ("four", None)])
def test_torchrun_local_world_size(monkeypatch, value, expected):
    """torchrun's LOCAL_WORLD_SIZE, read for both single-node checks (the bf16 wire's and the symmetric path's)."""
    from mfsdp_ext.comm.hosts import torchrun_local_world_size
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert torchrun_local_world_size() == expected
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert torchrun_local_world_size() is None


# ----------------------------------------------------------------------------------------------- GPU: bf16 wire
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_gpu_bf16_wire_matches_fp32_reduce_scatter(strategy):
    print(get_pool(2, "nccl").run(_case_matches_fp32_reduce_scatter, strategy, 2, False)[0])


@pytest.mark.gpu
def test_bf16_wire_native_collectives():
    print(get_pool(2, "nccl").run(_case_matches_fp32_reduce_scatter, "optim_grads_params", 2, False, True)[0])


@pytest.mark.gpu
def test_gpu_bf16_wire_hsdp():
    print(get_pool(4, "nccl").run(_case_matches_fp32_reduce_scatter, "optim_grads_params", 2, True)[0])
