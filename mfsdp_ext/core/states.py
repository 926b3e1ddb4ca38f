"""The named states of an FSDP unit (as FSDP2 names them) and the sharding strategies."""

from enum import Enum, auto


class TrainingState(Enum):
    """Where a unit is in the current iteration; back to IDLE when the root ends the iteration."""

    IDLE = auto()  # no forward yet
    FORWARD = auto()  # its forward ran (a forward inside the backward is an activation-checkpoint recompute)
    PRE_BACKWARD = auto()  # the backward reached its outputs: gathered again for its backward
    POST_BACKWARD = auto()  # its gradients are reduced (or kept locally, between microbatches)


class ShardedState(Enum):
    """Which parameters the module computes with."""

    SHARDED = auto()  # the DTensor shards (the main weights): at rest
    SHARDED_POST_FORWARD = auto()  # reshard_after_forward=N: sharded params, the gathered weights kept over N ranks
    UNSHARDED = auto()  # views into the gathered compute-dtype buffer


class Strategy(str, Enum):
    """What stays sharded (the ZeRO stages); ``fully_shard(sharding_strategy=...)``."""

    NO_SHARD = "no_shard"  # DDP-like: full weights everywhere, grads all-reduced on the last microbatch
    OPTIM = "optim"  # ZeRO-1: optimizer state sharded; grads reduced on the last microbatch
    OPTIM_GRADS = "optim_grads"  # ZeRO-2: grads reduce-scattered every microbatch; weights stay gathered
    OPTIM_GRADS_PARAMS = "optim_grads_params"  # ZeRO-3: weights gathered for compute only

    @property
    def keeps_weights_gathered(self) -> bool:
        return self is not Strategy.OPTIM_GRADS_PARAMS

    @property
    def reduces_every_microbatch(self) -> bool:
        return self in (Strategy.OPTIM_GRADS, Strategy.OPTIM_GRADS_PARAMS)
