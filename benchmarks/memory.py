"""Memory account: what is live at the peak of a training step, grouped by owner, for mfsdp_ext and FSDP2.

    torchrun --nproc-per-node 2 benchmarks/memory.py --configs 1,4 --out benchmarks/results

Same models, policies and optimizer as benchmarks/step.py (fp32 main weights, bf16 compute, fp32 reduction,
AdamW). For each config and implementation, rank 0 records the CUDA caching allocator's history
(``torch.cuda.memory._record_memory_history``, Python stacks) from before the model is built, runs ``--warmup``
steps, then one measured step. Replaying the recorded allocations and frees gives the live blocks at the
measured step's peak; each block is assigned to an owner by the source line that allocated it (the first frame
in mfsdp_ext, FSDP2, torch.optim or the model). The NCCL symmetric-memory pool (ncclMemAlloc, outside the caching
allocator) is added as its own line. The replayed peak is checked against ``max_memory_allocated``.

Writes ``memory_<N>gpu.{md,json}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import linecache
import os

import step as step_bench  # benchmarks/step.py: this script's folder
import torch
import torch.distributed as dist

from mfsdp_ext.testing import gpt

HERE = os.path.dirname(os.path.abspath(__file__))

GIB = 2**30

# Owners, by the source line (or function) of the first frame, innermost first, that a specific rule matches; frames
# of allocation helpers (FlatBuffer.__init__, FSDP2's comm.allocate) only pass the decision to their caller.
SPECIFIC_RULES = [
    ("optimizer state and step temporaries", lambda f, fn, src: "/torch/optim/" in f),
    # ours (mfsdp_ext/param_group.py, group_grads.py and comm/)
    ("main weights (fp32 shard)", lambda f, fn, src: "self.main_weight = " in src),
    ("model-weight cache (bf16 shard)", lambda f, fn, src: "self.model_weight = " in src),
    ("main grads (fp32 shard)", lambda f, fn, src: "mfsdp_ext" in f and fn == "_new_main_grad"),
    ("gathered weights", lambda f, fn, src: "mfsdp_ext" in f and fn in ("alloc", "_make_unsharded", "all_gather")),
    ("reduce-scatter buffers", lambda f, fn, src: "mfsdp_ext" in f and ("collectives" in f or "dist_ops" in f)),
    # FSDP2 (torch/distributed/fsdp/_fully_shard)
    ("main weights (fp32 shard)", lambda f, fn, src: "_fully_shard" in f and fn in ("_init_sharded_param",
                                                                                    "reset_sharded_param")),
    ("main grads (fp32 shard)", lambda f, fn, src: "_fully_shard" in f and "reduce_output = " in src),
    ("reduce-scatter buffers", lambda f, fn, src: "_fully_shard" in f and ("reduce_scatter_input" in src
                                                                           or fn == "foreach_reduce")),
    ("gathered weights", lambda f, fn, src: "_fully_shard" in f and ("all_gather" in fn or "unsharded" in fn)),
]
FALLBACK_RULES = [
    ("other mfsdp_ext", lambda f, fn, src: "mfsdp_ext" in f),
    ("other FSDP2", lambda f, fn, src: "_fully_shard" in f),
    ("activations and forward temporaries", lambda f, fn, src: f.endswith("gpt.py") and fn != "forward_backward"),
    ("loss / backward entry", lambda f, fn, src: f.endswith("gpt.py")),
]


def owner_of(frames: list) -> str:
    if not frames:
        return "autograd engine (unsharded grads, backward temporaries)"
    described = []
    for fr in frames:  # innermost first
        f, line, fn = fr.get("filename", ""), fr.get("line", 0), fr.get("name", "")
        described.append((f, fn, linecache.getline(f, line) if line else ""))
    for rules in (SPECIFIC_RULES, FALLBACK_RULES):
        for f, fn, src in described:
            for owner, test in rules:
                if test(f, fn, src):
                    return owner
    inner = frames[0]
    return f"other ({os.path.basename(inner.get('filename', '?'))}:{inner.get('name', '?')})"


SITE_FRAMES = 3  # --site-frames


def site_of(frames: list) -> str:
    """Where a block was allocated, finer than its owner: its innermost SITE_FRAMES frames (file:line function)."""
    if not frames:
        return "(no Python frame: autograd engine)"
    return " < ".join(f"{os.path.basename(fr.get('filename', '?'))}:{fr.get('line', 0)} {fr.get('name', '?')}"
                      for fr in frames[:SITE_FRAMES])


def replay_peaks(trace: list, phases: list[str]) -> dict:
    """Replay the allocator's events. ``phases`` are the names of marker functions whose allocations start each
    phase of the measured step; returns per phase (peak bytes, live blocks at the peak, event index)."""
    live: dict[int, tuple[int, list]] = {}
    total = 0
    phase = None
    peaks: dict[str, tuple[int, dict, int]] = {}
    for i, ev in enumerate(trace):
        action = ev["action"]
        if action == "alloc":
            frames = ev.get("frames", [])
            live[ev["addr"]] = (ev["size"], frames)
            total += ev["size"]
            names = {fr.get("name") for fr in frames}
            phase = next((p for p in phases if p in names), phase)
        elif action == "free_requested" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
        if phase is not None and total > peaks.get(phase, (0,))[0]:
            peaks[phase] = (total, dict(live), i)
    return peaks


# Marker allocations: where the measured step's forward+backward and its optimizer step begin.
def forward_backward_begins(device: torch.device) -> torch.Tensor:
    return torch.empty(1, device=device)


def optimizer_step_begins(device: torch.device) -> torch.Tensor:
    return torch.empty(1, device=device)


PHASES = {"forward_backward_begins": "forward + backward", "optimizer_step_begins": "optimizer step"}


def _requested_peak(device: torch.device) -> int:
    """The peak of the bytes the program asked the caching allocator for. max_memory_allocated counts blocks, which
    are rounded up and, in the large pool, keep an unsplit remainder of up to 1 MiB. (Its current value is no
    leftover measure: a block freed while another stream still uses it (record_stream) stays counted until the
    allocator has seen that stream's event.)"""
    return torch.cuda.memory_stats(device)["requested_bytes.all.peak"]


def measure(impl: str, bc, mesh, device: torch.device, args) -> dict:
    step_bench.free_memory(device)
    rank = dist.get_rank()
    record = rank == 0
    if record:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python", context="alloc")
    _, MixedPrecisionPolicy = gpt.load_impl(impl)
    torch.manual_seed(0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = gpt.build_sharded(bc.model_config(), impl, device, args.init == "meta", mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    batches = step_bench.make_batches(bc, device, seed=100 + rank)
    losses = []
    for _ in range(args.warmup):
        step_bench.train_step(model, optimizer, batches, impl, losses)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    markers = [forward_backward_begins(device)]
    before = torch.cuda.memory_allocated(device)
    gpt.forward_backward(model, impl, batches)
    torch.cuda.synchronize(device)
    grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    # what one forward + backward leaves allocated besides the gradients (the allocator's own count, not the replay)
    left_mib = (torch.cuda.memory_allocated(device) - before - grads) / 2**20
    markers.append(optimizer_step_begins(device))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    del markers
    result = dict(max_allocated_gib=torch.cuda.max_memory_allocated(device) / GIB, left_after_backward_mib=left_mib,
                  max_requested_gib=_requested_peak(device) / GIB)
    symmetric = getattr(getattr(getattr(model, "_mfsdp_unit", None), "context", None), "symmetric", None)
    result["symmetric_pool_gib"] = symmetric.comm.native.capacity / GIB if symmetric is not None else 0.0
    if record:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][device.index or 0]
        result["phases"] = {}
        for marker, (peak, live, index) in replay_peaks(trace, list(PHASES)).items():
            owners: dict[str, float] = collections.defaultdict(float)
            for size, frames in live.values():
                owners[owner_of(frames)] += size / GIB
            if result["symmetric_pool_gib"]:
                owners["NCCL symmetric pool"] += result["symmetric_pool_gib"]
            sites: dict[str, float] = collections.defaultdict(float)
            for size, frames in live.values():
                sites[site_of(frames)] += size / GIB
            result["phases"][PHASES[marker]] = dict(peak_gib=peak / GIB, owners=dict(owners), sites=dict(sites),
                                                    context=_context(trace, index))
        result["replayed_peak_gib"] = max(p["peak_gib"] for p in result["phases"].values())
    if hasattr(model, "release_symmetric_memory"):
        model.release_symmetric_memory()
    del model, optimizer, batches
    step_bench.free_memory(device)
    return result


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _context(trace: list, index: int) -> str:
    """Where the peak is: the Python frames of the allocation that reached it."""
    frames = trace[index].get("frames", []) if index < len(trace) else []
    return " < ".join(f"{os.path.basename(f.get('filename', '?'))}:{f.get('name', '?')}" for f in frames[:6])


def write_report(results: dict, world: int, out: str) -> None:
    lines = [f"# Memory at the step's peak: mfsdp_ext vs FSDP2, {world} x {torch.cuda.get_device_name()}", "",
             "Rank 0; GiB of live caching-allocator blocks at the peak of each phase of one training step (after "
             "warm-up; AdamW foreach as in benchmarks/step.py), by the source line that allocated them "
             "(benchmarks/memory.py), plus NCCL's symmetric pool. `python3 -m torch.distributed.run --nproc-per-node "
             f"{world} benchmarks/memory.py`.", ""]
    for cid, by_impl in results.items():
        ours, fsdp2 = by_impl.get("ours", {}), by_impl.get("fsdp2", {})
        bc = step_bench.CONFIGS[int(cid)]
        lines += [f"## config {cid}: {bc.describe()}, {bc.batch}x{bc.seq}, {bc.microbatches} microbatch(es)", "",
                  "max_memory_allocated (+ symmetric pool): ours "
                  f"{ours.get('max_allocated_gib', 0) + ours.get('symmetric_pool_gib', 0):.3f}, "
                  f"fsdp2 {fsdp2.get('max_allocated_gib', 0):.3f} GiB", "",
                  "peak of the bytes asked for (torch.cuda.memory_stats requested_bytes; blocks are rounded up): "
                  f"ours {ours.get('max_requested_gib', 0) + ours.get('symmetric_pool_gib', 0):.6f}, "
                  f"fsdp2 {fsdp2.get('max_requested_gib', 0):.6f} GiB", "",
                  "left allocated by the measured forward + backward besides the gradients (the allocator's count): "
                  f"ours {ours.get('left_after_backward_mib', 0):.1f}, "
                  f"fsdp2 {fsdp2.get('left_after_backward_mib', 0):.1f} MiB",
                  ""]
        for phase in PHASES.values():
            a_ph, b_ph = ours.get("phases", {}).get(phase, {}), fsdp2.get("phases", {}).get(phase, {})
            a_own, b_own = a_ph.get("owners", {}), b_ph.get("owners", {})
            lines += [f"### at the peak of the {phase}", "", "| owner | ours GiB | fsdp2 GiB | ours - fsdp2 |",
                      "|---|---:|---:|---:|"]
            for n in sorted(set(a_own) | set(b_own), key=lambda n: -max(a_own.get(n, 0), b_own.get(n, 0))):
                a, b = a_own.get(n, 0.0), b_own.get(n, 0.0)
                if max(a, b) >= 0.0005:
                    lines.append(f"| {n} | {a:.3f} | {b:.3f} | {a - b:+.3f} |")
            ta, tb = sum(a_own.values()), sum(b_own.values())
            lines += [f"| **total** | **{ta:.3f}** | **{tb:.3f}** | **{ta - tb:+.3f}** |", "",
                      f"reached at: ours `{a_ph.get('context', '')}`; fsdp2 `{b_ph.get('context', '')}`", ""]
            lines += _site_differences(a_ph.get("sites", {}), b_ph.get("sites", {}))
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"memory_{world}gpu")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    print("\n".join(lines))


def _site_differences(ours: dict, fsdp2: dict, top: int = 8) -> list[str]:
    """The allocation sites outside either framework (the model, autograd, torch) whose live GiB differ most
    between the two at the peak: what the owners' "activations" and "autograd" lines do not explain."""
    def outside(site: str) -> bool:
        ours = ("param_group.py", "group_grads.py", "flat_buffer.py", "collectives.py", "group.py")
        return "_fully_shard" not in site and not any(m in site for m in ours)
    diffs = sorted(((ours.get(k, 0.0) - fsdp2.get(k, 0.0), k) for k in set(ours) | set(fsdp2) if outside(k)),
                   key=lambda d: -abs(d[0]))
    rows = [f"| `{k}` | {ours.get(k, 0.0):.4f} | {fsdp2.get(k, 0.0):.4f} | {d:+.4f} |" for d, k in diffs[:top]
            if abs(d) >= 0.0005]
    if not rows:
        return []
    return [f"Largest differences by allocation site (innermost {SITE_FRAMES} frames), outside both frameworks:", "",
            "| site | ours GiB | fsdp2 GiB | ours - fsdp2 |", "|---|---:|---:|---:|", *rows, ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1,4")
    p.add_argument("--impls", default="ours,fsdp2")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--init", choices=["meta", "full"], default="meta")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--site-frames", type=int, default=3, help="frames that name an allocation site in the report")
    args = p.parse_args()
    global SITE_FRAMES
    SITE_FRAMES = args.site_frames
    device = gpt.setup_distributed("cuda")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    results: dict = {}
    try:
        for cid in [c.strip() for c in args.configs.split(",") if c.strip()]:
            bc = step_bench.CONFIGS[int(cid)]
            for impl in [s.strip() for s in args.impls.split(",") if s.strip()]:
                results.setdefault(cid, {})[impl] = measure(impl, bc, mesh, device, args)
                if dist.get_rank() == 0:
                    r = results[cid][impl]
                    print(f"config {cid} {impl}: peak {r['max_allocated_gib']:.3f} GiB (replayed "
                          f"{r.get('replayed_peak_gib', 0):.3f}), symmetric pool {r['symmetric_pool_gib']:.3f}",
                          flush=True)
        if dist.get_rank() == 0:
            write_report(results, dist.get_world_size(), args.out)
    finally:
        gpt.teardown_distributed(mesh)


if __name__ == "__main__":
    main()
