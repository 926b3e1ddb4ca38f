"""Fp8ParamGroup: a ParamGroup whose model weight is FP8 e4m3 (the weights of the linear layers Fp8Policy chose).

Buffers, beside ParamGroup's main_weight (fp32 shard) and main_grad:
  model_weight     shard        float8_e4m3fn, cast once per optimizer step with per-parameter current scaling:
                                segment_amax over this rank's rows of each parameter, one all-reduce(MAX) of the
                                amax vector (shard group, and replicate group under HSDP; one for all the tree's
                                FP8 groups: sync_scales) so every rank uses the same scale, then fp8_cast;
                                ``scale_inv`` (fp32, one per parameter) kept.
                                keep_fp8_shard=False (cache_model_weight=False, and None until a third gather of
                                the same weights): the amax once per step, the fp8_cast at every all-gather into
                                storage freed right after it
  unsharded_fp8    param-major  float8_e4m3fn: what the all-gather fills (half the bytes of bf16)
  unsharded        param-major  compute dtype. compute=False: fp8_dequantize'd from unsharded_fp8 after every
                                gather (one native pass), then unsharded_fp8 is freed. compute=True: never
                                allocated; the parameters are views of it only so that autograd has a leaf of the
                                right shape and dtype to put the weight gradient on (``info.unsharded.grad``, which
                                the reduce-scatter packs): the layers read the FP8 weight instead (Fp8Tensor views
                                of unsharded_fp8 given to each Fp8Linear in use_unsharded_params). Its storage
                                exists only while fully_shard makes those views (views need it), then never
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _native
from ..comm import dist_ops
from ..core.flat_buffer import FlatBuffer
from ..fp8.tensor import E4M3, Fp8Tensor
from .group import ParamGroup

SCALE_ROW = 64  # floats: each GEMM scale 256-byte aligned


class Fp8ParamGroup(ParamGroup):
    fp8 = True

    def __init__(self, params, *, fp8_compute: bool, keep_fp8_shard: bool | None = None, **kwargs):
        """keep_fp8_shard: keep the FP8 model-weight shard from one optimizer step to the next (True: cast once per
        step), or (False) cast it from the main weight at every all-gather, with the step's scales, and free it after.
        None: False until the same weights are gathered a third time (microbatches), then True (see note_gather)."""
        self.fp8_compute = fp8_compute
        self.keep_fp8_shard = bool(keep_fp8_shard)
        self.keep_when_regathered = keep_fp8_shard is None
        self._scales_pending = False  # new scales computed: gemm_scale_inv follows at this version's first cast
        self.fp8_views: list[Fp8Tensor] | None = None  # compute=True: the gathered weights' FP8 views, made once
        compute = kwargs["dtypes"].compute
        if compute not in (torch.bfloat16, torch.float16):
            raise ValueError(f"FP8 weights need a bfloat16 or float16 compute dtype, got {compute}")
        bad = [f"{fqn} ({p.dtype})" for fqn, p, _ in params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"FP8 weights are cast from float32 main weights; {', '.join(bad)} are not: "
                             "keep the model in float32 and choose the compute dtype with MixedPrecisionPolicy")
        kwargs["cache_model_weight"] = True
        super().__init__(params, **kwargs)

    # ------------------------------------------------------------------ setup (called by ParamGroup)
    def _make_model_weight(self, device: torch.device) -> FlatBuffer:
        n = len(self.layout.slots)
        self.segments = torch.tensor(self.layout.local_segments(self.rank), dtype=torch.int64).reshape(n, 2).to(device)
        self.unsharded_segments = torch.tensor([(s.unsharded_offset, s.unsharded_offset + s.numel)
                                                for s in self.layout.slots], dtype=torch.int64).reshape(n, 2).to(device)
        self.amax = torch.zeros(n, dtype=torch.float32, device=device)
        self.scale_inv = torch.ones(n, dtype=torch.float32, device=device)
        # The FP8 GEMM's scales, one per row of SCALE_ROW floats: cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED) a
        # scale pointer that is only 4-byte aligned, i.e. scale_inv[i] for i > 0 (measured on H200, torch 2.11)
        self.gemm_scale_inv = torch.ones(n, SCALE_ROW, dtype=torch.float32, device=device)
        return FlatBuffer(self.layout, E4M3, device, rank=self.rank)

    def _make_unsharded(self, device: torch.device) -> FlatBuffer:
        self.unsharded_fp8 = FlatBuffer(self.layout, E4M3, device)
        self.fp8_views = None  # views of the previous buffer (materialize makes a new one)
        # compute=True: allocated here only for the parameter views to be made (a view needs the storage), freed
        # at the end of __init__ (free_unsharded) and never allocated again: see the module docstring
        return FlatBuffer(self.layout, self.compute_dtype, device)

    def _bind_plan(self) -> None:
        super()._bind_plan()
        # gloo has no float8 collectives: the bytes travel as uint8 (NCCL does the same with either)
        gathered = self.plan.gathered
        self.fp8_gather_inputs = [self.model_weight.chunk_slot(i).view(torch.uint8) for i in gathered]
        self.fp8_gather_outputs = [self.unsharded_fp8.padded_param(i).view(torch.uint8) for i in gathered]

    # ------------------------------------------------------------------ weights
    def sync_model_weight(self, version: tuple) -> None:
        """Cast main_weight into the FP8 model weight with per-parameter scales every rank agrees on, unless it was
        cast at this weights_version(). Collective over the shard (and replicate) group: every rank decides alike,
        as weights_version() counts the same optimizer steps and writes on every rank. (A unit's gather syncs the
        scales of all its tree's FP8 groups that need them at once first: FsdpUnit._sync_fp8_scales.)"""
        if self.cast.synced_version != version:
            sync_scales([self], [version])

    def _scales_synced(self, version: tuple) -> None:
        """The amax vector holds every rank's maximum for ``version``: the scales follow at the next cast."""
        self.cast.synced_version = version
        self.stats.scale_syncs += 1
        self._scales_pending = True
        if self.keep_fp8_shard:
            self._cast_fp8_shard()

    def note_gather(self, version: tuple) -> None:
        """keep_fp8_shard=None: a run that gathers the same weights only twice per step (forward and backward) casts
        at each gather and holds no FP8 shard between gathers (FSDP2 + float8's memory;
        benchmarks/results/step_fp8_cache_1xh200.md); at a third gather (microbatches) the shard is kept
        from then on, cast once per step. Called before this gather's sync_model_weight and all_gather."""
        if not self.keep_when_regathered or not self.versions.gathered_third_time(version):
            return
        self.keep_fp8_shard, self.keep_when_regathered = True, False
        if self.cast.synced_version == version:  # this version's amax exists: cast the shard kept from now on
            self.model_weight.alloc()
            self._cast_fp8_shard()

    def _cast_fp8_shard(self) -> None:
        """main_weight -> model_weight with the scales of the amax vector (the same bits at every call); the first
        cast of a weights version also gives the GEMMs its scales (the layers' FP8 views read gemm_scale_inv)."""
        _native.fp8_cast(self.main_weight.data, self.segments, self.amax, self.model_weight.data, self.scale_inv)
        self.stats.weight_syncs += 1
        if self._scales_pending:
            self.gemm_scale_inv[:, 0].copy_(self.scale_inv)
            self._scales_pending = False

    def all_gather(self, op=None) -> None:
        """Gather every rank's FP8 shard into unsharded_fp8 (through ``transport``: ``op`` is not used), then
        dequantize it into the compute-dtype buffer (compute=False) or make the layers' FP8 views (compute=True)."""
        with torch.autograd._unsafe_preserve_version_counter(self.gather_targets()):
            outputs, inputs = self.gather_begin()
            if self.world == 1:  # one rank: the shard layout is the unsharded layout
                self.unsharded_fp8.data.copy_(self.model_weight.data)
            else:
                self.collectives.transport.all_gather_into(outputs, inputs, self.shard_group)
            self.gather_end()

    def gather_targets(self) -> tuple[torch.Tensor, ...]:
        return self.unsharded_fp8.data, self.unsharded.data

    def gather_begin(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Up to the collective: the FP8 shard cast for this gather where none is kept; returns the collective's
        (outputs, inputs), uint8 views."""
        self.unsharded_fp8.alloc()
        if not self.keep_fp8_shard:
            self.model_weight.alloc()
            self._cast_fp8_shard()
        return self.fp8_gather_outputs, self.fp8_gather_inputs

    def gather_end(self) -> None:
        """After the collective (issued, on this stream): the per-gather FP8 shard freed, then the compute-dtype
        weights dequantized (compute=False) or the layers' FP8 views made (compute=True)."""
        if not self.keep_fp8_shard:
            # freed in the all-gather stream's order (this runs on it): reused only after the collective
            self.model_weight.free()
        self.stats.all_gathers += 1
        self.stats.all_gather_bytes += self.plan.gathered_bytes(E4M3)
        if self.fp8_compute:
            if self.fp8_views is None:
                # made once (at the first gather: a meta-initialised group has real storage by then) and kept: the
                # views stay valid across free / alloc, and they carry no transpose (Fp8Linear's backward makes
                # its own), so nothing in them belongs to one gather
                self.fp8_views = [Fp8Tensor(self.unsharded_fp8.param_view(i), self.gemm_scale_inv[i, 0])
                                  for i in range(len(self.infos))]
            return
        self.unsharded.alloc()
        _native.fp8_dequantize(self.unsharded_fp8.data, self.unsharded_segments, self.scale_inv, self.unsharded.data)
        self.unsharded_fp8.free()

    def free_unsharded(self) -> None:
        self.unsharded_fp8.free()
        self.unsharded.free()
        if not self.keep_fp8_shard:  # the per-gather FP8 shard (allocated at construction)
            self.model_weight.free()

    def unsharded_nbytes(self) -> int:
        """Bytes of gathered storage held now (the FP8 and the compute-dtype buffer)."""
        return self.unsharded_fp8.nbytes() + self.unsharded.nbytes()

    # ------------------------------------------------------------------ parameter swapping
    def use_unsharded_params(self) -> None:
        super().use_unsharded_params()
        if self.fp8_compute and self.fp8_views is not None:
            # views of the parameters' own slots (their shape, e4m3, contiguous): no check needed
            for info, fp8 in zip(self.infos, self.fp8_views):
                _fp8_layer(info)._use_fp8_weight(fp8)

    def use_sharded_params(self) -> None:
        super().use_sharded_params()
        if self.fp8_compute:
            for info in self.infos:
                _fp8_layer(info)._use_fp8_weight(None)

    def write_shard(self, out: torch.Tensor, start: int = 0) -> None:
        raise RuntimeError("mfsdp_ext: FP8 groups gather with their own plain all-gather (no symmetric staging)")

    def cast_into_own_slots(self) -> None:
        raise RuntimeError("mfsdp_ext: FP8 groups keep their FP8 shard; nothing is cast into the gathered slots")


def _fp8_layer(info) -> Any:
    """The Fp8Linear whose weight parameter ``info`` is (FP8 weights are never tied: one place)."""
    return info.places[0].module


def sync_scales(groups: list[Fp8ParamGroup], versions: list[tuple]) -> None:
    """The amax vectors of ``groups`` (which share their shard group, replicate group and transport) at
    ``versions``: each group's amax over this rank's rows, then one all-reduce(MAX) of them all, back to back
    (and one over the replicate group under HSDP): one collective per optimizer step rather than one per group,
    each ~120 us of host time through ProcessGroupNCCL. MAX is exact: the same bits as a reduction per group."""
    first = groups[0]
    if len(groups) == 1:
        amax, parts = first.amax, [first.amax]
    else:  # each group's amax straight into its place in one vector; copied back after the all-reduce
        amax = torch.empty(sum(g.amax.numel() for g in groups), dtype=torch.float32, device=first.device)
        parts = list(amax.split([g.amax.numel() for g in groups]))
    for g, part in zip(groups, parts):
        _native.segment_amax(g.main_weight.data, g.segments, part)
    if first.world > 1:
        first.collectives.transport.all_reduce_max(amax, first.shard_group)
    if first.replicate_group is not None and dist.get_world_size(first.replicate_group) > 1:
        dist_ops.all_reduce(amax, first.replicate_group, op=dist.ReduceOp.MAX)
    if len(groups) > 1:
        torch._foreach_copy_([g.amax for g in groups], parts)
    for g, version in zip(groups, versions):
        g._scales_synced(version)
