"""Parameters a user put in place of a unit's sharded ones (``module.weight = nn.Parameter(...)`` after fully_shard,
``load_state_dict(assign=True)``): their values are taken into the unit's flat buffers."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from . import rows
from .group import ParamGroup


@torch.no_grad()
def take_assigned(groups: list[ParamGroup]) -> None:
    """``load_state_dict(sd, assign=True)`` (accelerate's ``cpu_ram_efficient_loading`` loads a meta-built,
    sharded model so) puts the state dict's own tensors in the modules' places: copy their values into the unit's
    flat buffers (giving a group still on the meta device its storage first) and put the unit's parameters back,
    as FSDP2 takes up a swapped sharded parameter at its lazy init (root.lazy_init calls this too). A group still on
    the meta device takes them only when every parameter of it was assigned (else it stays on meta, and the first
    forward says so)."""
    for g in groups:
        assigned = [(i, place, place.module._parameters.get(place.name)) for i, info in enumerate(g.infos)
                    for place in info.places]
        assigned = [(i, p, new) for i, p, new in assigned
                    if new is not None and new is not g.infos[i].sharded and new is not g.infos[i].unsharded]
        if not assigned or (g.main_weight.data.is_meta and {i for i, _, _ in assigned} != set(range(len(g.infos)))):
            continue
        g.rebuild(g.device)  # no-op unless on meta (it makes new parameters: taken below)
        for i, _, new in assigned:
            info = g.infos[i]
            value = new.to_local() if isinstance(new, DTensor) else rows.local_of_full(g, i, new)
            info.sharded._local_tensor.copy_(value)  # type: ignore[attr-defined]
            if info.sharded.requires_grad != new.requires_grad:
                info.sharded.requires_grad_(new.requires_grad)
        g.use_sharded_params()
