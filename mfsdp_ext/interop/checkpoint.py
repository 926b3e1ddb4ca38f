"""State dicts of sharded modules.

Every parameter is a ``Shard(0)`` DTensor split as torch.chunk splits it (FSDP2's split), so ``state_dict()``
returns the parameters' own DTensors with no communication, and DCP, ``get_state_dict`` / ``set_state_dict``,
resharding and optimizer state work as they do for FSDP2. What is here:
  * save and load hooks that put the sharded parameters in place first (a unit may hold its gathered ones, e.g.
    the root between forward and backward): a load must reach the main weights, never a gathered copy;
  * a note of the shards state_dict() hands out, so that a later in-place write into them (``dcp.load``) is seen
    by the next forward's cast, like a load_state_dict;
  * loading plain full tensors (a ``torch.save``d full state dict): each rank keeps its chunk of rows;
  * ``full_state_dict()``: every parameter as a full tensor on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..core.flat_buffer import FlatBuffer
from ..params import assigned, rows
from ..params.group import ParamGroup
from ..runtime.module import FsdpModule


def register_state_dict_hooks(modules: list[nn.Module], groups: list[ParamGroup]) -> None:
    """The hooks of one unit over ``modules`` (the module given to fully_shard, or each of FSDP2's list): each
    module's state dict names the places of its own subtree."""
    def use_sharded_params(*args, **kwargs) -> None:
        for g in groups:
            g.use_sharded_params()

    def mark_loaded(module, incompatible_keys) -> None:
        assigned.take_assigned(groups)
        for g in groups:  # load_state_dict writes through DTensor ops, which the step detection cannot see
            g.versions.mark_changed()

    holders = {id(m): m for m in modules}  # as FSDP2, also the modules holding the parameters: their own state_dict()
    holders.update((id(place.module), place.module) for g in groups for info in g.infos for place in info.places)

    def before_load(*args, **kwargs) -> None:
        assigned.take_assigned(groups)  # a sibling holder's assign=True load, before its places are reset
        for g in groups:  # a group still on meta has no gathered copy, and its places may hold assigned tensors
            if not g.main_weight.data.is_meta:  # that it takes only once all of them are there
                g.use_sharded_params()

    for m in holders.values():
        m.register_state_dict_pre_hook(use_sharded_params)
        m.register_load_state_dict_pre_hook(before_load)
    for module in modules:
        module.register_state_dict_post_hook(_watch_returned_shards(module, groups))
        module.register_load_state_dict_pre_hook(_full_tensors_to_local_chunks(module, groups))
        module.register_load_state_dict_post_hook(mark_loaded)


def _watch_returned_shards(holder: nn.Module, groups: list[ParamGroup]):
    """dcp.load(model.state_dict()) writes into the returned shards in place, maybe much later: watch them."""

    def hook(module, state_dict, prefix, local_metadata) -> None:
        for g in groups:
            for info in g.infos:
                for place in info.places:
                    value = state_dict.get(prefix + place.fqn) if place.holder is holder else None
                    if isinstance(value, DTensor):
                        g.versions.watch_alias(value._local_tensor)

    return hook


def _full_tensors_to_local_chunks(holder: nn.Module, groups: list[ParamGroup]):
    """A plain (non-DTensor) value of a sharded parameter is its full tensor: keep this rank's rows of it."""

    @torch.no_grad()
    def hook(module, state_dict, prefix, *args) -> None:
        for g in groups:
            for i, info in enumerate(g.infos):
                for place in info.places:
                    if place.holder is not holder:
                        continue
                    key = prefix + place.fqn
                    value = state_dict.get(key)
                    if value is None or isinstance(value, DTensor) or value.shape != info.shape:
                        continue  # absent, already sharded, or wrong (nn.Module reports the size mismatch)
                    local = rows.local_of_full(g, i, value).to(g.main_weight.data.device, g.dtype)
                    state_dict[key] = g.as_dtensor(i, local)

    return hook


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` as its full tensor, on every rank (a collective: call it on all ranks; one
    all-gather per group). Named as ``state_dict()`` names them: a tied parameter appears under each of its names.
    Read from the main weights, also while a unit holds its gathered (compute-dtype) parameters."""
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, FlatBuffer] = {}  # a unit over several modules is met once per module: gather once
    for prefix, m in module.named_modules():
        if not isinstance(m, FsdpModule):
            continue
        prefix = f"{prefix}." if prefix else ""
        for g in m._mfsdp_unit.groups:
            if id(g) not in gathered:
                gathered[id(g)] = rows.gather_full(g, g.main_weight)
            for i, info in enumerate(g.infos):
                value = rows.full_of_local(g, i, gathered[id(g)].param_view(i)).clone()
                for place in info.places:
                    if place.holder is m:
                        out[prefix + place.fqn] = value
    for name, p in module.named_parameters(remove_duplicate=False):
        if name not in out:  # parameters of no unit
            out[name] = p.detach().clone()
    return out
