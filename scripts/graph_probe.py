"""Which parts of a training step under mfsdp_ext's fully_shard break CUDA graph capture, or replay wrongly.

    torchrun --nproc-per-node 2 scripts/graph_probe.py                  # every case, one report
    torchrun --nproc-per-node 2 scripts/graph_probe.py --cases base,fp8  # a few cases
    python scripts/graph_probe.py --list                                 # the cases and what each expects
    torchrun --nproc-per-node 2 scripts/graph_probe.py --cpu-smoke       # the harness on CPU/gloo (no capture)

Imports ``mfsdp_ext`` (and its model, ``mfsdp_ext.testing.gpt``) as Python finds it: the installed package, or a
checkout named by PYTHONPATH (``PYTHONPATH=CHECKOUT torchrun ...``; scripts/gpu_env.sh sets this repository). The
"expect" column says what each case is expected to do (docs/cuda_graphs.md describes the limits it probes).

For each case (a model config x an optimizer x a capture recipe), on every rank:
  1. build two identical sharded GPTs (same seed): ``model`` (to be graphed) and ``twin`` (eager throughout);
  2. ``--warmup`` eager steps on both (the graphed model's on the side stream that will capture, as torch's docs
     ask); the last warm-up step of ``model`` runs under ``torch.cuda.set_sync_debug_mode("warn")`` and every
     synchronizing call is recorded with its Python stack (host syncs: .item(), .tolist(), H2D from pageable...);
  3. capture (``torch.cuda.graph(g, stream=s, capture_error_mode=--mode)``) either forward+loss+backward
     ("fwdbwd", torchtitan's recipe, optimizer eager) or the whole step incl. optimizer.step()+zero_grad ("whole").
     Key mfsdp_ext functions are wrapped (instrument()): after each returns, the capture stream's status is read
     with cudaStreamIsCapturing (ctypes, libcudart already loaded by torch); the first function after which the
     capture is no longer "active" is the culprit (its name, thread and stack are printed), and the first
     exception is kept too. A failed capture is retried on fresh models with capture_error_mode="relaxed" to tell
     "unsafe API call" (passes relaxed) from structural problems (cross-capture event waits, syncs: fail both);
  4. if every rank captured: ``--steps`` replays (copy the batch into the static inputs, replay, and for "fwdbwd"
     optimizer.step() + zero_grad eagerly) against the same steps of ``twin`` in eager mode; losses are compared
     bit for bit every step and the fp32 parameter shards at the end ("replays wrong" = host state frozen at
     capture: step counters, .grad bindings, prefetch across the graph boundary, ...);
  5. it prints the graph pool (memory_reserved growth across the capture) and median step times (replay vs eager).
Determinism: SDPA math backend only; the eager twin must match the graphed model bit for bit in the warm-up,
else the case says "eager not deterministic" and its replay comparison means nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import gc
import importlib
import os
import statistics
import sys
import threading
import time
import traceback
import warnings

import torch

# ----------------------------------------------------------------------------------------------------- the cases
LR = 1e-3
SEQ, BATCH = 128, 2  # M = 256 tokens per microbatch: FP8 GEMMs need multiples of 16


@dataclasses.dataclass
class Case:
    name: str
    recipe: str = "fwdbwd"  # "fwdbwd": capture forward+loss+backward, optimizer eager; "whole": the whole step
    optim: str = "torch"  # torch | torch_capturable | ours_adamw | ours_adamw_noprefetch | ours_sgd_noprefetch
    zero_to_none: bool = False  # fwdbwd: optimizer.zero_grad(set_to_none=...) after each step (whole: always True)
    fp8: bool = False  # MixedPrecisionPolicy(fp8=Fp8Policy(compute=True))
    micro: int = 1  # microbatches per step (mfsdp_ext.microbatch + set_requires_gradient_sync, gpt.grad_sync_context)
    ac: str = ""  # "" | "rng" (mfsdp_ext/testing/gpt.py's checkpoint: preserve_rng_state=True) | "norng"
    mesh: str = "1d"  # "1d" | "hsdp" (2 x world/2: replicate x shard)
    shard: dict = dataclasses.field(default_factory=dict)  # fully_shard keywords for every unit
    root: dict = dataclasses.field(default_factory=dict)  # ... for the root only (check_finite_grads)
    mp: dict = dataclasses.field(default_factory=dict)  # MixedPrecisionPolicy keywords ("float32" -> torch.float32)
    no_shard_norm: bool = False  # mfsdp_ext.no_shard(model.norm): a replicated group in the root
    unused_false: bool = False  # model.set_reduce_scatter_unused_params(False)
    expect: str = ""  # what the case is expected to do


CASES = [
    Case("base", expect="fwdbwd should capture (bf16 ZeRO-3, bf16 wire all-to-all, torch AdamW eager, "
                        "zero_grad(set_to_none=False)); replays bit-exact. If not: see the culprit"),
    Case("base_set_to_none", zero_to_none=True,
         expect="captures; replays WRONG: zero_grad(set_to_none=True) drops the .grad views of the graph-owned "
                "main_grad, the optimizer skips every parameter (silent no-training)"),
    Case("ours_adamw", optim="ours_adamw",
         expect="capture FAILS (isolation/invalidated): the captured forward waits on the all-gather event that "
                "step_prefetch issued eagerly inside optimizer.step (unit.wait_unshard)"),
    Case("ours_adamw_noprefetch", optim="ours_adamw_noprefetch",
         expect="captures (optimizer eager, gather_next_forward=False); replays bit-exact"),
    Case("fp32_wire", mp={"reduce_comm_dtype": "float32"},
         expect="captures (flat reduce-scatter path instead of the all-to-all)"),
    Case("fp8", fp8=True, expect="captures (two-pass quantizer + per-call cuBLASLt workspace under capture)"),
    Case("micro2", micro=2, expect="captures 2 microbatches in one graph; bit-exact"),
    Case("ac", ac="rng", expect="capture FAILS in torch.utils.checkpoint: get_rng_state() under capture "
                                "(preserve_rng_state=True)"),
    Case("ac_norng", ac="norng", expect="captures (checkpoint(preserve_rng_state=False)); bit-exact"),
    Case("native", shard={"native_collectives": True}, expect="captures (own NCCL communicator on our streams)"),
    Case("symm", shard={"use_symm_mem": True}, expect="captures if NCCL windows are set up at lazy init "
                                                      "(unpack/pack tables <= 160 entries) [E3, F4]"),
    Case("no_shard", no_shard_norm=True, expect="captures (replicated group refreshed inside the graph)"),
    Case("hsdp", mesh="hsdp", expect="captures (replicate all-reduce through ProcessGroupNCCL)"),
    Case("finite", root={"check_finite_grads": True},
         expect="capture FAILS: finite_grads.check: torch.tensor(ordinals, device=cuda) and first.item()"),
    Case("unused_false", unused_false=True,
         expect="capture FAILS: GradReduction._params_given_a_grad: torch.tensor(list, device=cuda), .tolist()"),
    Case("whole_ours_adamw", recipe="whole", optim="ours_adamw_noprefetch",
         expect="captures (prefetch off, so B1 is out of the way), replays WRONG from the 2nd replay: AdamW's host "
                "step count and coefficients are frozen at capture in the kernel's inline parameters [G1, E2]"),
    Case("whole_ours_sgd", recipe="whole", optim="ours_sgd_noprefetch",
         expect="SGD(momentum) has no host step counter: if this is bit-exact and whole_ours_adamw is not, the "
                "AdamW host state is the cause"),
    Case("whole_torch_capturable", recipe="whole", optim="torch_capturable",
         expect="torch AdamW(capturable=True) on our DTensor shards: step on device; bit-exact if the rest is"),
    Case("whole_fp8_micro2", recipe="whole", optim="torch_capturable", fp8=True, micro=2,
         expect="FP8 + microbatches in one whole-step graph (cache_model_weight auto flips at the 3rd gather)"),
]


# ------------------------------------------------------------------------------- capture status of a CUDA stream
ACTIVE = 1  # cudaStreamCaptureStatusActive; 0 none, 2 invalidated


class CaptureWatch:
    """Reads cudaStreamIsCapturing(capture stream) after each instrumented call while a capture is under way."""

    def __init__(self):
        self.lib = None
        self.active = False
        self.stream_ptr = 0
        self.reset()

    def load(self) -> None:
        """libcudart as torch loaded it (after CUDA init); None where torch links it statically."""
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
        except OSError:
            paths = []
        for path in paths:
            try:
                lib = ctypes.CDLL(path)
                lib.cudaStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
                lib.cudaStreamIsCapturing.restype = ctypes.c_int
                self.lib = lib
                return
            except (OSError, AttributeError):
                continue

    def reset(self) -> None:
        self.culprit = None  # (function, thread, status, stack): the first call after which the capture was lost
        self.first_bad_seen = None  # the first instrumented call that found it lost already (if no culprit)
        self.last_ok = None
        self.exception = None  # (function, repr, stack) of the first exception through an instrumented call
        self.calls = 0

    def status(self) -> int:
        if self.lib is None:  # fallback: this thread's current stream only
            return ACTIVE if torch.cuda.is_current_stream_capturing() else 0
        st = ctypes.c_int(0)
        rc = self.lib.cudaStreamIsCapturing(ctypes.c_void_p(self.stream_ptr), ctypes.byref(st))
        return st.value if rc == 0 else -rc

    def begin(self, stream) -> None:
        self.reset()
        self.stream_ptr = stream.cuda_stream
        self.active = True

    def end(self) -> None:
        self.active = False

    def after(self, name: str, before: int) -> None:
        self.calls += 1
        now = self.status()
        if now == ACTIVE:
            self.last_ok = name
        elif before == ACTIVE and self.culprit is None:
            self.culprit = (name, threading.current_thread().name, now, _stack())
        elif self.first_bad_seen is None and self.culprit is None:
            self.first_bad_seen = (name, threading.current_thread().name, now, _stack())

    def note_exception(self, name: str, exc: BaseException) -> None:
        if self.exception is None:
            self.exception = (name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                              _stack())


WATCH = CaptureWatch()
KEEP = ("mfsdp_ext", "gpt.py", "checkpoint.py", "torch/distributed", "torch/optim", "graph_probe.py")


def _stack(limit: int = 10) -> list[str]:
    frames = [f for f in traceback.extract_stack()[:-3] if any(k in f.filename for k in KEEP)]
    return [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in frames[-limit:]]


def _short(path: str) -> str:
    for mark in ("mfsdp_ext/", "examples/", "torch/"):
        i = path.rfind(mark)
        if i >= 0:
            return path[i:]
    return os.path.basename(path)


# ------------------------------------------------------------------------------------------- instrumentation
TARGETS = {
    "mfsdp_ext.core.device": {"DeviceHandle": ["use_stream", "record_event", "wait_event", "wait_stream",
                                               "record_stream"]},
    "mfsdp_ext.core.flat_buffer": {"FlatBuffer": ["free", "alloc"]},
    "mfsdp_ext.runtime.unit": {"FsdpUnit": ["lazy_init", "unshard", "wait_unshard", "reshard", "show_sharded_params",
                                            "pre_forward", "post_forward", "_pre_backward", "post_backward",
                                            "_reduce_early", "end_iteration"],
                               None: ["_sync_fp8_scales"]},
    "mfsdp_ext.runtime.root": {None: ["lazy_init", "final_callback", "abandon_iteration"]},
    "mfsdp_ext.params.group": {"ParamGroup": ["note_gather", "sync_model_weight", "all_gather", "gather_begin",
                                              "gather_end", "write_shard", "cast_into_own_slots", "free_unsharded"]},
    "mfsdp_ext.params.grads": {"GroupGradients": ["pack", "drop_unsharded", "reduce_scatter", "accumulate_reduced",
                                                  "accumulate", "_new_main_grad", "attach"]},
    "mfsdp_ext.runtime.reduction": {"GradReduction": ["reduce_groups", "_reduce_scatter_together", "reduce",
                                                      "_params_given_a_grad"]},
    "mfsdp_ext.comm.collectives": {"PlainAllGather": ["__call__"],
                                   "PlainReduceScatter": ["__call__", "_sum_on_arrival"],
                                   "ArrivedShards": ["summed"],
                                   None: ["all_gather_together", "reduce_scatter_together"]},
    "mfsdp_ext.comm.dist_ops": {None: ["all_gather_into", "reduce_scatter_into", "grouped_reduce_scatter_into",
                                       "all_to_all_into", "all_reduce"]},
    "mfsdp_ext.comm.native": {"NcclTransport": ["all_gather_into", "reduce_scatter_into",
                                                "grouped_reduce_scatter_into", "all_reduce_max", "all_to_all_into"]},
    "mfsdp_ext.comm.symmetric.collectives": {"SymmetricAllGather": ["__call__"],
                                             "SymmetricReduceScatter": ["__call__"]},
    "mfsdp_ext.params.fp8_group": {"Fp8ParamGroup": ["sync_model_weight", "note_gather", "_cast_fp8_shard",
                                                     "all_gather", "gather_begin", "gather_end", "free_unsharded"],
                                   None: ["sync_scales"]},
    "mfsdp_ext.fp8.linear": {"_LastInput": ["quantized"], None: ["_fp8_linear"]},
    "mfsdp_ext.runtime.finite_grads": {None: ["check"]},
    "mfsdp_ext.runtime.step_prefetch": {"NextForwardGather": ["issue"], None: ["plan"]},
    "mfsdp_ext.optim.base": {"FlatOptimizerMixin": ["step", "_split", "_step_group"]},
    "mfsdp_ext.optim.adamw": {"AdamW": ["_flat_key", "_coeffs", "_run_kernel", "_torch_step"]},
    "mfsdp_ext.optim.sgd": {"SGD": ["_flat_key", "_coeffs", "_run_kernel", "_torch_step"]},
    "mfsdp_ext._native": {None: ["pack", "pack_pieces", "unpack", "cast", "segment_amax", "fp8_cast", "fp8_dequantize",
                                 "fp8_quantize", "fp8_transpose", "fp8_gemm", "fp8_linear", "fp8_quantize_input",
                                 "grad_accumulate", "adamw_step", "sgd_step"]},
}


def _wrap(fn, name: str):
    @functools.wraps(fn)
    def probe_wrapper(*args, **kwargs):
        if not WATCH.active:
            return fn(*args, **kwargs)
        before = WATCH.status()
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            WATCH.note_exception(name, exc)
            raise
        finally:
            WATCH.after(name, before)

    probe_wrapper._probe_wrapped = True
    return probe_wrapper


def instrument() -> list[str]:
    """Wrap the TARGETS (before any model or optimizer is built: hooks bind methods at registration). Module-level
    functions are replaced wherever an mfsdp_ext module imported them by name. Returns what it could not find."""
    missing, replaced = [], {}
    for mod_name, table in TARGETS.items():
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as exc:
            missing.append(f"{mod_name} ({exc})")
            continue
        for cls_name, names in table.items():
            owner = mod if cls_name is None else getattr(mod, cls_name, None)
            if owner is None:
                missing.append(f"{mod_name}.{cls_name}")
                continue
            for name in names:
                raw = (vars(owner).get(name) if cls_name is not None else getattr(owner, name, None))
                if raw is None or not callable(raw) or isinstance(raw, (staticmethod, classmethod)):
                    missing.append(f"{mod_name}.{cls_name or ''}.{name}")
                    continue
                if getattr(raw, "_probe_wrapped", False):
                    continue
                label = f"{cls_name}.{name}" if cls_name else f"{mod_name.rsplit('.', 1)[-1]}.{name}"
                wrapped = _wrap(raw, label)
                setattr(owner, name, wrapped)
                if cls_name is None:
                    replaced[id(raw)] = (raw, wrapped)
    for mod_name, mod in list(sys.modules.items()):  # `from .x import f` copies
        if not mod_name.startswith("mfsdp_ext") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            hit = replaced.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(mod, attr, hit[1])
    return missing


# ------------------------------------------------------------------------------------------------ host syncs
@contextlib.contextmanager
def sync_scan(records: list):
    """Every synchronizing CUDA call inside (torch.cuda.set_sync_debug_mode("warn")), with its Python stack."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original = warnings.showwarning

        def hook(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            if "synchroniz" in text.lower():
                records.append((f"{_short(filename)}:{lineno}", text.splitlines()[0][:160], _stack(6)))
            else:
                original(message, category, filename, lineno, file, line)

        warnings.showwarning = hook
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(prev)


# ---------------------------------------------------------------------------------------------- model and step
def _dtype(v):
    return getattr(torch, v) if isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype) else v


