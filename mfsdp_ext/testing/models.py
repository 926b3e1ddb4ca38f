"""Small models and a training loop shared by the distributed tests (run inside the rank processes)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..sharding.groups import reduces_early


class Block(nn.Module):
    def __init__(self, dim: int, ffn: int, checkpointing: str = "off"):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.checkpointing = checkpointing  # "off", "reentrant", "non_reentrant"

    def _body(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    def forward(self, x):
        if self.checkpointing == "off":
            return self._body(x)
        return checkpoint(self._body, x, use_reentrant=self.checkpointing == "reentrant")


class TinyLM(nn.Module):
    """Odd sizes on purpose: vocab 11 and a 3-wide aux head do not divide by 2 or 4 ranks."""

    def __init__(self, vocab: int = 11, dim: int = 12, ffn: int = 20, n_layers: int = 3, *, tie: bool = True,
                 checkpointing: str = "off"):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, ffn, checkpointing) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.aux = nn.Linear(dim, 3)

    def forward(self, tokens):
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h)), self.aux(h)


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits, aux = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) + 0.1 * aux.float().square().mean()


def rank_device() -> torch.device:
    """cuda:<current> under NCCL, cpu under gloo (or without a process group)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def batch(step: int, batch_size: int, seq: int = 6, vocab: int = 11, device=None):
    device = device or rank_device()
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def lm_train_step(model: nn.Module, opt):
    """One whole training step of ``model`` (the callable mfsdp_ext.graphed takes): loss, backward, step, zero_grad."""
    def train_step(tokens, targets):
        loss = lm_loss(model, tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


def root_groups(device: torch.device) -> int:
    """The parameter groups of shard_tiny_lm's root unit: on CUDA two, the embedding and the final norm and aux head
    used after the blocks (reduced as soon as their grads are ready, under the rest of the backward); on the CPU,
    where no collective overlaps compute, one (one reduce-scatter per unit, FSDP2's count)."""
    return 2 if reduces_early(device) else 1


def shard_tiny_lm(model: TinyLM, fully_shard, **kwargs) -> TinyLM:
    for b in model.blocks:
        fully_shard(b, **kwargs)
    fully_shard(model, **kwargs)
    return model


def train(model: nn.Module, steps: int, global_batch: int, *, sharded: bool, microbatches: int = 1,
          lr: float = 1e-2, microbatch_ctx=None) -> list[float]:
    """AdamW steps on the same global batches; a sharded model sees this rank's slice. Returns global losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    device = rank_device()
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, global_batch, device=device)
        tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
        total = torch.zeros((), device=device)
        for i, (t, y) in enumerate(zip(tokens.chunk(microbatches), targets.chunk(microbatches))):
            ctx = microbatch_ctx(model, i == 0, i == microbatches - 1) if microbatch_ctx else contextlib.nullcontext()
            with ctx:
                loss = lm_loss(model, t, y) / microbatches
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        if sharded:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_profiled(fn):
    """Run fn() under the CUDA profiler, waiting for the GPU before and after. Returns (fn's result, the
    (name, start_us, end_us) of every CUDA kernel, copy and memset it ran)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return result, events


@contextlib.contextmanager
def intercept_collectives(names, on_call):
    """``on_call(name, args)`` before each call of the mfsdp_ext.comm.dist_ops functions ``names`` (the only place the
    plain path issues torch.distributed collectives from), for the duration of the block."""
    import mfsdp_ext.comm.dist_ops as comm

    originals = {n: getattr(comm, n) for n in names}

    def wrap(name, fn):
        def called(*args, **kwargs):
            on_call(name, args)
            return fn(*args, **kwargs)
        return called

    for n, fn in originals.items():
        setattr(comm, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(comm, n, fn)
