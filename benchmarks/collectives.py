#!/usr/bin/env python3
"""All-gather and reduce-scatter: our native NCCL symmetric path vs PyTorch, side by side in one run.

    torchrun --nproc-per-node N benchmarks/collectives.py --out DIR

Methods (bf16, sizes = bytes of the gathered buffer / of the reduce-scatter input):
  ours       mfsdp_ext.comm.symmetric.SymmetricComm: buffers from our ncclMemAlloc pool registered as
             NCCL_WIN_COLL_SYMMETRIC windows, ncclAllGather / ncclReduceScatter(sum) called from C++.
  plain      torch.distributed all_gather_single / reduce_scatter_single (or *_into_tensor / *_tensor on
             older torch) on ordinary caching-allocator tensors.
  torchsymm  the same torch.distributed calls on tensors from PyTorch's symmetric-memory pool
             (torch.distributed._symmetric_memory, NCCL backend, rendezvous'ed on the group).
All-gathers are in place (input = this rank's slot of the output, as FSDP uses them) for every method;
reduce-scatters are out of place.

Timing (see time_case): latency as nccl-tests defines it (back-to-back calls between one event pair, mean
per call; median of 5 loops, max over ranks), and the time of one call alone (its own events, the GPU kept
busy by a spin queued before it so the host's launch time is not counted; median, max over ranks). No CUDA
graphs. busbw = size * (N-1)/N / latency, as nccl-tests. Each method's result is checked
once against plain (exact: the inputs are small integers). A profiler pass counts the NCCL kernels each
method ran (ncclSymk* = NCCL's symmetric kernels). Rank 0 writes collectives_<N>gpu.{md,json,png}.

    torchrun --nproc-per-node N benchmarks/collectives.py --units --out DIR

--units instead measures one fully_shard unit's collectives at the unit sizes of benchmarks/step.py's configs 1-4
(a Llama block of mfsdp_ext.testing.gpt and the root's embedding + norm + head; bf16 all-gather, fp32 reduce-scatter),
laid out by mfsdp_ext.core.layout.FlatLayout and called as fully_shard calls them, against the alternatives:
  AG grouped per parameter  ours: one all-gather per parameter, one NCCL group, each into its place (no copy)
  AG flat                   one flat all-gather of the same bytes (rank-major: the parameters come out split)
  AG flat + unpack          the flat all-gather plus the native copy into param-major places (FSDP2's copy-out)
  RS pack + flat            ours: bf16 grads packed (cast, scaled) rank-major in one native launch + flat RS
  RS flat                   the flat reduce-scatter alone
  RS grouped per parameter  one reduce-scatter per padded fp32 gradient, one NCCL group (no pack)
  RS bf16 wire + fp32 sum   MixedPrecisionPolicy(reduce_comm_dtype=bf16): bf16 grads packed as they are, one flat
                            all-to-all (half the bytes), this rank's shards summed in fp32 (one grad_accumulate)
  A2A bf16                  that all-to-all alone
  AG symmetric + unpack     use_symm_mem's all-gather: shard into its slot of the NCCL symmetric stage, symmetric
                            all-gather (one collective: NCCL's symmetric kernels take no groups), native unpack
  RS symmetric pack + flat  use_symm_mem's reduce-scatter: pack into the stage, symmetric reduce-scatter
Rank 0 writes collectives_units_<N>gpu.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections import Counter

# NVLink multicast stays off on these machines (never turn it on).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mfsdp_ext.comm.dist_ops import _all_gather_flat, _reduce_scatter_flat  # noqa: E402  (torch's flat collectives)

MiB = 1 << 20
DTYPE = torch.bfloat16
METHODS = ("ours", "plain", "torchsymm")
COLLS = ("all_gather", "reduce_scatter")


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[collectives] {msg}", flush=True)


def agree(ok: bool, device) -> bool:
    """True only if every rank says True (keeps ranks in lock-step around optional methods)."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


# ----------------------------------------------------------------------------------------------
# allocators per method
# ----------------------------------------------------------------------------------------------
class PlainAlloc:
    def __init__(self, device):
        self.device = device

    def __call__(self, numel):
        return torch.empty(numel, dtype=DTYPE, device=self.device)

    def release(self, t):
        pass


