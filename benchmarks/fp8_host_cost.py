"""Host time per call of the FP8 Linear's pieces (one GPU): what eager FP8 training pays on the CPU per layer.

    python benchmarks/fp8_host_cost.py [--out DIR] [--reps N] [--profile]

Each piece runs on a tiny problem (64 x 64 x 64: the GPU finishes long before the host issues the next call), many
times back to back; host microseconds per call = wall time / calls, the GPU synchronised once at the end. So the
figures are the host's Python, dispatcher, allocator and driver (launch) time, not GPU time. Pieces: an empty
kernel launch (torch's ``add_`` of a one-element tensor), a one-element ``torch.empty``, our quantizer (two-pass,
fused), ``torch._scaled_mm``, our ``fp8_gemm`` (cuBLASLt, plan cached), bf16 ``F.linear``, the native FP8 Linear
forward and backward calls, and whole layers, forward alone (with the graph built) and forward + backward:
nn.Linear bf16 vs Fp8Linear with the weight pre-quantized (as fully_shard supplies it). Results:
<out>/fp8_host_cost_<gpu>.md and .json. --profile: also the torch.profiler table of 100 calls of each whole layer,
forward alone and forward + backward (host time by op and CUDA runtime call, self time first), in
<out>/fp8_host_profile_<gpu>.txt: where the FP8 layer's extra host time goes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
import kernels as K  # noqa: E402  (gpu_tag, time_host) benchmarks/kernels.py: this script's folder

from mfsdp_ext import _native as N  # noqa: E402
from mfsdp_ext.fp8.linear import to_fp8_linear  # noqa: E402
from mfsdp_ext.fp8.tensor import E4M3, E5M2, quantize  # noqa: E402


def host_us(fn, reps: int) -> float:
    """Median over 5 rounds of kernels.py's time_host (``reps`` back-to-back calls), in microseconds."""
    for _ in range(20):
        fn()
    return statistics.median(K.time_host(fn, reps) for _ in range(5)) * 1e6


def pieces(size: int) -> dict:
    dev = "cuda"
    x = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    w = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    one = torch.zeros(1, device=dev)
    x8, xs = torch.empty(size, size, device=dev, dtype=E4M3), torch.empty((), device=dev)
    x8t = torch.empty(size, size, device=dev, dtype=E4M3)
    wq = quantize(w, transpose=True)
    xq = quantize(x)
    dy = torch.randn(size, size, device=dev, dtype=torch.bfloat16)

    def layer(module):
        xin = x.detach().requires_grad_()

        def step():
            module.weight.grad = None
            xin.grad = None
            module(xin).backward(dy)
        return step

    def forward_only(module):  # the graph is built (x requires grad) and dropped: forward's share of the layer
        xin = x.detach().requires_grad_()
        return lambda: module(xin)

    lin = nn.Linear(size, size, bias=False, device=dev, dtype=torch.bfloat16)
    fp8 = to_fp8_linear(nn.Linear(size, size, bias=False, device=dev, dtype=torch.bfloat16))
    fp8.set_fp8_weight(quantize(fp8.weight.detach(), transpose=True))
    fwd_out = N.fp8_linear_forward(x, wq.data, wq.scale_inv, None, True, True)
    return {
        "kernel launch (one-element add_)": lambda: one.add_(1.0),
        "torch.empty (one element)": lambda: torch.empty((), device=dev),
        "quantize, two-pass (N.fp8_quantize)": lambda: N.fp8_quantize(x, x8, xs, None, None, algo="two_pass"),
        "quantize, fused (N.fp8_quantize)": lambda: N.fp8_quantize(x, x8, xs, None, None, algo="fused"),
        "quantize + transpose, two-pass": lambda: N.fp8_quantize(x, x8, xs, None, x8t, algo="two_pass"),
        "quantize() with its allocations (fp8_tensor)": lambda: quantize(x),
        "torch._scaled_mm": lambda: torch._scaled_mm(xq.data, wq.data.t(), scale_a=xq.scale_inv,
                                                     scale_b=wq.scale_inv, out_dtype=torch.bfloat16,
                                                     use_fast_accum=True),
        "fp8_gemm (ours, cuBLASLt plan cached)": lambda: N.fp8_gemm(xq.data, wq.data, xq.scale_inv, wq.scale_inv,
                                                                    None, torch.bfloat16, True),
        "F.linear bf16": lambda: F.linear(x, w),
        "fp8_linear_forward (native: quantize + GEMM)": lambda: N.fp8_linear_forward(
            x, wq.data, wq.scale_inv, None, True, True),
        "fp8_linear_backward (native: quantize + 2 GEMMs)": lambda: N.fp8_linear_backward(
            dy, E5M2, wq.data_t, wq.scale_inv, fwd_out[1], fwd_out[2], torch.bfloat16, torch.bfloat16),
        "layer fwd: nn.Linear bf16": forward_only(lin),
        "layer fwd: Fp8Linear, W pre-quantized": forward_only(fp8),
        "layer fwd+bwd: nn.Linear bf16": layer(lin),
        "layer fwd+bwd: Fp8Linear, W pre-quantized": layer(fp8),
    }


def profile_layers(cases: dict, path: str, calls: int = 100) -> None:
    from torch.profiler import ProfilerActivity, profile

    with open(path, "w") as f:
        for label, fn in cases.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            f.write(f"== {label}: {calls} calls (host times are totals over them)\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n")
    print(f"wrote {path}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="also profile the two whole layers (see the docstring)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/fp8_host_cost.py needs a CUDA GPU", file=sys.stderr)
        return 2
    info = N.build_summary()
    name = torch.cuda.get_device_name()
    meta = {"gpu": name, "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "build": info, "size": args.size, "reps": args.reps}
    results = {}
    for label, fn in pieces(args.size).items():
        results[label] = host_us(fn, args.reps)
        print(f"{label:55s} {results[label]:8.1f} us/call", flush=True)
    lines = [f"# FP8 Linear host cost on {name}", "",
             f"{meta['date']} - torch {meta['torch']} - CUDA {meta['cuda']} - fp8_gemm: {info.get('fp8_gemm')}", "",
             f"Host microseconds per call, {args.size} x {args.size} x {args.size} problems (GPU time negligible), "
             f"median of 5 rounds of {args.reps} back-to-back calls. Command: `python benchmarks/fp8_host_cost.py`.",
             "", "| piece | host us / call |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in results.items()]
    os.makedirs(args.out, exist_ok=True)
    tag = K.gpu_tag(name)
    md, js = os.path.join(args.out, f"fp8_host_cost_{tag}.md"), os.path.join(args.out, f"fp8_host_cost_{tag}.json")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(js, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {md}, {js}", flush=True)
    if args.profile:
        cases = {k: v for k, v in pieces(args.size).items() if k.startswith("layer")}
        profile_layers(cases, os.path.join(args.out, f"fp8_host_profile_{tag}.txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
