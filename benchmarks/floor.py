"""The physical floor of a step config: the least time its work can take at the rates a machine was measured at.

    python3 benchmarks/floor.py --configs 3 --machine 4xh200 [--measured 22.4] [--compute-ms 13.9] [--no-regather]

One training step of benchmarks/step.py's config (forward + backward of every microbatch, an AdamW step on each
rank's fp32 shard, bf16 compute) needs, per rank:
  * compute: the model FLOPs of the rank's tokens (6 x matmul parameters + causal attention, gpt.flops_per_token)
    at the dense bf16 rate of a large matrix product; or (--compute-ms) a measured time of the same work: the
    unsharded forward + backward captured in a CUDA graph on one GPU (step.py's floor, `fwd+bwd`), which counts
    the rate its kernels really reach at this shape (small matrices, attention, norms, activations);
  * NVLink: the bytes each rank's all-gathers and reduce-scatters must move, (W-1)/W of the bf16 parameters per
    gather (per microbatch: one in forward, one more in backward as blocks are resharded after forward, the
    default; --no-regather: one gather per step, everything kept gathered) and of the bf16 gradients once per step
    (gradients accumulated across microbatches), at the measured bus bandwidth of a large collective;
  * HBM: the optimizer's 28 bytes per shard element (read parameter, gradient, two moments; write parameter, two
    moments) plus the bf16 cast (4 bytes read, 2 written) at the measured copy bandwidth.
The three use different units (SMs, NVLink, memory), so a step can in principle overlap them all: the floor is the
largest of the three. `serial` is their sum (nothing overlapped). Neither counts kernel launches or activations'
memory traffic, so both are lower bounds. The rates of each machine come from the committed tables named below.
"""

from __future__ import annotations

import argparse
import sys

# machine -> (world, dense bf16 TFLOP/s, all-gather bus GB/s, reduce-scatter bus GB/s, copy GB/s, where from)
MACHINES = {
    "2xh200": (2, 788.0, 254.5, 227.2, 4152.0,
               "matmul: 8192^3 bf16 product on H200 (device notes); collectives_2xh200.md plain 256 MiB; "
               "optim_h200.md copy"),
    "4xh200": (4, 788.0, 308.2, 298.6, 4152.0,
               "matmul: 8192^3 bf16 product on H200 (device notes); collectives_4xh200.md plain 256 MiB; "
               "optim_h200.md copy"),
}


def param_count(cfg) -> int:
    import torch

    from mfsdp_ext.testing import gpt

    with torch.device("meta"):
        model = gpt.GPT(cfg)
    return sum(p.numel() for p in model.parameters())


def floor(config_id: int, machine: str, regather: bool = True, compute_ms: float | None = None) -> dict:
    from step import CONFIGS  # benchmarks/step.py: this script's folder

    from mfsdp_ext.testing import gpt

    world, tflops, ag_gbs, rs_gbs, copy_gbs, _ = MACHINES[machine]
    bc = CONFIGS[config_id]
    cfg = bc.model_config()
    params = param_count(cfg)
    tokens = bc.batch * bc.seq * bc.microbatches
    if compute_ms is None:
        compute_ms = gpt.flops_per_token(cfg, bc.seq) * tokens / (tflops * 1e12) * 1e3
    full_bf16 = 2 * params
    gathers = 2 * bc.microbatches if regather else 1
    moved = (world - 1) / world * full_bf16
    nvlink_ms = (gathers * moved / (ag_gbs * 1e9) + moved / (rs_gbs * 1e9)) * 1e3
    shard = params / world
    hbm_ms = shard * (28 + 6) / (copy_gbs * 1e9) * 1e3
    parts = {"compute": compute_ms, "nvlink": nvlink_ms, "hbm": hbm_ms}
    return {"config": config_id, "machine": machine, "params": params, "tokens_per_rank": tokens, **parts,
            "floor": max(parts.values()), "bound_by": max(parts, key=parts.get), "serial": sum(parts.values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="3")
    p.add_argument("--machine", choices=sorted(MACHINES), default="4xh200")
    p.add_argument("--measured", default="", help="step ms to compare, one per config (comma-separated)")
    p.add_argument("--no-regather", action="store_true", help="one gather per step (blocks kept gathered)")
    p.add_argument("--compute-ms", default="", help="measured compute ms per config (comma-separated): the "
                   "unsharded forward + backward of all microbatches in a CUDA graph on one GPU")
    args = p.parse_args()
    configs = [int(c) for c in args.configs.split(",")]
    measured = [float(x) for x in args.measured.split(",")] if args.measured else []
    compute = [float(x) for x in args.compute_ms.split(",")] if args.compute_ms else [None] * len(configs)
    print(f"rates ({args.machine}): {MACHINES[args.machine][5]}")
    if args.compute_ms:
        print("compute: measured (--compute-ms), not the matrix-product rate")
    print("| config | params | tokens/rank | compute ms | NVLink ms | HBM ms | floor ms (bound by) | serial ms |"
          + (" measured ms | measured / floor |" if measured else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if measured else ""))
    for i, c in enumerate(configs):
        f = floor(c, args.machine, regather=not args.no_regather, compute_ms=compute[i])
        row = (f"| {c} | {f['params'] / 1e6:.0f}M | {f['tokens_per_rank']} | {f['compute']:.2f} | {f['nvlink']:.2f} | "
               f"{f['hbm']:.2f} | {f['floor']:.2f} ({f['bound_by']}) | {f['serial']:.2f} |")
        if measured:
            row += f" {measured[i]:.1f} | {measured[i] / f['floor']:.2f} |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