class OursAlloc:
    def __init__(self, comm):
        self.comm = comm

    def __call__(self, numel):
        return self.comm.alloc_tensor(numel, DTYPE)

    def release(self, t):
        self.comm.free_tensor(t)


class TorchSymmAlloc:
    """PyTorch's symmetric pool (NCCL backend). Tensors are rendezvous'ed (collective) on the group."""

    def __init__(self, device, group):
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.device = device
        self.group = group
        self.pool = symm_mem.get_mem_pool(device) if hasattr(symm_mem, "get_mem_pool") else None
        self.keep = []  # torch's pool caches segments; keep tensors alive until the method is done

    def __call__(self, numel):
        if self.pool is not None:
            with torch.cuda.use_mem_pool(self.pool):
                t = torch.empty(numel, dtype=DTYPE, device=self.device)
        else:
            t = self.symm_mem.empty(numel, dtype=DTYPE, device=self.device)
        self.symm_mem.rendezvous(t, self.group.group_name)
        self.keep.append(t)
        return t

    def release(self, t):
        pass


def setup_torchsymm(device, group):
    """(allocator, None) or (None, reason)."""
    try:
        import warnings

        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "set_backend"):
            get = getattr(symm_mem, "get_backend", None)
            if get is None or get(device) != "NCCL":
                symm_mem.set_backend("NCCL")
        else:
            return None, "torch.distributed._symmetric_memory has no set_backend (no NCCL backend in this torch)"
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(group.group_name)
        alloc = TorchSymmAlloc(device, group)
        probe = alloc(4096)  # allocation + rendezvous smoke test
        probe.zero_()
        return alloc, None
    except Exception as exc:  # pragma: no cover - depends on the torch build
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]


# ----------------------------------------------------------------------------------------------
# one collective on one method
# ----------------------------------------------------------------------------------------------
def make_case(method, coll, nbytes, alloc, comm, group, rank, world):
    """Returns (input, output, run) with inputs filled with small integers (exact in bf16 and in sums)."""
    numel = nbytes // torch.empty((), dtype=DTYPE).element_size()
    assert numel % world == 0
    shard = numel // world
    ag, rs = _all_gather_flat, _reduce_scatter_flat
    if coll == "all_gather":
        out = alloc(numel)
        out.zero_()
        inp = out.narrow(0, rank * shard, shard)
        inp.copy_((torch.arange(shard, device=out.device) % 251 + 3 * rank) % 256)
        if method == "ours":
            run = lambda: comm.all_gather_into(out, inp)  # noqa: E731
        else:
            run = lambda: ag(out, inp, group=group)  # noqa: E731
        return inp, out, run, [out]
    inp = alloc(numel)
    out = alloc(shard)
    inp.copy_(torch.arange(numel, device=inp.device) % 13 + rank)
    out.zero_()
    if method == "ours":
        run = lambda: comm.reduce_scatter_into(out, inp)  # noqa: E731
    else:
        run = lambda: rs(out, inp, group=group)  # noqa: E731
    return inp, out, run, [inp, out]


