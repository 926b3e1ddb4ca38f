"""BackwardSteps: an optimizer built with ``step_in_backward=True`` steps each CPU-offloaded ParamGroup on the host
as soon as its gradient is there, while the backward still computes the other groups' gradients.

[Note: optimizer step in backward]
With CPU offload the optimizer runs on the host, bound by host memory bandwidth: at the 8B shape it takes longer than
the whole forward and backward on the GPU, which waits for it when it runs after backward. Stepped in backward, an
offloaded group's kernel is queued on the offload worker right behind the sum of its reduced gradient
(params/offload.py), so it runs under the backward of the groups before it; backward returns once every queued step
is done (the root drains the worker), and ``optimizer.step()`` then steps only the rest (parameters on the GPU,
anything without an offloaded gradient) and counts the step. What a step reads is fixed when the group's final
reduction arrives (the learning rate then, the gradient as reduced), so a step in backward is refused where it would
differ from the step after backward:
  * a hyperparameter changed between backward and ``step()`` (set it before backward; a scheduler's ``step()`` after
    ``optimizer.step()`` is fine): ``step()`` raises;
  * a stepped group's gradients scaled, zeroed or released after backward (``clip_grad_norm_``, a GradScaler's
    ``unscale_``, ``zero_grad``): ``step()`` raises (seen by the values of a few elements: a change to some
    parameters' gradients only may go unseen);
  * a second final reduction of a group before ``step()``: backward raises. Microbatches before the last must not be
    final: ``set_requires_gradient_sync(False)``, or ``mfsdp_ext.microbatch(..., is_last=False)``;
  * the step cannot be skipped once backward ran (a check of the loss must come before backward).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..params import offload
from .flat_state import flat_owner

if TYPE_CHECKING:
    from ..params.group import ParamGroup


class BackwardSteps:
    """The offloaded groups an optimizer steps in backward (see the note), and what each step read."""

    def __init__(self, optimizer: Any):  # a FlatOptimizerMixin (base.py, which imports this module)
        self.optimizer = weakref.ref(optimizer)
        # ParamGroup -> [(index in the group, parameter, optimizer group index)] of the optimizer's parameters
        self.items: dict[ParamGroup, list[tuple[int, torch.Tensor, int]]] = {}
        # ParamGroup -> what its step in backward read: _Read
        self.done: dict[ParamGroup, _Read] = {}
        self.register()

    def register(self) -> None:
        """Step in backward the offloaded groups of the optimizer's parameters (again after add_param_group)."""
        opt = self.optimizer()
        items: dict = {}
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                owner = flat_owner(p)
                if owner is not None and owner[0].offload is not None:
                    items.setdefault(owner[0], []).append((owner[1], p, gi))
        for group in items:
            stepper = group.grads.stepper() if group.grads.stepper is not None else None
            if stepper is not None and stepper != self.on_reduction:
                raise ValueError(f"{type(opt).__name__}(step_in_backward=True): a group of offloaded parameters "
                                 "already steps in backward with another optimizer; give each fully_shard unit's "
                                 "parameters to one optimizer built with step_in_backward=True")
            group.grads.stepper = weakref.WeakMethod(self.on_reduction)
        self.items = items

    def on_reduction(self, group: ParamGroup, final: bool) -> None:
        """A reduction of ``group``'s gradients was queued (backward, main thread). The final one of a step queues
        the group's kernel on the offload worker, behind that gradient's sum."""
        if not final:
            return
        opt = self.optimizer()
        if opt is None:
            return
        if group in self.done:
            group.versions.mark_changed()  # the last step in backward changed the weights, uncounted by any step()
            raise RuntimeError(f"{type(opt).__name__}(step_in_backward=True): this backward reduced gradients that "
                               "were already stepped in an earlier backward, and optimizer.step() was not called "
                               "in between. Call optimizer.step() after each backward, or make the microbatches "
                               "before the last skip the gradient sync (set_requires_gradient_sync(False), or "
                               "mfsdp_ext.microbatch(..., is_last=False))")
        items = [(i, p, gi) for i, p, gi in self.items.get(group, ()) if p.grad is not None
                 and group.grads.attached_at(i)]
        if not items:
            return
        for i, p, _ in items:
            opt._state_for(p, group, i)
        flat = opt._flat(group)
        runs, keys, _ = opt._runs(group, items)
        coeffs = opt._coeffs(keys)
        for i, p, gi in items:
            opt._after_flat(gi, p, flat, i)
        read = self.done[group] = _Read(group.grads.main_grad.data, [(p, p.grad) for _, p, _ in items],
                                        _hyperparameters(opt, {gi for _, _, gi in items}))

        def step() -> None:
            opt._run_kernel(group, flat, runs, keys, coeffs)
            read.take_sample()  # after the worker's own writes (the gradient's sum)

        offload.run_on_worker(step)
        # queued behind the step: the next forward's compute-dtype shard
        group.offload.cast_ahead(group.main_weight, group.compute_dtype, group.weights_version()[1:])

    def take_done(self) -> set[ParamGroup]:
        """At ``optimizer.step()``: the groups stepped in backward since the last step, once nothing they read has
        changed since (else RuntimeError). The worker is drained first."""
        if not self.done:
            return set()
        offload.drain()
        done, self.done = self.done, {}
        opt = self.optimizer()
        name = f"{type(opt).__name__}(step_in_backward=True)"
        problem = None
        for group, read in done.items():
            if not read.unchanged(group):
                problem = ("gradients of offloaded parameters were changed or released after the backward that "
                           "stepped them (e.g. clip_grad_norm_, a GradScaler's unscale_, zero_grad); the step used "
                           "them as reduced. Build the optimizer without step_in_backward to change gradients before "
                           "the step")
            elif _hyperparameters(opt, set(read.hyperparameters)) != read.hyperparameters:
                problem = ("hyperparameters changed between backward and optimizer.step() (the offloaded parameters "
                           "were stepped in backward with the values before); change them before backward, e.g. step "
                           "the LR scheduler after optimizer.step()")
            if problem is not None:
                for stepped in done:  # changed in backward, and this step() is not counted: cast afresh
                    stepped.versions.mark_changed()
                raise RuntimeError(f"{name}: {problem}")
        return set(done)


