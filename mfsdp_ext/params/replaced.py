"""The parameters fully_shard replaced, and the check that no optimizer steps them.

fully_shard swaps each parameter it takes for a new ``nn.Parameter(DTensor)`` shard (as FSDP2 does), and
``to_empty()`` swaps a meta-built shard for one with storage. An optimizer built before that holds the old
tensors, which no forward uses any more: its steps would change nothing the model computes with, and training
would silently not train. The first step of every optimizer (and the first after its parameter list grows) looks
for replaced parameters and raises, naming one.
"""

from __future__ import annotations

import torch

from ..core import registry


def note_replaced(original: torch.Tensor, name: str, when: str) -> None:
    """``original`` is no longer the module's parameter (fully_shard made a shard of it, or to_empty() gave a
    meta shard real storage)."""
    registry.REPLACED_PARAMS[original] = (name, when)
    registry.install_optimizer_hook("check_replaced_params", _check_optimizer, pre=True)


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if registry.CHECKED_OPTIMIZERS.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            replaced = registry.REPLACED_PARAMS.get(p)
            if replaced is not None:
                name, when = replaced
                raise RuntimeError(
                    f"mfsdp_ext: {type(optimizer).__name__} holds parameter {name} as it was {when}; the model "
                    "no longer uses that tensor, so stepping it would not train. Build the optimizer after "
                    "fully_shard (and after to_empty() for a meta-built model), from model.parameters(), as "
                    "with FSDP2.")
    registry.CHECKED_OPTIMIZERS[optimizer] = count
