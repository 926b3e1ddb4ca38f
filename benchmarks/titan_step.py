"""torchtitan's own Trainer on the Llama 3 8B shape (or Qwen3 30B-A3B's MoE shape): PyTorch FSDP2 vs mfsdp_ext (bf16)
vs mfsdp_ext with FP8 weights, in one invocation, on the GPUs of one host; tokens/s per GPU, peak memory, and how far
each run's losses and grad norms are from FSDP2's, side by side.

    python3 benchmarks/titan_step.py --out DIR [--nproc 2] [--layers 16] [--steps 10] [--warmup 3]
        [--impls fsdp2,ours,ours_fp8] [--config llama3_8b_gpu|qwen3_moe_gpu] [--tag TAG] [--deadline 540]
        [-- more torchtitan options, e.g. --parallelism.tensor_parallel_degree 2]
    (scripts/gpu_titan.sh installs torchtitan from .whl/titan/ and runs this on 2 GPUs; its `nd` mode runs the
    2-D layouts on 4; an impl named NAME_rerun runs NAME again: FSDP2's own run-to-run spread)

Each implementation is one ``torchrun`` of examples/frameworks/torchtitan_train.py (``--impl fsdp2|ours|ours_fp8``)
with the config ``llama3_8b_gpu`` of examples/frameworks/titan_configs.py: torchtitan's llama3_8b (dim 4096, FFN 14336,
32 heads / 8 KV heads, vocab 128256, seq 8192, local batch 1, bf16 compute with fp32 reduction, selective activation
checkpointing, chunked loss, fused AdamW, clipping) with ``--layers`` of its 32 layers so that it fits, SDPA attention.
ours_fp8 adds ``mfsdp_ext.Fp8Policy(compute=True)`` to the policy torchtitan passes (FP8 weights all-gathered and used
by FP8 GEMMs in the decoder blocks' linear layers; Fp8Policy's default leaves the output head in bf16).

Per step each rank writes torchtitan's loss and grad norm, its tokens/s (tokens of the step / wall time between
torchtitan's metric logs) and torch.cuda.max_memory_allocated of the step. The table reports the median tokens/s per
GPU over the steps after ``--warmup`` (min over ranks), the peak memory over all steps and ranks, the ratios to FSDP2,
and the loss of the first and last step. A run that runs out of memory is retried once for every implementation
with 4 layers fewer (all rows keep one layer count). Writes DIR/titan_step_<N>gpu.{md,json} and the runs' logs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "frameworks", "torchtitan_train.py")
ASSETS_SCRIPT = os.path.join(ROOT, "examples", "frameworks", "titan_assets.py")
GIB = 1024 ** 3


def make_assets(path: str) -> None:
    """The tokenizer and corpus torchtitan_train.py reads (TITAN_DOCS documents, default 4000), unless already in
    ``path``: examples/frameworks/titan_assets.py, run as a script."""
    subprocess.run([sys.executable, ASSETS_SCRIPT, path, os.environ.get("TITAN_DOCS", "4000")], check=True,
                   stdout=subprocess.DEVNULL)


def run_logged(cmd: list, env: dict, log_path: str, timeout: float) -> tuple:
    """Run ``cmd`` with its output in ``log_path``: (exit code, or "timeout"; the log's text)."""
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, open(log_path, errors="replace").read()


def run_one(args, impl: str, layers: int, out_dir: str, timeout: float) -> dict:
    stem = f"titan_{args.tag + '_' if args.tag else ''}{impl}_L{layers}"  # one folder may hold several tags' runs
    metrics = os.path.join(out_dir, f"{stem}.jsonl")
    for r in range(args.nproc):
        if os.path.exists(f"{metrics}.rank{r}"):
            os.remove(f"{metrics}.rank{r}")
    log_path = os.path.join(out_dir, f"{stem}.log")
    env = {**os.environ, "TITAN_LAYERS": str(layers), "TITAN_DUMP": os.path.join(out_dir, f"dump_{impl}"),
           "TITAN_ASSETS": args.assets, "TITAN_AC": args.ac, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           SCRIPT, "--impl", impl.removesuffix("_rerun"), "--metrics", metrics, "--module", "titan_configs",
           "--config", args.config, "--training.steps", str(args.steps)] + args.titan_args
    t0 = time.time()
    print(f"== {impl}, {layers} layers: {' '.join(cmd[3:])}", flush=True)
    rc, text = run_logged(cmd, env, log_path, timeout)
    oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
    rows = {}
    for r in range(args.nproc):
        path = f"{metrics}.rank{r}"
        if os.path.exists(path):
            rows[r] = [json.loads(line) for line in open(path) if line.strip()]
    result = {"impl": impl, "layers": layers, "rc": rc, "oom": oom, "seconds": round(time.time() - t0, 1),
              "log": os.path.basename(log_path), "per_rank": rows,
              "cuda_graph": "Recorded CUDA graph" in text}  # torchtitan's log line when it captured its graph
    if rc == 0 and rows:
        timed = {r: [row for row in rs if row["step"] > args.warmup] for r, rs in rows.items()}
        result["tokens_per_s_per_gpu"] = min(statistics.median(x["tokens_per_s"] for x in rs)
                                             for rs in timed.values() if rs)
        mem = [x.get("max_memory_allocated", 0) for rs in rows.values() for x in rs]
        result["peak_gib"] = max(mem) / GIB
        reserved = [x.get("max_memory_reserved", 0) for rs in rows.values() for x in rs]
        result["peak_reserved_gib"] = max(reserved) / GIB
        last = rows[max(rows)]  # under pipeline parallel only the last stage's ranks compute the loss
        result["loss_first"], result["loss_last"] = last[0]["loss"], last[-1]["loss"]
        result["steps"] = len(last)
        result["by_step"] = {row["step"]: {"loss": row["loss"], "grad_norm": row["grad_norm"]} for row in last}
    else:
        tail = "\n".join(text.splitlines()[-15:])
        print(f"!! {impl} failed (rc {rc}{', out of memory' if oom else ''}); log tail:\n{tail}", flush=True)
    print(f"   {impl}: rc {rc} in {result['seconds']} s; "
          f"{result.get('tokens_per_s_per_gpu', float('nan')):.0f} tok/s/GPU, "
          f"peak {result.get('peak_gib', float('nan')):.2f} GiB", flush=True)
    return result


def versions() -> dict:
    import torch

    v = {"torch": torch.__version__, "cuda": torch.version.cuda,
         "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
         "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}
    for name in ("torchtitan", "mfsdp_ext"):
        try:
            from importlib.metadata import version

            v[name] = version(name)
        except Exception:  # noqa: BLE001
            v[name] = None
    v["commit"] = source_commit()
    return v


def source_commit() -> str | None:
    """The commit the code ran at: MFSDP_COMMIT when set (a device copy's git metadata can name an older commit than
    its files), else git's HEAD, marked "+changes" when the tree differs from it."""
    if os.environ.get("MFSDP_COMMIT"):
        return os.environ["MFSDP_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        changed = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return None
    return (head + ("+changes" if changed else "")) or None


MODELS = {  # --config -> (title, what the model is)
    "llama3_8b_gpu": ("Llama 3 8B shape", "torchtitan `llama3_8b` (dim 4096, FFN 14336, 32 heads, 8 KV heads, vocab "
                      "128256) with {layers} of its 32 layers; seq 8192, local batch 1"),
    "qwen3_moe_gpu": ("Qwen3 30B-A3B MoE shape", "torchtitan `qwen3_30b_a3b` (dim 2048, 128 experts of FFN 768, top 8, "
                      "vocab 151936) with {layers} of its 48 layers; seq 4096, local batch 1"),
    "llama3_8b_pp_gpu": ("Llama 3 8B shape, pipeline parallel 2 x FSDP 2",
                         "torchtitan `llama3_8b` with {layers} of its 32 layers split over 2 pipeline stages; "
                         "seq 8192, local batch 4 in microbatches of 1"),
}


def torch_at_least(version: str, major: int, minor: int) -> bool:
    """"2.11.0+cu130" -> whether it is at least major.minor (titan_configs.py's own test, for the table's words)."""
    return tuple(int(x) for x in version.split("+")[0].split(".")[:2]) >= (major, minor)


def max_rel_diff(ref: dict, other: dict, key: str) -> float:
    """The largest |other - ref| / |ref| of a per-step metric over the steps both runs logged."""
    steps = set(ref["by_step"]) & set(other["by_step"])
    return max((abs(other["by_step"][s][key] - ref["by_step"][s][key]) / abs(ref["by_step"][s][key])
                for s in steps), default=float("nan"))


def write_table(args, results: list[dict], meta: dict) -> str:
    ref = next((r for r in results if r["impl"] == "fsdp2" and "tokens_per_s_per_gpu" in r), None)
    title, model = MODELS.get(args.config, (args.config, "torchtitan config `{config}`, {layers} layers"))
    extra = " -- " + " ".join(args.titan_args) if args.titan_args else ""
    loss = "chunked loss" if torch_at_least(meta["torch"], 2, 12) else "plain cross-entropy loss (torch < 2.12)"
    lines = [f"# torchtitan Trainer, {title}: FSDP2 vs mfsdp_ext, {args.nproc} x {meta['gpu']}", "",
             f"- **Reproduce:** `python3 benchmarks/titan_step.py --out DIR --config {args.config} --nproc "
             f"{args.nproc} --layers {args.layers} --steps {args.steps} --warmup {args.warmup} --ac {args.ac} "
             f"--impls {args.impls}{extra}` (torchtitan installed as in `scripts/gpu_titan.sh --setup`)",
             f"- **Commit:** `{meta.get('commit')}`; **date:** {meta['date']}",
             f"- **Versions:** torch {meta['torch']}, CUDA {meta['cuda']}, NCCL {meta['nccl']}, torchtitan "
             f"{meta.get('torchtitan')}",
             f"- **Model:** {model.format(layers=results[0]['layers'] if results else '?', config=args.config)}, "
             f"bf16 compute, fp32 gradient reduction, the config's activation checkpointing "
             f"({'as configured' if args.ac == 'selective' else 'full'}), "
             f"{loss}, "
             "fused AdamW, "
             "clipping; SDPA attention; 2000-token local tokenizer and corpus (examples/frameworks/titan_assets.py)"
             + (f"; torchtitan options `{' '.join(args.titan_args)}`" if args.titan_args else ""),
             "- **Variants:** fsdp2 = torchtitan as shipped; ours = the same run after `mfsdp_ext.use_as_fsdp2()`; "
             "ours_fp8 = ours with `Fp8Policy(compute=True)` added to torchtitan's policy (the blocks' linear "
             "layers in FP8, the output head bf16)",
             f"- tok/s/GPU: median over steps {args.warmup + 1}..{args.steps} (min over ranks); peak: "
             "torch.cuda.max_memory_allocated, max over steps and ranks",
             "- loss / grad norm vs fsdp2: the largest relative difference over the steps from fsdp2's run (the last "
             "rank's logged values; bf16 runs differ run to run: `fsdp2_rerun` is FSDP2 again, its spread)",
             "- status \"its CUDA graph\": torchtitan recorded its CUDA graph of forward + backward in that run", "",
             "| impl | layers | tok/s/GPU | vs fsdp2 | peak GiB | vs fsdp2 | reserved GiB | loss first -> last | "
             "loss vs fsdp2 | grad norm vs fsdp2 | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "tokens_per_s_per_gpu" in r:
            tps, peak = r["tokens_per_s_per_gpu"], r["peak_gib"]
            vs_t = f"{tps / ref['tokens_per_s_per_gpu']:.3f}" if ref else "-"
            vs_m = f"{peak / ref['peak_gib']:.3f}" if ref and ref["peak_gib"] else "-"
            d_loss, d_norm = ((f"{max_rel_diff(ref, r, k):.2e}" for k in ("loss", "grad_norm"))
                              if ref and r is not ref else ("-", "-"))
            lines.append(f"| {r['impl']} | {r['layers']} | {tps:.0f} | {vs_t} | {peak:.2f} | {vs_m} | "
                         f"{r['peak_reserved_gib']:.2f} | {r['loss_first']:.4f} -> {r['loss_last']:.4f} | "
                         f"{d_loss} | {d_norm} | ok{', its CUDA graph' if r.get('cuda_graph') else ''} |")
        else:
            lines.append(f"| {r['impl']} | {r['layers']} | - | - | - | - | - | - | - | - | rc {r['rc']}"
                         f"{' (out of memory)' if r['oom'] else ''}, see {r['log']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--impls", default="fsdp2,ours,ours_fp8")
    ap.add_argument("--config", default="llama3_8b_gpu", choices=sorted(MODELS))
    ap.add_argument("--tag", default="", help="names the table: titan_step_TAG_<N>gpu (e.g. tp2, moe)")
    ap.add_argument("--assets", default="", help="the tokenizer/corpus folder (default: OUT/titan_assets)")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for everything (a retry is skipped "
                    "when it cannot finish in time)")
    ap.add_argument("--ac", choices=["selective", "full"], default="selective",
                    help="torchtitan's selective activation checkpointing (its llama3_8b default: every other matmul "
                         "output saved; mfsdp_ext's FP8 GEMMs are native kernels it does not see, so they are all "
                         "recomputed) or full checkpointing of each block")
    ap.add_argument("--run-timeout", type=float, default=240.0, help="seconds for one implementation's run")
    ap.add_argument("titan_args", nargs="*", help="more torchtitan options, after --")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.assets = args.assets or os.path.join(args.out, "titan_assets")
    t_start = time.time()
    make_assets(args.assets)
    impls = [i for i in args.impls.split(",") if i]
    layers = args.layers
    while True:
        results = []
        for impl in impls:
            left = args.deadline - (time.time() - t_start)
            results.append(run_one(args, impl, layers, args.out, timeout=max(min(left, args.run_timeout), 30)))
        oom = any(r["oom"] for r in results)
        per_run = max(r["seconds"] for r in results)
        if not oom or layers <= 4 or time.time() - t_start + per_run * len(impls) > args.deadline:
            break
        print(f"== out of memory at {layers} layers: all variants again at {layers - 4}", flush=True)
        layers -= 4
    meta = {**versions(), "date": datetime.datetime.now().isoformat(timespec="seconds")}
    stem = os.path.join(args.out, f"titan_step{'_' + args.tag if args.tag else ''}_{args.nproc}gpu"
                        + ("_fullac" if args.ac == "full" else ""))
    with open(f"{stem}.json", "w") as f:
        json.dump({"meta": meta, "args": {k: v for k, v in vars(args).items()}, "results": results}, f, indent=1)
    table = write_table(args, results, meta)
    with open(f"{stem}.md", "w") as f:
        f.write(table)
    print(table, flush=True)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
