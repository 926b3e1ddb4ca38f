"""The largest model each implementation trains on the GPUs given, with and without CPU offload.

    python3 benchmarks/offload_capacity.py --nproc 4 --out DIR
    python3 benchmarks/offload_capacity.py --nproc 2 --tiny --out DIR    # CPU smoke test of this driver

The family: step.py's config 6 (the Llama-3-8B shape: dim 4096, ffn 14336, 8 KV heads, vocab 128256, batch 1 x seq
8192 per GPU, every block recomputed) with more layers: ``--layers`` (default 32,48,64,80,96,112,128: 8.0B to 29.0B
parameters). For each variant in ``--impls`` (step.py's names; default ours_offload, fsdp2_offload, and ours_fused,
fsdp2_fused without offload for reference) it looks for the largest layer count that trains: each trial is a fresh
``torchrun`` of step.py (``--configs 6 --layers L --impls IMPL --init meta --no-floor``, ``--warmup`` then ``--steps``
steps), a process of its own since an OOM leaves a process's CUDA state unusable. A trial fits when step.py reports
its step time; it does not when it fails for memory (a CUDA OOM on any rank, pinned memory that cannot be allocated,
step.py's host memory guard) or does not finish within ``--trial-timeout-s`` (killed; a rank's OOM can leave the
others waiting in a collective). Any other failure ends that variant's search: its table row names it.

The search, per variant, over the sorted list: counts whose host memory estimate (step.py's HOST_BYTES_PER_PARAM per
parameter, for offloaded variants) exceeds ``--host-guard`` of this host's MemAvailable are not tried (step.py would
refuse them; the table says so). The first trial is at the largest count that a rough estimate says fits (GPU: 16
bytes per parameter / ranks without offload, 2 with, plus 6 GiB; host: as above), the second next to it (one up if it
fitted, one down if not), then bisection between the largest count that fitted and the smallest that did not. The
variants take turns, one trial each, so each gets its first trials early; no trial starts that would end after
``--budget-s`` (expected: that variant's longest trial so far, else the longest of any), and a search cut short is
reported as such ("at least").

Reported per variant: the largest count that trained (layers, parameters), its step time (median of the ``--steps``
timed steps after ``--warmup``, back to back, max over ranks: step.py's), GPU peak, host and pinned memory (step.py's
columns), and the next larger count with why it did not train; then every trial. Writes
``offload_capacity_<N>gpu.{md,json}`` (``...cpu`` with ``--tiny``) into ``--out`` after every trial, and each trial's
log and step.py report under ``--out``/trials/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import replace

import step  # benchmarks/step.py: this script's folder
import torch

from mfsdp_ext.testing import gpt

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_IMPLS = "ours_offload,fsdp2_offload,ours_fused,fsdp2_fused"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="ranks (GPUs) per trial; default: every GPU here")
    p.add_argument("--impls", default=DEFAULT_IMPLS, help="step.py variant names")
    p.add_argument("--layers", default=None, help="layer counts to search (default 32,48,64,80,96,112,128; with "
                                                   "--tiny 2,4,8)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per trial")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per trial")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no trial that would end after this")
    p.add_argument("--trial-timeout-s", type=float, default=150.0, help="a trial still running then is killed")
    p.add_argument("--host-guard", type=float, default=0.9, help="step.py's --host-guard (0: none)")
    p.add_argument("--tiny", action="store_true", help="step.py's tiny config 6 on the CPU (gloo): a smoke test")
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "benchmarks", "results"))
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- estimates


def gpu_total_bytes() -> float | None:
    """The first GPU's memory in bytes, from nvidia-smi (this process starts no CUDA context); None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return float(out.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def is_offload(impl: str) -> bool:
    return impl in step.OFFLOAD_IMPLS


def host_need(impl: str, n_params: int) -> float:
    """step.py's guard estimate for one host holding every rank."""
    return n_params * step.HOST_BYTES_PER_PARAM if is_offload(impl) else 0.0


def gpu_estimate(impl: str, n_params: int, nproc: int) -> float:
    """A rough per-GPU estimate (bytes) for the first trial only: without offload fp32 weights, gradients and AdamW
    state (16 B per parameter / ranks), with offload ours' kept bf16 shard (2 B; FSDP2 keeps nothing: less), plus
    6 GiB of activations, logits and gathered units."""
    per_param = 2 if is_offload(impl) else 16
    return n_params * per_param / nproc + 6 * 2**30


