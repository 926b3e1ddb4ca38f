"""AdamW on the CPU (the optimizer step of CPU-offloaded training): mfsdp_ext's native kernel against torch's AdamW,
and both against the machine's memory bandwidth measured in the same run. No GPU needed.

    python3 benchmarks/cpu_optim.py --out DIR                               # ~30M elements, every thread count
    python3 benchmarks/cpu_optim.py --numel 100000000 --tensors 200 --out DIR --tag 64core

Writes cpu_optim_<tag>.md and .json into --out (tag: --tag, default "<cores>core") and prints the tables.

Part 1, a flat set of --numel fp32 elements split into --tensors parameters (odd sizes), fp32 grads:
  ours            _native.adamw_step over the flat buffers, one run per parameter (the kernel of
                  mfsdp_ext.optim.AdamW; its per-step host work, a few us per group, is not in the number), on the
                  best code path this CPU has (and each other path, forced with _C.set_cpu_simd)
  ours bf16 grads the same with bf16 grads (2 bytes less per element)
  torch foreach   torch.optim.AdamW(foreach=True) over the parameters
  torch for-loop  torch.optim.AdamW(foreach=False)
  torch fused     torch.optim.AdamW(fused=True) (CPU fused AdamW; reported as an error where torch lacks it)
  stream copy     dst.copy_(src) over 4 x --numel fp32 elements: GB/s counting the read and the write (as STREAM
                  counts; the write-allocate read of dst is not counted, so the memory system moves ~1.5x this)
  stream scale    x.mul_(1.0) in place over the same size: one read and one write of each line, AdamW's pattern
                  (param, exp_avg, exp_avg_sq are read and written back; grad is only read)
The fraction of bandwidth is ours' GB/s over the higher of the two stream rates. State traffic per step (what AdamW
must read and write once): param r/w, grad r, exp_avg r/w, exp_avg_sq r/w = 28 B per element (26 with bf16 grads).

Part 2, a threads sweep (1, 2, 4, ... and the core count): stream copy, ours, torch foreach.

Part 3 (--gpt, on by default): benchmarks/optim.py's CPU setup (rank 0's shards of a GPT at world 2, one
adamw_step per fully_shard group, torch foreach over per-parameter views), as `python benchmarks/optim.py --device
cpu` runs it, at a shape whose shard holds ~29M elements (L8 d512 ffn1408, vocab 32000).

Every variant is warmed up, then timed round-robin (one step of each in turn, --steps rounds): a machine shared with
other work slows all variants alike instead of whichever ran during a burst. Median step times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from mfsdp_ext import _C, _native  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GPT_SHAPE = "8,512,1408,32000"  # layers, dim, ffn, vocab: rank 0's shard at world 2 holds 29.2M elements


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=float, default=30e6, help="elements of the flat set (default 30M)")
    p.add_argument("--tensors", type=int, default=64, help="parameters the flat set is split into")
    p.add_argument("--steps", type=int, default=20, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", default="", help="threads of part 1 (default: torch's, i.e. the core count)")
    p.add_argument("--sweep", default="auto", help="thread counts of part 2, e.g. 1,2,4; 'auto': 1, 2, 4, ... and "
                   "the core count; 'none': skip")
    p.add_argument("--sweep-steps", type=int, default=10)
    p.add_argument("--gpt", default=GPT_SHAPE, help="part 3's GPT shape 'layers,dim,ffn,vocab'; 'none': skip")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default="", help="file name tag (default: <cores>core)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- environment
def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (uncommitted changes)" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def simd_paths() -> list[str]:
    """The kernel's code paths this CPU runs, best first (a build before them: one, unnamed)."""
    return _C.cpu_simd_paths() if hasattr(_C, "cpu_simd_paths") else ["(one path)"]


def set_simd(path: str) -> None:
    """Force a code path ("auto": the best); nothing on a build before them."""
    if hasattr(_C, "set_cpu_simd"):
        _C.set_cpu_simd(path)


class OtherLoad:
    """The share of the machine's CPU time that other processes took between start() and stop() (Linux): timings
    from a machine busy with other work are slower, torch's many short parallel regions most of all."""

    def start(self) -> None:
        self.t0, self.own0 = self._stat(), self._own()

    def stop(self) -> float | None:
        t1, own1 = self._stat(), self._own()
        if self.t0 is None or t1 is None:
            return None
        busy, total = t1[0] - self.t0[0], t1[1] - self.t0[1]
        hz = os.sysconf("SC_CLK_TCK")
        return max(0.0, (busy / hz - (own1 - self.own0)) / (total / hz)) if total else None

    @staticmethod
    def _stat():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            return sum(v) - v[3] - v[4], sum(v)  # busy (all but idle and iowait), total
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system


