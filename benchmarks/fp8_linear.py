"""FP8 Linear micro-benchmark (one GPU): forward and forward + backward of config 4's Linear layers, in one run.

    python benchmarks/fp8_linear.py [--out DIR] [--tokens 1024,4096] [--reps N]
    python benchmarks/fp8_linear.py --device cpu --tokens 32 --reps 2 --out DIR   # smoke test of the script

Shapes: config 4 of benchmarks/step.py (d_model 4096, ffn 11008, the Llama block of mfsdp_ext/testing/gpt.py): wq / wk
/ wv / wo 4096 -> 4096, w1 / w3 4096 -> 11008, w2 11008 -> 4096, no bias, bf16 weights and activations, at 1024 and 4096
tokens. "block" sums the seven layers of one block (4 x attention + 2 x up + down).

Variants (same weights, inputs and output gradients):
  bf16                    nn.Linear in bf16 (cuBLAS)
  ours fp8, wgrad fp8     mfsdp_ext Fp8Linear: activation, weight and gradient quantized by the native kernel,
                          forward / dgrad / wgrad by the native fp8_gemm (cuBLASLt, plan cached per shape),
                          one native call per forward and per backward; the weight quantized on every call
  ours fp8, wgrad bf16    the same with the weight gradient as a bf16 GEMM
  ... W pre-quantized     the weight's FP8 form and transpose supplied (set_fp8_weight), as fully_shard will
                          gather it once per step: what training will run
  ... grad e4m3           the output gradient in e4m3 instead of the default e5m2 (speed is the same; accuracy)
  ... fused quantizer     the quantizer's one-launch algorithm instead of the default two-pass one
  previous Linear ...     our quantizer, with the GEMMs as torch._scaled_mm calls from Python (one call per
                          quantization and GEMM): the FP8 Linear before the native forward / backward calls
  torch-ops fp8           the same GEMMs with the quantization written in torch ops (amax, scale, clamp,
                          .to(float8), .t().contiguous() for the transposed operands): the contrast
Timing: CUDA events around each call, the GPU first held by a sleep kernel so host overhead does not show
(kernels.py's time_gpu), median of --reps. speedup = bf16 time / variant time. TFLOP/s counts 2MKN per GEMM.
"wall": the same calls issued back to back and timed on the host (kernels.py's time_host): per call the larger
of the host's Python/launch overhead and the GPU time, i.e. what eager training sees when nothing else hides it.
Accuracy: normwise relative error of y, dx and dW against fp32 GEMMs on the same bf16 values.
Results: <out>/fp8_linear_<gpu>.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
import kernels as K  # noqa: E402  (time_gpu, gpu_tag) benchmarks/kernels.py: this script's folder

from mfsdp_ext import _native as N  # noqa: E402
from mfsdp_ext.fp8.linear import Fp8LinearConfig, to_fp8_linear  # noqa: E402
from mfsdp_ext.fp8.tensor import E4M3, E5M2, quantize  # noqa: E402

# (name, in_features, out_features, count in one block) of config 4 (benchmarks/step.py: dim 4096, ffn 11008)
SHAPES = [("wq/wk/wv/wo", 4096, 4096, 4), ("w1/w3", 4096, 11008, 2), ("w2", 11008, 4096, 1)]
DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------------------------
# the contrast: an FP8 Linear quantizing with torch ops
# ----------------------------------------------------------------------------------------------
def torch_quantize(t: torch.Tensor, dtype: torch.dtype):
    fmax = N.FP8_MAX[dtype]
    amax = t.abs().max().float()
    scale = fmax / torch.clamp(amax, min=1e-12)
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


class TorchOpsFp8LinearFn(torch.autograd.Function):
    """Forward, dgrad and wgrad in FP8 (e4m3 activations / weights, e5m2 gradients), quantized with torch ops."""

    @staticmethod
    def forward(ctx, x, weight):
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = torch_quantize(x2, E4M3)
        wq, ws = torch_quantize(weight, E4M3)
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(xq, xs, wq, ws)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        xq, xs, wq, ws = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dq, ds = torch_quantize(dy2, E5M2)
        dx = torch._scaled_mm(dq, wq.t().contiguous().t(), scale_a=ds, scale_b=ws, out_dtype=dy.dtype)
        dw = torch._scaled_mm(dq.t().contiguous(), xq.t().contiguous().t(), scale_a=ds, scale_b=xs, out_dtype=dy.dtype)
        return dx.view(ctx.shape), dw


class TorchOpsFp8Linear(nn.Linear):
    def forward(self, x):
        return TorchOpsFp8LinearFn.apply(x, self.weight)


class ScaledMmFp8LinearFn(torch.autograd.Function):
    """Our quantizer, the GEMMs as torch._scaled_mm issued from Python, one call per step: the FP8 Linear before
    fp8_linear_forward / _backward (native, cuBLASLt plan cache). W pre-quantized (with its transpose)."""

    @staticmethod
    def forward(ctx, x, weight, wq):
        x2 = x.reshape(-1, x.shape[-1])
        xq = quantize(x2, E4M3, transpose=True)
        y = torch._scaled_mm(xq.data, wq.data.t(), scale_a=xq.scale_inv, scale_b=wq.scale_inv, out_dtype=x.dtype,
                             use_fast_accum=True)
        ctx.save_for_backward(xq.data_t, xq.scale_inv)
        ctx.wq, ctx.shape = wq, x.shape
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        x8t, xs = ctx.saved_tensors
        wq = ctx.wq
        dq = quantize(dy.reshape(-1, dy.shape[-1]), E5M2, transpose=True)
        dx = torch._scaled_mm(dq.data, wq.data_t.t(), scale_a=dq.scale_inv, scale_b=wq.scale_inv, out_dtype=dy.dtype)
        dw = torch._scaled_mm(dq.data_t, x8t.t(), scale_a=dq.scale_inv, scale_b=xs, out_dtype=dy.dtype)
        return dx.view(ctx.shape), dw, None


class ScaledMmFp8Linear(nn.Linear):
    def forward(self, x):
        return ScaledMmFp8LinearFn.apply(x, self.weight, self.wq)


# ----------------------------------------------------------------------------------------------
# variants and measurement
# ----------------------------------------------------------------------------------------------
def variants(k: int, n: int, device: str, weight: torch.Tensor) -> dict:
    def linear(cls=nn.Linear):
        m = cls(k, n, bias=False, device=device, dtype=DTYPE)
        with torch.no_grad():
            m.weight.copy_(weight)
        return m

    out = {"bf16": linear()}
    for wgrad in ("fp8", "bf16"):
        for pre in (False, True):
            for grad in ((E5M2, E4M3) if wgrad == "fp8" and not pre else (E5M2,)):
                m = to_fp8_linear(linear(), config=Fp8LinearConfig(grad_dtype=grad, wgrad=wgrad))
                if pre:
                    m.set_fp8_weight(quantize(m.weight.detach(), transpose=True))
                name = f"ours fp8, wgrad {wgrad}" + (", W pre-quantized" if pre else "") + \
                    (", grad e4m3" if grad == E4M3 else "")
                out[name] = m
    if device == "cuda":  # the one-launch quantizer in the variants training will run
        for wgrad in ("fp8", "bf16"):
            m = to_fp8_linear(linear(), config=Fp8LinearConfig(wgrad=wgrad, quantize_algo="fused"))
            m.set_fp8_weight(quantize(m.weight.detach(), transpose=True))
            out[f"ours fp8, wgrad {wgrad}, W pre-quantized, fused quantizer"] = m
    previous = linear(ScaledMmFp8Linear)
    previous.wq = quantize(previous.weight.detach(), transpose=True)
    out["previous Linear (torch._scaled_mm calls), wgrad fp8, W pre-quantized"] = previous
    out["torch-ops fp8"] = linear(TorchOpsFp8Linear)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def measure(m: int, k: int, n: int, reps: int, device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(m + k + n)
    weight = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(DTYPE)
    x = torch.randn(m, k, device=device, generator=g).to(DTYPE).requires_grad_()
    dy = torch.randn(m, n, device=device, generator=g).to(DTYPE)
    # fp32 reference on the same bf16 values
    y_ref = x.detach().float() @ weight.float().t()
    dx_ref = dy.float() @ weight.float()
    dw_ref = dy.float().t() @ x.detach().float()
    res = {}
    for name, mod in variants(k, n, device, weight).items():
        def fwd():
            return mod(x)

        def fwd_bwd():
            x.grad = None
            mod.weight.grad = None
            mod(x).backward(dy)

        fwd_bwd()
        errs = {"y": rel(mod(x).detach(), y_ref), "dx": rel(x.grad, dx_ref), "dw": rel(mod.weight.grad, dw_ref)}
        t_fwd = K.time_gpu(fwd, reps)  # a training forward (what it saves for backward included)
        t_all = K.time_gpu(fwd_bwd, reps)
        t_wall = K.time_host(fwd_bwd, reps)  # calls back to back: max(host overhead, GPU time) per call
        res[name] = {"fwd_s": t_fwd, "fwd_bwd_s": t_all, "fwd_bwd_wall_s": t_wall, "err": errs}
    return res


def write_markdown(path: str, meta: dict, results: list[dict]) -> None:
    lines = [f"# FP8 Linear on {meta['gpu']}", "",
             f"{meta['date']} - torch {meta['torch']} - CUDA {meta['cuda']} - build {meta['build']}", "",
             "Config 4's Linear layers (d_model 4096, ffn 11008), bf16, no bias. Median GPU time (CUDA events) of "
             "the forward and of forward + backward; `speedup` = bf16 time / this variant's time; `block` = the "
             "seven layers of one block (4 x 4096->4096, 2 x 4096->11008, 1 x 11008->4096). Errors: normwise "
             "relative error against fp32 GEMMs on the same bf16 values (y / dx / dW).", ""]
    for tokens in sorted({r["tokens"] for r in results}):
        rs = [r for r in results if r["tokens"] == tokens]
        names = list(rs[0]["variants"])
        lines += [f"## {tokens} tokens", "",
                  "| variant | " + " | ".join(f"{r['shape']} fwd+bwd us" for r in rs) +
                  " | block fwd us | block fwd+bwd us | fwd speedup | fwd+bwd speedup | block TFLOP/s | "
                  "block fwd+bwd wall us | wall speedup | errors y / dx / dW (w2) |",
                  "|---|" + "---:|" * (len(rs) + 8)]
        block = {}
        for name in names:
            tf = sum(r["variants"][name]["fwd_s"] * r["count"] for r in rs)
            tb = sum(r["variants"][name]["fwd_bwd_s"] * r["count"] for r in rs)
            block[name] = (tf, tb)
        flops = sum(6 * tokens * r["k"] * r["n"] * r["count"] for r in rs)
        wall = {name: sum(r["variants"][name]["fwd_bwd_wall_s"] * r["count"] for r in rs) for name in names}
        for name in names:
            tf, tb = block[name]
            tw = wall[name]
            e = rs[-1]["variants"][name]["err"]
            per = " | ".join(f"{r['variants'][name]['fwd_bwd_s'] * 1e6:.0f}" for r in rs)
            lines.append(f"| {name} | {per} | {tf * 1e6:.0f} | {tb * 1e6:.0f} | {block['bf16'][0] / tf:.2f}x | "
                         f"{block['bf16'][1] / tb:.2f}x | {flops / tb / 1e12:.0f} | {tw * 1e6:.0f} | "
                         f"{wall['bf16'] / tw:.2f}x | "
                         f"{e['y']:.4f} / {e['dx']:.4f} / {e['dw']:.4f} |")
        lines.append("")
    lines += ["## Summary (block, forward + backward, speedup over bf16)", ""]
    for tokens in sorted({r["tokens"] for r in results}):
        rs = [r for r in results if r["tokens"] == tokens]
        tb = {name: sum(r["variants"][name]["fwd_bwd_s"] * r["count"] for r in rs) for name in rs[0]["variants"]}
        parts = [f"{name} {tb['bf16'] / t:.2f}x" for name, t in tb.items() if name != "bf16"]
        lines.append(f"- {tokens} tokens: " + "; ".join(parts))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke-test the script only")
    args = p.parse_args()
    K.DEVICE = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/fp8_linear.py needs a CUDA GPU (--device cpu smoke-tests the script)", file=sys.stderr)
        return 2
    info = N.build_summary()
    if args.device == "cuda" and not info.get("cuda"):
        print(f"mfsdp_ext._C was built without CUDA kernels: {info}", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test)"
    meta = {"gpu": name, "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "build": info}
    print(f"# {name}, torch {torch.__version__}", flush=True)
    small = [("small", 64, 176, 4), ("small up", 64, 176, 2), ("small down", 176, 64, 1)]  # CPU smoke test
    shapes = SHAPES if args.device == "cuda" else small
    results = []
    for tokens in (int(t) for t in args.tokens.split(",") if t.strip()):
        for shape, k, n, count in shapes:
            res = measure(tokens, k, n, args.reps, args.device)
            results.append({"tokens": tokens, "shape": f"{shape} {k}->{n}", "k": k, "n": n, "count": count,
                            "variants": res})
            base = res["bf16"]
            for v, r in res.items():
                print(f"{tokens:5d} tok {shape:12s} {k:5d}->{n:<5d} {v:40s} fwd {r['fwd_s'] * 1e6:7.1f} us "
                      f"({base['fwd_s'] / r['fwd_s']:.2f}x)  fwd+bwd {r['fwd_bwd_s'] * 1e6:7.1f} us "
                      f"({base['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}x)  err y {r['err']['y']:.4f} dx {r['err']['dx']:.4f} "
                      f"dw {r['err']['dw']:.4f}", flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    tag = K.gpu_tag(name)
    md, js = os.path.join(args.out, f"fp8_linear_{tag}.md"), os.path.join(args.out, f"fp8_linear_{tag}.json")
    write_markdown(md, meta, results)
    with open(js, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(open(md).read(), flush=True)
    print(f"wrote {md}, {js}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
