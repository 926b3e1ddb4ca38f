"""The named states of an FSDP unit (as FSDP2 names them)."""

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
    UNSHARDED = auto()  # views into the gathered compute-dtype buffer
