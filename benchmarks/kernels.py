"""Kernel bandwidth benchmark (one GPU): mfsdp_ext kernels vs the GPU's copy bandwidth vs the PyTorch way.

    python benchmarks/kernels.py [--out DIR] [--sizes 1M,4M,16M,64M,256M,1G] [--reps N]
    python benchmarks/kernels.py --parts quant,transpose --tag fp8 --out DIR    # the FP8 kernels only

For each size (elements of the fp32 source) it measures, in one run, with CUDA events (warm-up, median of
many repetitions):
  copy      device-to-device copy of the fp32 source (8 B/elem)                      -> the roofline
  bf16 cast mfsdp cast fp32->bf16 (6 B/elem)       vs  src.to(torch.bfloat16)
  fp8 cast  mfsdp fp8_cast (5 B/elem), segment_amax (4 B/elem) and both (9 B/elem)
            vs  amax = src.abs().max(); (src * (448 / amax)).clamp(-448, 448).to(float8_e4m3fn)
  pack      mfsdp pack of 16 uneven fp32 tensors into one flat fp32 buffer (8 B/elem), back to back
            (misaligned) and at 64 B aligned offsets (fully_shard's layout)
            vs  torch._foreach_copy_(views of the flat buffer, tensors)
  shard sum the sum on arrival of reduce_comm_dtype=bf16 on 2 ranks: two bf16 shards -> fp32 scaled (8 B/elem),
            one grad_accumulate launch vs a call per shard vs torch.add
and pack of 2000 small tensors (~4K elements each) vs _foreach_copy_ (GPU time and host time per call).
FP8 (--parts quant,transpose; sizes in elements of a bf16 (rows, 4096) activation, shapes of FP8 matrices):
  quantize  mfsdp fp8_quantize bf16 -> e4m3, per-tensor current scaling (3 B/elem; 4 B/elem with the transpose
            written in the same pass), algorithms "two_pass" (2 launches) and "fused" (1 launch)
            vs  the same in torch ops (amax, scale, clamp, .to(float8) [, .t().contiguous()])
            `% copy` compares with a copy of the bf16 source (4 B/elem) in the same run
  transpose mfsdp fp8_transpose (2 B/elem) vs .t().contiguous(), against a copy of the same bytes
GB/s counts the bytes the operation must move (read + write) over its time; for the PyTorch way the same byte
count is used, so the GB/s columns compare times. Results: <out>/kernels_<gpu>.md, .json and .png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time

import torch

from mfsdp_ext import _native as N
from mfsdp_ext.core.layout import ALIGN_ELEMS, align_up

E4M3 = torch.float8_e4m3fn
DEVICE = "cuda"  # --device cpu: a smoke test of this script on a machine without a GPU (numbers meaningless)
GOAL = 0.90  # fraction of copy bandwidth at >= 64 MiB
GOAL_MIN_BYTES = 64 << 20
QUANT_GOAL = 0.85  # activation quantizer: fraction of the copy bandwidth of its bf16 source at >= 8 MiB
QUANT_GOAL_MIN_BYTES = 8 << 20


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", s.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def size_name(n: int) -> str:
    for unit, v in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % v == 0:
            return f"{n // v}{unit}"
    return str(n)


def gpu_tag(name: str) -> str:
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    tag = m.group(1) if m else name
    return re.sub(r"[^a-z0-9]+", "_", tag.lower()).strip("_") or "gpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_gpu(fn, reps: int, warmup: int = 3) -> float:
    """Median GPU time of fn() in seconds: CUDA events around each call. The GPU first spins on a sleep kernel
    long enough for the host to queue every repetition, so host launch overhead never shows as GPU time."""
    for _ in range(warmup):
        fn()
    sync()
    if DEVICE != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    t0 = time.perf_counter()
    fn()
    sync()
    host_per_call = time.perf_counter() - t0
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    # ~2 GHz clock: cycles to cover the host enqueueing all reps, with margin (first-time pinned allocations
    # of pack's table); capped at ~1 s. The median ignores the odd repetition the margin does not cover.
    torch.cuda._sleep(int(min(1.0, 4.0 * reps * host_per_call + 5e-3) * 2e9))
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def time_host(fn, reps: int) -> float:
    """Wall time per call, calls issued back to back, synchronised at the end (host overhead included)."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def reps_for(nbytes: int, base: int) -> int:
    return int(max(10, min(base, 4e10 / max(nbytes, 1))))


