"""One AdamW step over the shards that benchmarks/step.py's configs give rank 0 of 2, on one device.

    python benchmarks/optim.py --configs 1,3 --out benchmarks/results          # one GPU
    python benchmarks/optim.py --device cpu --quick --out DIR     # CPU smoke test (tiny configs)

No process group is needed: the GPT of the config is built on the meta device, its parameters are grouped as
fully_shard groups them (one unit per block, the root's embeddings / norm / head), each group gets the FlatLayout
of world 2, and rank 0's shard of each group is allocated (random weights and fp32 grads). Variants:

  ours          mfsdp_ext's flat kernel: one ``_native.adamw_step`` launch per group over its flat buffers (one
                run: one set of hyperparameters, as step.py's optimizer). The kernel only: the host-side work of
                ``mfsdp_ext.optim.AdamW.step`` (per-parameter state checks, run table) is not in this number.
  foreach       torch.optim.AdamW(foreach=True) over per-parameter plain-tensor views of the same flat buffers
                (the local shards; plain views, not DTensors)
  fused         torch.optim.AdamW(fused=True) over separately allocated per-parameter tensors
  bound         bytes AdamW must move (param r/w, grad r, exp_avg r/w, exp_avg_sq r/w: 28 B per fp32 element)
                / the copy bandwidth of a large device-to-device copy measured in the same run

Each variant: ``--warmup`` steps, then the median of ``--steps`` timed steps (CUDA events on the GPU, wall
clock on the CPU). Writes optim_<device>.md and optim_<device>.json into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn
from step import CONFIGS, TINY_CONFIGS  # benchmarks/step.py: this script's folder

from mfsdp_ext import _native
from mfsdp_ext.core.device import cuda_median_ms
from mfsdp_ext.core.flat_buffer import FlatBuffer
from mfsdp_ext.core.layout import FlatLayout
from mfsdp_ext.testing import gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORLD, RANK = 2, 0
HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BYTES_PER_ELEMENT = 4 * (2 + 1 + 2 + 2)  # param r/w, grad r, exp_avg r/w, exp_avg_sq r/w (fp32)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1,3")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="benchmarks/step.py's tiny configs, few steps")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    return p.parse_args(argv)


def unit_shapes(bc) -> list[list[torch.Size]]:
    """Parameter shapes per fully_shard unit (each block, then the root's own), as gpt.shard_model wraps them."""
    with torch.device("meta"):
        model = gpt.GPT(bc.model_config())
    units = [[p.shape for p in layer.parameters()] for layer in model.layers]
    in_layers = {id(p) for layer in model.layers for p in layer.parameters()}
    units.append([p.shape for p in model.parameters() if id(p) not in in_layers])
    return units


class Shards:
    """Rank 0's flat buffers of every group (weight, grad, exp_avg, exp_avg_sq) and one run per group."""

    def __init__(self, units: list[list[torch.Size]], device: torch.device):
        g = torch.Generator(device=device).manual_seed(0)
        self.groups = []
        for shapes in units:
            layout = FlatLayout(shapes, WORLD)
            bufs = [FlatBuffer(layout, torch.float32, device, rank=RANK) for _ in range(4)]
            bufs[0].data.normal_(generator=g)
            bufs[1].data.normal_(generator=g)
            bufs[2].data.zero_()
            bufs[3].data.zero_()
            runs = torch.tensor([[0, layout.shard_numel]], dtype=torch.int64)
            self.groups.append((layout, bufs, runs))
        self.numel = sum(layout.shard_numel for layout, _, _ in self.groups)
        self.params = sum(len(layout.slots) for layout, _, _ in self.groups)

    def ours_step(self):
        step = [0]
        lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]

        def fn():
            step[0] += 1
            s = step[0]
            coeffs = torch.tensor([[1 - lr * wd, 1 - b1, b2, 1 - b2, (1 - b2**s) ** 0.5, eps, -(lr / (1 - b1**s)),
                                    1.0]], dtype=torch.float32)
            for _, (w, gr, m, v), runs in self.groups:
                _native.adamw_step(w.data, gr.data, m.data, v.data, runs, coeffs)
        return fn

    def views(self) -> list[nn.Parameter]:
        """Per-parameter plain views of the flat weight buffers, their grads views of the flat grad buffers."""
        params = []
        for layout, (w, gr, _, _), _ in self.groups:
            for i in range(len(layout.slots)):
                p = nn.Parameter(w.param_view(i))
                p.grad = gr.param_view(i)
                params.append(p)
        return params


