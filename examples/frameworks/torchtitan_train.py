"""torchtitan's own Trainer (its model, FSDP wrapping, chunked loss, clipping, LR schedule, DCP checkpoints) on
PyTorch FSDP2 or on mfsdp_ext: the same command, ``--impl fsdp2`` or ``--impl ours``.

    torchrun --nproc-per-node 2 examples/frameworks/torchtitan_train.py --impl ours \\
        --module titan_configs --config llama3_debug_cpu [any torchtitan option, e.g. --checkpoint.enable]
    torchrun --nproc-per-node 2 examples/frameworks/torchtitan_train.py --impl ours \\
        --module titan_configs --config qwen3_moe_debug_cpu

The switch is one line before torchtitan is imported: ``mfsdp_ext.use_as_fsdp2()``. Without this script's extras
(a machine with GPUs, torchtitan's own configs), the runner does the same:
``torchrun --nproc-per-node 8 -m mfsdp_ext.as_fsdp2 torchtitan.train --module llama3 --config llama3_8b``.

Options of this script (everything else goes to torchtitan):
  --impl fsdp2|ours|ours_fp8   ours_fp8: ours, with the FP8 weights of mfsdp_ext.Fp8Policy(compute=True) added to the
                               MixedPrecisionPolicy torchtitan passes (torchtitan has no option for it: the policy is
                               re-mapped where torchtitan calls fully_shard; GPU, bf16)
  --metrics PATH               each rank appends one JSON line per step to PATH.rankR: step, loss, grad_norm (as
                               torchtitan logs them), tokens/s of this rank and the peak memory allocated in the step
The configs (titan_configs.py) are torchtitan's debug models with local assets (titan_assets.py, made on first use).

Only on a CPU-only machine (2 gloo ranks; FSDP2 needs them as much as ours), marked CPU ONLY below:
  1. torchtitan picks device "cuda" when torch reports no accelerator: it is pointed at the CPU while
     torchtitan.tools.utils is imported (with the memory queries its DeviceMemoryMonitor makes).
  2. gloo has no PREMUL_SUM, which FSDP2 uses after torchtitan's set_gradient_divide_factor(1.0): FSDP2's units also
     get set_force_sum_reduction_for_comms(True) (SUM without scaling, exactly what factor 1.0 means). Ours always
     reduces with SUM.
  3. --training.enable_cpu_offload asks init_process_group for torchtitan's device backend plus "cpu:gloo", which on a
     CPU device is "cpu:gloo,cpu:gloo": torch refuses it ("Duplicate device type cpu"), FSDP2 as ours. The CPU
     backend is gloo already: torchtitan's init_distributed is called without enable_cpu_backend.
  4. --training.enable_cpu_offload gives every fully_shard call CPUOffloadPolicy() (pin_memory=True); FSDP2 pins the
     offloaded shards, and pinning needs an accelerator ("Cannot access accelerator device when none is available"
     at fully_shard). FSDP2's units get CPUOffloadPolicy(pin_memory=False) (torchtitan has no option for it); ours
     take torchtitan's policy as it is (on a CPU mesh the parameters are in host memory already: pin_memory is not
     used). Rank 0 prints the policy each implementation was given ("offload_policy: ...").
And for a torch older than torchtitan 0.3.0 expects (any device): torch.distributed.set_timeout is skipped when this
torch lacks it (2.13 does), and torch < 2.12 gets a placeholder for torch.distributed.fsdp.DataParallelMeshDims, a
name torchtitan imports but uses only with its spmd_types / full_dtensor backends (full_dtensor needs torch >= 2.12),
and its pipeline stages are built without the mesh callback that torch's stages take from 2.12 on (used only for
DTensor activations between stages: tensor parallel with pipeline parallel needs torch >= 2.12).
Expert parallel > 1 where torch lacks FSDP2's per-parameter meshes (ShardPlacementResult, torch >= 2.12), or with
TITAN_EXPERTS_UNIT=1: "experts as their own unit" below shards each block's experts as a fully_shard unit of its own
on the expert-data-parallel mesh and the block on the dp mesh (FSDP2 and ours alike; rank 0 prints how many).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

ap = argparse.ArgumentParser(add_help=False)
ap.add_argument("--impl", choices=["fsdp2", "ours", "ours_fp8"], default="ours")
ap.add_argument("--metrics", default="")
args, titan_argv = ap.parse_known_args()
sys.argv = [sys.argv[0], *titan_argv]
RANK = int(os.environ.get("RANK", "0"))

if args.impl != "fsdp2":
    import mfsdp_ext

    mfsdp_ext.use_as_fsdp2()  # THE SWITCH: torch.distributed.fsdp.fully_shard is mfsdp_ext's from here on

import torch.distributed.fsdp as _torch_fsdp  # noqa: E402

if not hasattr(_torch_fsdp, "DataParallelMeshDims"):
    # torch < 2.12 (the GPU machines' 2.11): torchtitan 0.3.0 imports this name at module level but uses it only
    # with its spmd_types / full_dtensor backends (--parallelism.spmd_backend; titan_configs.py selects partial_dtensor)
    class DataParallelMeshDims:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"DataParallelMeshDims needs torch >= 2.12 (this is {torch.__version__})")

    _torch_fsdp.DataParallelMeshDims = DataParallelMeshDims

CPU_ONLY = not torch.cuda.is_available()
if CPU_ONLY:  # CPU ONLY 1: torchtitan's device is "cpu", and its memory monitor gets answers
    import types

    import torch._utils as _tu

    class _CpuDeviceModule:
        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        def get_device_name(self, device=None):
            return "cpu"

        def get_device_properties(self, device=None):
            return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                                         name="cpu")

        def memory_stats(self, device=None):
            return {}

        def reset_peak_memory_stats(self, device=None):
            pass

        def empty_cache(self):
            pass

    _saved = _tu._get_available_device_type, _tu._get_device_module
    _tu._get_available_device_type = lambda: "cpu"
    _tu._get_device_module = lambda device_type=None: _CpuDeviceModule()
    import torchtitan.tools.utils as _tt_utils

    _tu._get_available_device_type, _tu._get_device_module = _saved
    assert _tt_utils.device_type == "cpu", _tt_utils.device_type

import torchtitan.distributed.fsdp as tt_fsdp  # noqa: E402
import torchtitan.distributed.utils as tt_dist_utils  # noqa: E402

if not hasattr(torch.distributed, "set_timeout"):  # torch.distributed.set_timeout is newer than this torch
    tt_dist_utils.set_pg_timeouts = lambda *a, **k: None

if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch < 2.12: asked by the MoE token dispatcher (EP > 1);
    torch.compiler._is_non_strict_tracing = lambda: False   # there is no non-strict tracing in this torch to detect

import inspect  # noqa: E402

from torch.distributed.pipelining import PipelineStage as _PipelineStage  # noqa: E402

if "get_mesh" not in inspect.signature(_PipelineStage.__init__).parameters:
    # torch < 2.12: torchtitan 0.3.0 hands each pipeline stage a mesh callback, which only DTensor activations
    # between stages use (tensor parallel with pipeline parallel); this torch's stages pass plain tensors only
    import torchtitan.distributed.pipeline_parallel as _tt_pp

    class _StageWithoutMeshCallback(_PipelineStage):
        def __init__(self, *args, get_mesh=None, **kwargs):
            super().__init__(*args, **kwargs)

    _tt_pp.PipelineStage = _StageWithoutMeshCallback

import torch.distributed.pipelining.schedules as _pp_schedules  # noqa: E402


def _takes_microbatch_lists(step) -> bool:
    return "arg_mbs" in inspect.signature(step).parameters


if not _takes_microbatch_lists(_pp_schedules.PipelineScheduleSingle.step):
    # torchtitan 0.3.0 hands a pipeline schedule its microbatches as lists (step(arg_mbs=..., kwarg_mbs=...,
    # target_mbs=...)), a step() newer than this torch, whose step() takes the whole batch and splits it into
    # n_microbatches equal chunks along dim 0. The microbatches are concatenated back into that batch: the schedule
    # splits it into the same microbatches (FSDP2 and ours alike). Its loss_kwargs (the global count of valid tokens
    # the loss is divided by), which this torch's step() does not take, are bound into the loss function for the step.
    def _whole_batch(step):
        def step_with_lists(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, loss_kwargs=None, **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None and loss_kwargs is None:
                return step(self, *args, **kwargs)
            if arg_mbs:
                args = tuple(torch.cat(parts) for parts in zip(*arg_mbs, strict=True))
            for key in (kwarg_mbs or [{}])[0]:
                values = [mb[key] for mb in kwarg_mbs]
                kwargs[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else values[0]
            target = torch.cat(target_mbs) if target_mbs is not None else None
            if "return_outputs" not in inspect.signature(step).parameters:
                kwargs.pop("return_outputs", None)  # an older step() returns the outputs anyway
            loss_fn = self._loss_fn
            if loss_kwargs and loss_fn is not None:
                self._loss_fn = functools.partial(loss_fn, **loss_kwargs)
            try:
                return step(self, *args, target=target, **kwargs)
            finally:
                self._loss_fn = loss_fn

        return step_with_lists

    for _schedule in (_pp_schedules.PipelineScheduleSingle, _pp_schedules.PipelineScheduleMulti):
        _schedule.step = _whole_batch(_schedule.step)

if CPU_ONLY and args.impl == "fsdp2":  # CPU ONLY 2: FSDP2 on gloo, SUM reductions after divide factor 1.0
    _disable_division = tt_fsdp.disable_fsdp_gradient_division

    def _disable_division_sum_only(model):
        _disable_division(model)
        for m in model.modules():
            if isinstance(m, torch.distributed.fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = _disable_division_sum_only

if CPU_ONLY:  # CPU ONLY 3: the CPU backend of enable_cpu_offload is the one backend already
    _init_distributed = tt_dist_utils.init_distributed

    def _init_distributed_cpu(*a, enable_cpu_backend=False, **k):
        return _init_distributed(*a, **k)

    tt_dist_utils.init_distributed = _init_distributed_cpu

if CPU_ONLY and args.impl == "fsdp2":  # CPU ONLY 4: FSDP2 pins offloaded shards only with an accelerator
    tt_fsdp.CPUOffloadPolicy = functools.partial(tt_fsdp.CPUOffloadPolicy, pin_memory=False)

if args.impl == "ours_fp8":  # torchtitan's MixedPrecisionPolicy plus mfsdp_ext's FP8 weights
    import mfsdp_ext

    _fully_shard = tt_fsdp.fully_shard  # mfsdp_ext's, after the switch
    assert _fully_shard is mfsdp_ext.fully_shard

    def _fully_shard_fp8(module, *, mp_policy=None, **kwargs):
        # Fp8Policy's default choice: the units' nn.Linear layers, not the output head (lm_head, in the
        # [norm, lm_head] unit), as torchtitan's own float8 converter leaves "output" alone
        if mp_policy is not None and mp_policy.param_dtype in (torch.bfloat16, torch.float16):
            mp_policy = mfsdp_ext.MixedPrecisionPolicy(
                param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
                output_dtype=mp_policy.output_dtype, cast_forward_inputs=mp_policy.cast_forward_inputs,
                fp8=mfsdp_ext.Fp8Policy(compute=True))
        return _fully_shard(module, mp_policy=mp_policy, **kwargs)

    tt_fsdp.fully_shard = _fully_shard_fp8

# ---- experts as their own unit ------------------------------------------------------------------------------------
# torchtitan's expert parallel (EP > 1) gives the experts the expert-data-parallel mesh through FSDP2's per-parameter
# meshes (shard_placement_fn -> ShardPlacementResult, torch >= 2.12). Where torch lacks them (the GPU image's 2.11),
# or with TITAN_EXPERTS_UNIT=1 (to test it where both forms work), the layout FSDP2 users had before them, for FSDP2
# and ours alike: the experts module is a fully_shard unit of its own on that mesh, the block one on the dp mesh.
import torch.distributed.fsdp._fully_shard._fsdp_common as _fsdp_common  # noqa: E402
import torch.distributed.fsdp._fully_shard._fsdp_init as _fsdp_init  # noqa: E402

EXPERTS_UNIT = os.environ.get("TITAN_EXPERTS_UNIT") == "1" or not hasattr(_fsdp_common, "ShardPlacementResult")
if EXPERTS_UNIT:
    import dataclasses

    from torch.distributed.tensor import Shard

    if not hasattr(_fsdp_common, "ShardPlacementResult"):  # only what torchtitan builds: read back by the wrapper
        @dataclasses.dataclass
        class ShardPlacementResult:
            placement: object
            mesh_info: object

        _fsdp_common.ShardPlacementResult = ShardPlacementResult

    def _takes_mesh_dims(fn) -> bool:
        try:
            return "dp_mesh_dims" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return False

    _torch_mesh_info = getattr(_fsdp_init, "_get_mesh_info", None)
    if not _takes_mesh_dims(_torch_mesh_info):  # absent, or an older signature: torchtitan calls (mesh, dp_mesh_dims)
        def _get_mesh_info(mesh, *rest, **kwargs):
            if _torch_mesh_info is not None and not rest and not kwargs:
                return _torch_mesh_info(mesh)  # torch's own one-argument calls stay torch's
            dims = rest[0] if rest else kwargs.get("dp_mesh_dims")
            if dims is not None or mesh.ndim != 1:
                raise NotImplementedError(
                    f"experts as their own unit (torch {torch.__version__}) takes a 1-D expert-data-parallel mesh "
                    f"without dp_mesh_dims (spmd_backend partial_dtensor, no dp_replicate); got a {mesh.ndim}-D mesh"
                    f", dp_mesh_dims {dims!r}")
            return _fsdp_common.FSDPMeshInfo(mesh, shard_mesh_dim=0)

        _fsdp_init._get_mesh_info = _get_mesh_info

    _fully_shard_inner = tt_fsdp.fully_shard  # FSDP2's, ours or ours_fp8's wrapper: the nested calls go through it
    _expert_units: list = []

    def _fully_shard_experts_unit(module, *, shard_placement_fn=None, **kwargs):
        if shard_placement_fn is None or not isinstance(module, torch.nn.Module):
            return _fully_shard_inner(module, shard_placement_fn=shard_placement_fn, **kwargs)
        answers = {p: shard_placement_fn(p) for p in module.parameters()}
        if not any(isinstance(a, _fsdp_common.ShardPlacementResult) for a in answers.values()):
            return _fully_shard_inner(module, shard_placement_fn=shard_placement_fn, **kwargs)
        dp_mesh = kwargs.get("mesh")
        if dp_mesh is None or kwargs.get("dp_mesh_dims") is not None:
            raise NotImplementedError("experts as their own unit: needs fully_shard(mesh=dp_mesh) without "
                                      "dp_mesh_dims (torchtitan's spmd_backend partial_dtensor)")

        def placement(a):
            return a.placement if isinstance(a, _fsdp_common.ShardPlacementResult) else a

        def on_dp_mesh(a):
            return not isinstance(a, _fsdp_common.ShardPlacementResult) or a.mesh_info.mesh is dp_mesh or \
                a.mesh_info.mesh == dp_mesh

        experts = {p: a for p, a in answers.items() if not on_dp_mesh(a)}
        rest = {p: placement(a) for p, a in answers.items() if on_dp_mesh(a)}

        def plain_fn(placements):  # None where every placement is FSDP2's default Shard(0)
            if all(s is None or s == Shard(0) for s in placements.values()):
                return None
            return lambda p: placements.get(p)

        if experts:
            meshes = {id(a.mesh_info.mesh): a.mesh_info.mesh for a in experts.values()}
            if len(meshes) != 1:
                raise NotImplementedError(f"experts as their own unit: {len(meshes)} meshes besides the dp mesh in "
                                          f"{type(module).__name__}; one is supported")
            # the smallest submodule holding exactly these parameters (torchtitan's moe.routed_experts.inner_experts)
            owners = [m for m in module.modules() if set(m.parameters()) == set(experts)]
            if not owners:
                raise NotImplementedError(
                    f"experts as their own unit: no submodule of {type(module).__name__} holds exactly the "
                    f"{len(experts)} parameters that shard_placement_fn puts on the expert mesh")
            owner = min(owners, key=lambda m: sum(1 for _ in m.modules()))
            _fully_shard_inner(owner, **{**kwargs, "mesh": next(iter(meshes.values()))},
                               shard_placement_fn=plain_fn({p: placement(a) for p, a in experts.items()}))
            _expert_units.append(owner)
        return _fully_shard_inner(module, shard_placement_fn=plain_fn(rest), **kwargs)

    tt_fsdp.fully_shard = _fully_shard_experts_unit

    _disable_division_before_experts = tt_fsdp.disable_fsdp_gradient_division

    def _disable_division_and_report(model):
        _disable_division_before_experts(model)
        # torchtitan turns the division off on every FSDPModule of the model: the expert units are among them
        ours = [m for m in _expert_units if any(m is x for x in model.modules())]
        assert all(isinstance(m, tt_fsdp.FSDPModule) for m in ours), "an expert unit is not an FSDPModule"
        if ours and RANK == 0:
            print(f"[torchtitan_train] experts as their own unit: {len(ours)} blocks", flush=True)

    tt_fsdp.disable_fsdp_gradient_division = _disable_division_and_report

# ---- the offload policy torchtitan gives (--training.enable_cpu_offload): rank 0 prints the first one ----------------
_fully_shard_logged = tt_fsdp.fully_shard  # FSDP2's, ours, or one of the wrappers above: the outermost one


def _fully_shard_log_offload(module, *a, **k):
    if "offload_policy" in k and RANK == 0 and not getattr(_fully_shard_log_offload, "said", False):
        _fully_shard_log_offload.said = True
        print(f"[torchtitan_train] offload_policy: {k['offload_policy']!r}", flush=True)
    return _fully_shard_logged(module, *a, **k)


tt_fsdp.fully_shard = _fully_shard_log_offload

if args.metrics:  # one JSON line per step and rank, from torchtitan's own metrics
    from torchtitan.components.metrics import MetricsProcessor

    _log = MetricsProcessor.log

    def _log_json(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **k):
        row = {"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm), "impl": args.impl,
               "tokens_per_s": self.ntokens_since_last_log / (time.perf_counter() - self.time_last_log)}
        if torch.cuda.is_available():
            row["max_memory_allocated"] = torch.cuda.max_memory_allocated()  # before torchtitan resets the peak
            row["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        with open(f"{args.metrics}.rank{RANK}", "a") as f:
            f.write(json.dumps(row) + "\n")
        return _log(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **k)

    MetricsProcessor.log = _log_json


def main() -> None:
    import titan_assets

    titan_assets.make_assets(os.environ.get("TITAN_ASSETS", titan_assets.DEFAULT_DIR),
                             writer=os.environ.get("LOCAL_RANK", "0") == "0")
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
    # gloo on torch 2.13 sometimes aborts in a destructor at exit ("terminate called without an active
    # exception"), with FSDP2 as with ours: leave without running them once training is over
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
