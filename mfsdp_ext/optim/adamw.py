"""mfsdp_ext.optim.AdamW: torch.optim.AdamW with one fused kernel per fully_shard ParamGroup (see base.py)."""

from __future__ import annotations

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype

from .. import _native
from .base import FlatOptimizerMixin
from .flat_state import FlatState
from .graph_tables import ReplayPlan


class AdamW(FlatOptimizerMixin, torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, defaults, param_groups and state_dict) whose fully_shard parameters step
    in one native kernel per ParamGroup over flat state buffers; other parameters step with torch's AdamW.

    Refused (ValueError): amsgrad, capturable, differentiable, a Tensor lr or betas. ``foreach`` is used for
    the parameters torch steps; ``fused`` is accepted and ignored (the flat kernel is the fused path).

    ``step_in_backward=True`` (CPU-offloaded parameters only): each offloaded group steps on the host as soon as its
    gradient is reduced, under the rest of the backward; ``step()`` then steps the others. Refused at ``step()``
    where the result would differ from a step after backward (gradients or hyperparameters changed in between):
    [Note: optimizer step in backward] in in_backward.py.
    """

    STATE_NAMES = ("exp_avg", "exp_avg_sq")
    _UNSUPPORTED = (("amsgrad", "use torch.optim.AdamW(amsgrad=True)"),
                    ("capturable", "the flat kernel keeps steps on the host (torch's non-capturable AdamW); use "
                                   "capturable=False, or torch.optim.AdamW(capturable=True) for CUDA graphs"),
                    ("differentiable", "use torch.optim.AdamW(differentiable=True)"))

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, step_in_backward: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=None)
        self._setup_flat(step_in_backward)

    def _init_flat(self, p, flat: FlatState, i: int) -> None:
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())  # on the CPU, as torch's non-capturable AdamW
        for name in self.STATE_NAMES:
            state[name] = flat.fresh_view(name, i)

    def _flat_key(self, group_index: int, p) -> tuple[int, float]:
        state = self.state[p]
        state["step"] += 1
        return group_index, state["step"].item()

    def _step_counters(self, params: list) -> torch.Tensor | None:
        """The steps of ``params`` moved into one CPU tensor, each ``state[p]["step"]`` becoming a 0-dim view of its
        element (read, saved and loaded as torch's scalar step): a replay advances them all with one add."""
        if not params:  # nothing stepped in the graph (no gradients reached this optimizer)
            return None
        steps = torch.stack([self.state[p]["step"] for p in params])
        for k, p in enumerate(params):
            self.state[p]["step"] = steps[k]
        return steps

    def _replay_keys(self, plan: ReplayPlan) -> list | None:
        """Every step advanced by one in one add; each run's key from its first parameter's step, as _flat_key
        reads it."""
        if plan.counters is None:
            return []
        plan.counters.add_(1)
        steps = plan.counters.index_select(0, plan.first_positions).tolist()
        return [(group_index, step) for (group_index, _), step in zip(plan.keys, steps)]

    def _coeffs(self, keys: list[tuple[int, float]]) -> torch.Tensor:
        """Per run the kernel's coefficients (_native.adamw_step), in double as torch computes its scalars."""
        rows = []
        for group_index, step in keys:
            group = self.param_groups[group_index]
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
            rows.append([1 - lr * wd, 1 - beta1, beta2, 1 - beta2, bias_correction2**0.5, group["eps"],
                         -(lr / bias_correction1), -1.0 if group["maximize"] else 1.0])
        return torch.tensor(rows, dtype=torch.float32).reshape(-1, _native.OPTIM_COEFFS)

    def _run_kernel(self, group, flat: FlatState, runs: torch.Tensor, keys: list, coeffs: torch.Tensor,
                    device_table=None) -> None:
        _native.adamw_step(group.main_weight.data, group.grads.main_grad.data, flat.buffer("exp_avg"),
                           flat.buffer("exp_avg_sq"), runs, coeffs, device_table)

    def _torch_step(self, group: dict, params: list) -> None:
        """torch's AdamW step for ``params`` (its state init and its functional implementation)."""
        lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
        params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
        has_complex = self._init_group(dict(group, params=params), params_with_grad, grads, exp_avgs, exp_avg_sqs,
                                       max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=False,
             has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"], capturable=False,
             differentiable=False, fused=None, grad_scale=None, found_inf=None, decoupled_weight_decay=True)
