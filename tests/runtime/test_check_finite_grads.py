"""fully_shard(root, check_finite_grads=True): a NaN in one rank's gradient stops the step with the same error,
naming the same parameter, on every rank, and training goes on after the step is skipped (gloo ranks).

The reference for "goes on" is the same model trained without the poisoned step: fp32, same code path, so the
losses of the other steps must be equal exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mfsdp_ext import NonFiniteGradError, fully_shard
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, rank_device, shard_tiny_lm
from tests.interop.test_clip_grad_norm import Uneven
from tests.runtime.test_strategies import count_collectives
from tests.test_fully_shard import GLOBAL_BATCH

NAN = float("nan")


class Poisoned(Uneven):
    """Uneven whose gate gradient is NaN on the ranks that set ``poison`` (gate has 1 row: rank 0 holds it, so
    on more than one rank the NaN a rank >= 1 makes lands in another rank's shard only)."""

    poison = False

    def forward(self, x):
        gate = self.gate
        if self.poison:
            gate = gate.clone()
            gate.register_hook(lambda g: torch.full_like(g, NAN))
        return self.out(torch.tanh(self.inp(self.mix(x) * gate)))


def _poison_uneven(model, on: bool):
    model.poison = on
    return None


def _poison_block_output(model, on: bool):
    """NaN in the gradient reaching blocks[2]'s output: every parameter upstream of it gets a NaN gradient."""
    if not on:
        return None

    def hook(module, args, out):
        out.register_hook(lambda g: g * NAN)

    return model.blocks[2].register_forward_hook(hook)


def _step(model, step: int, poison, poisoned: bool) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    handle = poison(model, poisoned)
    try:
        if isinstance(model, TinyLM):
            tokens, targets = batch(step, GLOBAL_BATCH, device=rank_device())
            loss = lm_loss(model, tokens.chunk(world)[rank], targets.chunk(world)[rank])
        else:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
            loss = F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
    finally:
        poison(model, False) if handle is None else handle.remove()
    loss = loss.detach()
    dist.all_reduce(loss)
    return loss.item() / world


def _make(name: str, check: bool):
    torch.manual_seed(60)
    if name == "uneven":
        model = Poisoned()
        fully_shard(model.inp)
        return fully_shard(model, check_finite_grads=check), _poison_uneven
    model = TinyLM(tie=False)
    model.emb.requires_grad_(False)  # the root's parameters are then all downstream of the NaN
    for b in model.blocks:
        fully_shard(b)
    return fully_shard(model, check_finite_grads=check), _poison_block_output


def _run(model, poison, steps: int, bad_step: int, skip: bool):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, errors = [], []
    for step in range(steps):
        if step == bad_step and skip:
            losses.append(None)
            continue
        try:
            losses.append(_step(model, step, poison, step == bad_step and dist.get_rank() == 1))
        except NonFiniteGradError as e:
            errors.append(str(e))
            losses.append(None)
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return losses, errors


def _case_nan_found(name: str, expected_fqn: str):
    model, poison = _make(name, check=True)
    clean, _ = _make(name, check=True)
    got, errors = _run(model, poison, steps=4, bad_step=1, skip=False)
    want, clean_errors = _run(clean, poison, steps=4, bad_step=1, skip=True)
    assert len(errors) == 1 and f"'{expected_fqn}'" in errors[0], errors
    assert not clean_errors and got == want, (got, want)
    return {"error": errors[0][:90], "losses": got}


def _case_cost_when_off():
    """Off: no collective added. On: one all-reduce (MIN of an index) per backward on a 1-D mesh."""
    counts = {}
    for check in (False, True):
        model, poison = _make("tiny_lm", check)
        _step(model, 0, poison, False)  # the first step: lazy init
        with count_collectives() as c:
            _step(model, 1, poison, False)
        counts[check] = c.get("all_reduce", 0)
    assert counts[True] == counts[False] + 1, counts
    return counts


def _case_inner_unit_refused():
    model = TinyLM()
    fully_shard(model.blocks[0], check_finite_grads=True)
    shard_tiny_lm(model, lambda m: m if m is model.blocks[0] else fully_shard(m))
    with pytest.raises(ValueError, match="pass it to fully_shard of the root"):
        model(torch.zeros(2, 3, dtype=torch.long, device=rank_device()))
    return "refused"


@pytest.mark.parametrize("name,expected_fqn", [("uneven", "gate"), ("tiny_lm", "blocks.0.norm.weight")])
def test_nan_gradient_named_on_every_rank(cpu_pool, name, expected_fqn):
    print(cpu_pool.run(_case_nan_found, name, expected_fqn))


def test_check_finite_grads_cost(cpu_pool):
    print(cpu_pool.run(_case_cost_when_off)[0])


def test_check_finite_grads_on_inner_unit_refused(cpu_pool):
    print(cpu_pool.run(_case_inner_unit_refused)[0])
