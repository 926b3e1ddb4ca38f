"""Where the host time of one mfsdp_ext.graphed call goes (a replay, the GPU idle at its start).

    torchrun --nproc-per-node N benchmarks/graph_call.py [--configs 3,2] [--steps 20] [--out DIR]

For each config of benchmarks/step.py (the tiny ones on the CPU, where every call runs eagerly: no parts), the whole
step (forward, backward, mfsdp_ext.optim.AdamW, zero_grad) through mfsdp_ext.graphed, then per call, after a device
synchronisation: the call's time to return and its parts, timed around GraphedStep's methods and the graph launch:
  key       what the graph depends on, computed locally (shapes, modes, optimizers, held units' versions)
  agree     the ranks' agreement (one small all-reduce over a CPU group)
  prologue  the optimizers' host work (step counters, coefficients, one upload)
  launch    CUDAGraph.replay(): the graph's launch
  after     the weights epoch advanced; the output's copy
  rest      the call minus these (argument flattening, the arguments' copies into the graph's inputs)
Medians over steps, max over ranks, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import step as step_bench  # benchmarks/step.py: this script's folder
import torch
import torch.distributed as dist
from host_cost import HookTimer  # benchmarks/host_cost.py

import mfsdp_ext
import mfsdp_ext.optim
from mfsdp_ext.graphs import GraphedStep
from mfsdp_ext.optim.base import FlatOptimizerMixin
from mfsdp_ext.testing import gpt

PARTS = ("key", "agree", "prologue", "launch", "after")


def measure(cid: int, table: dict, device: torch.device, mesh, steps: int, timer: HookTimer) -> dict:
    bc = table[cid]
    model = gpt.build_sharded(bc.model_config(), "ours", device, False, mesh=mesh,
                              mp_policy=mfsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32))
    opt = mfsdp_ext.optim.AdamW(model.parameters(), lr=1e-4)
    batches = step_bench.make_batches(bc, device, seed=100 + dist.get_rank())

    def whole(batch_list):
        loss = gpt.forward_backward(model, "ours", batch_list)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    graphed = mfsdp_ext.graphed(whole, warmup=2)
    for _ in range(4):
        graphed(batches)
    rows = []
    for _ in range(steps):
        gpt.synchronize(device)
        timer.seconds.clear()
        t0 = time.perf_counter()
        graphed(batches)
        call = time.perf_counter() - t0
        row = {part: timer.seconds.get(part, 0.0) * 1e3 for part in PARTS}
        row["rest"] = call * 1e3 - sum(row.values())
        row["call"] = call * 1e3
        rows.append(row)
    gpt.synchronize(device)
    medians = {k: statistics.median(r[k] for r in rows) for k in (*PARTS, "rest", "call")}
    t = torch.tensor([medians[k] for k in medians], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    units = len(model._mfsdp_unit.context.units)
    return dict(zip(medians, t.tolist()), units=units)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="3,2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = gpt.setup_distributed("auto")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    timer = HookTimer()  # the parts do not nest: each call's time is its own
    timer.wrap(GraphedStep, "_key", "key")
    timer.wrap(GraphedStep, "_same_on_every_rank", "agree")
    timer.wrap(FlatOptimizerMixin, "graph_prologue", "prologue")
    timer.wrap(GraphedStep, "_after_replay", "after")
    timer.wrap(GraphedStep, "_output", "after")
    if device.type == "cuda":
        timer.wrap(torch.cuda.CUDAGraph, "replay", "launch")
    table = step_bench.CONFIGS if device.type == "cuda" else step_bench.TINY_CONFIGS
    results = {int(c): measure(int(c), table, device, mesh, args.steps, timer) for c in args.configs.split(",")}
    if dist.get_rank() == 0:
        where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        lines = [f"# The host time of one mfsdp_ext.graphed call, {dist.get_world_size()} x {where}", "",
                 f"torch {torch.__version__}; median of {args.steps} calls, each after a device synchronisation, max "
                 "over ranks, ms. `benchmarks/graph_call.py` (its docstring defines the parts).", "",
                 "| cfg | units | call | " + " | ".join((*PARTS, "rest")) + " |",
                 "|---|---|---|" + "---|" * (len(PARTS) + 1)]
        for cid, r in results.items():
            lines.append(f"| {cid} | {r['units']} | {r['call']:.2f} | "
                         + " | ".join(f"{r[k]:.3f}" for k in (*PARTS, "rest")) + " |")
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"graph_call_{dist.get_world_size()}gpu.md"), "w") as f:
                f.write(text)
    gpt.teardown_distributed(mesh)


if __name__ == "__main__":
    main()
