"""What mfsdp_ext.no_shard saves: a model with a frozen 24-layer tower (as a vision tower in a vision-language
model) and trainable blocks on top, the tower sharded like the rest vs marked no_shard, in one run.

    torchrun --nproc-per-node 2 benchmarks/no_shard.py --out benchmarks/results

Reports per step (median of --steps after --warmup): time, collectives issued by the plain path (counted at
mfsdp_ext.comm.dist_ops), and peak memory (max_memory_allocated, max over ranks). bf16 compute, fp32 main weights,
AdamW over the trainable parameters. Rank 0 writes no_shard_<N>gpu.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import mfsdp_ext.comm.dist_ops as dist_ops
from mfsdp_ext import MixedPrecisionPolicy, fully_shard, no_shard
from mfsdp_ext.core.device import cuda_median_ms


class Block(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TowerModel(nn.Module):
    def __init__(self, dim: int, tower_layers: int, trained_layers: int):
        super().__init__()
        self.tower = nn.ModuleList(Block(dim, 4 * dim) for _ in range(tower_layers))
        self.blocks = nn.ModuleList(Block(dim, 4 * dim) for _ in range(trained_layers))
        self.head = nn.Linear(dim, dim)
        self.tower.requires_grad_(False)

    def forward(self, x):
        for b in self.tower:
            x = b(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@contextlib.contextmanager
def count_collectives():
    counts = Counter()
    names = ("all_gather_into", "reduce_scatter_into", "all_reduce")
    originals = {n: getattr(dist_ops, n) for n in names}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for n in names:
        setattr(dist_ops, n, counted(n, originals[n]))
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(dist_ops, n, fn)


def run_variant(marked: bool, args, device) -> dict:
    torch.manual_seed(0)
    model = TowerModel(args.dim, args.tower_layers, args.trained_layers).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if marked:
        no_shard(model.tower)
    for b in list(model.tower) + list(model.blocks):
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randn(args.batch, args.seq, args.dim, device=device)

    def step():
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with count_collectives() as counts:
        step()
    step_ms = cuda_median_ms(step, args.steps, warmup=0)
    t = torch.tensor([step_ms, torch.cuda.max_memory_allocated() / 2**30], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"step_ms": t[0].item(), "peak_gib": t[1].item(), "collectives_per_step": dict(counts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--tower-layers", type=int, default=24)
    p.add_argument("--trained-layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    results = {}
    for name, marked in (("tower sharded", False), ("tower no_shard", True)):
        results[name] = run_variant(marked, args, device)
        torch.cuda.empty_cache()  # the variant's model and optimizer are gone
    if dist.get_rank() == 0:
        base = results["tower sharded"]
        lines = [f"# no_shard: a frozen {args.tower_layers}-layer tower, {world} x {torch.cuda.get_device_name()}", "",
                 f"d{args.dim} ffn{4 * args.dim}, {args.trained_layers} trained blocks + head, batch {args.batch} x "
                 f"{args.seq}, bf16 compute, AdamW; median of {args.steps} steps after {args.warmup}.", "",
                 "| variant | step ms | vs sharded | peak GiB | all-gathers | reduce-scatters | all-reduces |",
                 "|---|---|---|---|---|---|---|"]
        for name, r in results.items():
            c = r["collectives_per_step"]
            counts = " | ".join(str(c.get(k, 0)) for k in ("all_gather_into", "reduce_scatter_into", "all_reduce"))
            lines.append(f"| {name} | {r['step_ms']:.2f} | {r['step_ms'] / base['step_ms']:.3f} | "
                         f"{r['peak_gib']:.2f} | {counts} |")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"no_shard_{world}gpu.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, f"no_shard_{world}gpu.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