# ---------------------------------------------------------------------------------------------- timing
def timed_round_robin(fns: dict, steps: int, warmup: int) -> dict:
    """{name: median ms}: each fn warmed up, then timed one call at a time in turn. fns[name] is (setup, call):
    setup() runs before each of its calls, untimed (e.g. the code path to take)."""
    for setup, call in fns.values():
        for _ in range(warmup):
            setup()
            call()
    times = {name: [] for name in fns}
    for _ in range(steps):
        for name, (setup, call) in fns.items():
            setup()
            t0 = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def nothing() -> None:
    pass


# ---------------------------------------------------------------------------------------------- the flat set
def split_sizes(numel: int, tensors: int) -> list[int]:
    """tensors sizes summing to numel, unequal and mostly odd (vector tails, unaligned starts)."""
    base = numel // tensors
    sizes = [base + (7 * i) % 13 - 6 for i in range(tensors - 1)]
    sizes.append(numel - sum(sizes))
    assert min(sizes) > 0
    return sizes


class FlatSet:
    """param / grad / exp_avg / exp_avg_sq flat buffers and one run per parameter for ours; per-parameter views of
    param and grad for torch's optimizers (their states are their own)."""

    def __init__(self, numel: int, tensors: int):
        g = torch.Generator().manual_seed(0)
        self.numel = numel
        self.param = torch.randn(numel, generator=g)
        self.grad = torch.randn(numel, generator=g) * 1e-2
        self.grad_bf16 = self.grad.bfloat16()
        self.exp_avg, self.exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
        sizes = split_sizes(numel, tensors)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.runs = torch.tensor([[a, a + s] for a, s in zip(starts, sizes)], dtype=torch.int64)
        self.step = 0
        self.views = [(a, s) for a, s in zip(starts, sizes)]

    def coeffs(self) -> torch.Tensor:
        self.step += 1
        lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
        row = [1 - lr * wd, 1 - b1, b2, 1 - b2, (1 - b2**self.step) ** 0.5, eps, -(lr / (1 - b1**self.step)), 1.0]
        return torch.tensor([row] * self.runs.shape[0], dtype=torch.float32)

    def ours(self, grad: torch.Tensor):
        def step():
            _native.adamw_step(self.param, grad, self.exp_avg, self.exp_avg_sq, self.runs, self.coeffs())
        return step

    def torch_params(self) -> list[nn.Parameter]:
        params = []
        for a, s in self.views:
            p = nn.Parameter(torch.randn(s))
            p.grad = self.grad[a:a + s].clone()
            params.append(p)
        return params


def torch_adamw(fs: FlatSet, **kwargs):
    try:
        opt = torch.optim.AdamW(fs.torch_params(), **HYPER, **kwargs)
        opt.step()  # state made here (and errors raised), not in the timed steps
        return opt.step, None
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        return None, str(exc).splitlines()[0]


def streams(numel: int):
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    return {"stream copy": lambda: dst.copy_(src), "stream scale": lambda: src.mul_(1.0)}


def stream_gbps(ms: float, numel: int) -> float:
    return 2 * numel * 4 / (ms * 1e-3) / 1e9


def state_bytes(numel: int, grad_bytes: int) -> int:
    return numel * (4 * 2 * 3 + grad_bytes)


