"""Train a small GPT with fully sharded data parallelism: mfsdp_ext (``--impl ours``) or PyTorch FSDP2.

    torchrun --nproc-per-node 2 examples/train_gpt.py                     # CPU / gloo, tiny model
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 30          # all GPUs / NCCL, medium model
    torchrun --nproc-per-node 2 examples/train_gpt.py --impl fsdp2        # the same job on PyTorch FSDP2

Read top to bottom: set up the process group, make a synthetic corpus, build the model (on the meta device),
shard each block and then the root with ``fully_shard``, materialise and initialise the shards, and train
with AdamW and gradient accumulation. Only rank 0 prints.

The data is a seeded random sparse Markov chain (every token has ``--branching`` possible successors with
random probabilities). It has structure a model learns quickly, and its entropy rate is the best loss
achievable, printed at start-up, so you can see how close training gets.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402  (examples/gpt.py: the model and the FSDP glue)

warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")

# Per-preset run defaults: (micro-batch size per rank, sequence length, learning rate).
RUN_DEFAULTS = {
    "tiny": (8, 128, 3e-3),
    "small": (8, 256, 1e-3),
    "medium": (4, 1024, 6e-4),
    "large": (4, 2048, 3e-4),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=gpt.IMPLS, default="ours", help="ours = mfsdp_ext, fsdp2 = PyTorch FSDP2")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--model", choices=["auto", *gpt.PRESETS], default="auto", help="auto: tiny on CPU, medium on GPU")
    p.add_argument("--n-layers", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--n-heads", type=int)
    p.add_argument("--ffn-dim", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--learned-positions", action="store_true", help="learned absolute positions instead of rotary")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, help="sequences per rank per microbatch")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps per optimizer step")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int, default=10, help="linear LR warm-up steps (then cosine to 10%%)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm; 0 disables clipping")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute (param) dtype; master weights and gradient reduction stay fp32. auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--meta-init", action=argparse.BooleanOptionalAction, default=True,
                   help="build on the meta device, shard, then materialise only the local shards")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="default: each implementation's own default")
    p.add_argument("--extra-ours", action="append", default=[], metavar="KEY=VAL",
                   help="extra keyword for mfsdp_ext.fully_shard, e.g. use_symm_mem=auto (repeatable)")
    p.add_argument("--data-vocab", type=int, help="tokens used by the corpus (default min(vocab, 1024))")
    p.add_argument("--branching", type=int, default=4, help="successors per token in the Markov chain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    return p.parse_args(argv)




# ---------------------------------------------------------------------------------------------- set-up


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: max_memory_allocated; CPU: the process's resident-set high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is KiB on Linux


# ----------------------------------------------------------------------------------------------- data


class MarkovCorpus:
    """Token streams from a seeded random sparse Markov chain; identical on every rank for one seed."""

    def __init__(self, vocab: int, branching: int, seed: int, n_chains: int, length: int) -> None:
        g = torch.Generator().manual_seed(seed)
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

    def batches(self, batch_size: int, seq_len: int, seed: int, device: torch.device):
        """Endless (inputs, targets) of shape (batch, seq) from random windows; ``seed`` differs per rank."""
        g = torch.Generator().manual_seed(seed)
        n_chains, length = self.stream.shape
        offsets = torch.arange(seq_len + 1)
        while True:
            rows = torch.randint(n_chains, (batch_size, 1), generator=g)
            starts = torch.randint(length - seq_len - 1, (batch_size, 1), generator=g)
            window = self.stream[rows, starts + offsets].to(device, non_blocking=True)
            yield window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------------------------- model


def build_model(args, device: torch.device, world: int):
    preset = args.model if args.model != "auto" else ("medium" if device.type == "cuda" else "tiny")
    overrides = {k: v for k, v in dict(n_layers=args.n_layers, dim=args.dim, n_heads=args.n_heads,
                                       ffn_dim=args.ffn_dim, vocab_size=args.vocab_size).items() if v is not None}
    batch, seq, lr = RUN_DEFAULTS[preset]
    args.batch_size = args.batch_size or batch
    args.seq_len = args.seq_len or seq
    args.lr = args.lr or lr
    cfg = gpt.GPTConfig(**{**gpt.PRESETS[preset], **overrides, "max_seq_len": max(args.seq_len, 16)},
                        tie_embeddings=args.tie_embeddings, rope=not args.learned_positions,
                        activation_checkpointing=args.activation_checkpointing)

    compute_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32,
                     "auto": torch.bfloat16 if device.type == "cuda" else torch.float32}[args.dtype]
    _, MixedPrecisionPolicy = gpt.load_impl(args.impl)
    shard_kwargs = dict(mesh=init_device_mesh(device.type, (world,)),
                        mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32))
    if args.reshard_after_forward is not None:
        shard_kwargs["reshard_after_forward"] = args.reshard_after_forward
    if args.impl == "ours":
        shard_kwargs.update(gpt.parse_kv(args.extra_ours))

    torch.manual_seed(args.seed)  # the same full model on every rank (non-meta path shards it)
    model = gpt.build_sharded(cfg, args.impl, device, args.meta_init, **shard_kwargs)
    return model, cfg, preset, compute_dtype, shard_kwargs


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global grad norm (DTensor-aware) and, if max_norm > 0, clip to it."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(total, "full_tensor"):  # DTensor with a Partial placement: finish the reduction
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def main(argv=None) -> None:
    args = parse_args(argv)
    device = gpt.setup_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()

    model, cfg, preset, compute_dtype, shard_kwargs = build_model(args, device, world)
    params = list(model.parameters())
    n_params = gpt.num_params(model)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)

    def lr_lambda(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    data_vocab = min(args.data_vocab or 1024, cfg.vocab_size)
    corpus = MarkovCorpus(data_vocab, args.branching, args.seed, n_chains=64,
                          length=max(8 * (args.seq_len + 1), 4096))
    batches = corpus.batches(args.batch_size, args.seq_len, seed=args.seed + 1 + rank, device=device)
    tokens_per_step = world * args.microbatches * args.batch_size * args.seq_len

    extra = {k: v for k, v in shard_kwargs.items() if k not in ("mesh", "mp_policy")}
    log(f"impl={args.impl} world={world} device={device.type} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) torch={torch.__version__}")
    log(f"model={preset} {n_params / 1e6:.2f}M params {cfg.to_dict()}")
    log(f"compute={compute_dtype} master=fp32 reduce=fp32 meta_init={args.meta_init} "
        f"activation_checkpointing={args.activation_checkpointing} fully_shard extra={extra}")
    log(f"batch={args.batch_size}x{args.seq_len} per rank x {args.microbatches} microbatches x {world} ranks "
        f"= {tokens_per_step} tokens/step; lr={args.lr} warmup={args.warmup} steps={args.steps}")
    log(f"data: Markov chain over {data_vocab} tokens, {args.branching} successors each; "
        f"best achievable loss (entropy rate) = {corpus.entropy:.3f}; uniform guess = {math.log(cfg.vocab_size):.3f}")

    losses, step_times = [], []
    gpt.synchronize(device)
    dist.barrier()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss_sum = gpt.forward_backward(model, args.impl, [next(batches) for _ in range(args.microbatches)])
        grad_norm = clip_grad_norm(params, args.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

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

    # Summary: the first steps include lazy initialisation and warm-up, so the median skips them.
    skip = min(3, len(step_times) // 2)
    median_dt = statistics.median(step_times[skip:])
    tok_s = tokens_per_step / median_dt
    peak = torch.tensor(peak_memory_mib(device), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tflops = gpt.flops_per_token(cfg, args.seq_len) * tok_s / world / 1e12
    log("-" * 100)
    log(f"summary impl={args.impl} world={world}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"(best possible {corpus.entropy:.3f}) | median {tok_s:.0f} tok/s ({median_dt * 1e3:.1f} ms/step, "
        f"{tflops:.2f} TFLOP/s per rank) | peak memory {peak.item():.1f} MiB "
        f"({'max_memory_allocated' if device.type == 'cuda' else 'RSS high-water'}, max over ranks)")
    if hasattr(model, "release_symmetric_memory"):  # ours: free use_symm_mem's NCCL pool (collective)
        model.release_symmetric_memory()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