# ------------------------------------------------------------------------------------------- one trial


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:  # field 4 of stat: the parent's pid
                kids.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def _stop(proc: subprocess.Popen) -> None:
    """End a trial's torchrun (SIGTERM: it stops its workers) and, if it or they outlive that, kill them by id."""
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=45)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in workers:  # torchrun starts each worker in a session of its own
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_trial(impl: str, layers: int, args, trial_dir: str) -> dict:
    """One fresh torchrun of step.py; returns its result: fits, why not, step time and memory, wall time."""
    os.makedirs(trial_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.join(HERE, "step.py"),
           "--configs", "6", "--layers", str(layers), "--impls", impl, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--init", "meta", "--no-floor", "--host-guard", str(args.host_guard),
           "--timeout-s", str(int(args.trial_timeout_s)), "--out", trial_dir]
    if args.tiny:
        cmd += ["--tiny", "--device", "cpu"]
    log_path = os.path.join(trial_dir, "trial.log")
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.trial_timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            rc = proc.returncode
    wall = time.perf_counter() - t0
    with open(log_path, errors="replace") as f:
        text = f.read()
    stem = f"step_{args.nproc}{'cpu' if args.tiny else 'gpu'}.json"
    res = {}
    try:
        with open(os.path.join(trial_dir, stem)) as f:
            res = json.load(f)["results"][0]["variants"].get(impl) or {}
    except (OSError, ValueError, KeyError, IndexError):
        pass
    out = dict(impl=impl, layers=layers, wall_s=wall, rc=rc, log=os.path.relpath(log_path, args.out))
    if res.get("median_ms") is not None:  # trained (a hang after the report, e.g. at teardown, changes nothing)
        out.update(fits=True, why="", median_ms=res["median_ms"], peak_gib=res.get("peak_gib"),
                   host_gib=res.get("host_gib"), pinned_gib=res.get("pinned_gib"),
                   loss=(res.get("loss_first"), res.get("loss_last")))
        return out
    out.update(fits=False, **classify(res.get("error", ""), text, rc, timed_out, args.trial_timeout_s))
    return out


def classify(error: str, log: str, rc: int | None, timed_out: bool, timeout_s: float) -> dict:
    """Why a trial did not train: ``why``, and whether it is a memory limit (``memory_related``: the search goes on
    below it) or something else (the search of that variant ends)."""
    text = error + "\n" + log
    if "host memory guard" in text:
        why = "host memory guard (step.py)"
    elif "pinned host memory could not" in text or "cudaErrorMemoryAllocation" in text:
        why = "pinned host memory allocation failed"
    elif "OutOfMemoryError" in text or "out of memory" in text:
        why = "out of memory"
    elif timed_out:
        why = f"timeout after {timeout_s:.0f} s"
    elif rc in (-9, 137) or "Signal 9 (SIGKILL)" in log:
        why = "killed (SIGKILL: host out of memory?)"
    else:
        last = (error or log).strip().splitlines()
        return dict(why="error: " + (last[-1] if last else f"rc {rc}"), memory_related=False, timed_out=False)
    return dict(why=why, memory_related=True, timed_out=timed_out)


# ------------------------------------------------------------------------------------------- the search


class Search:
    """One variant's search over the sorted layer counts (see the module docstring)."""

    def __init__(self, impl: str, layers: list[int], params: dict[int, int], pivot: int, excluded_from: int):
        self.impl, self.layers, self.params = impl, layers, params
        self.lo, self.hi = -1, excluded_from  # largest index known to fit, smallest known not to
        self.pivot = min(max(pivot, 0), excluded_from - 1)
        self.trials: list[dict] = []
        self.stopped = ""  # why the search ended early (an error, the budget)

    def done(self) -> bool:
        return bool(self.stopped) or self.hi - self.lo <= 1

    def next_index(self) -> int:
        if not self.trials:
            return self.pivot
        if len(self.trials) == 1:  # next to the first: one up if it fitted, one down if not
            i = self.lo + 1 if self.trials[0]["fits"] else self.hi - 1
            if self.lo < i < self.hi:
                return i
        return (self.lo + self.hi) // 2

    def record(self, index: int, trial: dict) -> None:
        self.trials.append(trial)
        if trial["fits"]:
            self.lo = max(self.lo, index)
        elif trial.get("memory_related"):
            self.hi = min(self.hi, index)
        else:
            self.stopped = f"search ended: {trial['why']} at {self.layers[index]} layers"


