"""mfsdp_ext.optim.SGD: torch.optim.SGD with one fused kernel per fully_shard ParamGroup (see base.py)."""

from __future__ import annotations

import torch
from torch.optim.sgd import sgd

from .. import _native
from .base import FlatOptimizerMixin
from .flat_state import FlatState

_MOMENTUM, _FIRST, _NESTEROV = 1, 2, 4  # the kernel's flags (_native.sgd_step)


class SGD(FlatOptimizerMixin, torch.optim.SGD):
    """torch.optim.SGD (same arguments, defaults, param_groups and state_dict: ``momentum_buffer`` when momentum is
    not 0) whose fully_shard parameters step in one native kernel per ParamGroup; others step with torch's SGD.

    Refused (ValueError): differentiable, a Tensor lr / momentum / weight_decay. ``foreach`` is used for the
    parameters torch steps; ``fused`` is accepted and ignored.
    """

    STATE_NAMES = ("momentum_buffer",)
    _UNSUPPORTED = (("differentiable", "use torch.optim.SGD(differentiable=True)"),)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize,
                         foreach=foreach, differentiable=differentiable, fused=None)
        self._setup_flat()

    def _init_flat(self, p, flat: FlatState, i: int) -> None:
        pass  # torch makes the momentum buffer at the first step (a copy of the gradient): the kernel does

    def _flat_key(self, group_index: int, p) -> tuple[int, bool]:
        # "first step of the momentum buffer": only with momentum (SGD without it keeps no buffer)
        first = self.param_groups[group_index]["momentum"] != 0 and self.state.get(p, {}).get("momentum_buffer") is None
        return group_index, first

    def _coeffs(self, keys: list[tuple[int, bool]]) -> torch.Tensor:
        rows = []
        for group_index, first in keys:
            group = self.param_groups[group_index]
            momentum = group["momentum"]
            flags = (_MOMENTUM | (_FIRST if first else 0) | (_NESTEROV if group["nesterov"] else 0)
                     if momentum != 0 else 0)
            rows.append([group["weight_decay"], momentum, 1 - group["dampening"], -group["lr"],
                         -1.0 if group["maximize"] else 1.0, flags, 0.0, 0.0])
        return torch.tensor(rows, dtype=torch.float32).reshape(-1, _native.OPTIM_COEFFS)

    def _run_kernel(self, group, flat: FlatState, runs: torch.Tensor, keys: list, coeffs: torch.Tensor,
                    device_table=None) -> None:
        uses_buffer = any(self.param_groups[gi]["momentum"] != 0 for gi, _ in keys)
        _native.sgd_step(group.main_weight.data, group.grads.main_grad.data,
                         flat.buffer("momentum_buffer") if uses_buffer else None, runs, coeffs, device_table)

    def _after_flat(self, group_index: int, p, flat: FlatState, i: int) -> None:
        if self.param_groups[group_index]["momentum"] != 0:
            self.state[p]["momentum_buffer"] = flat.view("momentum_buffer", i)

    def _torch_step(self, group: dict, params: list) -> None:
        """torch's SGD step for ``params`` (its functional implementation and its momentum-buffer bookkeeping)."""
        params_with_grad: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        buffers: list[torch.Tensor | None] = []
        has_sparse_grad = self._init_group(dict(group, params=params), params_with_grad, grads, buffers)
        sgd(params_with_grad, grads, buffers, weight_decay=group["weight_decay"], momentum=group["momentum"],
            lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
            has_sparse_grad=has_sparse_grad, foreach=group["foreach"], fused=None, grad_scale=None, found_inf=None)
        if group["momentum"] != 0:
            for p, buf in zip(params_with_grad, buffers):
                self.state[p]["momentum_buffer"] = buf
