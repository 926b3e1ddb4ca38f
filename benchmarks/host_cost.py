"""Host (Python) cost per unit per step: the time spent inside the sharding hooks, mfsdp_ext vs FSDP2.

    python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/host_cost.py            # CPU or one GPU
    torchrun --nproc-per-node 2 benchmarks/host_cost.py --shape config3 --out DIR             # 2 GPUs, real dims

The model has config 3's structure (48 blocks, one unit each, plus the root) with tiny dimensions by default
(``--shape tiny``: dim 32, so kernels and collectives are small and the hooks' own work shows); ``--shape
config3`` uses config 3's dimensions. Each implementation's hook entry points are wrapped with a timer that
counts only the outermost hook on the stack (a hook that calls another is not counted twice):

  ours   FsdpUnit.pre_forward, post_forward, _pre_backward, post_backward, _final_callback
  FSDP2  FSDPState._pre_forward, _post_forward, FSDPParamGroup.pre_backward, post_backward,
         FSDPState._root_post_backward_final_callback

Reported: the median over steps of the hook time per step divided by the number of units (48 + root), per hook
and in total, and the forward + backward wall time per step (no optimizer step: its cost does not depend on the
sharding's hooks). On CUDA the hooks only enqueue work, so their time is the host cost that can starve the GPU
when the kernels are short. The hooks include the collectives' host-side calls (on CPU: gloo, synchronous).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from mfsdp_ext.testing import gpt

SHAPES = {
    "tiny": dict(n_layers=48, dim=32, ffn_dim=64, n_heads=1, vocab_size=256, seq=16),
    "config3": dict(n_layers=48, dim=1024, ffn_dim=2816, n_heads=8, vocab_size=32000, seq=256),
}


class HookTimer:
    """Accumulates wall time per hook name, counting only the outermost hook on the stack."""

    def __init__(self):
        self.depth = 0
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, cls, name: str, label: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if self.depth:
                return original(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.depth -= 1

        setattr(cls, name, timed)


def instrument(impl: str, timer: HookTimer) -> None:
    if impl == "ours":
        from mfsdp_ext.runtime.unit import FsdpUnit

        for name in ("pre_forward", "post_forward", "_pre_backward", "post_backward", "_final_callback"):
            timer.wrap(FsdpUnit, name, name.strip("_"))
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    timer.wrap(FSDPState, "_pre_forward", "pre_forward")
    timer.wrap(FSDPState, "_post_forward", "post_forward")
    timer.wrap(FSDPParamGroup, "pre_backward", "pre_backward")
    timer.wrap(FSDPParamGroup, "post_backward", "post_backward")
    timer.wrap(FSDPState, "_root_post_backward_final_callback", "final_callback")


def measure(impl: str, shape: dict, device: torch.device, mesh, steps: int, warmup: int,
            pyprofile: str | None = None) -> dict:
    cfg = gpt.GPTConfig(n_layers=shape["n_layers"], dim=shape["dim"], n_heads=shape["n_heads"],
                        ffn_dim=shape["ffn_dim"], vocab_size=shape["vocab_size"], max_seq_len=shape["seq"])
    extra = {"native_collectives": True} if impl == "ours_native" else {}
    fp8 = {}
    if impl == "ours_fp8":  # FP8 weights and GEMMs in the blocks' linear layers (CUDA: FP8 GEMMs need sm_89+)
        import mfsdp_ext

        fp8 = {"fp8": mfsdp_ext.Fp8Policy(compute=True)}
    impl = "ours" if impl in ("ours_native", "ours_fp8") else impl
    fully_shard_fn, MixedPrecisionPolicy = gpt.load_impl(impl)
    torch.manual_seed(0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **fp8)
    timer = HookTimer()
    instrument(impl, timer)  # before fully_shard, which registers the (then wrapped) methods as hooks
    model = gpt.build_sharded(cfg, impl, device, False, mesh=mesh, mp_policy=mp, **extra)
    tokens = torch.randint(0, cfg.vocab_size, (1, shape["seq"]), device=device)
    units = cfg.n_layers + 1
    per_step: list[dict] = []
    walls = []
    profiler = None
    for i in range(warmup + steps):
        if i == warmup and pyprofile and dist.get_rank() == 0:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        timer.seconds.clear()
        gpt.synchronize(device)
        t0 = time.perf_counter()
        model(tokens, tokens).backward()
        gpt.synchronize(device)
        if i >= warmup:
            walls.append(time.perf_counter() - t0)
            per_step.append(dict(timer.seconds))
        for p in model.parameters():
            p.grad = None
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        profiler.dump_stats(pyprofile + ".prof")  # the raw stats, for pstats' callers / callees
        text = io.StringIO()
        for order in ("tottime", "cumulative"):  # where the time is spent, and under which calls
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(60)
        with open(pyprofile, "w") as f:
            f.write(f"cProfile of {steps} forward + backward steps, {impl}, rank 0 (times inflated by the profiler)\n")
            f.write(text.getvalue())
    hooks = sorted(per_step[0])
    result = {h: statistics.median(s.get(h, 0.0) for s in per_step) * 1e6 / units for h in hooks}
    result["total"] = statistics.median(sum(s.values()) for s in per_step) * 1e6 / units
    result["fwd_bwd_ms"] = statistics.median(walls) * 1e3
    return result


IMPLS = ["ours", "ours_native", "ours_fp8", "fsdp2"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--impl", choices=IMPLS, default=None, help="one implementation (default: each of --impls, "
                   "each in its own process: the timers patch classes)")
    p.add_argument("--impls", default="ours,fsdp2", help="without --impl: the implementations to compare; "
                   "ours_native is ours with native_collectives=True (NCCL only), ours_fp8 ours with "
                   "Fp8Policy(compute=True)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", default=None)
    p.add_argument("--pyprofile", default=None, metavar="FILE",
                   help="with --impl: cProfile the timed steps on rank 0, the top functions by own time to FILE")
    args = p.parse_args()
    if args.impl is None:  # run each implementation in a fresh interpreter under the same launcher settings
        import subprocess

        rows = {}
        for impl in args.impls.split(","):
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  os.environ.get("HOST_COST_NPROC", "1"), __file__, "--impl", impl, "--shape",
                                  args.shape, "--steps", str(args.steps), "--warmup", str(args.warmup),
                                  "--device", args.device], capture_output=True, text=True, check=True).stdout
            rows[impl] = json.loads(out.strip().splitlines()[-1])
        report(rows, args)
        return
    device = gpt.setup_distributed(args.device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    try:
        torch.set_num_threads(1)
        result = measure(args.impl, SHAPES[args.shape], device, mesh, args.steps, args.warmup, args.pyprofile)
        result.update(device=str(torch.cuda.get_device_name()) if device.type == "cuda" else "cpu",
                      world=dist.get_world_size())
        if dist.get_rank() == 0:
            print(json.dumps(result))
    finally:
        gpt.teardown_distributed(mesh)


def report(rows: dict, args) -> None:
    hooks = ["pre_forward", "post_forward", "pre_backward", "post_backward", "final_callback", "total"]
    env = next(iter(rows.values()))
    lines = [f"# Host cost per unit per step: mfsdp_ext vs FSDP2 ({args.shape} shape, {env['world']} rank(s), "
             f"{env['device']})", "",
             "Microseconds inside each hook per step / 49 units (48 blocks + root), median over "
             f"{args.steps} steps; fwd+bwd = forward + backward wall time per step. `benchmarks/host_cost.py`.", "",
             "| impl | " + " | ".join(hooks) + " | fwd+bwd ms |", "|---|" + "---:|" * (len(hooks) + 1)]
    for impl, r in rows.items():
        lines.append(f"| {impl} | " + " | ".join(f"{r.get(h, 0.0):.1f}" for h in hooks) + f" | {r['fwd_bwd_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        kind = "gpu" if env["device"] != "cpu" else "cpu"
        stem = os.path.join(args.out, f"host_cost_{args.shape}_{env['world']}{kind}")
        with open(stem + ".md", "w") as f:
            f.write(text)
        with open(stem + ".json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