def build(case: Case, device, meshes):
    import mfsdp_ext
    from mfsdp_ext.testing import gpt

    cfg = gpt.GPTConfig(n_layers=4, dim=256, n_heads=2, ffn_dim=768, vocab_size=1024, max_seq_len=SEQ,
                        activation_checkpointing=bool(case.ac))
    torch.manual_seed(1234)  # the same full model on every rank, then sharded
    model = gpt.GPT(cfg, device=device)
    if case.no_shard_norm:
        mfsdp_ext.no_shard(model.norm)
    mp_kw = {k: _dtype(v) for k, v in case.mp.items()}
    if case.fp8:
        mp_kw["fp8"] = mfsdp_ext.Fp8Policy(compute=True)
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    if case.fp8:
        low = torch.bfloat16
    mp = mfsdp_ext.MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, **mp_kw)
    kw = dict(mesh=meshes[case.mesh], mp_policy=mp, **case.shard)
    for layer in model.layers:
        mfsdp_ext.fully_shard(layer, **kw)
    mfsdp_ext.fully_shard(model, **kw, **case.root)
    if case.unused_false:
        model.set_reduce_scatter_unused_params(False)
    return model


def make_optimizer(kind: str, model):
    import mfsdp_ext.optim

    params = list(model.parameters())
    if kind == "torch":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=True)
    if kind == "torch_capturable":  # (CPU smoke run: torch refuses capturable=True off the GPU)
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=True,
                                 capturable=params[0].device.type == "cuda")
    if kind.startswith("ours_adamw"):
        opt = mfsdp_ext.optim.AdamW(params, lr=LR, weight_decay=0.1)
    elif kind == "ours_sgd_noprefetch":
        opt = mfsdp_ext.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.1)
    else:
        raise ValueError(kind)
    if kind.endswith("noprefetch"):
        opt.gather_next_forward = False
    return opt