def uneven_sizes(n: int, parts: int, g: torch.Generator) -> list[int]:
    w = torch.rand(parts, generator=g) + 0.5
    sizes = (w / w.sum() * n).long().tolist()
    sizes[-1] += n - sum(sizes)
    return sizes


def _row(kernel, n, bytes_per_elem, t_ours, copy, t_torch=None, torch_way=""):
    t_copy = copy
    copy_bw = 8 * n / t_copy
    r = {"kernel": kernel, "elements": n, "src_bytes": 4 * n, "bytes_moved": bytes_per_elem * n, "ours_s": t_ours,
         "ours_gbps": bytes_per_elem * n / t_ours / 1e9, "copy_gbps": copy_bw / 1e9, "copy_s": t_copy}
    r["frac_of_copy"] = r["ours_gbps"] / r["copy_gbps"]
    if t_torch is not None:
        r.update(torch_s=t_torch, torch_gbps=bytes_per_elem * n / t_torch / 1e9, speedup=t_torch / t_ours,
                 torch_way=torch_way)
    return r


def _bench_copy(src: torch.Tensor, reps: int) -> float:
    dst = torch.empty_like(src)
    return time_gpu(lambda: dst.copy_(src), reps)


def _bench_bf16(src: torch.Tensor, reps: int, t_copy: float) -> tuple[list[dict], bool]:
    n = src.numel()
    dst = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    t_ours = time_gpu(lambda: N.cast(src, dst), reps)
    t_torch = time_gpu(lambda: src.to(torch.bfloat16), reps)
    ok = torch.equal(dst, src.to(torch.bfloat16))
    return [_row("cast fp32->bf16", n, 6, t_ours, t_copy, t_torch, "src.to(torch.bfloat16)")], ok


