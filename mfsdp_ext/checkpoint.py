"""State-dict conversion between our row layout and torch.chunk's.

Our shards own whole rows laid out by FlatLayout, which is not the split DTensor assumes for ``Shard(0)``
(torch.chunk: ceil(rows / world) rows per rank). Inside the module that is invisible: the optimizer works
element-wise. At the state-dict boundary it is not: ``DTensor.full_tensor()`` and DCP offsets follow
torch.chunk. So ``state_dict()`` returns torch.chunk-split DTensors (one all-gather per group, one unit's
full buffer held at a time) and ``load_state_dict()`` takes those, or full tensors, back into our layout.
Optimizer state (``optimizer.state_dict()``) is still in our layout: save it per rank, not with DCP.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .module import FsdpModule


def _chunk_rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows under torch.chunk's split (what DTensor's Shard(0) means); empty past the end."""
    rows = -(-full.shape[0] // world)
    return full[min(rank * rows, full.shape[0]) : min((rank + 1) * rows, full.shape[0])]


def chunked_state_dict_hook(groups):
    @torch.no_grad()
    def hook(module, state_dict, prefix, local_metadata) -> None:
        for g in groups:
            if g.world == 1 or not any(prefix + p.fqn in state_dict for i in g.infos for p in i.places):
                continue  # replicated (no_shard): already exact
            full = g.gather_full(g.main_weight.data)
            for slot, info in zip(g.layout.slots, g.infos):
                local = _chunk_rows(slot.view(full), g.rank, g.world).clone()
                value = DTensor.from_local(local, g.mesh, info.sharded.placements, run_check=False,
                                           shape=info.shape, stride=info.sharded.stride())
                for place in info.places:
                    if prefix + place.fqn in state_dict:
                        state_dict[prefix + place.fqn] = value

    return hook


def row_layout_load_hook(groups):
    @torch.no_grad()
    def hook(module, state_dict, prefix, *args) -> None:
        for g in groups:
            if g.world == 1:
                continue
            for i, info in enumerate(g.infos):
                for place in info.places:
                    key = prefix + place.fqn
                    if key not in state_dict:
                        continue
                    value = state_dict[key]
                    full = value.full_tensor() if isinstance(value, DTensor) else value
                    local = g.local_rows(i, full).to(g.device, g.dtype)
                    state_dict[key] = DTensor.from_local(local, g.mesh, info.sharded.placements, run_check=False,
                                                         shape=info.shape, stride=info.sharded.stride())

    return hook


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` as its full tensor, on every rank (a collective: call it on all ranks).

    Named as ``state_dict()`` names them: a tied parameter appears under each of its names."""
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for m in module.modules():
        if not isinstance(m, FsdpModule):
            continue
        for g in m._mfsdp_unit.groups:
            full = g.gather_full(g.main_weight.data)
            for slot, info in zip(g.layout.slots, g.infos):
                value = slot.view(full).clone()
                for name in names_of.get(id(info.sharded), []):
                    out[name] = value
    for name, p in module.named_parameters(remove_duplicate=False):
        if name not in out:  # parameters of no unit
            out[name] = p.detach().clone()
    return out