def batches_for(case: Case, n_steps: int, rank: int, device, vocab: int = 1024):
    out = []
    for t in range(n_steps):
        mbs = []
        for m in range(case.micro):
            g = torch.Generator().manual_seed(100_000 * rank + 100 * t + m)
            x = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
            y = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
            mbs.append((x.to(device), y.to(device)))
        out.append(mbs)
    return out


def fwd_bwd(model, mbs):
    from mfsdp_ext.testing import gpt

    k, total = len(mbs), None
    for i, (x, y) in enumerate(mbs):
        with gpt.grad_sync_context(model, "ours", i, k):
            loss = model(x, y) / k
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def eager_step(model, opt, mbs, set_to_none: bool):
    loss = fwd_bwd(model, mbs)
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def param_mismatch(model, twin) -> str | None:
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        a = p.to_local() if hasattr(p, "to_local") else p
        b = q.to_local() if hasattr(q, "to_local") else q
        if not _bits_equal(a, b):
            return name
    return None


@contextlib.contextmanager
def checkpoint_rng(mode: str):
    """mfsdp_ext.testing.gpt's Block calls the module-level `checkpoint`; "norng" swaps in preserve_rng_state=False."""
    from torch.utils.checkpoint import checkpoint

    from mfsdp_ext.testing import gpt

    saved = gpt.checkpoint
    if mode == "norng":
        gpt.checkpoint = functools.partial(checkpoint, preserve_rng_state=False)
    try:
        yield
    finally:
        gpt.checkpoint = saved