def environment(args) -> dict:
    env = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
               python=platform.python_version(), torch=torch.__version__, nproc=args.nproc, tiny=args.tiny,
               steps=args.steps, warmup=args.warmup, budget_s=args.budget_s, trial_timeout_s=args.trial_timeout_s,
               host_guard=args.host_guard, omp_num_threads=os.environ.get("OMP_NUM_THREADS"), cpus=os.cpu_count(),
               mem_available_gib=(step.mem_available() or 0) / 2**30)
    total = None if args.tiny else gpu_total_bytes()
    env["gpu_memory_gib"] = None if total is None else total / 2**30
    if not args.tiny:
        try:
            env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=60).stdout.splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError, IndexError):
            env["gpu"] = "?"
    return env


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def write_report(searches: list[Search], env: dict, base: step.BenchConfig, args, notes: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    stem = f"offload_capacity_{args.nproc}{'cpu' if args.tiny else 'gpu'}"
    data = dict(environment=env, base=base.describe(), layers=searches[0].layers if searches else [],
                searches=[dict(impl=s.impl, params=s.params, largest_fit=(s.layers[s.lo] if s.lo >= 0 else None),
                               smallest_unfit=(s.layers[s.hi] if s.hi < len(s.layers) else None), stopped=s.stopped,
                               excluded=notes.get(s.impl, {}), trials=s.trials) for s in searches])
    with open(os.path.join(args.out, stem + ".json.tmp"), "w") as f:
        json.dump(data, f, indent=1)
    os.replace(os.path.join(args.out, stem + ".json.tmp"), os.path.join(args.out, stem + ".json"))

    where = f"{args.nproc} x {env.get('gpu', 'cpu')}"
    peak = "RSS high-water GiB" if args.tiny else "GPU peak GiB"
    lines = [
        f"# The largest model trained, with and without CPU offload: {where}",
        "",
        f"{env['date']}, torch {env['torch']}, {env['cpus']} CPUs and {env['mem_available_gib']:.0f} GiB of "
        f"MemAvailable on the host at the start, OMP_NUM_THREADS={env['omp_num_threads']}"
        + (f", {env['gpu_memory_gib']:.0f} GiB per GPU" if env.get("gpu_memory_gib") else "")
        + (". **Tiny CPU smoke-test config.**" if args.tiny else "."),
        "",
        f"Family: step.py's config 6 ({base.describe()}, batch {base.batch} x seq {base.seq} per rank) with the layer "
        f"count grown; each trial a fresh `torchrun --nproc-per-node {args.nproc} benchmarks/step.py --configs 6 "
        f"--layers L --impls IMPL --init meta --no-floor --warmup {args.warmup} --steps {args.steps}`. Trained = "
        "step.py reported a step time; not = a CUDA OOM, a pinned allocation that failed, step.py's host memory guard "
        f"(estimate {step.HOST_BYTES_PER_PARAM} B per parameter > {args.host_guard:g} of MemAvailable: also applied "
        f"here without a trial), or no end within {args.trial_timeout_s:.0f} s. step ms: median of the "
        f"{args.steps} timed steps after {args.warmup} warm-up, back to back, max over ranks. GPU peak, host GiB "
        "(this host's MemAvailable drop over the trial's build and steps) and pinned GiB (torch's pinned allocator, "
        "all ranks) as step.py reports them. Search: a first trial where an estimate says it fits, one next to it, "
        f"then bisection, the variants taking turns, within a {args.budget_s:.0f} s budget.",
        "",
        f"| variant | offload | optimizer | largest trained: layers | params | step ms | {peak} | host GiB | "
        "pinned GiB | next larger: layers | params | why not |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in searches:
        v = step.make_variants(step.parse_args(["--impls", s.impl]))[0]
        fit = max((t for t in s.trials if t["fits"]), key=lambda t: t["layers"], default=None)
        best = s.layers[s.lo] if s.lo >= 0 else None
        if s.hi < len(s.layers):
            nxt = s.layers[s.hi]
            tried = [t for t in s.trials if t["layers"] == nxt and not t["fits"]]
            why = tried[0]["why"] if tried else notes.get(s.impl, {}).get(nxt, "not tried")
        else:
            nxt, why = None, "none larger in the list"
        if s.stopped:
            why = s.stopped + ("" if nxt is None else f"; {why}")
        if not s.done():
            why = "search cut short by the time budget: the largest is at least this; " + why
        row = [s.impl, "yes" if is_offload(s.impl) else "no", step.optimizer_label(v),
               "none" if best is None else str(best), "-" if best is None else f"{s.params[best] / 1e9:.2f}B",
               _fmt(fit and fit["median_ms"]), _fmt(fit and fit.get("peak_gib"), ".2f"),
               _fmt(fit and fit.get("host_gib")), _fmt(fit and fit.get("pinned_gib")),
               "-" if nxt is None else str(nxt), "-" if nxt is None else f"{s.params[nxt] / 1e9:.2f}B",
               why.replace("|", "/")]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Trials, in the order run:", "",
              f"| variant | layers | params | trained | step ms | {peak} | host GiB | pinned GiB | wall s | log |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for t in sorted((t for s in searches for t in s.trials), key=lambda t: t["order"]):
        s = next(s for s in searches if s.impl == t["impl"])
        lines.append(f"| {t['impl']} | {t['layers']} | {s.params[t['layers']] / 1e9:.2f}B | "
                     + ("yes" if t["fits"] else "no: " + t["why"].replace("|", "/"))
                     + f" | {_fmt(t.get('median_ms'))} | {_fmt(t.get('peak_gib'), '.2f')} | {_fmt(t.get('host_gib'))}"
                     f" | {_fmt(t.get('pinned_gib'))} | {t['wall_s']:.0f} | {t['log']} |")
    skipped = [(impl, n, why) for impl, d in notes.items() for n, why in sorted(d.items())]
    if skipped:
        lines += ["", "Not tried: " + "; ".join(f"{impl} at {n} layers ({why})" for impl, n, why in skipped) + "."]
    lines.append("")
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.nproc is None:
        args.nproc = 2 if args.tiny else torch.cuda.device_count()
    if args.nproc < 1:
        raise SystemExit("no GPU here: pass --tiny (a CPU smoke test) or --nproc")
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    known = {"ours", "fsdp2", "ours_fused", "fsdp2_fused"} | set(step.OFFLOAD_IMPLS)
    bad = [i for i in impls if i not in known]
    if bad:
        raise SystemExit(f"--impls: {bad} (choose from {sorted(known)})")
    layers = sorted({int(x) for x in (args.layers or ("2,4,8" if args.tiny else "32,48,64,80,96,112,128"))
                     .split(",") if x.strip()})
    base = (step.TINY_CONFIGS if args.tiny else step.CONFIGS)[6]
    params = {n: gpt.num_params(gpt.GPT(replace(base, n_layers=n).model_config(), device="meta")) for n in layers}
    env = environment(args)
    gpu_total = env.get("gpu_memory_gib")
    print(f"offload capacity: {args.nproc} ranks, {env.get('gpu', 'cpu')}, layers {layers} "
          f"({', '.join(f'{params[n] / 1e9:.2f}B' for n in layers)}), impls {impls} -> {args.out}", flush=True)

    notes: dict[str, dict[int, str]] = {}  # impl -> layers -> why not tried
    searches = []
    avail = step.mem_available()
    for impl in impls:
        excluded_from = len(layers)
        for i, n in enumerate(layers):
            need = host_need(impl, params[n])
            if args.host_guard > 0 and avail is not None and need > args.host_guard * avail:
                excluded_from = i
                notes.setdefault(impl, {})[n] = (f"host memory estimate {need / 2**30:.0f} GiB > {args.host_guard:g}"
                                                 f" x {avail / 2**30:.0f} GiB MemAvailable")
                break
        fits = [i for i, n in enumerate(layers[:excluded_from])
                if gpu_total is None or gpu_estimate(impl, params[n], args.nproc) <= 0.97 * gpu_total * 2**30]
        if gpu_total is None:  # no estimate (CPU): start in the middle
            pivot = (excluded_from - 1) // 2
        else:
            pivot = max(fits) if fits else 0
        searches.append(Search(impl, layers, params, pivot, excluded_from))

    t_start = time.perf_counter()
    order = 0
    while True:
        progressed = False
        for s in searches:
            if s.done():
                continue
            longest = max((t["wall_s"] for t in s.trials), default=max(
                (t["wall_s"] for x in searches for t in x.trials), default=0.0))
            if time.perf_counter() - t_start + longest > args.budget_s:
                continue
            i = s.next_index()
            n = layers[i]
            print(f"[{time.perf_counter() - t_start:5.0f} s] {s.impl} at {n} layers ({params[n] / 1e9:.2f}B) ...",
                  flush=True)
            trial = run_trial(s.impl, n, args, os.path.join(args.out, "trials", f"{s.impl}_L{n}"))
            trial["order"] = order
            order += 1
            s.record(i, trial)
            print(f"    {'trained' if trial['fits'] else 'not: ' + trial['why']}"
                  + (f", {trial['median_ms']:.0f} ms/step, GPU peak {_fmt(trial.get('peak_gib'), '.1f')} GiB, host "
                     f"{_fmt(trial.get('host_gib'))} GiB" if trial["fits"] else "")
                  + f" ({trial['wall_s']:.0f} s)", flush=True)
            write_report(searches, env, base, args, notes)
            progressed = True
        if not progressed:
            break
    write_report(searches, env, base, args, notes)
    for s in searches:
        best = s.layers[s.lo] if s.lo >= 0 else None
        print(f"{s.impl}: largest trained {best} layers" + (f" ({params[best] / 1e9:.2f}B)" if best else "")
              + ("" if s.done() else " (search cut short by the budget)") + (f"; {s.stopped}" if s.stopped else ""),
              flush=True)
    stem = f"offload_capacity_{args.nproc}{'cpu' if args.tiny else 'gpu'}"
    print(f"wrote {os.path.join(args.out, stem)}.md / .json", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
