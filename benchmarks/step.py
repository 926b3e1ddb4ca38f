"""End-to-end training-step benchmark: mfsdp_ext ("ours") vs PyTorch FSDP2, side by side in one run.

    torchrun --nproc-per-node 2 benchmarks/step.py --configs 1,2,3,4,5 --out benchmarks/results
    torchrun --nproc-per-node 4 benchmarks/step.py --extra-ours use_symm_mem=auto --out benchmarks/results
    torchrun --nproc-per-node 2 benchmarks/step.py --tiny --impls fsdp2 --out DIR   # CPU smoke test
    torchrun --nproc-per-node 2 benchmarks/step.py --impls ours,ours_fp8,fsdp2,fsdp2_float8 --out benchmarks/results
    torchrun --nproc-per-node 4 benchmarks/step.py --tp 2 --configs 1,6 --impls ours_fused,fsdp2_fused --out ...

``--tp N``: a (dp, tp) mesh; every block tensor-parallel over "tp" (mfsdp_ext.testing.gpt's tensor_parallel: colwise
q/k/v
and gate/up, rowwise o and down), then fully_shard over "dp" for both implementations; the ranks of one dp group
read the same batch. FP8 variants and the floor are not run with it.

FP8 variants, only when named in ``--impls``: ``ours_fp8`` is ours with
``MixedPrecisionPolicy(..., fp8=Fp8Policy(compute=True))`` (FP8 weights gathered in FP8, FP8 GEMMs in the blocks'
linear layers; the lm-head stays bf16); ``fsdp2_float8`` is FSDP2 on a model converted by torchao
(``convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))``, lm-head
excluded, before ``fully_shard``; ``precompute_float8_dynamic_scale_for_fsdp(model)`` after each optimizer
step), skipped with a note when torchao is not importable. Both need ``--dtype bf16``.

CPU offload variants, only when named in ``--impls`` (eager only: no CUDA graphs, no FP8, no ``--tp``): fully_shard
with ``offload_policy=CPUOffloadPolicy(pin_memory=True)`` (torch's class, for both; pageable on a CPU mesh, where
FSDP2 cannot pin): fp32 shards, gradients and optimizer state in host memory, the optimizer stepping them on the host.
``ours_offload``: mfsdp_ext.fully_shard with ``mfsdp_ext.optim.AdamW`` (its native CPU kernel); ``ours_offload_kept``:
the same with ``cache_model_weight=True`` (the bf16 shard kept on the GPU, copied once per step instead of at each
all-gather); ``ours_offload_torch``: the same as ours_offload with torch's ``AdamW(fused=True)``; ``fsdp2_offload``:
FSDP2 with torch's ``AdamW(fused=True)`` (torch's CPU kernel: the fastest of torch's AdamW on CPU tensors);
``fsdp2_offload_default``: FSDP2 with ``torch.optim.AdamW`` as constructed by default (on CPU tensors its per-tensor
for-loop: torch defaults to foreach on CUDA tensors only). With ``--init meta`` FSDP2 offloaded is materialised as
torchtitan does it (``to_empty(device="cpu")``), each module's ``reset_parameters`` run on device temporaries of this
rank's shards and copied into the host shards (each rank from its own seed); ours as without offload. The CPU
optimizers run on torch's intra-op threads (OMP_NUM_THREADS / torch.get_num_threads(), recorded in the report). An
offloaded variant whose host memory estimate (``HOST_BYTES_PER_PARAM`` per parameter on this host) exceeds
``--host-guard`` of MemAvailable is not run (recorded as an error naming the guard): past that the kernel's OOM
killer, not an exception, would end it. Reported for every variant: ``host_gib``, this host's MemAvailable drop from
before the build to after the timed steps (all ranks on the host, whatever they hold: pinned and pageable), and
``pinned_gib``, the pinned bytes that torch's caching host allocator owns then (in use and cached, blocks rounded up
as it allocates them), summed over the ranks; an "Offload" section of the report lists them with the step-time and
peak ratios between offloaded and other variants.

``--sync-steps N``: N more steps after the timed ones, each between two device synchronisations and timed on the
host (max over ranks): the step as one waits for it, next to the back-to-back time (CUDA events between steps
issued without waiting, which is also where a step's host work shows when the GPU waits for it).

Model: the Llama-style decoder of mfsdp_ext/testing/gpt.py (RMSNorm, causal SDPA, SwiGLU, rotary, vocab 32000,
n_heads = dim / 128), fp32 master weights, bf16 compute, fp32 gradient reduction
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` for both), AdamW, one ``fully_shard`` unit
per block plus the root.

By default (``--init full``) every rank builds the full model with one seed and shards it, so all variants
start from identical weights and their losses can be compared (the report flags one that does not learn or
ends far from FSDP2's); ``--init meta`` builds on the meta device and initialises the shards instead.

For every config each variant is built, warmed up (``--warmup`` steps) and timed (``--steps`` steps, CUDA
events around each step; a step's time is the max over ranks), then freed before the next one; the order of
the variants rotates from config to config. Peak memory is ``max_memory_allocated`` plus the NCCL symmetric
pool of ``use_symm_mem`` and the copy engines' buffers (max over ranks), the peak stats reset
before each variant (after ``--init full`` has dropped the transient full model).

The floor: forward + backward of the *unsharded* bf16 model on rank 0's GPU (no communication at all; per
block x layers + embeddings/head if the whole model does not fit; on CUDA the faster of eager and a CUDA graph
of it), times the microbatches, plus one fused AdamW step over a single rank's fp32 shard (numel / world
parameters). efficiency = floor / step time.

Rank 0 writes ``step_<N>gpu.{md,json,png}`` (``step_<N>cpu...`` on CPU) into ``--out`` after every variant.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib
import json
import math
import os
import platform
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import timeline  # benchmarks/timeline.py: this script's folder
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_ext.testing import gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


@dataclass
class BenchConfig:
    n_layers: int
    dim: int
    ffn_dim: int
    batch: int
    seq: int
    microbatches: int = 1
    vocab: int = 32000
    head_dim: int = 128
    n_kv_heads: int = 0  # 0: as many as query heads
    activation_checkpointing: bool = False  # per block
    ac_every: int = 1  # checkpoint one block in every ac_every
    ac_skip_last: int = 0  # but not the last ac_skip_last blocks

    def model_config(self) -> gpt.GPTConfig:
        return gpt.GPTConfig(n_layers=self.n_layers, dim=self.dim, n_heads=self.dim // self.head_dim,
                             n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim, vocab_size=self.vocab,
                             max_seq_len=self.seq, activation_checkpointing=self.activation_checkpointing,
                             ac_every=self.ac_every, ac_skip_last=self.ac_skip_last)

    def describe(self) -> str:
        ac = "" if not self.activation_checkpointing else " AC" if self.ac_every == 1 else f" AC 1/{self.ac_every}"
        ac += f" (last {self.ac_skip_last} not)" if ac and self.ac_skip_last else ""
        return (f"L{self.n_layers} d{self.dim} ffn{self.ffn_dim}" + (f" kv{self.n_kv_heads}" if self.n_kv_heads else "")
                + (f" vocab{self.vocab}" if self.vocab != 32000 else "") + ac)


CONFIGS: dict[int, BenchConfig] = {
    1: BenchConfig(16, 2048, 5632, batch=2, seq=2048),
    2: BenchConfig(16, 2048, 5632, batch=1, seq=512),
    3: BenchConfig(48, 1024, 2816, batch=1, seq=256),
    4: BenchConfig(8, 4096, 11008, batch=1, seq=1024),
    5: BenchConfig(8, 4096, 11008, batch=1, seq=1024, microbatches=4),
    # real size: the Llama-3-8B shape, activation checkpointing per block (run on its own: --configs 6)
    6: BenchConfig(32, 4096, 14336, batch=1, seq=8192, vocab=128256, n_kv_heads=8, activation_checkpointing=True),
}

# Same shapes of problem (big/long, small batch, many thin layers, few wide layers, accumulation) scaled down
# so that 2 CPU processes finish in well under a minute.
TINY_CONFIGS: dict[int, BenchConfig] = {
    1: BenchConfig(4, 256, 704, batch=2, seq=128, vocab=1024, head_dim=64),
    2: BenchConfig(4, 256, 704, batch=1, seq=32, vocab=1024, head_dim=64),
    3: BenchConfig(12, 128, 352, batch=1, seq=32, vocab=1024, head_dim=64),
    4: BenchConfig(2, 512, 1408, batch=1, seq=64, vocab=1024, head_dim=64),
    5: BenchConfig(2, 512, 1408, batch=1, seq=64, vocab=1024, head_dim=64, microbatches=4),
    6: BenchConfig(4, 256, 896, batch=1, seq=128, vocab=2048, head_dim=64, n_kv_heads=1, activation_checkpointing=True),
}


@dataclass
class Variant:
    name: str  # column label
    impl: str  # "ours" | "fsdp2"
    extra: dict  # extra keyword arguments for fully_shard
    fp8: str = ""  # "" | "ours" (Fp8Policy(compute=True)) | "torchao" (torchao float8 training under FSDP2)
    fused_optimizer: bool = False  # ours: mfsdp_ext.optim.AdamW (one native kernel per flat group); fsdp2: torch's
    # AdamW(fused=True) instead of its foreach default
    graph: str = ""  # "" eager | "fwdbwd": torch.cuda.graph around forward+backward, the optimizer eager (torchtitan's
    # recipe) | "step": the whole step as one graph (mfsdp_ext.graphed) | "step_unheld": the same, its first units
    # gathered at the start of each replay (hold_first_units=False: what holding them across replays saves)
    offload: bool = False  # fully_shard(offload_policy=CPUOffloadPolicy(pin_memory=True)) (see OFFLOAD_IMPLS)
    optimizer: str = ""  # "" as fused_optimizer says | "torch_fused": torch's AdamW(fused=True) wherever the
    # parameters are (the CPU kernel for offloaded ones) | "torch_default": torch's AdamW with its defaults |
    # "step_in_backward": mfsdp_ext.optim.AdamW(step_in_backward=True)


FUSED_IMPLS = {"ours_fused": "ours", "ours_fp8_fused": "ours_fp8"}  # name -> the variant it is, with our AdamW
# name -> (impl, graph): fused AdamW on both sides (ours: mfsdp_ext.optim.AdamW; FSDP2: torch's fused=True)
# name -> (impl, graph, fp8)
GRAPH_IMPLS = {"fsdp2_fused": ("fsdp2", "", ""), "fsdp2_captured": ("fsdp2", "fwdbwd", ""),
               "ours_captured": ("ours", "fwdbwd", ""), "ours_graphed": ("ours", "step", ""),
               "ours_fp8_captured": ("ours", "fwdbwd", "ours"), "ours_fp8_graphed": ("ours", "step", "ours"),
               "ours_graphed_unheld": ("ours", "step_unheld", ""),
               "ours_fp8_graphed_unheld": ("ours", "step_unheld", "ours")}


FP8_IMPLS = {"ours_fp8": ("ours", "ours"), "fsdp2_float8": ("fsdp2", "torchao")}  # name -> (impl, fp8)

# name -> (impl, fused_optimizer, optimizer): CPU offload (see the module docstring); ours_offload steps with
# mfsdp_ext.optim.AdamW, the others with torch's AdamW, fused (its CPU kernel) or as constructed by default
OFFLOAD_IMPLS = {"ours_offload": ("ours", True, ""), "ours_offload_kept": ("ours", True, ""),
                 "ours_offload_ib": ("ours", True, "step_in_backward"),
                 "ours_offload_torch": ("ours", False, "torch_fused"),
                 "fsdp2_offload": ("fsdp2", False, "torch_fused"),
                 "fsdp2_offload_default": ("fsdp2", False, "torch_default")}
OFFLOAD_EXTRA = {"ours_offload_kept": {"mp.cache_model_weight": True}}  # the compute-dtype shard kept on the GPU

# Host bytes per parameter an offloaded variant needs on its host, for the guard (--host-guard): fp32 main weight and
# gradient, pinned (torch's pinned allocator rounds each block up to a power of two: up to 2x), AdamW's two fp32
# states (pageable), staging. An estimate to stay clear of the OOM killer, not a measurement (host_gib is).
HOST_BYTES_PER_PARAM = 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1,2,3,4,5")
    p.add_argument("--impls", default="ours,fsdp2")
    p.add_argument("--extra-ours", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                   help="an additional 'ours' column with these fully_shard keywords (repeatable: one column each); "
                        "keys mp.NAME go to MixedPrecisionPolicy, e.g. mp.cache_model_weight=False")
    p.add_argument("--extra-ours-fp8", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                   help="the same for an additional 'ours_fp8' column; keys fp8.NAME go to its Fp8LinearConfig, "
                        "e.g. fp8.quantize_algo=fused")
    p.add_argument("--extra-fused", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                   help="the same for an additional 'ours_fused' column (our fused AdamW), e.g. "
                        "native_collectives=True")
    p.add_argument("--extra-fp8-fused", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                   help="the same for an additional 'ours_fp8_fused' column")
    p.add_argument("--extra-captured", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                   help="the same for an additional 'ours_captured' column, e.g. use_symm_mem=True")
    p.add_argument("--extra-graphed", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                   help="the same for an additional 'ours_graphed' column")
    p.add_argument("--extra-fsdp2-captured", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                   help="an additional 'fsdp2_captured' column with these keywords for FSDP2's fully_shard, e.g. "
                        "reshard_after_forward=False")
    p.add_argument("--layers", type=int, default=None,
                   help="override the configs' layer count (e.g. config 6's 8B shape at 8 layers fits one GPU); "
                        "the report names the count it ran")
    p.add_argument("--ac-every", type=int, default=None, metavar="N",
                   help="activation checkpointing of one block in every N (0: none) instead of the configs' own; "
                        "the report names it")
    p.add_argument("--ac-skip-last", type=int, default=0, metavar="K",
                   help="with activation checkpointing: do not checkpoint the last K blocks (no recomputation there), "
                        "to spend saved memory on speed; the report names it")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (see above)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    p.add_argument("--sync-steps", type=int, default=0, metavar="N",
                   help="N more steps per variant after the timed ones, each between two device synchronisations and "
                        "timed on the host (max over ranks): reported as 'synced' next to the back-to-back time")
    p.add_argument("--host-guard", type=float, default=0.9, metavar="FRACTION",
                   help="do not run an offloaded variant whose host memory estimate (HOST_BYTES_PER_PARAM per "
                        "parameter held on this host) exceeds FRACTION of MemAvailable (0: no guard)")
    p.add_argument("--floor-steps", type=int, default=5)
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="compute dtype")
    p.add_argument("--tiny", action="store_true", help="tiny configs (CPU smoke test)")
    p.add_argument("--init", choices=["meta", "full"], default="full",
                   help="meta: build on meta, shard, init the shards; full: init the full model on every rank "
                        "(same seed) and shard it, so every variant starts from identical weights")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--profile-dir", default=None,
                   help="after timing, profile two more steps of each variant (GPU only: where the GPU waits, "
                        "printed; then CPU + GPU) and write rank 0's breakdown and op tables to "
                        "DIR/profile_<config>_<variant>.txt, and its GPU kernels (name, start, end in us, stream) to "
                        "DIR/profile_<config>_<variant>_kernels.json")
    p.add_argument("--sm-carveout", type=int, default=0, metavar="N",
                   help="leave N SMs free of every cuBLAS matmul, in every variant (torch's "
                        "_set_sm_carveout_experimental): room for communication kernels running beside them")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--timeout-s", type=int, default=600, help="process-group timeout")
    return p.parse_args(argv)




def make_variants(args) -> list[Variant]:
    variants = []
    for impl in [s.strip() for s in args.impls.split(",") if s.strip()]:
        if impl in OFFLOAD_IMPLS:
            base, fused, optimizer = OFFLOAD_IMPLS[impl]
            variants.append(Variant(impl, base, dict(OFFLOAD_EXTRA.get(impl, {})), fused_optimizer=fused, offload=True,
                                    optimizer=optimizer))
            continue
        if impl in GRAPH_IMPLS:
            base, graph, fp8 = GRAPH_IMPLS[impl]
            variants.append(Variant(impl, base, {}, fp8, fused_optimizer=True, graph=graph))
            continue
        fused = impl in FUSED_IMPLS
        name, impl = impl, FUSED_IMPLS.get(impl, impl)
        if fused:
            base, fp8 = FP8_IMPLS.get(impl, (impl, ""))
            variants.append(Variant(name, base, {}, fp8, fused_optimizer=True))
            continue
        if impl in FP8_IMPLS:
            base, fp8 = FP8_IMPLS[impl]
            if fp8 == "torchao" and not torchao_available():
                if dist.get_rank() == 0:
                    print(f"note: {impl} skipped: torchao is not importable here", flush=True)
                continue
            variants.append(Variant(impl, base, {}, fp8))
            continue
        if impl not in gpt.IMPLS:
            known = list(gpt.IMPLS) + list(FP8_IMPLS) + list(FUSED_IMPLS) + list(GRAPH_IMPLS) + list(OFFLOAD_IMPLS)
            raise SystemExit(f"unknown impl {impl!r} (choose from {known})")
        variants.append(Variant(impl, impl, {}))
    for base_name, fp8, fused, graph, texts in (("ours", "", False, "", args.extra_ours),
                                                ("ours_fp8", "ours", False, "", args.extra_ours_fp8),
                                                ("ours_fused", "", True, "", args.extra_fused),
                                                ("ours_fp8_fused", "ours", True, "", args.extra_fp8_fused),
                                                ("ours_captured", "", True, "fwdbwd", args.extra_captured),
                                                ("ours_graphed", "", True, "step", args.extra_graphed),
                                                ("fsdp2_captured", "", True, "fwdbwd", args.extra_fsdp2_captured)):
        for text in texts:
            extra = gpt.parse_kv(text)
            name = base_name + "(" + ",".join(f"{k}={v}" for k, v in extra.items()) + ")"
            impl = "fsdp2" if base_name.startswith("fsdp2") else "ours"
            variants.append(Variant(name, impl, extra, fp8, fused_optimizer=fused, graph=graph))
    return variants


# ------------------------------------------------------------------------------------------- timing


class Clock:
    """Per-step wall times in ms: CUDA events on GPU (read after one final synchronize), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def time_fn(fn: Callable[[], None], steps: int, warmup: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    clock = Clock(device)
    clock.mark()
    for _ in range(steps):
        fn()
        clock.mark()
    return clock.intervals_ms()


def comm_buffer_bytes(model) -> float:
    """Bytes of ours' communication buffers outside the caching allocator (NCCL's symmetric pool, the copy engines'
    buffers) on this rank; 0 for FSDP2. Attribute access without defaults: a renamed field fails here, not in
    silence."""
    unit = getattr(model, "_mfsdp_unit", None)
    if unit is None:
        return 0.0
    comm = unit.context.comm
    pool = comm.symmetric.comm.native.capacity if comm.symmetric is not None else 0
    return float(pool + sum(stage.buffer.numel() for stage in comm.copy_engines))


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        # the pinned blocks torch's host allocator caches (an offloaded variant's shards): back to the OS, or the next
        # variant (other block sizes) would hold its own on top
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def mem_available() -> float | None:
    """This host's available memory in bytes: psutil's (the kernel's MemAvailable on Linux); without psutil the free
    pages (os.sysconf: less than what is available, so the host guard errs on the safe side); None where neither
    answers."""
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def pinned_bytes() -> float | None:
    """Pinned host bytes that torch's caching host allocator owns (in use and cached, blocks as allocated from CUDA:
    rounded up), None where torch does not say (no CUDA, or no host_memory_stats)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        value = torch.cuda.host_memory_stats().get("allocated_bytes.current")
    except Exception:  # noqa: BLE001 - informational only
        return None
    return None if value is None else float(value)


class HostMemoryGuard(RuntimeError):
    """An offloaded variant not run: its host memory estimate exceeds --host-guard of MemAvailable."""


def check_host_memory(v: Variant, n_params: int, device: torch.device, fraction: float) -> None:
    """Raise HostMemoryGuard on every rank if any rank's host lacks the memory an offloaded variant is estimated to
    take there (HOST_BYTES_PER_PARAM per parameter, for the share of the model its local ranks hold)."""
    if not v.offload or fraction <= 0:
        return
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    need = n_params * HOST_BYTES_PER_PARAM * local_world / world
    avail = mem_available()
    short = avail is not None and need > fraction * avail
    flag = torch.tensor([1.0 if short else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        here = f"{avail / 2**30:.0f} GiB" if avail is not None else "unknown"
        raise HostMemoryGuard(f"host memory guard: {v.name} needs ~{need / 2**30:.0f} GiB of host memory on a host "
                              f"({HOST_BYTES_PER_PARAM} B x {n_params / 1e9:.2f}B parameters x {local_world}/{world} "
                              f"ranks), over {fraction:g} of MemAvailable (here {here}); not run")


def host_usage(device: torch.device, avail_before: float | None) -> tuple[float | None, float | None]:
    """(GiB by which MemAvailable fell since ``avail_before``, read by each host's local rank 0, summed over the hosts;
    pinned GiB owned by torch's host allocator, summed over the ranks); each None where some rank does not know."""
    dist.barrier()
    local0 = int(os.environ.get("LOCAL_RANK", 0)) == 0
    now = mem_available()
    pinned = pinned_bytes() if device.type == "cuda" else None
    drop_known = not local0 or (avail_before is not None and now is not None)
    t = torch.tensor([avail_before - now if local0 and drop_known else 0.0, pinned or 0.0,
                      0.0 if drop_known else 1.0, 0.0 if pinned is not None else 1.0],
                     dtype=torch.float64, device=device)
    dist.all_reduce(t)  # sums; the last two count the ranks that do not know
    return (None if t[2].item() else t[0].item() / 2**30), (None if t[3].item() else t[1].item() / 2**30)


def time_synced(fn: Callable[[], None], steps: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Per-step wall times in ms, each step between two device synchronisations (host clock); and how long each
    call itself took to return: with the device idle when it starts, its host work (a replay's, or an eager step's
    launches and whatever in it waits for the device)."""
    times, calls = [], []
    for _ in range(steps):
        gpt.synchronize(device)
        t0 = time.perf_counter()
        fn()
        calls.append((time.perf_counter() - t0) * 1e3)
        gpt.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times, calls


def make_batches(bc: BenchConfig, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(bc.microbatches):
        tokens = torch.randint(bc.vocab, (bc.batch, bc.seq + 1), generator=g).to(device)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


# -------------------------------------------------------------------------------------------- floor


def _fwd_bwd_ms(model: torch.nn.Module, batches, steps: int, device: torch.device) -> float:
    """Median ms of the unsharded forward + backward: eager, or on CUDA the faster of eager and a CUDA graph of it
    (which takes the host's launches out: at few tokens per GPU they, not the GPU, set the eager time)."""
    def step():
        x, y = batches[0]
        model(x, y).backward()
        for p in model.parameters():
            p.grad = None

    eager = statistics.median(time_fn(step, steps, 2, device))
    return min(eager, _fwd_bwd_graph_ms(model, batches, steps, device) or eager)


def _fwd_bwd_graph_ms(model: torch.nn.Module, batches, steps: int, device: torch.device) -> float | None:
    """The forward + backward captured in a CUDA graph (gradients made by the capture, written afresh by each
    replay, as an eager step with freed gradients makes them); median ms of its replays. None off CUDA, or when it
    does not fit."""
    if device.type != "cuda":
        return None
    x, y = batches[0]
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream(device)  # torch's recipe: warm up on a side stream before the capture
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            model(x, y).backward()
        torch.cuda.current_stream(device).wait_stream(side)
        for p in model.parameters():
            p.grad = None
        with torch.cuda.graph(graph):
            model(x, y).backward()
        return statistics.median(time_fn(graph.replay, steps, 2, device))
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        for p in model.parameters():
            p.grad = None
        del graph
        free_memory(device)


def _unsharded_model(cfg: gpt.GPTConfig, dtype: torch.dtype, device: torch.device) -> gpt.GPT:
    with torch.device("meta"):
        model = gpt.GPT(cfg).to(dtype)
    model.to_empty(device=device)
    model.init_weights()
    return model


def measure_floor(bc: BenchConfig, world: int, dtype: torch.dtype, device: torch.device, steps: int) -> dict:
    """Single-GPU, communication-free lower bound of one training step (rank 0 only)."""
    cfg = bc.model_config()
    batches = make_batches(bc, device, seed=1234)
    method = "whole model"
    try:
        model = _unsharded_model(cfg, dtype, device)
        fwd_bwd = _fwd_bwd_ms(model, batches, steps, device)
        full_shapes = [p.shape for p in model.parameters()]
        del model
    except torch.cuda.OutOfMemoryError:
        free_memory(device)
        method = "per block x layers + embeddings/head"
        one = _unsharded_model(gpt.GPTConfig(**{**cfg.to_dict(), "n_layers": 1}), dtype, device)
        root = _unsharded_model(gpt.GPTConfig(**{**cfg.to_dict(), "n_layers": 0}), dtype, device)
        t1, t0 = _fwd_bwd_ms(one, batches, steps, device), _fwd_bwd_ms(root, batches, steps, device)
        n_ac = sum(map(cfg.checkpointed, range(cfg.n_layers)))
        t1_plain = t1
        if 0 < n_ac < cfg.n_layers:  # some blocks are not checkpointed: time a plain block too
            one.layers[0].activation_checkpointing = False
            t1_plain = _fwd_bwd_ms(one, batches, steps, device)
        fwd_bwd = t0 + n_ac * (t1 - t0) + (cfg.n_layers - n_ac) * (t1_plain - t0)
        block_shapes = [p.shape for p in one.layers[0].parameters()]
        full_shapes = [p.shape for p in root.parameters()] + block_shapes * cfg.n_layers
        del one, root
    free_memory(device)

    # AdamW on one rank's fp32 shard: the same tensors as the model (dim 0 split across ranks), fp32.
    shards = [torch.zeros((math.ceil(s[0] / world), *s[1:]), device=device, requires_grad=True) for s in full_shapes]
    for t in shards:
        t.grad = torch.randn_like(t)
    opt = torch.optim.AdamW(shards, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    adam = statistics.median(time_fn(opt.step, steps, 2, device))
    shard_numel = sum(t.numel() for t in shards)
    del shards, opt
    free_memory(device)
    return dict(fwd_bwd_ms=fwd_bwd, microbatches=bc.microbatches, adamw_ms=adam, adamw_numel=shard_numel,
                floor_ms=fwd_bwd * bc.microbatches + adam, method=method, fwd_bwd_graphed=device.type == "cuda")


# -------------------------------------------------------------------------------------- the variants


def torchao_available() -> bool:
    try:
        importlib.import_module("torchao.float8")
    except ImportError:
        return False
    return True


def _torchao_filter(module: torch.nn.Module, fqn: str) -> bool:
    """The linear layers torchao converts: the blocks' (dims multiples of 16), not the lm-head (as ours)."""
    return fqn != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0


def build_fsdp2_float8(cfg: gpt.GPTConfig, device: torch.device, meta_init: bool, **shard_kwargs):
    """FSDP2 on a model whose linear layers torchao converted to float8 training with FP8 all-gathers. With
    --init meta the converted layers are initialised by their own reset_parameters (torchao's Float8Linear)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fully_shard_fn, _ = gpt.load_impl("fsdp2")
    if meta_init:
        with torch.device("meta"):
            model = gpt.GPT(cfg)
    else:
        model = gpt.GPT(cfg, device=device)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=_torchao_filter)
    gpt.shard_model(model, fully_shard_fn, **shard_kwargs)
    if meta_init:
        gpt.materialize(model, "fsdp2", device)
    return model


def build_fsdp2_offloaded(cfg: gpt.GPTConfig, device: torch.device, meta_init: bool, **shard_kwargs):
    """FSDP2 with CPUOffloadPolicy (in shard_kwargs). --init full: as without offload (the whole model on the device,
    sharded: fully_shard moves the shards to the host). --init meta: built on meta, sharded, materialised as torchtitan
    does with offload (to_empty(device="cpu"): FSDP2 pins the shards), then initialised through the device: each
    module's reset_parameters() on device temporaries the shape of this rank's shards of its own parameters, copied
    into the host shards. (model.init_weights() on the host DTensors draws the normals on the CPU: tens of seconds per
    rank at the 8B shape.) Each rank draws from its own seed, so shards are not slices of one full init."""
    from torch.distributed.tensor import DTensor

    if not meta_init:
        return gpt.build_sharded(cfg, "fsdp2", device, False, **shard_kwargs)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    gpt.shard_model(model, gpt.load_impl("fsdp2")[0], **shard_kwargs)
    model.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(1000 + dist.get_rank())
        for m in model.modules():
            own = [(n, p) for n, p in m._parameters.items() if p is not None]
            if not own or not hasattr(m, "reset_parameters"):
                continue
            shards = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in own}
            for n, p in own:
                m._parameters[n] = torch.nn.Parameter(torch.empty(shards[n].shape, dtype=shards[n].dtype,
                                                                  device=device), requires_grad=p.requires_grad)
            try:
                m.reset_parameters()
                for n, _ in own:
                    shards[n].copy_(m._parameters[n])
            finally:
                for n, p in own:
                    m._parameters[n] = p
    return model


def train_step(model, optimizer, batches, impl: str, losses: list, after_step=None) -> None:
    """One optimizer step over len(batches) microbatches (gradients reduced on the last one)."""
    loss_sum = gpt.forward_backward(model, impl, batches)
    optimizer.step()
    if after_step is not None:
        after_step(model)
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss_sum)


def make_optimizer(v: Variant, model):
    hyper = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if v.optimizer == "torch_fused":  # wherever the parameters are: torch's CPU kernel for offloaded (CPU) shards
        return torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    if v.optimizer == "torch_default":  # on CPU tensors: the per-tensor for-loop (foreach is the default on CUDA)
        return torch.optim.AdamW(model.parameters(), **hyper)
    if v.fused_optimizer and v.impl == "ours":
        import mfsdp_ext.optim

        return mfsdp_ext.optim.AdamW(model.parameters(), step_in_backward=v.optimizer == "step_in_backward", **hyper)
    # torch's: foreach on CUDA (its default, as users run it), or fused=True
    return torch.optim.AdamW(model.parameters(), fused=v.fused_optimizer and model.parameters().__next__().is_cuda,
                             **hyper)


def make_step(v: Variant, model, optimizer, batches, losses: list, after_step, warmup: int):
    """The step to time. Eager; or (v.graph) forward+backward captured after the warm-up steps and replayed, the
    optimizer eager (the warm-up's zero_grad(set_to_none=True) lets the capture make the gradients in its pool, as
    an eager step makes them during backward; zero_grad(set_to_none=False) between replays: the graph writes them in
    place); or the whole step through mfsdp_ext.graphed."""
    eager = functools.partial(train_step, model, optimizer, batches, v.impl, losses, after_step)
    if not v.graph or not torch.cuda.is_available():
        return eager
    if v.graph in ("step", "step_unheld"):
        import mfsdp_ext

        def whole(batch_list):
            loss = gpt.forward_backward(model, v.impl, batch_list)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        graphed = mfsdp_ext.graphed(whole, warmup=max(1, warmup - 1))
        graphed.hold_first_units = v.graph == "step"
        return lambda: losses.append(graphed(batches))
    state = {"graph": None, "calls": 0}

    def fwdbwd():
        state["calls"] += 1
        if state["calls"] < warmup:  # eager warm-up, then the capture at the last warm-up step
            losses.append(gpt.forward_backward(model, v.impl, batches))
        elif state["graph"] is None:
            torch.cuda.synchronize()
            state["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["graph"]):
                state["loss"] = gpt.forward_backward(model, v.impl, batches)
            state["graph"].replay()
            losses.append(state["loss"].clone())
        else:
            state["graph"].replay()
            losses.append(state["loss"].clone())
        optimizer.step()
        if after_step is not None:
            after_step(model)
        optimizer.zero_grad(set_to_none=state["graph"] is None)

    return fwdbwd


def dtype_or_value(val):
    """"bfloat16" / "torch.bfloat16" -> torch.bfloat16 (e.g. mp.reduce_comm_dtype=bfloat16); anything else as is."""
    name = val.removeprefix("torch.") if isinstance(val, str) else None
    return getattr(torch, name) if name and isinstance(getattr(torch, name, None), torch.dtype) else val


def run_variant(v: Variant, bc: BenchConfig, mesh, dtype: torch.dtype, device: torch.device, args,
                tp_mesh=None) -> dict:
    free_memory(device)
    _, MixedPrecisionPolicy = gpt.load_impl(v.impl)
    cfg = bc.model_config()
    check_host_memory(v, gpt.num_params(gpt.GPT(cfg, device="meta")), device, args.host_guard)
    dist.barrier()  # every rank's previous variant freed: this host's MemAvailable before the build
    avail_before = mem_available() if int(os.environ.get("LOCAL_RANK", 0)) == 0 else None
    t_build = time.perf_counter()
    torch.manual_seed(0)
    # keys "mp.NAME" go to MixedPrecisionPolicy (e.g. mp.cache_model_weight=False), the rest to fully_shard;
    # keys "fp8.NAME" go to the FP8 layers' Fp8LinearConfig (e.g. fp8.quantize_algo=fused)
    mp_extra = {k[3:]: dtype_or_value(val) for k, val in v.extra.items() if k.startswith("mp.")}
    linear_extra = {k[4:]: val for k, val in v.extra.items() if k.startswith("fp8.")}
    shard_extra = {k: val for k, val in v.extra.items() if not k.startswith(("mp.", "fp8."))}
    after_step = None
    if v.fp8 == "ours":
        import mfsdp_ext

        mp_extra["fp8"] = mfsdp_ext.Fp8Policy(compute=True, linear_config=mfsdp_ext.Fp8LinearConfig(**linear_extra))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, **mp_extra)
    if v.offload:  # torch's policy for both (ours takes FSDP2's); FSDP2 cannot pin without an accelerator
        from torch.distributed.fsdp import CPUOffloadPolicy

        shard_extra["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    # --init full: the full model on every rank, same seed: identical initial weights for every variant
    if v.fp8 == "torchao":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp as after_step

        model = build_fsdp2_float8(cfg, device, args.init == "meta", mesh=mesh, mp_policy=mp, **shard_extra)
    elif v.offload and v.impl == "fsdp2":
        model = build_fsdp2_offloaded(cfg, device, args.init == "meta", mesh=mesh, mp_policy=mp, **shard_extra)
    else:
        model = gpt.build_sharded(cfg, v.impl, device, args.init == "meta", tp_mesh=tp_mesh, mesh=mesh, mp_policy=mp,
                                  **shard_extra)
    if args.init != "meta" or v.offload:
        free_memory(device)  # drop the transient full model or init temporaries (and reset the peak after them)
    optimizer = make_optimizer(v, model)
    gpt.synchronize(device)
    build_s = time.perf_counter() - t_build
    batches = make_batches(bc, device, seed=100 + mesh.get_local_rank())  # one batch per data-parallel rank
    k = bc.microbatches
    losses = []
    step = make_step(v, model, optimizer, batches, losses, after_step, args.warmup)
    for _ in range(args.warmup):
        step()
    gpt.synchronize(device)
    dist.barrier()
    times = time_fn(step, args.steps, 0, device)
    synced, calls = time_synced(step, args.sync_steps, device)
    host_gib, pinned_gib = host_usage(device, avail_before)  # the model and optimizer alive, after their steps
    if args.profile_dir:
        mb = f"x{k}mb" if k > 1 else ""  # configs 4 and 5 share a shape: the microbatches tell their files apart
        profile_step(step, device, os.path.join(args.profile_dir,
                                                f"profile_L{bc.n_layers}_d{bc.dim}_{bc.batch}x{bc.seq}{mb}_{v.name}.txt"))

    # A step takes as long as its slowest rank.
    t = torch.tensor(times + synced + calls, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    n, m = len(times), len(synced)
    times, synced, calls = t.tolist()[:n], t.tolist()[n: n + m], t.tolist()[n + m:]
    if device.type == "cuda":
        mem = torch.tensor([torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)],
                           dtype=torch.float64, device=device)
    else:  # process RSS high-water: monotonic over the run, not resettable per variant
        import resource

        mem = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, 0.0], dtype=torch.float64)
    # NCCL's symmetric pool (use_symm_mem) comes from ncclMemAlloc and the copy engines' buffers from torch's
    # symmetric memory: the caching allocator sees neither
    mem += comm_buffer_bytes(model)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    loss_first, loss_last = float(losses[0]), float(losses[-1])
    del step  # its CUDA graph first: NCCL keeps the symmetric windows a live graph captured
    gc.collect()
    if hasattr(model, "release_symmetric_memory"):  # ours: free use_symm_mem's NCCL pool (collective)
        model.release_symmetric_memory()
    del model, optimizer, batches, losses
    free_memory(device)
    return dict(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times), times_ms=times,
                peak_gib=mem[0].item() / 2**30, resting_gib=mem[1].item() / 2**30, build_s=build_s,
                synced_median_ms=statistics.median(synced) if synced else None, synced_ms=synced,
                call_median_ms=statistics.median(calls) if calls else None,
                host_gib=host_gib, pinned_gib=pinned_gib,
                loss_first=loss_first, loss_last=loss_last,
                tokens_per_s=mesh.size() * k * bc.batch * bc.seq / (statistics.median(times) / 1e3),
                mfu=model_flops_utilization(bc, statistics.median(times), device, args.tp))


# Dense bf16 peak per GPU (no sparsity), the MFU denominator: H100 SXM and H200 both 989 TFLOP/s.
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}


def model_flops_utilization(bc: BenchConfig, step_ms: float, device: torch.device, tp: int = 1):
    """Model FLOPs (6 x matmul parameters + causal attention per token; recompute not counted) of one rank's
    tokens per step (a tensor-parallel rank's share: 1/tp of its group's) / step time / the GPU's dense bf16 peak;
    None where the peak is not known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    if peak is None:
        return None
    tokens = bc.microbatches * bc.batch * bc.seq
    return gpt.flops_per_token(bc.model_config(), bc.seq) * tokens / tp / (step_ms / 1e3) / (peak * 1e12)


def profile_step(step, device: torch.device, path: str) -> None:
    """Two more steps under the profiler. The first records only the GPU (CUPTI costs the host little, so the
    timeline is the real one): where the GPU waits (timeline.py). The second records the host too: rank 0
    writes the ops by self CPU time (host cost) and by device time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu_time = ""
    if device.type == "cuda":
        gpt.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            gpt.synchronize(device)
        events = [e for e in prof.events()
                  if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events]
        gpu_time = timeline.describe(timeline.breakdown(kernels))
        if dist.get_rank() == 0:  # every kernel's (name, start us, end us, stream): for reading overlaps afterwards
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path.removesuffix(".txt") + "_kernels.json", "w") as f:
                json.dump([k + (getattr(e, "device_resource_id", None),) for k, e in zip(kernels, events)], f)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    gpt.synchronize(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        gpt.synchronize(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    if dist.get_rank() != 0:
        return
    if gpu_time:
        print(f"{os.path.basename(path)}: {gpu_time}", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    averages = prof.key_averages()
    device_key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with open(path, "w") as f:
        f.write(f"{gpu_time}\n\none profiled step (host and GPU): {wall_ms:.1f} ms wall (profiler overhead "
                "included)\n\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n\n")
        f.write(averages.table(sort_by=device_key, row_limit=20) + "\n")


# ------------------------------------------------------------------------------------------- report


def environment(device: torch.device, world: int, args) -> dict:
    env = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
               python=platform.python_version(), torch=torch.__version__, world=world, device=device.type,
               steps=args.steps, warmup=args.warmup, dtype=args.dtype, tiny=args.tiny, init=args.init, tp=args.tp,
               sm_carveout=args.sm_carveout, sync_steps=args.sync_steps, cpu_threads=torch.get_num_threads(),
               cpus=os.cpu_count())
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        v = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        env["cuda"] = torch.version.cuda
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_ALGO", "NCCL_PROTO"):
        if key in os.environ:
            env[key] = os.environ[key]
    try:
        import mfsdp_ext

        env["mfsdp_ext"] = getattr(mfsdp_ext, "__version__", "?")
        from mfsdp_ext import _native

        env["mfsdp_ext_native"] = _native.build_summary()
    except Exception as e:  # noqa: BLE001 - informational only
        env["mfsdp_ext"] = f"not importable: {e}"
    return env


def learned(res: dict) -> bool:
    """The loss must fall over warm-up + timed steps on a fixed batch (catches a step that changes nothing)."""
    return res["loss_last"] < res["loss_first"] - 1e-3


def _fmt(x, spec=".1f", missing="-"):
    return missing if x is None else format(x, spec)


def optimizer_label(v: Variant) -> str:
    """The optimizer a variant steps with (make_optimizer), and where its shards are."""
    where = "host" if v.offload else "device"
    if v.optimizer == "torch_fused":
        return f"torch AdamW(fused=True) on the {where}"
    if v.optimizer == "torch_default" or not v.fused_optimizer:
        return ("torch AdamW() defaults (per-tensor for-loop on the host)" if v.offload else
                "torch AdamW() defaults (foreach on CUDA)")
    if v.optimizer == "step_in_backward":
        return "mfsdp_ext.optim.AdamW(step_in_backward=True) (native CPU kernel, host, during backward)"
    if v.impl == "ours":
        return "mfsdp_ext.optim.AdamW" + (" (native CPU kernel, host)" if v.offload else " (device)")
    return "torch AdamW(fused=True) on the device"


def offload_pairs(variants: list[Variant]) -> list[tuple[str, str]]:
    """(x, y) pairs the offload ratios compare: each offloaded ours against each offloaded FSDP2, then each offloaded
    variant against the plain (no FP8, no graph, no extra keywords) non-offloaded variants of its implementation."""
    off = [v for v in variants if v.offload]
    pairs = [(a.name, b.name) for a in off if a.impl == "ours" for b in off if b.impl == "fsdp2"]
    for a in off:
        pairs += [(a.name, b.name) for b in variants
                  if not b.offload and b.impl == a.impl and not b.fp8 and not b.graph and not b.extra]
    return pairs


def offload_ratios(entry: dict, variants: list[Variant]) -> list[str]:
    """One line per offload pair of a config: x/y of the back-to-back and synced median step times and GPU peaks."""
    lines = []
    for a, b in offload_pairs(variants):
        ra, rb = entry["variants"].get(a) or {}, entry["variants"].get(b) or {}
        if not ra.get("median_ms") or not rb.get("median_ms"):
            continue
        parts = [f"step {ra['median_ms'] / rb['median_ms']:.3f}"]
        if ra.get("synced_median_ms") and rb.get("synced_median_ms"):
            parts.append(f"synced {ra['synced_median_ms'] / rb['synced_median_ms']:.3f}")
        if ra.get("peak_gib") and rb.get("peak_gib"):
            parts.append(f"GPU peak {ra['peak_gib'] / rb['peak_gib']:.3f}")
        lines.append(f"{a}/{b}: " + ", ".join(parts))
    return lines


def offload_section(results: list[dict], variants: list[Variant], env: dict) -> list[str]:
    """The report's CPU offload section (only when an offloaded variant ran)."""
    lines = [
        "## CPU offload",
        "",
        "Offloaded variants: `fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=True))` (torch's class, for "
        "both implementations): fp32 shards, their gradients and the AdamW state in host memory, the optimizer "
        f"stepping on the host with {env.get('cpu_threads', '?')} CPU threads per rank (torch's intra-op threads; "
        f"{env.get('cpus', '?')} CPUs on the host, {env['world']} ranks).",
        "",
        "step ms: the median back-to-back step time of the table above. synced ms: "
        + (f"the median of {env['sync_steps']} more steps, each between two device synchronisations, on the host "
           "clock (max over ranks)." if env.get("sync_steps") else "not measured (`--sync-steps 0`).")
        + (" GPU peak" if env["device"] == "cuda" else " peak (on CPU: the RSS high-water)")
        + ": as above. host GiB: how far this host's MemAvailable fell from "
        "before the variant's build to after its timed steps, all its ranks together (pinned and pageable: weights, "
        "gradients, optimizer state, staging, allocator caches; and anything else that ran on the host meanwhile). "
        "pinned GiB: the pinned bytes torch's caching host allocator owned then, summed over the ranks (in use and "
        "cached, each block rounded up to a power of two as the allocator allocates it).",
        "",
        f"| cfg | variant | offload | optimizer | step ms | synced ms | {'GPU ' if env['device'] == 'cuda' else ''}peak"
        " GiB | host GiB | pinned GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for v in variants:
            res = r["variants"].get(v.name)
            if res is None:
                continue
            if "error" in res:
                cells = ["error: " + res["error"].strip().splitlines()[-1].replace("|", "/")] + ["-"] * 4
            else:
                cells = [_fmt(res.get("median_ms")), _fmt(res.get("synced_median_ms")),
                         _fmt(res.get("peak_gib"), ".2f"), _fmt(res.get("host_gib"), ".1f"),
                         _fmt(res.get("pinned_gib"), ".1f")]
            lines.append(f"| {r['id']} | {v.name} | {'yes' if v.offload else 'no'} | {optimizer_label(v)} | "
                         + " | ".join(cells) + " |")
    lines += ["", "Ratios x/y: step = x's step ms / y's, synced = x's synced ms / y's, GPU peak = x's / y's.", ""]
    for r in results:
        lines += [f"- config {r['id']}: {line}" for line in offload_ratios(r, variants)]
    lines.append("")
    return lines


def write_report(results: list[dict], variants: list[Variant], env: dict, out_dir: str, stem: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, stem + ".json.tmp"), "w") as f:
        json.dump(dict(environment=env, variants=[asdict(v) for v in variants], results=results), f, indent=1)
    os.replace(os.path.join(out_dir, stem + ".json.tmp"), os.path.join(out_dir, stem + ".json"))

    names = [v.name for v in variants]
    base = "fsdp2" if "fsdp2" in names else None
    others = [n for n in names if n != base]
    head = ["cfg", "model", "batch x seq", "mb"] + [f"{n} ms" for n in names]
    if base:
        head += [f"{n}/fsdp2" for n in others]
    head += [f"{n} peak GiB" for n in names] + ["floor ms"] + [f"{n} eff" for n in names]
    head += [f"{n} MFU" for n in names]
    graphed_floor = any((r.get("floor") or {}).get("fwd_bwd_graphed") for r in results)
    lines = [
        f"# Training step: mfsdp_ext vs FSDP2, {env['world']} x {env.get('gpu', env['device'])}"
        + (f", tensor parallel {env['tp']} x data parallel "
           f"{env['world'] // env['tp']}" if env.get("tp", 1) > 1 else ""),
        "",
        f"{env['date']}, torch {env['torch']}" + (f", CUDA {env['cuda']}, NCCL {env['nccl']}" if "nccl" in env else "")
        + f", {env['steps']} timed steps after {env['warmup']} warm-up, {env['init']} init, compute {env['dtype']},"
        " fp32 master weights"
        " and gradient reduction, AdamW." + (" **Tiny CPU smoke-test configs.**" if env["tiny"] else "")
        + (f" Every variant's matmuls leave {env['sm_carveout']} SMs free (`--sm-carveout`)."
           if env.get("sm_carveout") else ""),
        "",
        "Step time: median over timed steps (max over ranks). Peak: max_memory_allocated + NCCL symmetric pool"
        " + the copy engines' buffers (max over ranks)"
        + ("" if env["device"] == "cuda" else "; on CPU the process RSS high-water, cumulative over the run")
        + (". floor = unsharded bf16 fwd+bwd on one GPU (the faster of eager and a CUDA graph of it) x microbatches"
           " + torch's fused AdamW on one rank's fp32 shard" if graphed_floor else
           ". floor = unsharded bf16 fwd+bwd on one GPU x microbatches + torch's AdamW on one rank's fp32 shard")
        + " (the fused optimizer beats that part: eff > 1 is possible); eff = floor / step time. MFU = model FLOPs "
          "per rank (6 x matmul params + causal attention per token,"
        " recompute not counted) / step time / 989 TFLOP/s (H100/H200 dense bf16).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    for r in results:
        bc, res, floor = r["config"], r["variants"], r.get("floor") or {}
        ms = {n: (res.get(n) or {}).get("median_ms") for n in names}
        row = [str(r["id"]), BenchConfig(**bc).describe(), f"{bc['batch']}x{bc['seq']}",
               str(bc["microbatches"])]
        row += [_fmt(ms[n]) if "error" not in (res.get(n) or {}) else "error" for n in names]
        if base:
            row += [_fmt(ms[n] / ms[base], ".3f") if ms[n] and ms[base] else "-" for n in others]
        row += [_fmt((res.get(n) or {}).get("peak_gib"), ".2f") for n in names]
        f_ms = floor.get("floor_ms")
        row += [_fmt(f_ms)] + [_fmt(f_ms / ms[n], ".2f") if f_ms and ms[n] else "-" for n in names]
        mfu = {n: (res.get(n) or {}).get("mfu") for n in names}
        row += [f"{100 * mfu[n]:.1f}%" if mfu[n] else "-" for n in names]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    same_init = env.get("init") == "full"
    lines.append("Sanity: training loss on the (fixed, random-token) batches, first -> last step; every variant must"
                 " learn" + (", and from identical initial weights end close to fsdp2 (FP8 variants: close to "
                             "fsdp2_float8 where it ran; FP8 rounding changes the trajectory, so they are not held to "
                             "a bf16 run's loss)." if same_init else "."))
    lines.append("")
    for r in results:
        parts = []
        refs = {False: (r["variants"].get("fsdp2") or {}).get("loss_last"),
                True: (r["variants"].get("fsdp2_float8") or {}).get("loss_last")}
        for n, res in r["variants"].items():
            fp8 = "fp8" in n or "float8" in n
            ref = refs[fp8]
            if "error" in res:
                parts.append(f"{n}: error `{res['error'].strip().splitlines()[-1]}`")
            elif res.get("loss_first") is not None:
                flag = "" if learned(res) else " **NOT LEARNING**"
                if (same_init and ref is not None and n not in ("fsdp2", "fsdp2_float8")
                        and abs(res["loss_last"] - ref) > 0.05 * abs(ref) + 1e-3):
                    flag += " **DIFFERS FROM " + ("FSDP2 + FLOAT8**" if fp8 else "FSDP2**")
                parts.append(f"{n} {res['loss_first']:.4f} -> {res['loss_last']:.4f}{flag}")
        lines.append(f"- config {r['id']}: " + "; ".join(parts))
        if (r.get("floor") or {}).get("method", "whole model") != "whole model":
            lines.append(f"- config {r['id']} floor measured {r['floor']['method']}")
    lines.append("")
    if any(v.offload for v in variants):
        lines += offload_section(results, variants, env)
    elif env.get("sync_steps"):
        lines += synced_section(results, names)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write("\n".join(lines))
    write_chart(results, names, env, os.path.join(out_dir, stem + ".png"))


def synced_section(results: list[dict], names: list[str]) -> list[str]:
    """Per config and variant: the step back to back and synchronised after every step, as ratios to FSDP2's best
    of its variants in the run, and how long the call itself takes to return (its host work)."""
    lines = ["## Back to back and synchronised after every step", "",
             "back to back: the median of the table above. synced: the median step between two device "
             "synchronisations (a loop that reads the loss every step). call: how long the step's call takes to "
             "return when the device is idle at its start (its host work; max over ranks). Ratios are to FSDP2's "
             "fastest variant in the run, the same way timed.", "",
             "| cfg | variant | back to back ms | ratio | synced ms | ratio | call ms |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        res = {n: r["variants"].get(n) or {} for n in names}
        best = {key: min((res[n][key] for n in names if n.startswith("fsdp2") and res[n].get(key)), default=None)
                for key in ("median_ms", "synced_median_ms")}
        for n in names:
            if "error" in res[n] or not res[n]:
                continue
            cells = [str(r["id"]), n]
            for key in ("median_ms", "synced_median_ms"):
                ms = res[n].get(key)
                cells += [_fmt(ms), _fmt(ms / best[key], ".3f") if ms and best[key] else "-"]
            cells.append(_fmt(res[n].get("call_median_ms"), ".2f"))
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def write_chart(results: list[dict], names: list[str], env: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not getattr(write_chart, "_warned", False):
            print("matplotlib is not importable: skipping the chart", flush=True)
            write_chart._warned = True
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"{r['id']}\n{r['config']['batch']}x{r['config']['seq']}" + (f"x{r['config']['microbatches']}mb"
              if r["config"]["microbatches"] > 1 else "") for r in results]
    width = 0.8 / max(1, len(names))
    have_floor = all((r.get("floor") or {}).get("floor_ms") for r in results)
    for i, n in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(results))]
        vals, mems = [], []
        for r in results:
            res = r["variants"].get(n) or {}
            ms = res.get("median_ms")
            vals.append((r["floor"]["floor_ms"] / ms if have_floor else ms) if ms else 0)
            mems.append(res.get("peak_gib") or 0)
        axes[0].bar(xs, vals, width, label=n)
        axes[1].bar(xs, mems, width, label=n)
    axes[0].set_ylabel("efficiency = floor / step time" if have_floor else "step time (ms)")
    if have_floor:
        axes[0].axhline(1.0, color="gray", lw=0.8, ls="--")
    axes[1].set_ylabel("peak memory (GiB)" if env["device"] == "cuda" else "RSS high-water (GiB)")
    for ax in axes:
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels(labels)
        ax.set_xlabel("config")
        ax.legend(fontsize=8)
    fig.suptitle(f"training step, {env['world']} x {env.get('gpu', env['device'])}, torch {env['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- main


def _meshes(device: torch.device, world: int, args):
    """The data-parallel mesh fully_shard takes, and the tensor-parallel one (None without --tp)."""
    if args.tp == 1:
        return init_device_mesh(device.type, (world,)), None
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
    if any(v.fp8 for v in make_variants(args)):
        raise SystemExit("--tp: the FP8 variants refuse tensor-parallel layers; leave them out of --impls")
    if any(v.offload for v in make_variants(args)):
        raise SystemExit("--tp: the offload variants are not run tensor-parallel here; leave them out of --impls")
    args.no_floor = True  # the floor is one GPU's unsharded step: not a tensor-parallel rank's
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def main(argv=None) -> None:
    args = parse_args(argv)
    device = gpt.setup_distributed(args.device, timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh, tp_mesh = _meshes(device, world, args)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.sm_carveout:
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
    table = TINY_CONFIGS if args.tiny else CONFIGS
    config_ids = [int(c) for c in args.configs.split(",") if c.strip()]
    variants = make_variants(args)
    env = environment(device, world, args)
    stem = f"step_{world}{'gpu' if device.type == 'cuda' else 'cpu'}" + (f"_tp{args.tp}" if args.tp > 1 else "")

    def log(*a):
        if rank == 0:
            print(*a, flush=True)

    log(f"step benchmark: world={world} {env.get('gpu', 'cpu')} torch={torch.__version__} "
        f"variants={[v.name for v in variants]} configs={config_ids} -> {os.path.join(args.out, stem)}.*")
    results = []
    for n_cfg, cid in enumerate(config_ids):
        bc = table[cid] if args.layers is None else replace(table[cid], n_layers=args.layers)
        if args.ac_every is not None:
            bc = replace(bc, activation_checkpointing=args.ac_every > 0, ac_every=max(args.ac_every, 1))
        if args.ac_skip_last:
            bc = replace(bc, ac_skip_last=args.ac_skip_last)
        n_params = gpt.num_params(gpt.GPT(bc.model_config(), device="meta"))
        log(f"\n== config {cid}: {bc.describe()}, {n_params / 1e6:.0f}M params, "
            f"batch {bc.batch} x seq {bc.seq} x {bc.microbatches} microbatches per rank")
        entry = dict(id=cid, config=asdict(bc), n_params=n_params, variants={}, floor=None)

        if not args.no_floor:
            if rank == 0:
                try:
                    entry["floor"] = measure_floor(bc, world, dtype, device, args.floor_steps)
                    fl = entry["floor"]
                    log(f"  floor {fl['floor_ms']:.1f} ms = fwd+bwd {fl['fwd_bwd_ms']:.1f} x {fl['microbatches']} "
                        f"+ AdamW {fl['adamw_ms']:.1f} ({fl['method']})")
                except Exception:  # noqa: BLE001 - the floor is optional
                    log("  floor failed:\n" + traceback.format_exc())
                    free_memory(device)
            dist.barrier()

        order = variants[n_cfg % len(variants):] + variants[: n_cfg % len(variants)]
        results.append(entry)
        for v in order:
            try:
                res = run_variant(v, bc, mesh, dtype, device, args, tp_mesh)
                log(f"  {v.name:<24} median {res['median_ms']:8.1f} ms (min {res['min_ms']:.1f}, max "
                    f"{res['max_ms']:.1f})"
                    + (f" | synced {res['synced_median_ms']:.1f} ms, call {res['call_median_ms']:.2f} ms"
                       if res["synced_median_ms"] is not None else "")
                    + f" | peak {res['peak_gib']:6.2f} GiB | rest {res['resting_gib']:6.2f} GiB"
                    + (f" | host {res['host_gib']:.1f} GiB" if res["host_gib"] is not None else "")
                    + (f" | pinned {res['pinned_gib']:.1f} GiB" if res["pinned_gib"] is not None else "")
                    + f" | {res['tokens_per_s']:9.0f} tok/s | build {res['build_s']:.1f} s"
                    f" | loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}"
                    + ("" if learned(res) else "  !! loss did not fall: is the optimizer step reaching the model?"))
            except HostMemoryGuard as e:  # every rank raised it, before building anything
                res = dict(error=str(e))
                log(f"  {v.name:<24} {e}")
            except Exception as e:  # noqa: BLE001 - record and go on (assumes all ranks failed alike, e.g. OOM)
                # the report keeps what failed; the traceback (this machine's file paths) goes to the log only
                res = dict(error=f"{type(e).__name__}: {e}")
                print(f"[rank {rank}] config {cid} {v.name} failed:\n{traceback.format_exc()}", flush=True)
                free_memory(device)
            entry["variants"][v.name] = res
            if rank == 0:  # after every variant: a run cut short by a timeout keeps what it measured
                write_report(results, variants, env, args.out, stem)

        names = [v.name for v in variants]
        if "fsdp2" in names:
            base = entry["variants"]["fsdp2"].get("median_ms")
            for n in names:
                ms = entry["variants"][n].get("median_ms")
                if n != "fsdp2" and ms and base:
                    log(f"  {n}/fsdp2 = {ms / base:.3f}")
        for line in offload_ratios(entry, variants):
            log("  " + line)
    log(f"\nwrote {os.path.join(args.out, stem)}.md / "
        ".json" + (" / .png" if os.path.exists(os.path.join(args.out, stem + ".png")) else ""))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