# --------------------------------------------------------------------------------------------------- one case
def run_case(case: Case, env: dict, mode: str) -> dict:
    import torch.distributed as dist

    device, rank, cpu_pg = env["device"], env["rank"], env["cpu_pg"]
    res = dict(case=case.name, mode=mode, stage="build", ok=False)
    model = twin = opt = opt2 = g = None
    cuda = device.type == "cuda"
    try:
        if case.mesh not in env["meshes"]:
            return dict(res, stage="skipped", detail=f"mesh {case.mesh} needs an even world size >= 2")
        if "use_symm_mem" in case.shard or "native_collectives" in case.shard:
            if not cuda:
                return dict(res, stage="skipped", detail="needs CUDA + NCCL")
        with checkpoint_rng(case.ac):
            model, twin = build(case, device, env["meshes"]), build(case, device, env["meshes"])
            opt, opt2 = make_optimizer(case.optim, model), make_optimizer(case.optim, twin)
            ztn = True if case.recipe == "whole" else case.zero_to_none
            W, K = env["warmup"], env["steps"]
            data = batches_for(case, W + K, rank, device)
            s = torch.cuda.Stream() if cuda else None
            stream_ctx = (lambda: torch.cuda.stream(s)) if cuda else contextlib.nullcontext

            # -- warm-up: eager on both, the graphed model on the capture stream
            res["stage"] = "warmup"
            syncs = []
            for t in range(W):
                if cuda:
                    s.wait_stream(torch.cuda.current_stream())
                with stream_ctx():
                    scan = sync_scan(syncs) if (cuda and t == W - 1) else contextlib.nullcontext()
                    with scan:
                        la = eager_step(model, opt, data[t], ztn)
                if cuda:
                    torch.cuda.current_stream().wait_stream(s)
                lb = eager_step(twin, opt2, data[t], ztn)
                if not _bits_equal(la, lb):
                    res["eager_nondeterministic"] = f"warm-up step {t}: {la.item()!r} vs {lb.item()!r}"
            res["syncs"] = syncs
            res["loss_warmup"] = float(lb)

            # -- capture
            res["stage"] = "capture"
            static = [(x.clone(), y.clone()) for x, y in data[W]]
            static_loss = None
            captured_ok, t0 = False, time.perf_counter()
            if cuda:
                torch.cuda.synchronize()
                reserved0 = torch.cuda.memory_reserved(device)
                g = torch.cuda.CUDAGraph()
                WATCH.begin(s)
                try:
                    with torch.cuda.graph(g, stream=s, capture_error_mode=mode):
                        if case.recipe == "fwdbwd":
                            static_loss = fwd_bwd(model, static)
                        else:
                            static_loss = eager_step(model, opt, static, True)
                    captured_ok = True
                except BaseException as exc:  # noqa: BLE001 - reported
                    res["capture_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                    tb = traceback.extract_tb(exc.__traceback__)
                    res["capture_error_stack"] = [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in tb
                                                  if any(k in f.filename for k in KEEP)][-8:]
                finally:
                    WATCH.end()
                res["culprit"] = WATCH.culprit
                res["first_bad_seen"] = WATCH.first_bad_seen
                res["last_ok"] = WATCH.last_ok
                res["first_exception"] = WATCH.exception
                res["instrumented_calls"] = WATCH.calls
                torch.cuda.synchronize()
                res["pool_mib"] = (torch.cuda.memory_reserved(device) - reserved0) / 2**20
            else:  # --cpu-smoke: no capture; the "replays" below are eager steps of the same model
                captured_ok = True
                res["capture_error"] = "not captured (CPU smoke run)"
            res["capture_s"] = time.perf_counter() - t0

            # -- every rank must have captured before any replay (a replay runs collectives)
            flag = torch.tensor([1 if captured_ok else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_pg)
            if not int(flag.item()):
                res["stage"] = "capture failed" if not captured_ok else "capture failed on another rank"
                return res

            # -- replays against the eager twin
            res["stage"] = "replay"
            mism, t_graph, t_eager = None, [], []
            for t in range(W, W + K):
                a0 = time.perf_counter()
                if cuda:
                    for (sx, sy), (x, y) in zip(static, data[t]):
                        sx.copy_(x)
                        sy.copy_(y)
                    g.replay()
                    if case.recipe == "fwdbwd":
                        opt.step()
                        opt.zero_grad(set_to_none=ztn)
                    la = static_loss.clone()
                    torch.cuda.synchronize()
                else:
                    la = eager_step(model, opt, data[t], ztn)
                t_graph.append(time.perf_counter() - a0)
                b0 = time.perf_counter()
                lb = eager_step(twin, opt2, data[t], ztn)
                if cuda:
                    torch.cuda.synchronize()
                t_eager.append(time.perf_counter() - b0)
                if mism is None and not _bits_equal(la, lb):
                    mism = f"step {t - W + 1} of {K}: graphed loss {la.item()!r} vs eager {lb.item()!r}"
            res["loss_mismatch"] = mism
            res["param_mismatch"] = param_mismatch(model, twin)
            res["graph_ms"] = statistics.median(t_graph) * 1e3
            res["eager_ms"] = statistics.median(t_eager) * 1e3
            res["ok"] = mism is None and res["param_mismatch"] is None
            res["stage"] = "done"
            return res
    except BaseException as exc:  # noqa: BLE001 - reported
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        tb = traceback.extract_tb(exc.__traceback__)
        res["error_stack"] = [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in tb
                              if any(k in f.filename for k in KEEP)][-8:]
        return res
    finally:
        WATCH.end()
        for m in (model, twin):
            if m is not None and hasattr(m, "release_symmetric_memory"):
                try:
                    m.release_symmetric_memory()  # collective: every rank reaches it in the same case
                except Exception:  # noqa: BLE001
                    pass
        del g, model, twin, opt, opt2
        gc.collect()
        if cuda:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - a sticky CUDA error ends the run
                res["fatal"] = f"CUDA unusable after this case: {exc}"


# ------------------------------------------------------------------------------------------------------ report
def summarize(case: Case, per_rank: list[dict]) -> tuple[str, list[str]]:
    r0 = per_rank[0]
    if r0.get("stage") == "skipped":
        return f"{case.name:24s} skipped: {r0.get('detail')}", []
    worst = next((r for r in per_rank if r.get("error")), None) or \
        next((r for r in per_rank if r.get("stage") != "done"), None) or r0
    if worst.get("error"):
        verdict = f"ERROR at {worst['stage']}: {worst['error']}"
    elif worst.get("stage") != "done":
        c = worst.get("culprit")
        where = f" after {c[0]} [{c[1]}]" if c else ""
        verdict = f"CAPTURE FAILS{where}: {worst.get('capture_error', '?')}"
    elif not all(r.get("ok") for r in per_rank):
        bad = next(r for r in per_rank if not r.get("ok"))
        verdict = f"REPLAYS WRONG: {bad.get('loss_mismatch') or ''} params: {bad.get('param_mismatch') or 'equal'}"
    elif str(r0.get("capture_error", "")).startswith("not captured"):
        verdict = "CPU smoke: harness ran, graphed model and eager twin bit-identical (nothing captured)"
    else:
        verdict = "captures, replays bit-exact"
    syncs = r0.get("syncs") or []
    head = f"{case.name:24s} {verdict}"
    lines = []
    if syncs:
        first = syncs[0]
        lines.append(f"    host syncs in one warmed-up eager step: {len(syncs)}; first at {first[0]}: {first[1]}")
        for frame in first[2]:
            lines.append(f"        {frame}")
    for r in per_rank:
        if r.get("culprit"):
            name, thread, st, stack = r["culprit"]
            lines.append(f"    rank {per_rank.index(r)}: capture lost (status {st}) after {name} on thread {thread};"
                         f" last call with capture active: {r.get('last_ok')}")
            lines += [f"        {f}" for f in stack]
            break
        if r.get("first_bad_seen"):
            name, thread, st, stack = r["first_bad_seen"]
            lines.append(f"    rank {per_rank.index(r)}: capture already lost (status {st}) when {name} returned; "
                         f"last instrumented call with capture active: {r.get('last_ok')}")
            break
    for r in per_rank:
        if r.get("first_exception"):
            name, msg, stack = r["first_exception"]
            lines.append(f"    first exception through {name}: {msg}")
            break
    for key in ("capture_error_stack", "error_stack"):
        if worst.get(key):
            lines.append(f"    {key.replace('_', ' ')}: " + " <- ".join(reversed(worst[key][-4:])))
    if r0.get("eager_nondeterministic"):
        lines.append(f"    WARNING eager not deterministic: {r0['eager_nondeterministic']}")
    if r0.get("pool_mib") is not None:
        lines.append(f"    graph pool {r0['pool_mib']:.1f} MiB (reserved growth across the capture), capture "
                     f"{r0.get('capture_s', 0):.2f} s" + (f", step graph {r0['graph_ms']:.2f} ms vs eager "
                                                         f"{r0['eager_ms']:.2f} ms" if r0.get('graph_ms') else ""))
    if case.expect:
        lines.append(f"    expected: {case.expect}")
    return head, lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="replays compared with eager steps")
    p.add_argument("--mode", default="global", choices=["global", "thread_local", "relaxed"])
    p.add_argument("--no-classify", action="store_true", help="do not retry a failed capture in relaxed mode")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--cpu-smoke", action="store_true", help="run the harness on CPU/gloo without capturing")
    args = p.parse_args(argv)
    chosen = [c for c in CASES if not args.cases or c.name in args.cases.split(",")]
    if args.list:
        for c in chosen:
            print(f"{c.name:24s} {c.recipe:6s} optim={c.optim:22s} {c.expect}")
        return
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("graph_probe: no CUDA device here; run it with torchrun on a GPU machine (or --cpu-smoke / --list)")
        return
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import mfsdp_ext
    from mfsdp_ext.testing import gpt

    missing = instrument()  # before any model: the hooks bind the (wrapped) methods at fully_shard
    device = gpt.setup_distributed("cpu" if args.cpu_smoke else "cuda")
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu_pg = dist.new_group(backend="gloo")
    if device.type == "cuda":
        WATCH.load()
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)
    meshes = {"1d": init_device_mesh(device.type, (world,))}
    if world >= 2 and world % 2 == 0:
        meshes["hsdp"] = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    env = dict(device=device, rank=rank, cpu_pg=cpu_pg, meshes=meshes, warmup=args.warmup, steps=args.steps)
    if rank == 0:
        info = dict(torch=torch.__version__, cuda=torch.version.cuda, world=world, device=str(device),
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
                    cudart_for_status="ctypes" if WATCH.lib is not None else "torch fallback (this thread only)",
                    mfsdp_ext=os.path.dirname(mfsdp_ext.__file__), env={k: v for k, v in os.environ.items()
                                            if k.startswith(("NCCL_", "TORCH_NCCL", "PYTORCH_CUDA_ALLOC"))})
        print(f"graph_probe: {info}", flush=True)
        if missing:
            print(f"graph_probe: not instrumented (renamed?): {missing}", flush=True)
    report = []
    for case in chosen:
        res = run_case(case, env, args.mode)
        if (not args.no_classify and device.type == "cuda" and res.get("stage") in
                ("capture failed", "capture failed on another rank") and args.mode != "relaxed"):
            relaxed = run_case(case, env, "relaxed")
            res["relaxed"] = ("captures in relaxed mode (an unsafe API call, e.g. a sync or cudaMalloc, broke "
                              "the strict capture)" if relaxed.get("stage") in ("replay", "done")
                              else f"fails in relaxed mode too: {relaxed.get('capture_error') or relaxed.get('error')}")
            if relaxed.get("stage") == "done":
                res["relaxed"] += "; replays " + ("bit-exact" if relaxed.get("ok") else
                                                  f"WRONG ({relaxed.get('loss_mismatch')})")
        gathered = [None] * world
        dist.all_gather_object(gathered, res, group=cpu_pg)
        if rank == 0:
            head, lines = summarize(case, gathered)
            if gathered[0].get("relaxed"):
                lines.insert(0, f"    relaxed mode: {gathered[0]['relaxed']}")
            print(head, flush=True)
            for line in lines:
                print(line, flush=True)
            report.append(head)
        if any(r.get("fatal") for r in gathered):
            if rank == 0:
                print(f"graph_probe: stopping: {[r.get('fatal') for r in gathered if r.get('fatal')][0]}")
            break
    if rank == 0:
        print("\n==== summary ====")
        for line in report:
            print(line)
    dist.barrier(group=cpu_pg)
    gpt.teardown_distributed(*meshes.values())


if __name__ == "__main__":
    main()
