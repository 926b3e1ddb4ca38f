"""What fully_shard's default ("auto") chooses for the copy engines at benchmarks/step.py's configs: per config and
shard world size, per direction, whether the copy engines carry it, each buffer's size, the rounds a block and the
root take, and the four buffers as a share of the resident training state (mfsdp_ext.comm.copy_engine.plan_both).

The choice is made from the groups' layouts alone, so no GPU is needed: the model is built on the meta device over
a gloo group, and the conditions a GPU host must meet (CUDA, NCCL, one host, torch's symmetric memory) are taken as
met. Each rank count is its own run:

    torchrun --standalone --nproc-per-node 2 benchmarks/copy_engine_plan.py [--configs 1,2,3,4,5] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step import CONFIGS  # noqa: E402

import mfsdp_ext  # noqa: E402
from mfsdp_ext.comm import copy_engine  # noqa: E402
from mfsdp_ext.testing import gpt  # noqa: E402

DIRECTIONS = (("all-gather", copy_engine.gather_need), ("gradient exchange", copy_engine.reduce_need))


def plan_rows(config_id: int) -> list[list[str]]:
    """One row per direction of config ``config_id`` sharded over every rank."""
    cfg = CONFIGS[config_id]
    with torch.device("meta"):
        model = gpt.GPT(cfg.model_config())
    policy = mfsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                            reduce_comm_dtype=torch.bfloat16)
    gpt.shard_model(model, mfsdp_ext.fully_shard, mp_policy=policy)
    block = model.layers[0]._mfsdp_unit.groups
    root = model._mfsdp_unit.groups
    groups = [g for layer in model.layers for g in layer._mfsdp_unit.groups] + root
    resident = sum(copy_engine.resident_bytes(g) for g in groups)
    auto_bytes = copy_engine.auto_buffer_bytes(resident)
    asked = [("auto", g) for g in groups]
    plans = copy_engine.plan_both(asked, asked, auto_bytes)
    rows = []
    for (direction, need), (chosen, nbytes) in zip(DIRECTIONS, plans):
        size = nbytes or auto_bytes

        def rounds(unit_groups, size=size, need=need):
            return max(-(-need(g) // size) for g in unit_groups)

        rows.append([str(config_id), cfg.describe(), str(dist.get_world_size()), direction,
                     "copy engines" if chosen else "NCCL", f"{nbytes / 2**20:.1f}" if chosen else "-",
                     f"{max(need(g) for g in block) / 2**20:.1f}", str(rounds(block)),
                     f"{max(need(g) for g in root) / 2**20:.1f}", str(rounds(root)),
                     f"{2 * nbytes / resident * 100:.2f}%" if chosen else "0%"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1,2,3,4,5")
    p.add_argument("--out", default=None, help="write copy_engine_plan_<N>ranks.md here (rank 0)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    header = ["cfg", "model", "ranks", "direction", "auto", "buffer MiB", "block needs MiB", "block rounds",
              "root needs MiB", "root rounds", "2 buffers / resident"]
    rows = [row for c in args.configs.split(",") for row in plan_rows(int(c))]
    if dist.get_rank() == 0:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        print("\n".join(lines))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"copy_engine_plan_{dist.get_world_size()}ranks.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
