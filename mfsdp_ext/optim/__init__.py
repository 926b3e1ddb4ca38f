"""Flat fused optimizers for parameters of mfsdp_ext's fully_shard: ``AdamW`` and ``SGD``, drop-ins for torch's.

Parameters that fully_shard owns (the DTensor views of a ParamGroup's fp32 main weight) keep their optimizer
state in flat buffers of the same shard layout, and each ParamGroup steps in one native kernel launch
(``_native.adamw_step`` / ``sgd_step``); every other parameter is stepped by torch's own implementation in the
same optimizer. ``state_dict()`` looks exactly like torch's (the same keys; DTensor state, views of the flat
buffers), so checkpoints cross between these optimizers and torch's.
"""

from .adamw import AdamW
from .sgd import SGD

__all__ = ["AdamW", "SGD"]