def _bench_fp8(src: torch.Tensor, reps: int, t_copy: float) -> tuple[list[dict], bool]:
    n = src.numel()
    seg = torch.tensor([[0, n]], device=DEVICE)
    amax = torch.empty(1, device=DEVICE)
    q = torch.empty(n, dtype=E4M3, device=DEVICE)
    sinv = torch.empty(1, device=DEVICE)
    t_amax = time_gpu(lambda: N.segment_amax(src, seg, amax), reps)
    t_fp8 = time_gpu(lambda: N.fp8_cast(src, seg, amax, q, sinv), reps)

    def both():
        N.segment_amax(src, seg, amax)
        N.fp8_cast(src, seg, amax, q, sinv)

    def torch_fp8():
        a = src.abs().max()
        scale = 448.0 / a
        return (src * scale).clamp(-448.0, 448.0).to(E4M3), 1.0 / scale

    t_both = time_gpu(both, reps)
    t_torch = time_gpu(torch_fp8, max(5, reps // 2))
    ok = float(amax[0]) == float(src.abs().max())
    return [_row("segment_amax fp32", n, 4, t_amax, t_copy), _row("fp8_cast fp32->e4m3", n, 5, t_fp8, t_copy),
            _row("amax + fp8_cast", n, 9, t_both, t_copy, t_torch, "abs().max(); (x*s).clamp().to(e4m3)")], ok


def _bench_pack(n: int, reps: int, t_copy: float, align: int = 1) -> tuple[list[dict], bool]:
    """16 uneven fp32 tensors -> one fp32 flat buffer, vs _foreach_copy_ into views of it. ``align`` = 1 packs
    them back to back (sources misaligned to their destinations); ALIGN_ELEMS places them as fully_shard's
    layout does."""
    sizes = uneven_sizes(n, 16, torch.Generator().manual_seed(0))
    tensors = [torch.randn(s, device=DEVICE) for s in sizes]
    offsets, cur = [], 0
    for s in sizes:
        cur = align_up(cur, align)
        offsets.append(cur)
        cur += s
    flat = torch.empty(cur, device=DEVICE)
    views = [flat[o:o + s] for o, s in zip(offsets, sizes)]
    t_pack = time_gpu(lambda: N.pack(tensors, offsets, flat), reps)
    t_foreach = time_gpu(lambda: torch._foreach_copy_(views, tensors), reps)
    flat.fill_(float("nan"))
    N.pack(tensors, offsets, flat)
    ok = all(torch.equal(v, t) for v, t in zip(views, tensors))
    name = "pack 16 tensors fp32" + ("" if align == 1 else f", {4 * align} B aligned")
    return [_row(name, n, 8, t_pack, t_copy, t_foreach, "torch._foreach_copy_(views, tensors)")], ok


def _bench_shard_sum(n: int, reps: int, t_copy: float) -> tuple[list[dict], bool]:
    """The sum on arrival of reduce_comm_dtype=bf16 on 2 ranks: two bf16 shards -> fp32, scaled (8 B/elem), as one
    grad_accumulate of (2, n) against two calls (one per shard) and against torch ops."""
    parts = torch.randn(2, n, device=DEVICE).to(torch.bfloat16)
    out = torch.empty(n, device=DEVICE)
    t_ours = time_gpu(lambda: N.grad_accumulate(out, parts, 0.5, False), reps)
    fused = out.clone()

    def per_shard():
        N.grad_accumulate(out, parts[0], 0.5, False)
        N.grad_accumulate(out, parts[1], 0.5, True)

    t_calls = time_gpu(per_shard, reps)
    t_torch = time_gpu(lambda: torch.add(parts[0].float() * 0.5, parts[1].float(), alpha=0.5), reps)
    ok = torch.equal(fused, out) and torch.equal(fused, parts[0].float() * 0.5 + parts[1].float() * 0.5)
    return [_row("sum 2 bf16 shards -> fp32 (one launch)", n, 8, t_ours, t_copy, t_torch, "torch.add(a*s, b, alpha=s)"),
            _row("sum 2 bf16 shards -> fp32 (a call per shard)", n, 8, t_calls, t_copy)], ok


def bench_size(n: int, reps_base: int) -> list[dict]:
    reps = reps_for(8 * n, reps_base)
    src = torch.randn(n, device=DEVICE)
    t_copy = _bench_copy(src, reps)  # the roofline: device-to-device copy, 8 B/elem
    rows, ok = _bench_bf16(src, reps, t_copy)
    more, ok2 = _bench_fp8(src, reps, t_copy)
    rows += more
    del src
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    more, ok3 = _bench_pack(n, reps, t_copy)
    rows += more
    more, ok4 = _bench_pack(n, reps, t_copy, align=ALIGN_ELEMS)
    rows += more
    more, ok5 = _bench_shard_sum(n, reps, t_copy)
    rows += more
    ok = ok and ok2 and ok3 and ok4 and ok5
    if not ok:
        print(f"WARNING: a result check failed at n={n}", file=sys.stderr)
    for r in rows:
        r["check_ok"] = ok
    return rows


def _quant_torch(src: torch.Tensor, transpose: bool):
    """The activation quantizer written in torch ops (what an eager FP8 Linear without native kernels does)."""
    amax = src.abs().max().float()
    scale = 448.0 / torch.clamp(amax, min=1e-12)
    q = (src.float() * scale).clamp(-448.0, 448.0).to(E4M3)
    return (q, q.t().contiguous() if transpose else None), scale.reciprocal()


def _quant_reference(src: torch.Tensor, fmax: float = N.FP8_E4M3_MAX):
    """(q, q transposed, scale_inv) with the kernels' arithmetic in torch ops: scale = fmax / max(amax, eps) as ONE
    fp32 division. (_quant_torch's ``448.0 / tensor`` is ``tensor.reciprocal() * 448`` in torch: two roundings,
    an ulp off the kernels' scale for about one bf16 amax in five, and then q and scale_inv differ.)"""
    amax = src.abs().max().float()
    scale = torch.full_like(amax, fmax) / torch.clamp(amax, min=1e-12)
    q = (src.float() * scale).clamp(-fmax, fmax).to(E4M3)
    return q, q.t().contiguous(), torch.ones_like(scale) / scale


def _first_difference(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when got and want hold the same bytes; else a line: how many differ, the first one (index, and
    (row, col) for a matrix) and both values with their bits."""
    a, b = got.detach().reshape(-1).view(torch.uint8), want.detach().reshape(-1).view(torch.uint8)
    diff = (a != b).nonzero().flatten()
    if diff.numel() == 0:
        return None
    esz = got.element_size()
    k = int(diff[0]) // esz  # first differing element
    g, w = got.reshape(-1)[k], want.reshape(-1)[k]
    gb, wb = (bytes(t.view(torch.uint8).cpu().tolist()[::-1]).hex() for t in (g.reshape(1), w.reshape(1)))
    where = f"element {k}" + (f" (row {k // got.shape[1]}, col {k % got.shape[1]})" if got.dim() == 2 else "")
    return (f"{what}: {diff.numel()} of {a.numel()} bytes differ; first at {where}: got 0x{gb} ({float(g)!r}), "
            f"want 0x{wb} ({float(w)!r})")


def bench_quantize(n: int, reps_base: int, cols: int = 4096) -> tuple[list[dict], bool]:
    """One bf16 activation (n // cols, cols) -> e4m3 with per-tensor current scaling, with and without the
    transpose, every algorithm, against a copy of the source and against torch ops. The result of the last of the
    timed back-to-back calls is checked bit for bit; a failed check prints which case and what differs."""
    rows_n = max(1, n // cols)
    n = rows_n * cols
    src = torch.randn(rows_n, cols, device=DEVICE, dtype=torch.bfloat16)
    reps = reps_for(4 * n, reps_base)
    dst = torch.empty_like(src)
    t_copy = time_gpu(lambda: dst.copy_(src), reps)
    q = torch.empty(rows_n, cols, dtype=E4M3, device=DEVICE)
    qt = torch.empty(cols, rows_n, dtype=E4M3, device=DEVICE)
    sinv = torch.empty((), device=DEVICE)
    ok = True
    ref_q, ref_qt, ref_sinv = _quant_reference(src)
    amax = float(src.abs().max())
    rows = []
    for transpose in (False, True):
        t_torch = time_gpu(lambda: _quant_torch(src, transpose), max(5, reps // 2))
        for algo in ("two_pass", "fused") if DEVICE == "cuda" else ("two_pass",):
            q.view(torch.uint8).fill_(0xFF)  # NaN: what the kernel does not write cannot pass the check
            qt.view(torch.uint8).fill_(0xFF)
            sinv.fill_(float("nan"))
            t = time_gpu(lambda: N.fp8_quantize(src, q, sinv, dst_t=qt if transpose else None, algo=algo), reps)
            calls = reps + (4 if DEVICE == "cuda" else 3)  # time_gpu's warm-up (and host timing) calls included
            case = f"quantize {n} ({rows_n}x{cols}) algo={algo} transpose={transpose}, last of {calls} calls"
            checks = [("q", q, ref_q), ("scale_inv", sinv, ref_sinv)] + ([("qt", qt, ref_qt)] if transpose else [])
            failures = [f for f in (_first_difference(f"{case}: {w}", g, r) for w, g, r in checks) if f]
            if failures:
                print("\n".join(f"CHECK FAILED {f} [amax {amax!r}]" for f in failures), file=sys.stderr)
            ok &= not failures
            name = f"quantize bf16->e4m3{' +transpose' if transpose else ''} ({algo})"
            bpe = 4 if transpose else 3
            r = {"kernel": name, "elements": n, "src_bytes": 2 * n, "bytes_moved": bpe * n, "ours_s": t,
                 "ours_gbps": bpe * n / t / 1e9, "copy_s": t_copy, "copy_gbps": 4 * n / t_copy / 1e9,
                 "torch_s": t_torch, "torch_gbps": bpe * n / t_torch / 1e9, "speedup": t_torch / t,
                 "torch_way": "abs().max(); (x.float()*s).clamp().to(e4m3)"
                              + ("; .t().contiguous()" if transpose else ""),
                 "check_ok": not failures, "check_failures": failures}
            r["frac_of_copy"] = r["ours_gbps"] / r["copy_gbps"]
            rows.append(r)
    return rows, ok


def parse_shape(s: str) -> tuple[int, int]:
    a, b = s.lower().split("x")
    return int(a), int(b)


def bench_transpose(shape: tuple[int, int], reps_base: int) -> tuple[list[dict], bool]:
    """FP8 (rows, cols) -> (cols, rows): ours vs .t().contiguous(), against a copy of the same bytes."""
    n = shape[0] * shape[1]
    src = torch.randint(0, 256, shape, device=DEVICE, dtype=torch.uint8).view(E4M3)
    dst = torch.empty(shape[1], shape[0], dtype=E4M3, device=DEVICE)
    reps = reps_for(2 * n, reps_base)
    cp = torch.empty_like(src.view(torch.uint8))
    t_copy = time_gpu(lambda: cp.copy_(src.view(torch.uint8)), reps)
    t = time_gpu(lambda: N.fp8_transpose(src, dst), reps)
    t_torch = time_gpu(lambda: src.view(torch.uint8).t().contiguous(), reps)
    ok = torch.equal(dst.view(torch.uint8), src.view(torch.uint8).t())
    r = {"kernel": f"fp8 transpose {shape[0]}x{shape[1]}", "elements": n, "src_bytes": n, "bytes_moved": 2 * n,
         "ours_s": t, "ours_gbps": 2 * n / t / 1e9, "copy_s": t_copy, "copy_gbps": 2 * n / t_copy / 1e9,
         "torch_s": t_torch, "torch_gbps": 2 * n / t_torch / 1e9, "speedup": t_torch / t,
         "torch_way": ".t().contiguous()"}
    r["frac_of_copy"] = r["ours_gbps"] / r["copy_gbps"]
    return [r], ok


def bench_small_tensors(count: int, reps_base: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(2048, 6145, (count,), generator=g).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        tensors = [torch.randn(s, device=DEVICE, dtype=dtype) for s in sizes]
        offsets, cur = [], 0
        for s in sizes:
            offsets.append(cur)
            cur += s
        flat = torch.empty(cur, device=DEVICE, dtype=dtype)
        views = [flat[o:o + s] for o, s in zip(offsets, sizes)]
        esz = flat.element_size()
        nbytes = 2 * esz * cur
        n_copy = torch.empty_like(flat)
        t_copy = time_gpu(lambda: n_copy.copy_(flat), reps_base)
        t_pack = time_gpu(lambda: N.pack(tensors, offsets, flat), reps_base)
        t_foreach = time_gpu(lambda: torch._foreach_copy_(views, tensors), reps_base)
        h_pack = time_host(lambda: N.pack(tensors, offsets, flat), 50)
        h_foreach = time_host(lambda: torch._foreach_copy_(views, tensors), 50)
        flat.fill_(float("nan"))
        N.pack(tensors, offsets, flat)
        ok = all(torch.equal(v, t) for v, t in zip(views, tensors))
        rows.append({"kernel": f"pack {count} small tensors {str(dtype).replace('torch.', '')}", "elements": cur,
                     "src_bytes": esz * cur, "bytes_moved": nbytes, "ours_s": t_pack,
                     "ours_gbps": nbytes / t_pack / 1e9,
                     "copy_s": t_copy, "copy_gbps": nbytes / t_copy / 1e9, "frac_of_copy": t_copy / t_pack,
                     "torch_s": t_foreach, "torch_gbps": nbytes / t_foreach / 1e9, "speedup": t_foreach / t_pack,
                     "torch_way": "torch._foreach_copy_(views, tensors)", "ours_host_s": h_pack,
                     "torch_host_s": h_foreach, "check_ok": ok})
    return rows


def write_markdown(path: str, meta: dict, rows: list[dict], goals: list[str]) -> None:
    lines = [f"# mfsdp_ext kernels on {meta['gpu']}", "",
             f"{meta['date']} - torch {meta['torch']} - CUDA {meta['cuda']} - build {meta['build']}", "",
             "GB/s = bytes the operation must move (read + written) / median GPU time (CUDA events). "
             "`% copy` = ours / device-to-device copy bandwidth measured in the same run. "
             "`speedup` = PyTorch time / our time.", "",
             "| kernel | elements | src MiB | ours GB/s | copy GB/s | % copy | PyTorch GB/s | speedup | ours us "
             "| PyTorch us |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tg = f"{r['torch_gbps']:.0f}" if "torch_gbps" in r else ""
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        tu = f"{r['torch_s'] * 1e6:.1f}" if "torch_s" in r else ""
        lines.append(f"| {r['kernel']} | {size_name(r['elements'])} | {r['src_bytes'] / 2**20:.1f} | "
                     f"{r['ours_gbps']:.0f} | {r['copy_gbps']:.0f} | {100 * r['frac_of_copy']:.0f}% | {tg} | {sp} | "
                     f"{r['ours_s'] * 1e6:.1f} | {tu} |")
    small = [r for r in rows if "ours_host_s" in r]
    if small:
        lines += ["", "Host time per call (calls back to back, includes Python/C++ overhead and the table upload):", "",
                  "| case | ours us/call | _foreach_copy_ us/call |", "|---|---:|---:|"]
        for r in small:
            lines.append(f"| {r['kernel']} | {r['ours_host_s'] * 1e6:.1f} | {r['torch_host_s'] * 1e6:.1f} |")
    lines += ["", "Goals:", ""] + [f"- {g}" for g in goals]
    lines += ["", "Legend: fp32->bf16 cast moves 6 B/elem, fp32->e4m3 cast 5 B/elem, amax 4 B/elem, "
              "amax + cast 9 B/elem, pack fp32 8 B/elem, sum of 2 bf16 shards into fp32 8 B/elem, copy 8 B/elem "
              "(of the fp32 source). "
              "quantize bf16->e4m3: 3 B/elem (4 with the transpose), against a copy of the bf16 source "
              "(4 B/elem); the two-pass kernels read the source twice (5 B/elem of traffic, the second read "
              "partly from L2). fp8 transpose: 2 B/elem, against a copy of the same bytes."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_chart(path: str, meta: dict, rows: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        print(f"matplotlib not importable ({exc}); skipping the chart", file=sys.stderr)
        return False
    sweep = [r for r in rows if "ours_host_s" not in r and not r["kernel"].startswith(("quantize", "fp8 transpose"))]
    if not sweep:  # the chart is the fp32 sweep; the FP8 rows are in the table
        return False
    kernels = []
    for r in sweep:
        if r["kernel"] not in kernels:
            kernels.append(r["kernel"])
    fig, ax = plt.subplots(figsize=(9, 5.5))
    copy_pts = {}
    for r in sweep:
        copy_pts[r["src_bytes"]] = r["copy_gbps"]
    xs = sorted(copy_pts)
    ax.plot([x / 2**20 for x in xs], [copy_pts[x] for x in xs], "k--", lw=2, label="D2D copy")
    for i, k in enumerate(kernels):
        pts = [r for r in sweep if r["kernel"] == k]
        color = f"C{i}"
        ax.plot([r["src_bytes"] / 2**20 for r in pts], [r["ours_gbps"] for r in pts], "o-", color=color,
                label=f"mfsdp {k}")
        if any("torch_gbps" in r for r in pts):
            ax.plot([r["src_bytes"] / 2**20 for r in pts if "torch_gbps" in r],
                    [r["torch_gbps"] for r in pts if "torch_gbps" in r], "x:", color=color,
                    label=f"PyTorch ({pts[0].get('torch_way', '')})"[:60])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("fp32 source size (MiB)")
    ax.set_ylabel("GB/s (bytes moved / time)")
    ax.set_title(f"mfsdp_ext kernels on {meta['gpu']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--sizes", default="1M,4M,16M,64M,256M,1G", help="comma-separated element counts")
    p.add_argument("--reps", type=int, default=100, help="repetitions at small sizes (fewer at large ones)")
    p.add_argument("--small-count", type=int, default=2000, help="tensors in the many-small-tensors pack case")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke-test the script only")
    p.add_argument("--parts", default="fp32,small,quant,transpose",
                   help="fp32 (cast / fp8_cast / pack sweep over --sizes), small (2000 small tensors), quant "
                        "(activation quantizer over --quant-sizes), transpose (over --transpose-shapes)")
    p.add_argument("--quant-sizes", default="4M,8M,16M,64M,256M",
                   help="elements of the bf16 activation (rows x 4096); 4M = 8 MiB")
    p.add_argument("--transpose-shapes", default="4096x4096,4096x11008,11008x4096,16384x8192")
    p.add_argument("--tag", default="", help="output name kernels_<tag>_<gpu>.* (default kernels_<gpu>.*)")
    args = p.parse_args()
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    unknown = parts - {"fp32", "small", "quant", "transpose"}
    if unknown:
        p.error(f"unknown --parts {sorted(unknown)}")

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (--device cpu smoke-tests the script)", file=sys.stderr)
        return 2
    info = N.build_summary()
    if DEVICE == "cuda" and not info.get("cuda"):
        print(f"mfsdp_ext._C was built without CUDA kernels: {info}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)"
    meta = {"gpu": name, "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "build": info}
    print(f"# {name}, torch {torch.__version__}, build {info}", flush=True)

    rows: list[dict] = []
    for n in [parse_size(s) for s in args.sizes.split(",") if s.strip()] if "fp32" in parts else []:
        free = torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else 8 << 30
        need = 24 * n + (256 << 20)  # src + copy + bf16 + the PyTorch fp8 temporaries, roughly
        if need > free:
            print(f"skip n={size_name(n)}: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free", flush=True)
            continue
        t0 = time.time()
        new = bench_size(n, args.reps)
        rows += new
        for r in new:
            extra = f"  PyTorch {r['torch_gbps']:7.0f} GB/s  speedup {r['speedup']:.2f}x" if "speedup" in r else ""
            print(f"{r['kernel']:34s} n={size_name(n):>5s}  ours {r['ours_gbps']:7.0f} GB/s  "
                  f"copy {r['copy_gbps']:7.0f} GB/s  {100 * r['frac_of_copy']:5.1f}%{extra}", flush=True)
        print(f"  ({time.time() - t0:.1f} s)", flush=True)
    if "small" in parts:
        small = bench_small_tensors(args.small_count, args.reps)
        rows += small
        for r in small:
            print(f"{r['kernel']}: ours {r['ours_s'] * 1e6:.1f} us ({r['ours_gbps']:.0f} GB/s), _foreach_copy_ "
                  f"{r['torch_s'] * 1e6:.1f} us, speedup {r['speedup']:.2f}x; host {r['ours_host_s'] * 1e6:.1f} vs "
                  f"{r['torch_host_s'] * 1e6:.1f} us/call", flush=True)
    fp8_jobs = [("quant", bench_quantize, parse_size(x)) for x in args.quant_sizes.split(",") if x.strip()]
    fp8_jobs += [("transpose", bench_transpose, parse_shape(x)) for x in args.transpose_shapes.split(",") if x.strip()]
    for part, fn, arg in fp8_jobs:
        if part not in parts:
            continue
        new, ok = fn(arg, args.reps)
        if not ok:
            print(f"WARNING: a result check failed in {part} {arg}", file=sys.stderr)
        for r in new:
            r.setdefault("check_ok", ok)
            print(f"{r['kernel']:44s} {r['src_bytes'] / 2**20:7.1f} MiB  ours {r['ours_gbps']:7.0f} GB/s "
                  f"{r['ours_s'] * 1e6:8.1f} us  copy {r['copy_gbps']:7.0f} GB/s  {100 * r['frac_of_copy']:5.1f}%  "
                  f"torch {r['torch_s'] * 1e6:8.1f} us  speedup {r['speedup']:.2f}x", flush=True)
        rows += new
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    goals = []
    for k, label in (("cast fp32->bf16", "bf16 cast"), ("fp8_cast fp32->e4m3", "FP8 cast"),
                     ("pack 16 tensors fp32", "pack"),
                     (f"pack 16 tensors fp32, {4 * ALIGN_ELEMS} B aligned",
                      f"pack at fully_shard's {4 * ALIGN_ELEMS} B alignment")):
        if "fp32" not in parts:
            break
        big = [r for r in rows if r["kernel"] == k and r["src_bytes"] >= GOAL_MIN_BYTES]
        if not big:
            goals.append(f"{label} (>= 90% of copy at >= 64 MiB): no size >= 64 MiB measured")
            continue
        worst = min(big, key=lambda r: r["frac_of_copy"])
        met = worst["frac_of_copy"] >= GOAL
        goals.append(f"{label} (>= 90% of copy at >= 64 MiB): {'MET' if met else 'NOT MET'} (worst "
                     f"{100 * worst['frac_of_copy']:.1f}% of copy at {size_name(worst['elements'])} elements)")
    quant_kernels = sorted({r["kernel"] for r in rows if r["kernel"].startswith("quantize")})
    for k in quant_kernels:
        big = [r for r in rows if r["kernel"] == k and r["src_bytes"] >= QUANT_GOAL_MIN_BYTES]
        if not big:
            continue
        worst = min(big, key=lambda r: r["frac_of_copy"])
        met = worst["frac_of_copy"] >= QUANT_GOAL
        sizes = ", ".join(f"{100 * r['frac_of_copy']:.0f}% at {r['src_bytes'] / 2**20:.0f} MiB" for r in big)
        goals.append(f"{k} (>= {100 * QUANT_GOAL:.0f}% of copy at >= 8 MiB): {'MET' if met else 'NOT MET'} ({sizes})")
    for g in goals:
        print("goal:", g, flush=True)

    tag = (args.tag + "_" if args.tag else "") + gpu_tag(name)
    md = os.path.join(args.out, f"kernels_{tag}.md")
    js = os.path.join(args.out, f"kernels_{tag}.json")
    png = os.path.join(args.out, f"kernels_{tag}.png")
    write_markdown(md, meta, rows, goals)
    with open(js, "w") as f:
        json.dump({"meta": meta, "rows": rows, "goals": goals}, f, indent=1)
    wrote_png = write_chart(png, meta, rows)
    print(f"wrote {md}, {js}" + (f", {png}" if wrote_png else ""), flush=True)
    checks = all(r.get("check_ok", True) for r in rows)
    if not checks:
        print("ERROR: some result checks failed", file=sys.stderr)
    return 0 if checks else 1


if __name__ == "__main__":
    sys.exit(main())
