"""How a unit's groups communicate: the policy ``fully_shard`` checks once, and the one pass that gives every group its
collectives at the root's lazy init.

``CommPolicy`` (frozen, one per unit) holds what the user asked for: the transport of the plain collectives
(torch.distributed, or mfsdp_ext's own NCCL communicator), NCCL symmetric memory (False, True or "auto": timed at lazy
init), and the copy engines for the all-gather and for the gradient exchange. ``CommPolicy.checked`` validates it
against the shard group with errors that say what to do.

``assign_collectives`` gives each group its ``GroupCollectives`` (transport, all-gather, reduce-scatter), in one pass.
For each direction the first that applies wins:

  1. FSDP2's custom hook (``set_custom_all_gather`` / ``set_custom_reduce_scatter``), for the groups it can carry;
  2. the copy engines, where the unit asks for them (True, or "auto", the default: wherever they can run and the
     unit asks for no other transport) and the group can take them (not FP8 groups or dim > 0 splits for the
     gather; only a gradient exchange that sums on arrival, the narrow wire, for the reduction);
  3. NCCL symmetric memory, where the unit asks for it (True, or "auto" where it timed faster for that size);
  4. the plain collectives over the unit's transport (the reduce-scatter on a process group of its own with FSDP2's
     ``set_separate_reduce_scatter_group``).

It is collective over the shard groups (communicators and symmetric buffers are created in it): every rank calls it
with the same units in the same order.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch.distributed as dist

from ..core import registry
from ..core.device import DeviceHandle
from . import copy_engine, custom, native
from .collectives import TORCH_TRANSPORT, GroupBoundTransport, GroupCollectives, ParamGroup, PlainReduceScatter
from .symmetric import choose as symmetric_choice
from .symmetric.collectives import SymmetricAllGather, SymmetricReduceScatter, SymmetricStages
from .symmetric.comm import is_available as symmetric_available

SymmMem = Union[bool, str]  # False, True or "auto"
CopyEngines = Union[bool, str]  # False, True or "auto" (the default)
COPY_ENGINE_FLAGS = ("copy_engine_all_gather", "copy_engine_reduce_scatter")


@dataclass(frozen=True)
class CommPolicy:
    """How one unit's groups communicate (``fully_shard``'s ``native_collectives``, ``use_symm_mem``,
    ``copy_engine_all_gather`` and ``copy_engine_reduce_scatter``)."""

    native: bool = False  # the plain collectives on mfsdp_ext's own NCCL communicator (comm/native.py)
    symm_mem: SymmMem = False  # NCCL symmetric memory: True, or "auto" (kept per size where it times faster)
    copy_engine_all_gather: CopyEngines = "auto"  # weights moved by the copy engines (comm/copy_engine.py)
    copy_engine_reduce_scatter: CopyEngines = "auto"  # bf16 gradients exchanged by the copy engines
    custom_all_gather: Any = None  # FSDP2's AllGather hook (comm/custom.py)
    custom_reduce_scatter: Any = None  # FSDP2's ReduceScatter hook
    reduce_scatter_group: Any = None  # set_separate_reduce_scatter_group: the plain reduce-scatters' own group

    @classmethod
    def checked(cls, shard_group: Optional[dist.ProcessGroup], *, native: bool = False, symm_mem: SymmMem = False,
                copy_engine_all_gather: CopyEngines = "auto", copy_engine_reduce_scatter: CopyEngines = "auto",
                several_meshes: bool = False) -> CommPolicy:
        """The policy for a unit sharded over ``shard_group`` (None: no_shard), checked.

        Args:
            shard_group: the unit's shard process group, or None for a replicated (no_shard) unit.
            native: ``fully_shard(native_collectives=...)``.
            symm_mem: ``fully_shard(use_symm_mem=...)``; "auto" falls back to the plain collectives, with one
                warning, where symmetric memory is unavailable.
            copy_engine_all_gather: ``fully_shard(copy_engine_all_gather=...)``: True, False or "auto" (decided per
                group at lazy init: ``uses_copy_engines``).
            copy_engine_reduce_scatter: ``fully_shard(copy_engine_reduce_scatter=...)``, the same.
            several_meshes: shard_placement_fn put parameters on meshes of their own (symmetric memory takes one).

        Raises:
            ValueError: a value of the wrong kind, or two settings that move the same bytes two ways.
            RuntimeError: a setting asked for (True) that this build, backend or machine cannot give.
        """
        if native not in (False, True):
            raise ValueError(f"native_collectives must be True or False, got {native!r}")
        for name, value in (("use_symm_mem", symm_mem), ("copy_engine_all_gather", copy_engine_all_gather),
                            ("copy_engine_reduce_scatter", copy_engine_reduce_scatter)):
            if not any(value is choice for choice in (False, True)) and value != "auto":
                raise ValueError(f"{name} must be False, True or 'auto', got {value!r}")
        policy = cls(bool(native), symm_mem, copy_engine_all_gather, copy_engine_reduce_scatter)
        policy._check_copy_engines(shard_group)
        if native:
            _refuse(native_reason(shard_group), "native_collectives=True", "native_collectives=False (the default: "
                    "torch.distributed's collectives)")
        return dataclasses.replace(policy, symm_mem=_resolve_symm_mem(symm_mem, shard_group, several_meshes))

    def with_symmetric_memory(self, shard_group: Optional[dist.ProcessGroup]) -> CommPolicy:
        """This policy with ``use_symm_mem=True`` (FSDP2's ``set_symm_mem_for_comm``), checked.

        Raises:
            ValueError: the unit moves its bytes with the copy engines.
            RuntimeError: NCCL symmetric memory is unavailable here.
        """
        for name in COPY_ENGINE_FLAGS:
            if getattr(self, name) is True:
                raise ValueError(f"set_symm_mem_for_comm: this unit has {name}=True; symmetric memory and the copy "
                                 "engines are two ways to move the same bytes: pass one")
        ok, why = symmetric_available(shard_group)
        if not ok:
            raise RuntimeError(f"set_symm_mem_for_comm: NCCL symmetric memory is unavailable here: {why}")
        return dataclasses.replace(self, symm_mem=True)

    def uses_copy_engines(self, flag: str, g: ParamGroup) -> bool:
        """Whether group ``g`` of this unit asks for the copy engines in the direction ``flag`` names (one of
        COPY_ENGINE_FLAGS): True as asked (checked at fully_shard), "auto" where they can run over its shard group
        and the unit asks for no other transport. The same answer on every rank (collective over the shard group
        the first time: comm/dist_ops.on_one_host)."""
        value = getattr(self, flag)
        if value != "auto":
            return bool(value)
        if self.native or self.symm_mem or g.world == 1:
            return False
        return copy_engine.unavailable_reason(g.shard_group) is None

    def _check_copy_engines(self, shard_group: Optional[dist.ProcessGroup]) -> None:
        for name in COPY_ENGINE_FLAGS:
            if getattr(self, name) is not True:
                continue
            if self.symm_mem:
                what = name.removeprefix("copy_engine_").replace("_", "-")
                raise ValueError(f"fully_shard: {name}=True and use_symm_mem are two {what}s; pass one")
            _refuse(copy_engine.unavailable_reason(shard_group), f"{name}=True",
                    f"{name}=False (the default: NCCL's collectives)")

    def describe(self) -> str:
        """What differs from the defaults, e.g. "native, symm_mem=auto" ("" for the defaults): the same-model check
        and the unit summary name it."""
        fields = [f.name if value is True else f"{f.name}={value if isinstance(value, (bool, str)) else 'set'}"
                  for f in dataclasses.fields(self) if not _is_default(value := getattr(self, f.name), f.default)]
        return ", ".join(fields)


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (isinstance(value, str) and value == default)


def native_reason(group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """Why ``native_collectives=True`` cannot run over ``group``, or None when it can."""
    if group is None:
        return "no_shard has no all-gather or reduce-scatter"
    return native.unavailable_reason(group)


def _refuse(reason: Optional[str], asked: str, instead: str) -> None:
    if reason is not None:
        raise RuntimeError(f"fully_shard({asked}): {reason}. Pass {instead}.")


_warned_auto_fallback: list[bool] = []  # "auto" without symmetric memory warns once per process


def _resolve_symm_mem(symm_mem: SymmMem, group: Optional[dist.ProcessGroup], several_meshes: bool) -> SymmMem:
    if not symm_mem:
        return False
    if several_meshes:
        if symm_mem is True:
            raise ValueError("fully_shard(use_symm_mem=True): shard_placement_fn puts parameters on a mesh of their "
                             "own; symmetric memory takes one shard group per model: pass use_symm_mem=False")
        return False  # "auto": the plain collectives
    ok, why = (False, "no_shard has no all-gather or reduce-scatter") if group is None else symmetric_available(group)
    if ok:
        return symm_mem
    if symm_mem is True:
        raise RuntimeError(f"fully_shard(use_symm_mem=True): NCCL symmetric memory is unavailable: {why}. "
                           "Pass use_symm_mem='auto' to fall back to the plain path, or False.")
    if not _warned_auto_fallback:
        warnings.warn(f"use_symm_mem='auto': using the plain collectives ({why})", stacklevel=4)
        _warned_auto_fallback.append(True)
    return False


@dataclass
class CommResources:
    """What the groups under one root share for their collectives: the symmetric-memory stages (None when no group
    uses them) and the copy-engine stages (one per direction in use)."""

    symmetric: Optional[SymmetricStages] = None
    copy_engines: list = dataclasses.field(default_factory=list)


def assign_collectives(units: list[tuple[CommPolicy, list]], device: DeviceHandle) -> CommResources:
    """Give every group its collectives (the module docstring: the precedence) and return what they share.

    Args:
        units: (policy, groups) of each unit under one root, in the same order on every rank.
        device: the root's device handle (the copy engines' barriers and capture state).
    """
    pairs = [(policy, g) for policy, groups in units for g in groups]
    transports = {id(g): _transport(policy, g) for policy, g in pairs}
    wanted = [(g, policy.symm_mem) for policy, g in pairs if policy.symm_mem]
    stages, by_symmetric = symmetric_choice.choose_symmetric(wanted, transports)
    ce_gather, ce_reduce = _copy_engine_plans(pairs)
    ce_stages, by_copy_engine = copy_engine.copy_engine_collectives(ce_gather, ce_reduce, device)
    for policy, g in pairs:
        transport = transports[id(g)]
        ag, rs = by_copy_engine.get(id(g), (None, None))
        sym_ag, sym_rs = by_symmetric.get(id(g), (None, None))
        plain_rs = transport.reduce_scatter_op
        if policy.reduce_scatter_group is not None and transport is TORCH_TRANSPORT:
            plain_rs = PlainReduceScatter(GroupBoundTransport(policy.reduce_scatter_group))
        g.use_collectives(GroupCollectives(transport, ag or sym_ag or transport.all_gather_op,
                                           rs or sym_rs or plain_rs))
    use_custom(pairs)
    return CommResources(stages, ce_stages)


def _copy_engine_plans(pairs: list[tuple[CommPolicy, Any]]) -> tuple[tuple[list, int], tuple[list, int]]:
    """(groups, buffer bytes) of the copy-engine all-gather and gradient exchange (copy_engine.plan_both)."""
    asked = [_one_shard_group([(getattr(policy, flag), g) for policy, g in pairs
                               if eligible(g) and policy.uses_copy_engines(flag, g)])
             for flag, eligible in (("copy_engine_all_gather", copy_engine.gathers_by_copy_engine),
                                    ("copy_engine_reduce_scatter", copy_engine.reduces_by_copy_engine))]
    resident = sum(copy_engine.resident_bytes(g) for _, g in pairs)
    return copy_engine.plan_both(asked[0], asked[1], copy_engine.auto_buffer_bytes(resident))


def _one_shard_group(asked: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """One stage serves one shard group: groups asking by "auto" on another shard group than the first asked for
    keep NCCL's collectives (e.g. experts sharded over their own mesh); ones asking by True raise in
    copy_engine_collectives."""
    if not asked:
        return []
    first = next((g for value, g in asked if value is True), asked[0][1]).shard_group
    return [(value, g) for value, g in asked if value is True or g.shard_group is first]


def use_custom(pairs: list[tuple[CommPolicy, Any]]) -> None:
    """Each (policy, group)'s custom hooks, for the groups they can carry: at lazy init, and when FSDP2's setters come
    after it (they take effect from the next collective)."""
    for policy, g in pairs:
        if not custom.takes_custom(g):
            continue
        transport, ag, rs = g.collectives
        if policy.custom_all_gather is not None:
            ag = custom.CustomAllGather(policy.custom_all_gather)
        if policy.custom_reduce_scatter is not None:
            rs = custom.CustomReduceScatter(policy.custom_reduce_scatter)
            g.grads.on_ready = None  # the unit's groups reduce in one hook call, as FSDP2's: none ahead of the rest
        if (ag, rs) != g.collectives[1:]:
            g.use_collectives(GroupCollectives(transport, ag, rs))


def separate_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A process group over ``group``'s ranks for the reduce-scatters alone (FSDP2's set_separate_reduce_scatter_group),
    one per rank set and process: made the first time (collective over those ranks), then shared."""
    ranks = tuple(dist.get_process_group_ranks(group))
    return registry.per_default_group(registry.REDUCE_SCATTER_GROUPS, ranks,
                                      lambda: dist.new_group(list(ranks), use_local_synchronization=True))


