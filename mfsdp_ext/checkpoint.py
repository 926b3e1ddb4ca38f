"""State-dict helpers.

``module.state_dict()`` returns the sharded DTensor parameters. Our shards own whole rows laid out by
FlatLayout, which is not torch.chunk's split, so ``DTensor.full_tensor()`` cannot reassemble them: use
``full_state_dict`` below, which gathers with the layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import comm
from .module import FsdpModule


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` as its full tensor, on every rank (a collective: call it on all ranks)."""
    fqn_of = {id(p): name for name, p in module.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for m in module.modules():
        if not isinstance(m, FsdpModule):
            continue
        for g in m._mfsdp_unit.groups:
            full = torch.empty(g.layout.total_numel, dtype=g.dtype, device=g.device)
            if g.world > 1:
                comm.all_gather_into(full, g.main_weight.data, g.shard_group)
            else:
                full.copy_(g.main_weight.data)
            for slot, info in zip(g.layout.slots, g.infos):
                name = fqn_of.get(id(info.sharded))
                if name is not None:
                    out[name] = full[slot.offset : slot.end].view(slot.shape).clone()
    for name, p in module.named_parameters():
        if name not in out:  # parameters of no unit
            out[name] = p.detach().clone()
    return out