def part1(args, fs: FlatSet) -> dict:
    stream_numel = 4 * fs.numel
    fns = {name: (nothing, fn) for name, fn in streams(stream_numel).items()}
    paths = simd_paths()
    for path in paths:
        fns[f"ours ({path})"] = ((lambda p=path: set_simd(p)), fs.ours(fs.grad))
    fns[f"ours ({paths[0]}), bf16 grads"] = ((lambda: set_simd(paths[0])), fs.ours(fs.grad_bf16))
    errors = {}
    for name, kwargs in (("torch foreach", dict(foreach=True)), ("torch for-loop", dict(foreach=False)),
                         ("torch fused", dict(fused=True))):
        step, err = torch_adamw(fs, **kwargs)
        if step is None:
            errors[name] = err
        else:
            fns[name] = (nothing, step)
    ms = timed_round_robin(fns, args.steps, args.warmup)
    set_simd("auto")
    stream = {name: stream_gbps(ms[name], stream_numel) for name in ("stream copy", "stream scale")}
    best_stream = max(stream.values())
    rows = []
    for name, t in ms.items():
        if name.startswith("stream"):
            rows.append(dict(variant=name, ms=t, gbps=stream[name], note=f"{stream_numel / 1e6:.0f}M fp32 elements"))
            continue
        nbytes = state_bytes(fs.numel, 2 if "bf16" in name else 4)
        rows.append(dict(variant=name, ms=t, gbps=nbytes / (t * 1e-3) / 1e9,
                         pct_stream=100 * nbytes / (t * 1e-3) / 1e9 / best_stream))
    foreach = ms.get("torch foreach")
    for r in rows:
        if foreach and not r["variant"].startswith("stream"):
            r["vs_foreach"] = foreach / r["ms"]
    for name, err in errors.items():
        rows.append(dict(variant=name, error=err))
    return dict(rows=rows, stream=stream, best_stream=best_stream, threads=torch.get_num_threads())


def sweep_counts(spec: str) -> list[int]:
    if spec == "none":
        return []
    if spec != "auto":
        return [int(x) for x in spec.split(",") if x.strip()]
    n, out, t = cores(), [], 1
    while t < n:
        out.append(t)
        t *= 2
    return out + [n]


def part2(args, fs: FlatSet) -> list[dict]:
    counts = sweep_counts(args.sweep)
    if not counts:
        return []
    stream_numel = 4 * fs.numel
    copy = streams(stream_numel)["stream copy"]
    best = simd_paths()[0]
    foreach, _ = torch_adamw(fs, foreach=True)
    before = torch.get_num_threads()
    rows = []
    try:
        for t in counts:
            torch.set_num_threads(t)
            fns = {"copy": (nothing, copy), "ours": ((lambda: set_simd(best)), fs.ours(fs.grad))}
            if foreach is not None:
                fns["foreach"] = (nothing, foreach)
            ms = timed_round_robin(fns, args.sweep_steps, 2)
            nbytes = state_bytes(fs.numel, 4)
            row = dict(threads=t, copy_gbps=stream_gbps(ms["copy"], stream_numel), ours_ms=ms["ours"],
                       ours_gbps=nbytes / (ms["ours"] * 1e-3) / 1e9)
            if "foreach" in ms:
                row.update(foreach_ms=ms["foreach"], foreach_gbps=nbytes / (ms["foreach"] * 1e-3) / 1e9,
                           speedup=ms["foreach"] / ms["ours"])
            rows.append(row)
            print(f"  threads {t}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "threads"),
                  flush=True)
    finally:
        torch.set_num_threads(before)
    return rows


def part3(args) -> dict | None:
    """benchmarks/optim.py's CPU setup (its Shards: rank 0 of world 2, a GPT's fully_shard groups)."""
    if args.gpt == "none":
        return None
    import optim as optim_bench  # benchmarks/optim.py
    from step import BenchConfig

    layers, dim, ffn, vocab = (int(x) for x in args.gpt.split(","))
    bc = BenchConfig(layers, dim, ffn, batch=1, seq=128, vocab=vocab, head_dim=64)
    shards = optim_bench.Shards(optim_bench.unit_shapes(bc), torch.device("cpu"))
    fns = {}
    for path in simd_paths():
        fns[f"ours ({path})"] = ((lambda p=path: set_simd(p)), shards.ours_step())
    fns["torch foreach"] = (nothing, optim_bench.torch_step(shards.views(), foreach=True))
    fns["torch for-loop"] = (nothing, optim_bench.torch_step(shards.views(), foreach=False))
    ms = timed_round_robin(fns, args.steps, args.warmup)
    set_simd("auto")
    nbytes = state_bytes(shards.numel, 4)
    rows = [dict(variant=name, ms=t, gbps=nbytes / (t * 1e-3) / 1e9, vs_foreach=ms["torch foreach"] / t)
            for name, t in ms.items()]
    return dict(model=bc.describe(), groups=len(shards.groups), params=shards.params, numel=shards.numel, rows=rows)