class _Read:
    """What a group's step in backward read: its gradient buffer, the parameters' ``.grad`` and the hyperparameters
    of their optimizer groups. A write to the gradients after the step is seen by its values: in-place ops through
    the ``.grad`` DTensors (clip_grad_norm_'s foreach scaling) move no version counter. A few elements spread over the
    buffer are compared: what scales or zeroes the gradients (clipping, unscaling, zeroing) changes all of them."""

    SAMPLES = 16

    def __init__(self, buffer: torch.Tensor, grads: list[tuple[torch.Tensor, torch.Tensor]], hyperparameters: dict):
        self.buffer, self.grads, self.hyperparameters = buffer, grads, hyperparameters
        count = min(self.SAMPLES, buffer.numel())  # evenly spaced, in integers (a float linspace rounds past the end)
        self.positions = torch.arange(count, dtype=torch.int64) * (buffer.numel() - 1) // max(count - 1, 1)
        self.sample: torch.Tensor | None = None  # taken by the worker once the step ran

    def take_sample(self) -> None:
        self.sample = self.buffer[self.positions]

    def unchanged(self, group: ParamGroup) -> bool:
        """The gradients the step read are still the parameters' ``.grad``, with the values it read."""
        main_grad = group.grads.main_grad
        return (main_grad is not None and main_grad.data is self.buffer and self.sample is not None
                and torch.equal(self.buffer[self.positions], self.sample)
                and all(p.grad is grad for p, grad in self.grads))


def _hyperparameters(opt: torch.optim.Optimizer, indices: set[int]) -> dict:
    return {gi: {k: v for k, v in opt.param_groups[gi].items() if k != "params"} for gi in indices}