def torch_step(params: list[nn.Parameter], **kwargs):
    opt = torch.optim.AdamW(params, **HYPER, **kwargs)
    return opt.step


def separate_params(shards: Shards) -> list[nn.Parameter]:
    params = []
    for p in shards.views():
        q = nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        params.append(q)
    return params


def median_ms(fn, steps: int, warmup: int, device: torch.device) -> float:
    if device.type == "cuda":
        return cuda_median_ms(fn, iters=steps, warmup=warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_gbps(device: torch.device, numel: int, steps: int, warmup: int) -> float:
    """Device memory bandwidth (read + write) of one large copy, GB/s."""
    src = torch.empty(numel, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), steps, warmup, device)
    return 2 * numel * 4 / (ms * 1e-3) / 1e9


def run_config(cid: int, bc, device: torch.device, args) -> dict:
    shards = Shards(unit_shapes(bc), device)
    bound_bytes = shards.numel * BYTES_PER_ELEMENT
    gbps = copy_gbps(device, max(shards.numel, 1 << 26 if device.type == "cuda" else 1 << 22), args.steps,
                     args.warmup)
    bound_ms = bound_bytes / (gbps * 1e9) * 1e3
    res = {"config": cid, "model": bc.describe(), "groups": len(shards.groups), "params": shards.params,
           "shard_numel": shards.numel, "bytes": bound_bytes, "copy_GBps": gbps, "bound_ms": bound_ms}
    variants = {"ours": shards.ours_step(),
                "foreach": torch_step(shards.views(), foreach=True),
                "fused": torch_step(separate_params(shards), fused=True)}
    for name, fn in variants.items():
        try:
            ms = median_ms(fn, args.steps, args.warmup, device)
            res[name] = {"ms": ms, "pct_of_bound": 100 * bound_ms / ms}
        except (RuntimeError, NotImplementedError) as exc:  # e.g. no fused AdamW for this device
            res[name] = {"error": str(exc).splitlines()[0]}
    return res


def write_report(results: list[dict], env: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"optim_{env['device']}")
    with open(stem + ".json", "w") as f:
        json.dump({"env": env, "results": results}, f, indent=2)
    lines = [f"# One AdamW step over rank 0's shards (world 2), {env['device_name']}", "",
             f"torch {env['torch']}; median of {env['steps']} steps after {env['warmup']}; bound = {BYTES_PER_ELEMENT} "
             "B per element / measured copy bandwidth. foreach: plain per-parameter views (not DTensors).", "",
             "| config | model | groups | params | shard elements | copy GB/s | bound ms | ours ms (% bound) | "
             "foreach ms (% bound) | fused ms (% bound) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        cells = []
        for name in ("ours", "foreach", "fused"):
            v = r[name]
            cells.append(f"{v['ms']:.3f} ({v['pct_of_bound']:.0f}%)" if "ms" in v else f"error: {v['error'][:60]}")
        lines.append(f"| {r['config']} | {r['model']} | {r['groups']} | {r['params']} | {r['shard_numel']:,} | "
                     f"{r['copy_GBps']:.0f} | {r['bound_ms']:.3f} | " + " | ".join(cells) + " |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 5), min(args.warmup, 1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    table = TINY_CONFIGS if args.quick else CONFIGS
    env = {"device": device.type, "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup,
           "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "CPU", "quick": args.quick}
    results = [run_config(int(c), table[int(c)], device, args) for c in args.configs.split(",") if c.strip()]
    write_report(results, env, args.out)


if __name__ == "__main__":
    main()