def release_symmetric(resources: CommResources, groups: list) -> None:
    """Give the groups that use symmetric memory their transport's plain collectives back, then free the stages.
    Collective over the shard group (freeing NCCL windows is): every rank calls it alike."""
    if resources.symmetric is None:
        return
    symmetric = (SymmetricAllGather, SymmetricReduceScatter)
    for g in groups:
        transport, ag, rs = g.collectives
        if isinstance(ag, symmetric) or isinstance(rs, symmetric):
            g.use_collectives(GroupCollectives(transport, transport.all_gather_op if isinstance(ag, symmetric) else ag,
                                               transport.reduce_scatter_op if isinstance(rs, symmetric) else rs))
    stages, resources.symmetric = resources.symmetric, None
    stages.close()  # waits for the device, so no collective still uses the stages


def _transport(policy: CommPolicy, g: ParamGroup):
    """The transport of the group's plain collectives: mfsdp_ext's own NCCL communicator where the policy asks for it
    and the group spans several ranks, torch.distributed otherwise."""
    if policy.native and g.world > 1:
        return native.transport_for(g.shard_group, g.device)
    return TORCH_TRANSPORT


def plain_collectives() -> GroupCollectives:
    """A group's collectives before lazy init: the plain ones over torch.distributed."""
    return GroupCollectives(TORCH_TRANSPORT, TORCH_TRANSPORT.all_gather_op, TORCH_TRANSPORT.reduce_scatter_op)

