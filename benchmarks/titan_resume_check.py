"""torchtitan's CheckpointManager resumes a run of mfsdp_ext as it resumes FSDP2's, on the GPUs of one host (the
CPU tests in tests/integration/test_frameworks.py do the same with fp32 and gloo).

    python3 benchmarks/titan_resume_check.py --out DIR [--config llama3_8b_gpu] [--nproc 4] [--steps 4] [--save 2]
        [--pairs fsdp2<-fsdp2,ours<-ours,ours<-fsdp2,fsdp2<-ours] [-- more torchtitan options]
    (scripts/gpu_titan.sh resume: tensor parallel 2 and expert parallel 2 on 4 GPUs)

Full runs of FSDP2 and ours save a checkpoint at step --save; each pair RESUMED<-SOURCE then copies SOURCE's
checkpoint into a fresh folder and runs RESUMED from it to --steps. Its steps after --save are compared with the
uninterrupted run of SOURCE, whose state it loaded (loss and grad norm, largest relative difference): a resumed run
continues as the run it came from, also across the two implementations. Runs that are not bit-reproducible (MoE
token routing on GPU without torchtitan's --debug.deterministic) get FSDP2's own bound: what fsdp2<-fsdp2 differs by
(at least 1e-5). A pair passes when it loaded the checkpoint ("Loading the checkpoint" in its log), starts at step
--save + 1, and is within the bound. The table also shows whether the first resumed loss equals SOURCE's to the bit
(it depends only on the loaded weights and the data).
Writes DIR/titan_resume_<tag>_<N>gpu.{md,json}; exit code 1 when a run fails or a pair does not pass.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time

from titan_step import SCRIPT, make_assets, max_rel_diff, run_logged, versions  # benchmarks/: this script's folder

FLOOR = 1e-5  # an fp32 CPU run resumes to this (tests/integration/test_frameworks.py's RTOL)


def run(args, name: str, impl: str, dump: str, timeout: float) -> dict:
    """One torchrun of torchtitan_train.py with checkpoints on; rank 0's steps and its log."""
    metrics = os.path.join(args.out, f"resume_{name}.jsonl")
    if os.path.exists(f"{metrics}.rank0"):
        os.remove(f"{metrics}.rank0")
    env = {**os.environ, "TITAN_DUMP": dump, "TITAN_ASSETS": args.assets, "PYTHONUNBUFFERED": "1"}
    if not args.cuda:  # like tests/integration/test_frameworks.py: gloo ranks, one thread each
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           SCRIPT, "--impl", impl, "--metrics", metrics, "--module", "titan_configs", "--config", args.config,
           "--training.steps", str(args.steps), "--checkpoint.enable", "--checkpoint.interval", str(args.save),
           *args.titan_args]
    print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
    t0, log_path = time.time(), os.path.join(args.out, f"resume_{name}.log")
    rc, text = run_logged(cmd, env, log_path, timeout)
    rows = [json.loads(line) for line in open(f"{metrics}.rank0")] if os.path.exists(f"{metrics}.rank0") else []
    result = {"name": name, "impl": impl, "rc": rc, "seconds": round(time.time() - t0, 1),
              "loaded": "Loading the checkpoint" in text, "log": os.path.basename(log_path),
              "by_step": {r["step"]: {"loss": r["loss"], "grad_norm": r["grad_norm"]} for r in rows}}
    print(f"   {name}: rc {rc} in {result['seconds']} s, steps {sorted(result['by_step'])}", flush=True)
    if rc != 0:
        print("\n".join(text.splitlines()[-15:]), flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--config", default="llama3_8b_gpu")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU, or 2 CPU ranks)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save", type=int, default=2, help="the step whose checkpoint the resumed runs start from")
    ap.add_argument("--pairs", default="fsdp2<-fsdp2,ours<-ours,ours<-fsdp2,fsdp2<-ours")
    ap.add_argument("--tag", default="", help="names the table: titan_resume_TAG_<N>gpu")
    ap.add_argument("--assets", default="", help="the tokenizer/corpus folder (default: OUT/titan_assets)")
    ap.add_argument("--run-timeout", type=float, default=150.0)
    ap.add_argument("titan_args", nargs="*", help="more torchtitan options, after --")
    args = ap.parse_args()
    import torch

    args.cuda = torch.cuda.is_available()
    args.nproc = args.nproc or (torch.cuda.device_count() if args.cuda else 2)
    os.makedirs(args.out, exist_ok=True)
    args.assets = args.assets or os.path.join(args.out, "titan_assets")
    make_assets(args.assets)
    pairs = [tuple(p.split("<-")) for p in args.pairs.split(",") if p]
    dumps = os.path.join(args.out, "resume_dumps")  # checkpoints: GBs on GPU, deleted at the end
    try:
        full = {impl: run(args, f"{impl}_full", impl, os.path.join(dumps, f"{impl}_full"), args.run_timeout)
                for impl in sorted({x for p in pairs for x in p})}
        resumed = []
        for target, source in pairs:
            dump = os.path.join(dumps, f"{target}_from_{source}")
            saved = os.path.join(dumps, f"{source}_full", "checkpoint", f"step-{args.save}")
            if not os.path.isdir(saved):
                resumed.append({"name": f"{target}<-{source}", "rc": f"no checkpoint at {saved}", "by_step": {}})
                continue
            shutil.copytree(saved, os.path.join(dump, "checkpoint", f"step-{args.save}"))
            r = run(args, f"{target}_from_{source}", target, dump, args.run_timeout)
            r["name"] = f"{target}<-{source}"
            resumed.append(r)
    finally:
        shutil.rmtree(dumps, ignore_errors=True)
    for r in resumed:
        ref = full.get(r["name"].split("<-")[1])  # the run whose checkpoint it loaded
        ok_ref = ref is not None and ref["rc"] == 0 and r["by_step"]
        r["loss_diff"] = max_rel_diff(ref, r, "loss") if ok_ref else float("nan")
        r["grad_norm_diff"] = max_rel_diff(ref, r, "grad_norm") if ok_ref else float("nan")
        first = min(r["by_step"]) if r["by_step"] else None
        r["first_loss_exact"] = bool(ok_ref and first in ref["by_step"]
                                     and r["by_step"][first]["loss"] == ref["by_step"][first]["loss"])
    own = next((r for r in resumed if r["name"] == "fsdp2<-fsdp2" and r["rc"] == 0), None)
    bound = max(FLOOR, own["loss_diff"], own["grad_norm_diff"]) if own else FLOOR
    for r in resumed:
        r["passed"] = bool(r["rc"] == 0 and r.get("loaded") and r["by_step"]
                           and min(r["by_step"]) == args.save + 1
                           and max(r["loss_diff"], r["grad_norm_diff"]) <= bound)
    meta = {**versions(), "date": datetime.datetime.now().isoformat(timespec="seconds"), "bound": bound}
    stem = os.path.join(args.out, f"titan_resume{'_' + args.tag if args.tag else ''}_{args.nproc}"
                        + ("gpu" if args.cuda else "cpu"))
    with open(f"{stem}.json", "w") as f:
        json.dump({"meta": meta, "args": vars(args), "full": full, "resumed": resumed}, f, indent=1)
    device = f"{args.nproc} x {meta['gpu']}" if args.cuda else f"{args.nproc} CPU ranks"
    lines = [f"# torchtitan checkpoint resume: FSDP2 and mfsdp_ext, {device}", "",
             f"- **Reproduce:** `python3 benchmarks/titan_resume_check.py --config {args.config} --nproc {args.nproc} "
             f"--steps {args.steps} --save {args.save} --pairs {args.pairs}"
             + (f" -- {' '.join(args.titan_args)}" if args.titan_args else "") + "`"
             + (f" (TITAN_LAYERS={os.environ['TITAN_LAYERS']})" if os.environ.get("TITAN_LAYERS") else ""),
             f"- **Commit:** `{meta['commit']}`; **date:** {meta['date']}",
             f"- **Versions:** torch {meta['torch']}, torchtitan {meta['torchtitan']}",
             f"- Each pair RESUMED<-SOURCE: RESUMED run from SOURCE's checkpoint of step {args.save}, its steps "
             f"{args.save + 1}..{args.steps} against SOURCE's uninterrupted run (the state it loaded). The bound is "
             f"FSDP2's own (fsdp2<-fsdp2's difference, at least {FLOOR:g}): {bound:.3g}", "",
             "| pair | loaded | first step | first loss to the bit | loss diff | grad norm diff | bound "
             "| within bound |",
             "|---|---|---|---|---|---|---|---|"]
    for r in resumed:
        first = min(r["by_step"]) if r["by_step"] else "-"
        lines.append(f"| {r['name']} | {r.get('loaded', False)} | {first} | "
                     f"{'yes' if r.get('first_loss_exact') else 'no'} | {r.get('loss_diff', float('nan')):.3g} | "
                     f"{r.get('grad_norm_diff', float('nan')):.3g} | {bound:.3g} | "
                     f"{'yes' if r['passed'] else 'NO (rc ' + str(r['rc']) + ')'} |")
    table = "\n".join(lines) + "\n"
    with open(f"{stem}.md", "w") as f:
        f.write(table)
    print(table, flush=True)
    return 0 if all(r["rc"] == 0 for r in full.values()) and all(r["passed"] for r in resumed) else 1


if __name__ == "__main__":
    sys.exit(main())
