"""``fully_shard(root, check_finite_grads=True)``: after each backward's reductions, stop at the first parameter
whose reduced gradient holds NaN or inf, with the same error on every rank.

A NaN on one rank's input reaches only the ranks that hold the rows it lands in after the reduce-scatter; each
rank finds the first non-finite parameter among its own shards (in one order all ranks share: units, groups,
parameters), and one all-reduce (MIN) of that index over the mesh makes every rank name the same parameter.
Off by default, and then it costs nothing: no kernel, no collective.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm import dist_ops


class NonFiniteGradError(RuntimeError):
    """A reduced gradient holds NaN or inf (raised on every rank alike; the step can be skipped with zero_grad)."""


def check(root_module, units) -> None:
    """Raise NonFiniteGradError naming the first parameter (FQN from ``root_module``) whose reduced gradient is
    not finite on some rank. Collective: every rank of the mesh calls it after the same backward."""
    ordinals, views, total = [], [], 0
    for unit in units:
        for g in unit.groups:
            for i, info in enumerate(g.infos):
                main_grad = g.grads.main_grad
                if main_grad is not None and info.sharded.requires_grad and main_grad.param_view(i).numel():
                    ordinals.append(total)
                    views.append(g.grads.main_grad.param_view(i))
                total += 1
    mesh = next((g.mesh for u in units for g in u.groups), None)
    if mesh is None:
        return
    device = next(g.device for u in units for g in u.groups)
    first = torch.full((), total, dtype=torch.int64, device=device)
    if views:  # the max |x| of a shard is NaN or inf exactly when the shard holds one (one fused kernel)
        bad = ~torch.isfinite(torch.stack(torch._foreach_norm(views, math.inf)))
        candidates = torch.where(bad, torch.tensor(ordinals, device=bad.device), total)
        first = candidates.min().to(device)  # offloaded shards are in host memory; the all-reduce runs on the mesh's
    for dim in range(mesh.ndim):
        dist_ops.all_reduce(first, mesh.get_group(dim), op=dist.ReduceOp.MIN)
    index = int(first.item())
    if index < total:
        raise NonFiniteGradError(
            f"mfsdp_ext: the reduced gradient of '{_fqn(root_module, units, index)}' holds NaN or inf (the first "
            "such parameter, in module order; found by fully_shard(check_finite_grads=True)). Skip the step "
            "(optimizer.zero_grad()) or lower the learning rate / loss scale; look for a NaN in this batch's inputs "
            "or a loss that overflows.")


def _fqn(root_module, units, index: int) -> str:
    paths = {id(m): name for name, m in root_module.named_modules()}
    for unit in units:
        for g in unit.groups:
            if index < len(g.infos):
                place = g.infos[index].places[0]
                prefix = paths.get(id(place.holder), "")
                return f"{prefix}.{place.fqn}" if prefix else place.fqn
            index -= len(g.infos)
    return "?"
