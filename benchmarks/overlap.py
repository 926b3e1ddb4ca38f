#!/usr/bin/env python3
"""How much a transfer running beside a matmul slows it: NCCL's all-gather (its kernels take SMs) against
copy-engine copies that pull each peer's shard over peer-mapped memory (no SMs).

    torchrun --standalone --nproc-per-node N benchmarks/overlap.py --out DIR

The sizes are config 1's (benchmarks/step.py): a block of 16 x d2048 ffn5632 (51.4M parameters, gathered in bf16)
and the matmuls of its forward at 2 x 2048 tokens per rank: the q projection (4096 x 2048 x 2048) and the first
feed-forward one (4096 x 2048 x 5632). For each matmul and each transfer: the matmul's mean time in a loop of
--matmuls back to back on the compute stream, alone and with the transfer looping on a side stream for longer than
that; and the transfer's mean time alone and beside the matmuls. Median of --repeats, max over ranks.

  nccl_all_gather         torch.distributed.all_gather_into_tensor of the block (ProcessGroupNCCL, in place)
  pull_same_order         one barrier, then each peer's shard copied out of its symmetric buffer straight into the
                          gathered tensor, every rank in the order 0, 1, ..., N-1 (all read rank 0 first, then 1, ...)
  pull_peer_order         the same, each rank starting at itself and going around (mfsdp_ext.comm.copy_engine's
                          order: at each turn the ranks read from distinct peers)
  pull_peer_streams       the same copies, each peer's on a stream of its own, forked from and joined to the
                          transfer's stream (all copies in flight at once)

Each is checked once for the values it delivers. Rank 0 writes overlap_<N>gpu.{md,json}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics

import torch
import torch.distributed as dist

from mfsdp_ext.comm.copy_engine import peer_order

BLOCK_PARAMS = 4 * 2048 * 2048 + 3 * 2048 * 5632  # config 1's block: q, k, v, o and the three feed-forward weights
MATMULS = {"q projection 4096x2048x2048": (4096, 2048, 2048), "ffn w1 4096x2048x5632": (4096, 2048, 5632)}


def timed(stream: torch.cuda.Stream, fn, count: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Queue ``count`` calls of fn on ``stream`` between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(count):
            fn()
        end.record()
    return start, end


def measure(matmul, transfer, matmuls: int, transfers: int) -> tuple[float, float]:
    """Mean ms of one matmul and of one transfer, each queued on its own stream (either may be None)."""
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(compute)
    dist.barrier()
    torch.cuda.synchronize()
    t_side = timed(side, transfer, transfers) if transfer else None
    t_mm = timed(compute, matmul, matmuls) if matmul else None
    torch.cuda.synchronize()
    mean = lambda t, n: t[0].elapsed_time(t[1]) / n if t else float("nan")
    return mean(t_mm, matmuls), mean(t_side, transfers)


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def transfers(rank: int, world: int, device: torch.device) -> dict:
    import torch.distributed._symmetric_memory as symm_mem

    shard = -(-BLOCK_PARAMS // world)
    gathered = torch.empty(shard * world, dtype=torch.bfloat16, device=device)
    own = gathered[rank * shard:(rank + 1) * shard]
    own.fill_(rank)
    mine = symm_mem.empty(shard, dtype=torch.bfloat16, device=device)
    mine.fill_(rank)
    group_name = dist.group.WORLD.group_name
    handle = symm_mem.rendezvous(mine, group_name)
    peers = [handle.get_buffer(r, (shard,), torch.bfloat16) for r in range(world)]
    chunks = gathered.view(world, shard)
    streams = [torch.cuda.Stream() for _ in range(world)]

    def all_gather():
        dist.all_gather_into_tensor(gathered, own)

    def pull(order: list[int], own_streams: bool):
        def move():  # the shards never change here, so one barrier per call keeps every read valid
            handle.barrier(channel=0)
            here = torch.cuda.current_stream()
            for r in order:
                if own_streams:
                    streams[r].wait_stream(here)
                with torch.cuda.stream(streams[r] if own_streams else here):
                    chunks[r].copy_(peers[r])
            for r in order if own_streams else ():
                here.wait_stream(streams[r])
        return move

    moves = {"nccl_all_gather": all_gather, "pull_same_order": pull(list(range(world)), False),
             "pull_peer_order": pull(peer_order(rank, world), False),
             "pull_peer_streams": pull(peer_order(rank, world), True)}
    expected = torch.arange(world, device=device).repeat_interleave(shard).to(torch.bfloat16)
    for name, move in moves.items():
        gathered.zero_()
        own.fill_(rank)  # the NCCL all-gather's input
        move()
        torch.cuda.synchronize()
        if not torch.equal(gathered, expected):
            raise RuntimeError(f"{name} delivered wrong values")
    return moves


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--matmuls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    moves = transfers(rank, world, device)
    rows = []
    for mm_name, (m, k, n) in MATMULS.items():
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        w = torch.randn(n, k, dtype=torch.bfloat16, device=device)
        matmul = functools.partial(torch.nn.functional.linear, x, w)
        for _ in range(3):
            measure(matmul, None, 20, 0)
        alone = statistics.median(measure(matmul, None, args.matmuls, 0)[0] for _ in range(args.repeats))
        alone = max_over_ranks(alone)
        for t_name, move in moves.items():
            t_alone = max_over_ranks(statistics.median(measure(None, move, 0, 20)[1] for _ in range(args.repeats)))
            # enough transfers to outlast the matmul loop
            count = max(4, int(2 * alone * args.matmuls / t_alone) + 1)
            both = [measure(matmul, move, args.matmuls, count) for _ in range(args.repeats)]
            mm = max_over_ranks(statistics.median(b[0] for b in both))
            tr = max_over_ranks(statistics.median(b[1] for b in both))
            rows.append(dict(matmul=mm_name, transfer=t_name, matmul_alone_ms=alone, matmul_beside_ms=mm,
                             slowdown=mm / alone, transfer_alone_ms=t_alone, transfer_beside_ms=tr))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"overlap_{world}gpu")
        env = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, world=world,
                   nccl=".".join(map(str, torch.cuda.nccl.version())), block_params=BLOCK_PARAMS)
        with open(stem + ".json", "w") as f:
            json.dump(dict(environment=env, rows=rows), f, indent=1)
        lines = [f"# A matmul beside a transfer, {world} x {env['gpu']}", "",
                 f"torch {env['torch']}, NCCL {env['nccl']}; transfer = one block of config 1 "
                 f"({BLOCK_PARAMS / 1e6:.1f}M bf16 parameters) gathered; medians of {args.repeats}, max over ranks.",
                 "", "| matmul | transfer | matmul alone us | matmul beside us | slowdown | transfer alone us "
                 "| transfer beside us |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['matmul']} | {r['transfer']} | {r['matmul_alone_ms'] * 1e3:.1f} | "
                         f"{r['matmul_beside_ms'] * 1e3:.1f} | {r['slowdown']:.2f}x | "
                         f"{r['transfer_alone_ms'] * 1e3:.1f} | {r['transfer_beside_ms'] * 1e3:.1f} |")
        with open(stem + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
