"""WeightVersions: when a group's main weights may have changed, and how often the same weights were gathered.

[Note: weights version]
The compute-dtype (or FP8) copy of a group's weights is cast once per version of its main weights, and a gathered
unit is gathered again only when the version moved. The version is a tuple that changes whenever the main weights may
have changed:
  * an optimizer step: torch.optim's foreach kernels write the local tensors without bumping any version counter, so
    a global step post-hook counts every optimizer's steps (core/registry.py); frozen groups get no gradients, so no
    step changes them and they are not counted;
  * an in-place op on a parameter (a hand-written update, ``copy_``): the sharded DTensor's own version counter;
  * a write to the flat buffer itself (init, a load of full tensors): the buffer's version counter;
  * a write through a tensor that shares the buffer's storage with a version counter of its own (the local tensor
    of a DTensor that state_dict() returned, which DCP loads into in place): ``watch_alias``;
  * anything else a caller knows of: ``mark_changed``.
The unit adds the context's weights epoch (runtime/context.py), which moves at each evaluation forward of a model that
trains, so writes no counter sees (``.data`` swaps around an evaluation) are cast afresh too. Every rank counts the
same events, so every rank decides alike where the decision is collective (FP8 scales).
"""

from __future__ import annotations

import weakref
from typing import Optional, Protocol

import torch

from ..core import registry


class _Info(Protocol):
    sharded: torch.Tensor


class WeightVersions:
    def __init__(self) -> None:
        self._external_writes = 0
        self._aliases: list[tuple[weakref.ref, int]] = []  # (tensor sharing main_weight's storage, its version)
        self._gathered: Optional[tuple] = None  # the version the last training gathers were of ...
        self._gathers = 0  # ... and how many of them
        registry.watch_optimizer_steps()

    def current(self, infos: list, main_weight: torch.Tensor, pending_step: bool = False) -> tuple[int, int, int, int]:
        """The version of the weights of the parameters ``infos`` over the flat buffer ``main_weight`` (the note).
        ``pending_step``: inside an optimizer step, the version the weights will have once that step is counted."""
        if self._aliases:
            self._count_alias_writes()
        params, trainable = 0, False
        for info in infos:
            params += info.sharded._version
            trainable = trainable or info.sharded.requires_grad
        steps = registry.optimizer_steps() + pending_step if trainable else 0
        return (steps, params, main_weight._version, self._external_writes)

    def mark_changed(self) -> None:
        self._external_writes += 1

    def watch_alias(self, tensor: torch.Tensor) -> None:
        """``tensor`` shares main_weight's storage with a version counter of its own: count writes through it while
        it lives."""
        self._aliases.append((weakref.ref(tensor), tensor._version))

    def _count_alias_writes(self) -> None:
        live = []
        for ref, seen in self._aliases:
            tensor = ref()
            if tensor is None:
                continue
            if tensor._version != seen:
                self._external_writes += 1
            live.append((ref, tensor._version))
        self._aliases = live

    def gathered_third_time(self, version: tuple) -> bool:
        """Count a training gather of ``version``: True from the third of the same weights on (a step of one
        microbatch gathers twice: forward and backward)."""
        if version != self._gathered:
            self._gathered, self._gathers = version, 0
        self._gathers += 1
        return self._gathers > 2

    def forget_gathers(self) -> None:
        """New storage (materialisation): no gather of it was counted."""
        self._gathered, self._gathers = None, 0
