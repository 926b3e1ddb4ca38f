"""Which groups take NCCL symmetric memory (use_symm_mem=True / "auto"), decided at lazy init (comm/policy.py).

NCCL never checks that its symmetric kernel is faster: on H200 we saw the symmetric all-gather win at every
size and the symmetric reduce-scatter lose from about 8 MiB up. "auto" therefore times both paths once, at
lazy init, for each distinct (collective, size) of the units, takes the slowest rank's time so that every
rank decides the same, and keeps the symmetric path only where it beats the plain one by a margin.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ...core.device import cuda_median_ms
from .collectives import SymmetricAllGather, SymmetricReduceScatter, SymmetricStages

AUTO_MARGIN = 0.95  # the symmetric path must be at least 5% faster to be chosen (never slower beyond noise)


def choose_symmetric(wanted: list, transports: dict) -> tuple[SymmetricStages | None, dict]:
    """Which of the groups in ``wanted`` ((group, use_symm_mem: True or "auto") pairs) take the symmetric all-gather
    and reduce-scatter: returns the stages they share (None when none does) and id(group) -> (all-gather or None,
    reduce-scatter or None). "auto" times the group's plain path (over its transport in ``transports``, by id) against
    the symmetric one. Collective over the shard group: every rank calls it alike."""
    groups = [(g, mode) for g, mode in wanted if g.world > 1 and not g.fp8]  # FP8 groups keep the plain path
    if not groups:
        return None, {}
    shard_group = groups[0][0].shard_group
    if any(g.shard_group is not shard_group for g, _ in groups):
        raise ValueError("use_symm_mem: all units under one root must shard over the same group")
    # a group whose grads travel narrower than they are summed (reduce_comm_dtype) keeps its all-to-all
    reduces = [g for g, _ in groups if g.requires_grad and not g.sums_on_arrival]
    stages_bytes = _stage_bytes([g for g, _ in groups], reduces)
    stages = SymmetricStages(shard_group, *stages_bytes)
    decisions: dict = {}  # groups of the same size and dtypes decide once
    chosen = []
    for g, mode in groups:
        if mode is True:
            use = (True, g.requires_grad)
        else:
            key = (tuple(s.shape for s in g.layout.slots), g.compute_dtype, g.reduce_dtype, g.requires_grad)
            if key not in decisions:
                decisions[key] = _measure(stages, g, transports[id(g)])
            use = decisions[key]
        chosen.append((g, use[0], use[1] and g in reduces))
    # "auto" may have kept the plain path for one collective or both: hold only the stages that are used
    # (the pool cannot shrink in place, so make it again; every rank decided alike, so all of them do)
    used = _stage_bytes([g for g, ag, _ in chosen if ag], [g for g, _, rs in chosen if rs])
    if used != stages_bytes:
        stages.close()
        stages = SymmetricStages(shard_group, *used) if any(used) else None
    return stages, {id(g): (SymmetricAllGather(stages) if ag else None, SymmetricReduceScatter(stages) if rs else None)
                    for g, ag, rs in chosen if ag or rs}


def _stage_bytes(gathered, reduced) -> tuple[int, int]:
    """Bytes of the all-gather and reduce-scatter stages: the largest of the groups that use each."""
    ag = max((g.layout.rank_major_numel * g.compute_dtype.itemsize for g in gathered), default=0)
    rs = max((SymmetricStages.reduce_scatter_stage_bytes(g.layout.rank_major_numel, g.world, g.reduce_dtype)
              for g in reduced), default=0)
    return ag, rs


def _measure(stages: SymmetricStages, g, transport) -> tuple[bool, bool]:
    """Time the group's own all-gather both ways (its plain path, through torch.distributed or native_collectives'
    communicator, and the symmetric one with its copy into the stage and its unpack into place) and, if it has
    gradients, the reduce-scatter of its packed gradients both ways."""
    stats = dataclasses.replace(g.stats)  # timing runs are not the model's gathers
    times = [cuda_median_ms(lambda: g.all_gather(transport.all_gather_op)),  # the plain path this group has
             cuda_median_ms(lambda: g.all_gather(SymmetricAllGather(stages)))]
    g.stats = stats
    g.free_unsharded()
    if g.requires_grad:
        rank_major, shard = g.layout.rank_major_numel, g.layout.shard_numel
        packed = torch.randn(rank_major, device=g.device).to(g.reduce_dtype)
        reduced = torch.empty(shard, dtype=g.reduce_dtype, device=g.device)
        s_packed, s_reduced = stages.reduce_scatter_buffers(rank_major, g.reduce_dtype)
        s_packed.copy_(packed)
        times += [cuda_median_ms(lambda: transport.reduce_scatter_into(reduced, packed, g.shard_group)),
                  cuda_median_ms(lambda: stages.comm.reduce_scatter_into(s_reduced, s_packed))]
    t = torch.tensor(times, dtype=torch.float64, device=g.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.shard_group)  # slowest rank: every rank decides alike
    ms = t.tolist()
    return ms[1] < AUTO_MARGIN * ms[0], len(ms) == 4 and ms[3] < AUTO_MARGIN * ms[2]