def sleep_cycles_per_us(device) -> float:
    """Clock cycles of torch.cuda._sleep per microsecond on this GPU (measured once)."""
    cycles = 2_000_000
    torch.cuda._sleep(cycles // 10)  # warm-up
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(cycles)
    e1.record()
    torch.cuda.synchronize(device)
    return cycles / (e0.elapsed_time(e1) * 1e3)


def time_case(run, iters, warmup, device, local_rank, cycles_per_us, repeats=5):
    """Returns (b2b_us, call_us, min_call_us), each the max over ranks.

    b2b_us: nccl-tests' latency: one event pair around `iters` back-to-back calls, divided by iters;
            median of `repeats` such loops.
    call_us: one call between its own events, median over iters. A GPU spin (torch.cuda._sleep) is queued
             before each call so the GPU is still busy when the call is launched: the host's launch time is
             not counted, and since every rank spins equally after the previous call, ranks start together.
    """
    for _ in range(warmup):
        run()
    torch.cuda.synchronize(device)
    dist.barrier(device_ids=[local_rank])
    loops = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            run()
        e1.record()
        torch.cuda.synchronize(device)
        loops.append(e0.elapsed_time(e1) * 1e3 / iters)
    dist.barrier(device_ids=[local_rank])
    spin = int(60 * cycles_per_us)  # longer than one launch on the host
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        torch.cuda._sleep(spin)
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize(device)
    per_call = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    stats = torch.tensor([statistics.median(loops), statistics.median(per_call), min(per_call)],
                         dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank bounds the collective
    return stats.tolist()


def kernel_names(prof) -> Counter:
    from torch.autograd import DeviceType

    names = Counter()
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        name = e.name.split("(")[0]
        if name.startswith("nccl"):
            names[name] += 1
    return names


def iters_for(nbytes: int, scale: float) -> int:
    base = 200 if nbytes <= 8 * MiB else (100 if nbytes <= 64 * MiB else 40)
    return max(5, int(base * scale))


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def write_report(out_dir, world, meta, results, kernels, skipped):
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"collectives_{world}gpu")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "results": results, "kernels": kernels, "skipped": skipped}, f, indent=2)

    def get(coll, size, method):
        for r in results:
            if r["coll"] == coll and r["size_mib"] == size and r["method"] == method:
                return r
        return None

    lines = [
        f"# Collectives on {world} x {meta['gpu']} (bf16)",
        "",
        f"torch {meta['torch']}, NCCL (torch) {meta['nccl_torch']}, NCCL (ours) {meta['nccl_ours']}, "
        f"NCCL_NVLS_ENABLE={meta['env'].get('NCCL_NVLS_ENABLE')}, "
        f"TORCH_SYMM_MEM_DISABLE_MULTICAST={meta['env'].get('TORCH_SYMM_MEM_DISABLE_MULTICAST')}.",
        f"plain/torchsymm use `{meta['ag_fn']}` / `{meta['rs_fn']}`. All-gathers in place, reduce-scatters out of "
        "place.",
        "Latency: nccl-tests' definition, back-to-back calls between one event pair, mean per call (median of 5 "
        "loops, max over ranks). Per call: each call between its own events with the GPU kept busy by a spin "
        "queued before it, so host launch time is not counted (median, max over ranks).",
        "busbw = size * (N-1)/N / latency. Ratios > 1 mean ours is faster.",
        "",
    ]
    for m, why in skipped.items():
        lines.append(f"- **{m} skipped**: {why}")
    if skipped:
        lines.append("")
    for coll in COLLS:
        sizes = sorted({r["size_mib"] for r in results if r["coll"] == coll})
        if not sizes:
            continue
        lines += [
            f"## {coll} (size = {'gathered output' if coll == 'all_gather' else 'reduce-scatter input'})",
            "",
            "| size MiB | ours us | plain us | torchsymm us | plain/ours | torchsymm/ours | ours GB/s | plain GB/s "
            "| torchsymm GB/s | per call: ours us | plain us | torchsymm us | plain/ours | correct (ours/torchsymm) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
        ]
        for s in sizes:
            o, p, t = (get(coll, s, m) for m in METHODS)
            lat = lambda r: None if r is None else r["b2b_us"]  # noqa: E731
            bw = lambda r: None if r is None else r["busbw_gbps"]  # noqa: E731
            call = lambda r: None if r is None else r["call_us"]  # noqa: E731
            ratio = lambda a, b: None if a is None or b is None or b == 0 else a / b  # noqa: E731
            ok = lambda r: "-" if r is None else ("yes" if r["correct"] else f"NO ({r['max_abs_diff']})")  # noqa: E731
            lines.append(
                f"| {s} | {fmt(lat(o))} | {fmt(lat(p))} | {fmt(lat(t))} | {fmt(ratio(lat(p), lat(o)), '.2f')} "
                f"| {fmt(ratio(lat(t), lat(o)), '.2f')} | {fmt(bw(o))} | {fmt(bw(p))} | {fmt(bw(t))} "
                f"| {fmt(call(o))} | {fmt(call(p))} | {fmt(call(t))} | {fmt(ratio(call(p), call(o)), '.2f')} "
                f"| {ok(o)} / {ok(t)} |"
            )
        lines.append("")
    if kernels:
        lines += ["## NCCL kernels seen by the profiler (all sizes, 2 calls each)", "",
                  "| method | collective | ncclSymk kernels | other NCCL kernels |", "|---|---|---|---|"]
        for m in METHODS:
            for coll in COLLS:
                k = kernels.get(m, {}).get(coll)
                if k is None:
                    continue
                symk = ", ".join(f"{n} x{c}" for n, c in sorted(k.items()) if n.startswith("ncclSymk")) or "none"
                other = ", ".join(f"{n} x{c}" for n, c in sorted(k.items()) if not n.startswith("ncclSymk")) or "none"
                lines.append(f"| {m} | {coll} | {symk} | {other} |")
        lines.append("")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, coll in zip(axes, COLLS):
            for m in METHODS:
                rs = sorted((r for r in results if r["coll"] == coll and r["method"] == m), key=lambda r: r["size_mib"])
                if rs:
                    ax.plot([r["size_mib"] for r in rs], [r["b2b_us"] for r in rs], marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size (MiB)")
            ax.set_ylabel("latency (us, nccl-tests)")
            ax.set_title(f"{coll}, {world} GPUs, bf16")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(base + ".png", dpi=120)
        plt.close(fig)
    except Exception as exc:  # matplotlib is optional
        print(f"[collectives] no chart: {exc}", flush=True)
    return base


# ----------------------------------------------------------------------------------------------
# one unit's collectives, as fully_shard issues them (--units)
# ----------------------------------------------------------------------------------------------
def unit_shapes() -> dict:
    """{unit name: parameter shapes} for the units of benchmarks/step.py's configs 1-4 (mfsdp_ext/testing/gpt.py)."""
    from mfsdp_ext.testing import gpt

    units = {}
    for dim, ffn in ((2048, 5632), (1024, 2816), (4096, 11008)):
        cfg = gpt.GPTConfig(n_layers=1, dim=dim, n_heads=dim // 128, ffn_dim=ffn, vocab_size=32000, max_seq_len=256)
        model = gpt.GPT(cfg, device="meta")
        units[f"block d{dim}"] = [p.shape for p in model.layers[0].parameters()]
        if dim == 2048:
            units[f"root d{dim} (embedding, norm, head)"] = [
                p.shape for n, p in model.named_parameters() if not n.startswith("layers.")]
    return units


def unit_cases(shapes, group, device, rank, world, symmetric=None) -> dict:
    """{method: run()} for one unit, with its buffers laid out as fully_shard lays them out; ``symmetric``
    (SymmetricStages) adds use_symm_mem's paths."""
    from mfsdp_ext import _native
    from mfsdp_ext.comm import dist_ops
    from mfsdp_ext.core.flat_buffer import FlatBuffer
    from mfsdp_ext.core.layout import FlatLayout

    layout = FlatLayout(shapes, world)
    S, n_params = layout.shard_numel, len(layout.slots)
    shard = FlatBuffer(layout, DTYPE, device, rank=rank)
    shard.data.copy_(torch.randn(S, device=device))
    unsharded = FlatBuffer(layout, DTYPE, device)
    rank_major = torch.empty(layout.rank_major_numel, dtype=DTYPE, device=device)
    gather_in = [shard.chunk_slot(i) for i in range(n_params)]
    gather_out = [unsharded.padded_param(i) for i in range(n_params)]
    pieces = layout.rank_major_pieces()  # as ParamGroup uses them
    unpack_offsets = [offset for _, _, _, offset in pieces]
    unpack_outs = [unsharded.padded_param(i)[first : first + n] for i, first, n, _ in pieces]
    table = torch.tensor(pieces, dtype=torch.int64)
    grads = [torch.randn(shape, device=device).to(DTYPE) for shape in shapes]
    packed = torch.empty(layout.rank_major_numel, dtype=torch.float32, device=device)
    reduced = FlatBuffer(layout, torch.float32, device, rank=rank)
    padded = [torch.randn(world * s.chunk_numel, device=device) for s in layout.slots]
    grouped_reduced = [reduced.chunk_slot(i) for i in range(n_params)]

    def pack_into(out):  # as ParamGroup.pack_grads: rank-major, cast to fp32, scaled
        _native.pack_pieces(grads, table, out, 1.0 / world)

    def flat_gather_unpack():
        _all_gather_flat(rank_major, shard.data, group=group)
        _native.unpack(rank_major, unpack_offsets, unpack_outs)

    def pack_reduce():
        pack_into(packed)
        _reduce_scatter_flat(reduced.data, packed, group=group)

    def grouped_reduce():
        group.reduce_scatter_tensor_coalesced(grouped_reduced, padded).wait()

    packed_wire = torch.empty(layout.rank_major_numel, dtype=DTYPE, device=device)
    received = torch.empty_like(packed_wire)

    def wire_reduce():  # as PlainReduceScatter._sum_on_arrival, summed into a fresh main_grad (buffers made once)
        _native.pack_pieces(grads, table, packed_wire, 1.0)
        dist_ops.all_to_all_into(received, packed_wire, group)
        _native.grad_accumulate(reduced.data, received.view(world, S), 1.0 / world, False)

    cases = {
        "AG grouped per parameter": lambda: dist_ops.all_gather_into(gather_out, gather_in, group),
        "AG flat": lambda: _all_gather_flat(rank_major, shard.data, group=group),
        "AG flat + unpack": flat_gather_unpack,
        "RS pack + flat": pack_reduce,
        "RS flat": lambda: _reduce_scatter_flat(reduced.data, packed, group=group),
        "RS grouped per parameter": grouped_reduce,
        "RS bf16 wire + fp32 sum": wire_reduce,
        "A2A bf16": lambda: dist_ops.all_to_all_into(received, packed_wire, group),
    }
    if symmetric is not None:
        stage, slot = symmetric.all_gather_buffers(S, DTYPE)
        s_packed, s_reduced = symmetric.reduce_scatter_buffers(layout.rank_major_numel, torch.float32)

        def symmetric_gather():
            slot.copy_(shard.data)
            symmetric.comm.all_gather_into(stage, slot)
            _native.unpack(stage, unpack_offsets, unpack_outs)

        def symmetric_reduce():
            pack_into(s_packed)
            symmetric.comm.reduce_scatter_into(s_reduced, s_packed)

        cases.update({"AG symmetric + unpack": symmetric_gather, "RS symmetric pack + flat": symmetric_reduce})
    return layout.unsharded_numel * DTYPE.itemsize / MiB, n_params, cases


UNIT_METHODS = ("AG grouped per parameter", "AG flat", "AG flat + unpack", "AG symmetric + unpack", "RS pack + flat",
                "RS flat", "RS grouped per parameter", "RS symmetric pack + flat", "RS bf16 wire + fp32 sum",
                "A2A bf16")


def bench_units(args, group, device, rank, world, local_rank) -> list:
    from mfsdp_ext.comm import symmetric as symm_mem
    from mfsdp_ext.comm.symmetric.collectives import SymmetricStages
    from mfsdp_ext.core.layout import FlatLayout

    cycles_per_us = sleep_cycles_per_us(device)
    units = unit_shapes()
    symmetric = None
    if agree(symm_mem.is_available(group)[0], device):
        layouts = [FlatLayout(shapes, world) for shapes in units.values()]
        symmetric = SymmetricStages(
            group, max(lay.rank_major_numel for lay in layouts) * DTYPE.itemsize,
            max(SymmetricStages.reduce_scatter_stage_bytes(lay.rank_major_numel, world, torch.float32)
                for lay in layouts))
    rows = []
    for name, shapes in units.items():
        mib, n_params, cases = unit_cases(shapes, group, device, rank, world, symmetric)
        row = dict(unit=name, gathered_mib=mib, params=n_params)
        for method in (m for m in UNIT_METHODS if m in cases):
            iters = iters_for(int(mib * MiB), args.iters_scale)
            b2b_us, call_us, _ = time_case(cases[method], iters, args.warmup, device, local_rank, cycles_per_us)
            row[method] = dict(b2b_us=b2b_us, call_us=call_us)
            log(f"{name:38s} {method:26s} latency {b2b_us:8.1f} us  per call {call_us:8.1f} us")
        rows.append(row)
        del cases
        torch.cuda.empty_cache()
    if symmetric is not None:
        symmetric.close()
    return rows


def write_units_report(out_dir, world, meta, rows) -> str:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"collectives_units_{world}gpu")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = [
        f"# One unit's collectives on {world} x {meta['gpu']}: grouped per parameter vs flat",
        "",
        f"torch {meta['torch']}, NCCL {meta['nccl_torch']}, NCCL_NVLS_ENABLE={meta['env'].get('NCCL_NVLS_ENABLE')}. "
        "All-gather bf16, reduce-scatter fp32; buffers laid out by mfsdp_ext's FlatLayout (torch.chunk's split).",
        "Latency: back-to-back calls between one event pair, mean per call (median of 5 loops, max over ranks); "
        "it includes the host's cost of issuing the calls when that is the bottleneck. Per call: the GPU time of "
        "one call (host launch time hidden by a spin queued before it). Microseconds.",
        "",
        "| unit | MiB | params | " + " | ".join(UNIT_METHODS)
        + " | grouped / flat AG | pack+flat / flat RS | bf16 wire / pack+flat RS |",
        "|---|---:|---:|" + "---:|" * len(UNIT_METHODS) + "---:|---:|---:|",
    ]
    for kind in ("b2b_us", "call_us"):
        for r in rows:
            cells = [fmt(r[m][kind]) if m in r else "-" for m in UNIT_METHODS]
            ratio_ag = r["AG grouped per parameter"][kind] / r["AG flat"][kind]
            ratio_rs = r["RS pack + flat"][kind] / r["RS flat"][kind]
            ratio_wire = r["RS bf16 wire + fp32 sum"][kind] / r["RS pack + flat"][kind]
            label = "latency" if kind == "b2b_us" else "per call"
            lines.append(f"| {r['unit']} ({label}) | {r['gathered_mib']:.1f} | {r['params']} | " + " | ".join(cells)
                         + f" | {ratio_ag:.2f} | {ratio_rs:.2f} | {ratio_wire:.2f} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return base


# ----------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sizes-mib", default="1,8,64,256")
    ap.add_argument("--iters-scale", type=float, default=1.0, help="scale the per-size iteration counts")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-profile", action="store_true", help="skip the profiler pass")
    ap.add_argument("--units", action="store_true", help="measure one unit's collectives at configs 1-4's sizes")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier(device_ids=[local_rank])  # make sure the communicator exists before borrowing it
    if args.units:
        return run_units(args, group, device, rank, world, local_rank)

    sizes = [int(s) for s in args.sizes_mib.split(",") if s]
    sizes = [s for s in sizes if (s * MiB // 2) % world == 0]
    skipped: dict[str, str] = {}

    # torch's symmetric backend must be chosen before any symmetric allocation.
    tsymm_alloc, why = setup_torchsymm(device, group)
    if not agree(tsymm_alloc is not None, device):
        skipped["torchsymm"] = why or "unavailable on another rank"
        tsymm_alloc = None
        log(f"torchsymm skipped: {skipped['torchsymm']}")

    from mfsdp_ext.comm import symmetric as symm_mem

    comm = None
    ok, why = symm_mem.is_available(group)
    if ok:
        try:
            pool = int(sum(sizes) * MiB * (1.0 + 1.0 / world)) + 64 * MiB
            comm = symm_mem.SymmetricComm(group, pool_bytes=pool)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
            traceback.print_exc()
    if not agree(comm is not None, device):
        skipped["ours"] = why
        if comm is not None:
            comm.close()
        comm = None
        log(f"ours skipped: {why}")
    elif rank == 0:
        log(f"ours: {comm!r}")

    allocs = {"plain": PlainAlloc(device)}
    if comm is not None:
        allocs["ours"] = OursAlloc(comm)
    if tsymm_alloc is not None:
        allocs["torchsymm"] = tsymm_alloc

    results = []
    kernels: dict = {}
    cycles_per_us = sleep_cycles_per_us(device)
    t_start = time.time()
    for coll in COLLS:
        expected = {}
        for method in ("plain", "ours", "torchsymm"):  # plain first: it is the reference
            if method not in allocs:
                continue
            alloc = allocs[method]
            cases = {}
            try:
                for s in sizes:
                    cases[s] = make_case(method, coll, s * MiB, alloc, comm, group, rank, world)
                setup_ok = True
            except Exception as exc:
                setup_ok = False
                err = f"{type(exc).__name__}: {exc}".splitlines()[0]
                traceback.print_exc()
            if not agree(setup_ok, device):
                skipped[f"{method}/{coll}"] = err if not setup_ok else "setup failed on another rank"
                continue
            for s in sizes:
                inp, out, run, _ = cases[s]
                run()
                torch.cuda.synchronize(device)
                if method == "plain":
                    expected[s] = out.clone()
                    correct, diff = True, 0.0
                else:
                    diff = (out.float() - expected[s].float()).abs().max().item() if out.numel() else 0.0
                    correct = bool(torch.equal(out, expected[s]))
                iters = iters_for(s * MiB, args.iters_scale)
                b2b_us, call_us, min_us = time_case(run, iters, args.warmup, device, local_rank, cycles_per_us)
                nbytes = s * MiB
                busbw = nbytes * (world - 1) / world / (b2b_us * 1e-6) / 1e9
                results.append(dict(coll=coll, method=method, size_mib=s, iters=iters, b2b_us=b2b_us,
                                    call_us=call_us, min_call_us=min_us, busbw_gbps=busbw, correct=correct,
                                    max_abs_diff=diff))
                log(f"{coll:14s} {method:9s} {s:4d} MiB  latency {b2b_us:9.1f} us  per call {call_us:9.1f} us  "
                    f"busbw {busbw:7.1f} GB/s  correct={correct}")
            if not args.no_profile:
                try:
                    from torch.profiler import ProfilerActivity, profile

                    dist.barrier(device_ids=[local_rank])
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for s in sizes:
                            for _ in range(2):
                                cases[s][2]()
                        torch.cuda.synchronize(device)
                    kernels.setdefault(method, {})[coll] = dict(kernel_names(prof))
                except Exception as exc:  # profiler trouble must not lose the timings
                    log(f"profiler pass failed for {method}/{coll}: {exc}")
            torch.cuda.synchronize(device)
            for s in sizes:
                for t in cases[s][3]:
                    alloc.release(t)
            cases.clear()
    log(f"measured in {time.time() - t_start:.1f} s")

    if rank == 0:
        meta = dict(
            world=world,
            gpu=torch.cuda.get_device_name(device),
            torch=torch.__version__,
            nccl_torch=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?",
            nccl_ours=symm_mem.format_nccl_version(symm_mem.nccl_version()),
            python=platform.python_version(),
            ag_fn=_all_gather_flat.__name__,
            rs_fn=_reduce_scatter_flat.__name__,
            sizes_mib=sizes,
            warmup=args.warmup,
            env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                 "NCCL_ALGO", "NCCL_PROTO", "CUDA_VISIBLE_DEVICES")},
            ours_borrowed_comm=None if comm is None else comm.borrowed,
        )
        base = write_report(args.out, world, meta, results, kernels, skipped)
        print(f"[collectives] wrote {base}.md / .json", flush=True)
        with open(base + ".md") as f:
            print(f.read(), flush=True)

    dist.barrier(device_ids=[local_rank])
    if comm is not None:
        comm.close()
    if tsymm_alloc is not None:
        tsymm_alloc.keep.clear()
    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()
    return 0


def run_units(args, group, device, rank, world, local_rank) -> int:
    rows = bench_units(args, group, device, rank, world, local_rank)
    if rank == 0:
        meta = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__,
                    nccl_torch=".".join(map(str, torch.cuda.nccl.version())), python=platform.python_version(),
                    env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO")})
        base = write_units_report(args.out, world, meta, rows)
        with open(base + ".md") as f:
            print(f.read(), flush=True)
    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
