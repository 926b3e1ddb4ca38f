"""The training loop that both example jobs (train_gpt.py, train_hf.py) run, so they print the same lines.

``add_args`` adds the run's flags (steps, batch, schedule, data, checkpoints); ``run`` trains a sharded model with
AdamW, a linear warm-up + cosine learning rate, gradient accumulation and clipping, prints one progress line per
step and a summary, and saves / resumes DCP checkpoints (checkpointing.py). Only rank 0 prints.

The data is a seeded random sparse Markov chain (every token has ``--branching`` possible successors with random
probabilities). It has structure a model learns quickly, and its entropy rate is the best loss achievable, printed
at start-up, so you can see how close training gets. A batch is a function of (seed, rank, step, microbatch), so
resuming at a step needs no data-loader state.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import time
from collections.abc import Callable

import checkpointing  # examples/checkpointing.py, beside this file (on sys.path: the examples run as scripts)
import torch
import torch.distributed as dist

from mfsdp_ext.testing import gpt


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, help="sequences per rank per microbatch")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps per optimizer step")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int, default=10, help="linear LR warm-up steps (then cosine to 10%%)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--optimizer", choices=["torch", "fused"], default="torch",
                   help="torch.optim.AdamW, or mfsdp_ext.optim.AdamW (one native kernel per flat group; --impl ours)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm; 0 disables clipping")
    p.add_argument("--cuda-graph", action="store_true",
                   help="(--impl ours) run each step (forward, backward, clipping, optimizer step) as one CUDA graph "
                        "through mfsdp_ext.graphed; on CPU the steps run eagerly, with one warning")
    p.add_argument("--data-vocab", type=int, help="tokens used by the corpus (default min(vocab, 1024))")
    p.add_argument("--branching", type=int, default=4, help="successors per token in the Markov chain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="two runs with one seed give bit-identical losses on GPU: attention on SDPA's math backend "
                        "(slower, more memory); see use_deterministic_attention")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--metrics-file", help="rank 0 appends one JSON line per step (exact losses) to this file")
    p.add_argument("--ckpt-dir", help="folder of DCP checkpoints (step-<N>/ each)")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="save a checkpoint every N steps and after the last one (0: never)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --ckpt-dir (from scratch if it has none)")


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Reports bad values of add_args' flags through the parser (usage + message, exit 2)."""
    for name in ("steps", "microbatches", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.ckpt_every < 0:
        p.error("--ckpt-every must be >= 0 (0: no checkpoints)")
    if (args.ckpt_every or args.resume) and not args.ckpt_dir:
        p.error("--ckpt-every and --resume need --ckpt-dir")
    if args.cuda_graph and getattr(args, "impl", "ours") != "ours":
        p.error("--cuda-graph captures the step with mfsdp_ext.graphed: use it with --impl ours")


def use_deterministic_attention() -> None:
    """Attention on SDPA's math backend only. Flash, memory-efficient and cuDNN attention add up their backward
    in an order that varies between runs, and on GPU that is the one source of run-to-run differences this job
    has: with the math backend, two runs of 20 steps on 2 H100 gave bit-identical losses and gradient norms, bf16
    and FP8 (`gpu_check.sh repeat`); with flash attention they differed from the first step's gradients on."""
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: max_memory_allocated; CPU: the process's resident-set high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is KiB on Linux


class MarkovCorpus:
    """Token streams from a seeded random sparse Markov chain; identical on every rank for one seed."""

    def __init__(self, vocab: int, branching: int, seed: int, n_chains: int, length: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.succ = torch.randint(vocab, (vocab, branching), generator=g)
        probs = -torch.rand(vocab, branching, generator=g).clamp_min(1e-6).log()  # Dirichlet(1, ..., 1)
        probs /= probs.sum(1, keepdim=True)
        cdf = probs.cumsum(1)
        stream = torch.empty(n_chains, length, dtype=torch.long)
        cur = torch.randint(vocab, (n_chains,), generator=g)
        for t in range(length):
            stream[:, t] = cur
            u = torch.rand(n_chains, 1, generator=g)
            j = torch.searchsorted(cdf[cur], u).clamp_(max=branching - 1).squeeze(1)
            cur = self.succ[cur, j]
        self.stream = stream
        # Best achievable loss: the entropy of the next-token distribution, averaged over the corpus.
        dense = torch.zeros(vocab, vocab).index_put_((torch.arange(vocab)[:, None].expand_as(self.succ), self.succ),
                                                     probs, accumulate=True)
        row_entropy = -(dense * dense.clamp_min(1e-30).log()).sum(1)
        self.entropy = row_entropy[stream].mean().item()

    def batch(self, batch_size: int, seq_len: int, rank: int, step: int, micro: int, device: torch.device):
        """(inputs, targets) of shape (batch, seq): random windows drawn from a generator seeded by
        (seed, rank, step, microbatch), so any step's data can be made again without replaying the ones before."""
        g = torch.Generator().manual_seed((((self.seed * 1_000_003 + rank) * 1_000_003 + step) * 1_000_003 + micro)
                                          % 2**63)
        n_chains, length = self.stream.shape
        rows = torch.randint(n_chains, (batch_size, 1), generator=g)
        starts = torch.randint(length - seq_len - 1, (batch_size, 1), generator=g)
        window = self.stream[rows, starts + torch.arange(seq_len + 1)].to(device, non_blocking=True)
        return window[:, :-1], window[:, 1:]


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global grad norm (DTensor-aware) and, if max_norm > 0, clip to it."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(total, "full_tensor"):  # DTensor with a Partial placement: finish the reduction
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def make_optimizer(args, params, device: torch.device):
    """torch's AdamW, or mfsdp_ext.optim.AdamW (--optimizer fused). Stepped inside a CUDA graph (--cuda-graph),
    torch's needs capturable=True and a tensor lr (which the scheduler then writes in place)."""
    hyper = dict(betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if getattr(args, "optimizer", "torch") == "fused":
        import mfsdp_ext.optim

        return mfsdp_ext.optim.AdamW(params, lr=args.lr, **hyper)
    if getattr(args, "cuda_graph", False) and device.type == "cuda":
        return torch.optim.AdamW(params, lr=torch.tensor(args.lr, device=device), capturable=True, **hyper)
    return torch.optim.AdamW(params, lr=args.lr, **hyper)


def lr_lambda(args) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def run(model, args, device: torch.device, *, impl: str, vocab_size: int, flops_per_token: float,
        describe: list[str], loss_fn: Callable | None = None) -> list[float]:
    """Train ``model`` (sharded with ``impl``) for ``args.steps`` steps; returns this run's per-step losses.
    ``describe``: the lines about the model that rank 0 prints first; ``loss_fn(model, inputs, targets)``: the mean
    loss of a microbatch (default ``model(inputs, targets)``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.deterministic:
        use_deterministic_attention()
    params = list(model.parameters())
    optimizer = make_optimizer(args, params, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))

    def train_step(microbatches):
        loss_sum = gpt.forward_backward(model, impl, microbatches, loss_fn)
        grad_norm = clip_grad_norm(params, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    if getattr(args, "cuda_graph", False):
        import mfsdp_ext

        train_step = mfsdp_ext.graphed(train_step, warmup=2)

    data_vocab = min(args.data_vocab or 1024, vocab_size)
    corpus = MarkovCorpus(data_vocab, args.branching, args.seed, n_chains=64, length=max(8 * (args.seq_len + 1), 4096))
    tokens_per_step = world * args.microbatches * args.batch_size * args.seq_len

    log(f"impl={impl} world={world} device={device.type} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) torch={torch.__version__}")
    for line in describe:
        log(line)
    log(f"batch={args.batch_size}x{args.seq_len} per rank x {args.microbatches} microbatches x {world} ranks "
        f"= {tokens_per_step} tokens/step; lr={args.lr} warmup={args.warmup} steps={args.steps}"
        + ("; deterministic attention (SDPA math)" if args.deterministic else ""))
    log(f"data: Markov chain over {data_vocab} tokens, {args.branching} successors each; "
        f"best achievable loss (entropy rate) = {corpus.entropy:.3f}; uniform guess = {math.log(vocab_size):.3f}")

    start = 0
    if args.resume:
        found = checkpointing.latest(args.ckpt_dir)
        if found is None:
            log(f"resume: no complete checkpoint in {args.ckpt_dir}; starting from step 0")
        else:
            start = checkpointing.load(found[1], model, optimizer, scheduler)
            log(f"resumed from {found[1]} at step {start}" + (" of " + str(args.steps) + ": nothing left to train"
                                                                 if start >= args.steps else ""))

    losses, step_times = [], []
    gpt.synchronize(device)
    dist.barrier()
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        microbatches = [corpus.batch(args.batch_size, args.seq_len, rank, step, i, device)
                        for i in range(args.microbatches)]
        loss_sum, grad_norm = train_step(microbatches)
        scheduler.step()

        dist.all_reduce(loss_sum)  # SUM (gloo has no AVG)
        loss_value = loss_sum.item() / world  # .item() also waits for the step to finish
        dt = time.perf_counter() - t0
        losses.append(loss_value)
        step_times.append(dt)
        if not math.isfinite(loss_value):
            log(f"step {step}: loss is {loss_value}, stopping")
            break
        if step % args.log_every == 0 or step == args.steps:
            log(f"step {step:4d} | loss {loss_value:7.4f} | grad_norm {grad_norm.item():7.3f} | "
                f"lr {scheduler.get_last_lr()[0]:.2e} | {tokens_per_step / dt:10.0f} tok/s | "
                f"{dt * 1e3:8.1f} ms | peak {peak_memory_mib(device):8.1f} MiB")
        if args.metrics_file and rank == 0:
            with open(args.metrics_file, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss_value, "grad_norm": grad_norm.item(),
                                    "lr": scheduler.get_last_lr()[0]}) + "\n")
        if args.ckpt_every and (step % args.ckpt_every == 0 or step == args.steps):
            path, seconds = checkpointing.save(args.ckpt_dir, step, model, optimizer, scheduler)
            log(f"checkpoint: step {step} saved to {path} ({seconds:.1f} s)")

    if losses:
        summarize(args, impl, device, losses, step_times, tokens_per_step, flops_per_token, corpus.entropy, start)
    if hasattr(model, "release_symmetric_memory"):  # ours: free use_symm_mem's NCCL pool (collective)
        model.release_symmetric_memory()
    dist.barrier()
    return losses


def summarize(args, impl, device, losses, step_times, tokens_per_step, flops_per_token, entropy, start) -> None:
    # The first steps include lazy initialisation and warm-up, so the median skips them.
    skip = min(3, len(step_times) // 2)
    median_dt = statistics.median(step_times[skip:])
    tok_s = tokens_per_step / median_dt
    peak = torch.tensor(peak_memory_mib(device), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    world = dist.get_world_size()
    tflops = flops_per_token * tok_s / world / 1e12
    resumed = f" (resumed at step {start})" if start else ""
    log("-" * 100)
    log(f"summary impl={impl} world={world}: loss {losses[0]:.4f} -> {losses[-1]:.4f}{resumed} "
        f"(best possible {entropy:.3f}) | median {tok_s:.0f} tok/s ({median_dt * 1e3:.1f} ms/step, "
        f"{tflops:.2f} TFLOP/s per rank) | peak memory {peak.item():.1f} MiB "
        f"({'max_memory_allocated' if device.type == 'cuda' else 'RSS high-water'}, max over ranks)")