# ---------------------------------------------------------------------------------------------- report
def report(env: dict, p1: dict, p2: list, p3: dict | None) -> str:
    lines = [f"# AdamW on the CPU: mfsdp_ext's native kernel vs torch ({env['cpu']}, {env['cores']} cores)", "",
             f"- **Command:** `{env['command']}`",
             f"- **Commit:** {env['commit']}",
             f"- **Date:** {env['date']}",
             f"- **Machine:** {env['cpu']}, {env['cores']} cores, {env['mem_gib']:.0f} GiB; CPU code paths: "
             f"{', '.join(env['simd_paths'])} (default: {env['simd_paths'][0]})",
             f"- **Versions:** torch {env['torch']}, Python {env['python']}",
             f"- **Other load:** {env['other_load']}", "",
             f"## One AdamW step over {env['numel'] / 1e6:.1f}M fp32 elements in {env['tensors']} parameters, "
             f"{p1['threads']} threads", "",
             f"Median of {env['steps']} rounds after {env['warmup']} (variants timed in turn). GB/s: state "
             "traffic (param, exp_avg, exp_avg_sq read and written, grad read: 28 B per element, 26 with bf16 grads) "
             f"per second. Stream: {p1['best_stream']:.1f} GB/s (the higher of copy and scale, read + write "
             "counted).", "",
             "| variant | ms | GB/s | % of stream | speedup vs torch foreach |", "|---|---|---|---|---|"]
    for r in p1["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'][:80]} | | | |")
            continue
        pct = f"{r['pct_stream']:.0f}%" if "pct_stream" in r else "-"
        vs = f"{r['vs_foreach']:.2f}x" if "vs_foreach" in r else "-"
        note = f" ({r['note']})" if "note" in r else ""
        lines.append(f"| {r['variant']}{note} | {r['ms']:.2f} | {r['gbps']:.1f} | {pct} | {vs} |")
    if p2:
        lines += ["", "## Threads (torch.set_num_threads)", "",
                  f"Median of {env['sweep_steps']} rounds; ours on its default path, fp32 grads.", "",
                  "| threads | stream copy GB/s | ours ms | ours GB/s | ours % of copy | torch foreach ms | "
                  "torch foreach GB/s | speedup |", "|---|---|---|---|---|---|---|---|"]
        for r in p2:
            fe = (f"{r['foreach_ms']:.2f} | {r['foreach_gbps']:.1f} | {r['speedup']:.2f}x" if "foreach_ms" in r
                  else "- | - | -")
            lines.append(f"| {r['threads']} | {r['copy_gbps']:.1f} | {r['ours_ms']:.2f} | {r['ours_gbps']:.1f} | "
                         f"{100 * r['ours_gbps'] / r['copy_gbps']:.0f}% | {fe} |")
    if p3:
        lines += ["", f"## benchmarks/optim.py's CPU setup: {p3['model']}, rank 0's shards at world 2", "",
                  f"{p3['groups']} fully_shard groups, {p3['params']} parameters, {p3['numel']:,} shard elements; "
                  f"ours: one adamw_step per group; torch: per-parameter views. {p1['threads']} threads.", "",
                  "| variant | ms | GB/s | speedup vs torch foreach |", "|---|---|---|---|"]
        for r in p3["rows"]:
            lines.append(f"| {r['variant']} | {r['ms']:.2f} | {r['gbps']:.1f} | {r['vs_foreach']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(int(args.threads))
    numel = int(args.numel)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem = float("nan")
    env = dict(command="python3 " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
               commit=commit(), date=time.strftime("%Y-%m-%d"), cpu=cpu_model(), cores=cores(), mem_gib=mem,
               simd_paths=simd_paths(), torch=torch.__version__, python=platform.python_version(), numel=numel,
               tensors=args.tensors, steps=args.steps, warmup=args.warmup, sweep_steps=args.sweep_steps)
    print(f"{env['cpu']}, {env['cores']} cores, torch {env['torch']}, paths {env['simd_paths']}; "
          f"{numel / 1e6:.1f}M elements", flush=True)
    load = OtherLoad()
    load.start()
    fs = FlatSet(numel, args.tensors)
    p1 = part1(args, fs)
    print("part 1 done", flush=True)
    p2 = part2(args, fs)
    del fs
    p3 = part3(args)
    other = load.stop()
    env["other_load"] = ("unknown" if other is None else
                         f"other processes took {100 * other:.0f}% of the machine's CPU time during the run "
                         "(0% = it ran alone)")
    text = report(env, p1, p2, p3)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"cpu_optim_{args.tag or str(cores()) + 'core'}")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(dict(env=env, part1=p1, threads=p2, gpt=p3), f, indent=2)
    print(text)


if __name__ == "__main__":
    main()
