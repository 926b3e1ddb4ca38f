"""Host issue time against wall time per training step: is a step bound by the host or by the GPU?

    torchrun --nproc-per-node N benchmarks/host_issue.py [--configs 5,4] [--variants bf16,fp8,fp8_keep] [--steps 10]

For each config of benchmarks/step.py (TINY_CONFIGS on the CPU) and each variant of ours with the fused optimizer
(bf16; fp8: Fp8Policy(compute=True); fp8_keep: the same with cache_model_weight=True), one step at a time after
warm-up: the GPU is drained, then `host` is the time until the step's Python returns (every kernel issued, none
waited for) and `wall` the time until the GPU has finished too (medians, rank 0). host close to wall: the host
bounds the step; host well below wall: the GPU does. ``--profile`` adds a cProfile of one step (top functions by
own time), where the host's time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import step as step_bench  # benchmarks/step.py: this script's folder
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import mfsdp_ext
import mfsdp_ext.optim
from mfsdp_ext.testing import gpt


def policy(variant: str) -> mfsdp_ext.MixedPrecisionPolicy:
    kwargs = {}
    if variant.startswith("fp8"):
        kwargs["fp8"] = mfsdp_ext.Fp8Policy(compute=True)
    if variant == "fp8_keep":
        kwargs["cache_model_weight"] = True
    elif variant not in ("bf16", "fp8"):
        raise SystemExit(f"unknown variant {variant!r}: bf16, fp8 or fp8_keep")
    return mfsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **kwargs)


def measure(bc, variant: str, mesh, device, args) -> str:
    torch.manual_seed(0)
    model = gpt.build_sharded(bc.model_config(), "ours", device, False, mesh=mesh, mp_policy=policy(variant))
    step_bench.free_memory(device)
    optimizer = mfsdp_ext.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    batches = step_bench.make_batches(bc, device, seed=100 + dist.get_rank())
    losses = []

    def one_step():
        step_bench.train_step(model, optimizer, batches, "ours", losses)

    for _ in range(args.warmup):
        one_step()
    host, wall = [], []
    for _ in range(args.steps):
        gpt.synchronize(device)
        t0 = time.perf_counter()
        one_step()
        t1 = time.perf_counter()
        gpt.synchronize(device)
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    text = (f"config {args.config_id} {variant:9s} wall {statistics.median(wall):7.1f} ms  host issue "
            f"{statistics.median(host):7.1f} ms  (min wall {min(wall):.1f})")
    if args.profile:
        gpt.synchronize(device)
        prof = cProfile.Profile()
        prof.enable()
        one_step()
        prof.disable()
        gpt.synchronize(device)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        text += "\n" + "\n".join(line[:150] for line in out.getvalue().splitlines()[:40])
    model = optimizer = one_step = None  # free them before the next variant is built
    step_bench.free_memory(device)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="5,4")
    ap.add_argument("--variants", default="bf16,fp8,fp8_keep")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    device = gpt.setup_distributed("auto")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    configs = step_bench.TINY_CONFIGS if device.type == "cpu" else step_bench.CONFIGS
    for config_id in (int(c) for c in args.configs.split(",")):
        args.config_id = config_id
        for variant in args.variants.split(","):
            text = measure(configs[config_id], variant, mesh, device, args)
            if dist.get_rank() == 0:
                print(text, flush=True)
    gpt.teardown_distributed()


if __name__ == "__main__":
    main()
