"""Loads the native extension ``mfsdp_ext._C`` and exposes its kernels to the Python layer.

Every function runs one C++ kernel (at::parallel_for) for CPU tensors or one CUDA launch on the current
stream for CUDA tensors (pack / unpack: one launch per source / destination dtype; one in total when the
dtypes agree). CPU and CUDA give identical bits. Inputs are checked (dtype, device, contiguity, sizes,
segment table shape and order) and bad ones raise ``RuntimeError``/``ValueError`` with the function's name.

Contract (all buffers are contiguous and indexed by their flat element index, on one device; nothing here
allocates outputs; float dtypes are float32 / bfloat16 / float16):

pack(tensors, offsets, out, scale=1.0)
    out[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i].flatten() * scale, cast to out.dtype (RNE).
    Every element of ``out`` that no tensor covers is set to 0 (the whole output is written).
    Ranges of different tensors must not overlap in ``out``; the product is taken in fp32 and rounded once.
    CUDA: up to PACK_INLINE_TABLE_ENTRIES (160) copy entries (tensors plus gaps, per source dtype) the entry
    table travels in the kernel's parameters, so the call can be captured in a CUDA graph; above that it is
    uploaded on every call through pinned memory, and capturing raises.
pack_pieces(tensors, pieces, out, scale=1.0)
    pack with each source given as pieces: every row (t, first, count, offset) of ``pieces`` (a CPU int64 (n, 4)
    tensor, made once and reused: no per-call slicing in Python) writes
    out[offset : offset + count] = tensors[t].flatten()[first : first + count] * scale; the rest of out is 0, and a
    tensor given as None leaves its pieces' ranges 0. One launch as for pack.
unpack(flat, offsets, outs)
    outs[i].view(-1)[:] = flat[offsets[i] : offsets[i] + outs[i].numel()], cast to outs[i].dtype.
cast(src, dst)
    dst[:] = src cast to dst.dtype (fp32 -> bf16 / fp16, round to nearest even).
segment_amax(src, segments, amax)
    segments: int64 (n, 2) of [start, end) element ranges into src, on src's device.
    amax[i] = max |src[start:end]| (0 for an empty segment; NaN if any element is NaN).
fp8_cast(src, segments, amax, dst, scale_inv, eps=1e-12)
    scale_i = fp8_max / max(amax[i], eps), or 1 where amax[i] is 0, inf or NaN.
    dst[start:end] = saturate(src[start:end] * scale_i) to +-fp8_max, NaN stays NaN; elements of dst in no
    segment are 0. scale_inv[i] = 1 / scale_i. dst dtype: float8_e4m3fn (max 448) or float8_e5m2 (57344).
fp8_dequantize(src, segments, scale_inv, dst)
    dst[start:end] = src[start:end].float() * scale_inv[i] cast to dst.dtype; elements in no segment are 0.
grad_accumulate(main_grad, reduced, scale, accumulate)
    main_grad[:] = (main_grad if accumulate else 0) + scale * reduced.float()  (fp32 arithmetic; when
    accumulating, one fused multiply-add, i.e. a single rounding). main_grad and reduced must not overlap.
    reduced may be (parts, main_grad.numel()): its rows are added in order, each as one more call would
    (``accumulate`` for row 0, accumulating after it), in one launch: the sum of an all-to-all's shards.

adamw_step(param, grad, exp_avg, exp_avg_sq, runs, coeffs)
    One AdamW step (decoupled weight decay) over the runs of flat buffers: for every run i, [start, end) =
    runs[i] (a CPU int64 (n, 2) segment table, rule below, within [0, param.numel())), every element j there:
        g = grad[j] * sign                                  (sign -1 when maximize; grad fp32 / bf16 / fp16)
        param[j] *= decay                                   (decay = 1 - lr * weight_decay)
        exp_avg[j] = lerp(exp_avg[j], g, w1)                (w1 = 1 - beta1; torch's CPU lerp: one fma)
        exp_avg_sq[j] = exp_avg_sq[j] * beta2 + (omb2 * g) * g        (omb2 = 1 - beta2)
        denom = sqrt(exp_avg_sq[j]) / bc2_sqrt + eps        (bc2_sqrt = sqrt(1 - beta2 ** step))
        param[j] += (neg_step * exp_avg[j]) / denom         (neg_step = -lr / (1 - beta1 ** step))
    with coeffs[i] = (decay, w1, beta2, omb2, bc2_sqrt, eps, neg_step, sign) (a CPU float32 (n, OPTIM_COEFFS)
    tensor; the host computes them in double, as torch does with its Python scalars, and rounds to fp32).
    Every operation is one fp32 rounding, in the order of torch's ``_single_tensor_adam`` (decoupled weight
    decay; lerp and addcmul as torch's CPU kernels: one fma each), so on the CPU the result equals
    ``torch.optim.AdamW(foreach=False)`` on fp32 tensors (grad cast to fp32 first) to the bit, except where
    torch's CPU sqrt (MKL VML for large tensors) is one ulp off: ours is correctly rounded. CUDA gives the same
    bits as this CPU kernel (correctly rounded __f*_rn operations). Elements in no run are not
    touched; a run may cover zero padding (zero weight and zero grad stay zero: the update is 0 / eps).
    param, exp_avg, exp_avg_sq: fp32, and grad: one numel, one device, no two overlapping.
    CUDA: up to OPTIM_INLINE_RUNS (64) runs travel in the kernel's parameters (no upload, capturable in a CUDA
    graph); above that they are uploaded through pinned memory on every call, and capturing raises.
sgd_step(param, grad, momentum_buffer, runs, coeffs)
    One SGD step over the runs, torch's ``_single_tensor_sgd`` order: g = grad * sign; g = fma(param, wd, g) when
    wd != 0; with momentum: buf = g on a parameter's first step, else buf = fma(g, 1 - dampening, buf * momentum),
    then g = fma(buf, momentum, g) (nesterov) or buf; param = fma(g, -lr, param). coeffs[i] = (wd, momentum,
    1 - dampening, -lr, sign, flags, 0, 0), flags = 1 (momentum: momentum_buffer used) | 2 (first step: buf = g)
    | 4 (nesterov). momentum_buffer may be None when no run has flag 1.
    Both take ``device_table`` (CUDA): ``optim_device_table(runs, coeffs)`` copied to param's device; the kernel
    then reads runs and coefficients there instead of from its parameters, so a CUDA graph that captured the launch
    steps with whatever the table holds at each replay.
    CPU: one contiguous chunk of the buffer per thread (at::parallel_for, torch.get_num_threads()), stepped by one
    of three code paths with the same bits: "avx512" (AVX-512F), "avx" (AVX + FMA + F16C; no AVX2 needed) or
    "scalar", the best this CPU supports unless ``MFSDP_CPU_SIMD`` (auto / scalar / avx / avx512, read at the first
    step) or ``_C.set_cpu_simd(path)`` names one (ValueError for one the CPU lacks; returns the path before).
    ``_C.cpu_simd()``: the path in effect; ``_C.cpu_simd_paths()`` and ``build_info()["cpu_simd_paths"]``: those
    this CPU runs, best first.

fp8_quantize(src, dst, scale_inv, amax=None, dst_t=None, eps=1e-12, algo="auto")
    Per-tensor current scaling of one tensor (activations, gradients): amax = max |src| over the whole tensor,
    scale = fp8_max / max(amax, eps) (1 where amax is 0, inf or NaN), dst = saturate(src * scale) as for
    fp8_cast, scale_inv[0] = 1 / scale, amax[0] = amax (when given). src: any shape; dst: same number of
    elements, float8_e4m3fn or float8_e5m2; scale_inv / amax: one float32 element each. dst_t (optional,
    dst's dtype): the transpose of the FP8 result with src seen as (rows, cols), cols = src's last dimension,
    shape (cols, rows), written in the same pass (what Hopper FP8 GEMMs want as a column-major operand).
    CUDA ``algo``: "two_pass" (two launches: per-block amax, then the cast, which re-reads the input from the
    end so that the part still in L2 comes first), "fused" (one launch: tiles taken by an atomic ticket, each
    block's first tile kept in registers while the amax is completed, the rest re-read; no grid barrier, so
    nothing waits for SMs that other kernels hold; two-pass under CUDA graph capture), "auto" (two-pass for
    now; benchmarks/kernels.py compares them). CPU: one way, the same bits.
fp8_transpose(src, dst)
    dst = src.t() for a 2-D FP8 tensor: dst (cols, rows) contiguous, the same dtype.

These four allocate their outputs (the only ones here that do):
fp8_gemm(a, b, scale_a, scale_b, bias, out_dtype, fast_accum) -> out
    out (M, N) = (a.float() * scale_a) @ (b.float() * scale_b).T (+ bias), accumulated in fp32 (``fast_accum``:
    Hopper's faster, less exact FP8 accumulation), rounded to out_dtype (bfloat16 / float16 / float32). a (M, K),
    b (N, K): contiguous FP8 (not both e5m2), K contiguous in both; scales: one float32 element each. CUDA:
    cublasLtMatmul with the algorithm chosen once per shape (``build_info()["fp8_gemm"] == "cublaslt"``), or
    torch._scaled_mm where the build found no cuBLASLt headers; CPU: torch._scaled_mm (an fp32 emulation on
    torch builds without it). ``fp8_gemm_calls()``: how many fp8_gemm calls this process has made.
fp8_linear_forward(x, w8, w_scale_inv, bias, keep_x_t, fast_accum, eps, algo) -> (y, x8t or None, x_scale_inv)
    fp8_quantize(x) to e4m3 (its transpose x8t (K, M) too when keep_x_t), then y = fp8_gemm(x8, w8, ...) in x's
    dtype. x (M, K) contiguous float; w8 (N, K) e4m3.
fp8_linear_backward(dy, grad_dtype, w8t, w_scale_inv, x8t, x_scale_inv, dx_dtype, dw_dtype, eps, algo) -> (dx, dw)
    fp8_quantize(dy) to grad_dtype (with its transpose when x8t is given), then dx = dy @ W = fp8_gemm(dy8, w8t)
    when w8t (K, N) is given, dW = dy.T @ x = fp8_gemm(dy8t, x8t) when x8t (K, M) is given; None for the other.
fp8_quantize_input(x, keep_x_t, eps, algo) -> (x8, x_scale_inv, x8t or None)
    x (..., K) quantized as fp8_linear_forward quantizes it: x8 (M, K) e4m3 and its transpose (K, M) when keep_x_t.
fp8_linear(x, weight, bias, w8, w_scale_inv, w8t, grad_dtype, need_dx, need_dw, fp8_wgrad, fast_accum, eps, algo,
           x8=None, x_scale_inv=None, x8t=None)
    y = x @ W.T (+ bias) as a C++ autograd function: forward = fp8_linear_forward on x (..., K), backward =
    fp8_linear_backward, plus db = dy.sum(0) and, without fp8_wgrad, dW = dy.T @ x in x's dtype. W is read only
    as w8 (N, K) e4m3 and, for dx, w8t (K, N) when given, else backward transposes w8; ``weight`` receives dW.
    need_dx / need_dw: whether x / weight get gradients (the caller decides: grad mode and requires_grad).
    x8 / x_scale_inv / x8t: fp8_quantize_input(x) made beforehand (x8t needed when need_dw and fp8_wgrad), so
    layers sharing an input quantize it once; x's values are then not read (x receives dx).

Segment tables: rows sorted and non-overlapping, ``0 <= start_i <= end_i <= src.numel()`` and
``end_{i-1} <= start_i``; an empty row is written ``(e, e)`` at its place in order (e.g. clipping each
parameter's range to the local shard keeps this). CPU tables are checked on every call; a CUDA table is
checked once (one device-to-host copy) and again only when it changes (new tensor or version counter).

Arithmetic: all in fp32; bf16 / fp16 / fp8 conversions round to nearest even; FP8 saturates explicitly;
NaN results are canonical NaNs (bf16 0x7FC0, fp16 0x7E00, fp8 0x7F, fp32 0x7FC00000 after arithmetic);
scales: ``scale = fp8_max / max(amax, eps)`` in fp32, ``scale_inv = 1 / scale`` in fp32.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import float64

_PACKAGE = __package__.rpartition(".")[0]  # mfsdp_ext: the extension is mfsdp_ext._C
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _load_extension():
    """(module, how it was built, its path): the ahead-of-time build installed with the package (setup.py), else
    the just-in-time build (jit.py beside this file: cached, compiled on first use). Registered as mfsdp_ext._C."""
    aot_error = None
    installed = importlib.util.find_spec(f"{_PACKAGE}._C")
    # only one beside this file: an editable install of another checkout can answer for mfsdp_ext._C too
    # (real paths: a sys.path entry such as "benchmarks/.." leaves ".." in the origin)
    if installed is not None and os.path.dirname(os.path.realpath(installed.origin)) == _PACKAGE_DIR:
        try:
            from .. import _C as module

            return module, "ahead-of-time", module.__file__
        except ImportError as exc:  # e.g. built against another torch
            aot_error = exc
            warnings.warn(f"mfsdp_ext: the ahead-of-time build of mfsdp_ext._C does not load ({exc}); building it "
                          "just in time instead", stacklevel=3)
    from . import jit

    try:
        module = jit.load()
    except ImportError as exc:
        if aot_error is not None:
            raise ImportError(f"{exc}\n(the ahead-of-time build did not load either: {aot_error})") from exc
        raise
    sys.modules[f"{_PACKAGE}._C"] = module  # `from mfsdp_ext import _C` finds it, as an installed _C
    sys.modules[_PACKAGE]._C = module
    return module, "just-in-time", module.__file__


_C, _BUILD, _PATH = _load_extension()

# Constants defined once in C++ (csrc/) and read from the extension.
SYMM_ALIGNMENT: int = _C.SYMM_ALIGNMENT  # symmetric-pool window offsets are multiples of it (NCCL's rule)
SYMM_REGION_GRANULARITY: int = _C.SYMM_REGION_GRANULARITY  # pool regions are whole multiples of it
SYMM_DEFAULT_GROW_BYTES: int = _C.SYMM_DEFAULT_GROW_BYTES  # region added when a pool allocation does not fit
MIN_NCCL_VERSION: int = _C.MIN_NCCL_VERSION  # runtime NCCL needed by the symmetric collectives (22807 = 2.28.7)
PACK_INLINE_TABLE_ENTRIES: int = _C.PACK_INLINE_TABLE_ENTRIES  # CUDA pack/unpack: table in the kernel parameters
OPTIM_INLINE_RUNS: int = _C.OPTIM_INLINE_RUNS  # CUDA adamw_step/sgd_step: runs in the kernel parameters
OPTIM_COEFFS: int = _C.OPTIM_COEFFS  # columns of adamw_step/sgd_step's coefficient table
AGREE_RANK_WORDS: int = _C.AGREE_RANK_WORDS  # host_max_agree: int64 words per rank of the shared mapping
AGREE_MAX_VALUES: int = _C.AGREE_MAX_VALUES  # host_max_agree: the most values agreed on at once
FP8_E4M3_MAX: float = _C.FP8_E4M3_MAX  # largest finite float8_e4m3fn (the kernels saturate to it)
FP8_E5M2_MAX: float = _C.FP8_E5M2_MAX  # largest finite float8_e5m2

FP8_MAX = {torch.float8_e4m3fn: FP8_E4M3_MAX, torch.float8_e5m2: FP8_E5M2_MAX}

_BUILD_INFO: dict | None = None


def current_capture_id(device_index: int) -> int:
    """The id of the CUDA graph capture under way on the device's current stream (unique in the process); 0 when
    there is none. torch tells only whether a stream captures, not which capture it is."""
    return _C.current_capture_id(device_index)


def build_info() -> dict:
    """What ``_C`` was built with: {"native", "cpu", "cuda", "cuda_arch", "nccl", "nccl_version", ...}, and which
    build is loaded: "build" ("ahead-of-time" or "just-in-time") and "path" (its shared library)."""
    global _BUILD_INFO
    if _BUILD_INFO is None:
        info = dict(_C.build_info())
        # cuda_arch: compiled architectures, e.g. "sm_90a" (several: "sm_80,sm_90a")
        if info.get("cuda_arch"):
            info["cuda_arch"] = ",".join(info["cuda_arch"].split("__"))
        info.update(build=_BUILD, path=_PATH)
        _BUILD_INFO = info
    return dict(_BUILD_INFO)


def build_summary() -> dict:
    """``build_info()`` without "path": what a benchmark records of the build (where the library sits on one
    machine is not part of a result)."""
    return {k: v for k, v in build_info().items() if k != "path"}


# ----------------------------------------------------------------------------------------------
# CUDA segment tables: validated once per (tensor, version), not on every call
# ----------------------------------------------------------------------------------------------
_checked_segments = WeakIdKeyDictionary()  # CUDA table -> the key it was validated under


def _segments_key(segments: torch.Tensor, total: int):
    try:
        version = segments._version
    except RuntimeError:  # inference tensors have no version counter
        version = None
    return (version, segments.data_ptr(), tuple(segments.shape), total)


def _check_cuda_segments(segments: torch.Tensor, total: int) -> None:
    if not isinstance(segments, torch.Tensor) or not segments.is_cuda:
        return  # CPU tables are checked in C++; wrong devices are reported there
    key = _segments_key(segments, total)
    if _checked_segments.get(segments) == key:
        return
    if torch.cuda.is_current_stream_capturing():
        return  # no device-to-host copy inside a CUDA graph capture
    if segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != 2:
        return  # shape / dtype errors are reported by the kernel call itself
    _C.check_segments(segments.detach().cpu(), total)  # raises with a clear message
    _checked_segments[segments] = key


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor, scale: float = 1.0) -> None:
    if float64.involves(out, tensors):
        return float64.pack(tensors, offsets, out, scale)
    _C.pack(tensors, offsets, out, float(scale))


def pack_pieces(tensors: Sequence[torch.Tensor | None], pieces: torch.Tensor, out: torch.Tensor,
                scale: float = 1.0) -> None:
    if float64.involves(out, tensors):
        return float64.pack_pieces(tensors, pieces, out, scale)
    _C.pack_pieces(tensors, pieces, out, float(scale))


def unpack(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    if float64.involves(flat, outs):
        return float64.unpack(flat, offsets, outs)
    _C.unpack(flat, offsets, outs)


def cast(src: torch.Tensor, dst: torch.Tensor) -> None:
    if float64.involves(src, dst):
        return float64.cast(src, dst)
    _C.cast(src, dst)


def segment_amax(src: torch.Tensor, segments: torch.Tensor, amax: torch.Tensor) -> None:
    _check_cuda_segments(segments, src.numel())
    _C.segment_amax(src, segments, amax)


def fp8_cast(src, segments, amax, dst, scale_inv, eps: float = 1e-12) -> None:
    _check_cuda_segments(segments, src.numel())
    _C.fp8_cast(src, segments, amax, dst, scale_inv, float(eps))


def fp8_dequantize(src, segments, scale_inv, dst) -> None:
    _check_cuda_segments(segments, src.numel())
    _C.fp8_dequantize(src, segments, scale_inv, dst)


QUANTIZE_ALGOS: dict[str, int] = dict(_C.QUANTIZE_ALGOS)  # fp8_quantize's algo names -> the C++ codes


def fp8_quantize(src: torch.Tensor, dst: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor | None = None,
                 dst_t: torch.Tensor | None = None, eps: float = 1e-12, algo: str = "auto") -> None:
    if algo not in QUANTIZE_ALGOS:
        raise ValueError(f"mfsdp_ext.fp8_quantize: algo must be one of {sorted(QUANTIZE_ALGOS)}, got {algo!r}")
    _C.fp8_quantize(src, dst, scale_inv, amax, dst_t, float(eps), QUANTIZE_ALGOS[algo])


def fp8_transpose(src: torch.Tensor, dst: torch.Tensor) -> None:
    _C.fp8_transpose(src, dst)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             fast_accum: bool = False) -> torch.Tensor:
    return _C.fp8_gemm(a, b, scale_a, scale_b, bias, out_dtype, bool(fast_accum))


def fp8_gemm_calls() -> int:
    return _C.fp8_gemm_calls()


def _algo_code(fn: str, algo: str) -> int:
    code = QUANTIZE_ALGOS.get(algo)
    if code is None:
        raise ValueError(f"mfsdp_ext.{fn}: algo must be one of {sorted(QUANTIZE_ALGOS)}, got {algo!r}")
    return code


def fp8_linear_forward(x: torch.Tensor, w8: torch.Tensor, w_scale_inv: torch.Tensor, bias: torch.Tensor | None,
                       keep_x_t: bool, fast_accum: bool, eps: float = 1e-12, algo: str = "auto"):
    return _C.fp8_linear_forward(x, w8, w_scale_inv, bias, bool(keep_x_t), bool(fast_accum), float(eps),
                                 _algo_code("fp8_linear_forward", algo))


def fp8_linear_backward(dy: torch.Tensor, grad_dtype: torch.dtype, w8t: torch.Tensor | None,
                        w_scale_inv: torch.Tensor | None, x8t: torch.Tensor | None, x_scale_inv: torch.Tensor | None,
                        dx_dtype: torch.dtype, dw_dtype: torch.dtype, eps: float = 1e-12, algo: str = "auto"):
    return _C.fp8_linear_backward(dy, grad_dtype, w8t, w_scale_inv, x8t, x_scale_inv, dx_dtype, dw_dtype,
                                  float(eps), _algo_code("fp8_linear_backward", algo))


def fp8_quantize_input(x: torch.Tensor, keep_x_t: bool, eps: float = 1e-12, algo: str = "auto"):
    return _C.fp8_quantize_input(x, bool(keep_x_t), float(eps), _algo_code("fp8_quantize_input", algo))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w8: torch.Tensor,
               w_scale_inv: torch.Tensor, w8t: torch.Tensor | None, grad_dtype: torch.dtype, need_dx: bool,
               need_dw: bool, fp8_wgrad: bool, fast_accum: bool, eps: float = 1e-12,
               algo: str = "auto", x8: torch.Tensor | None = None, x_scale_inv: torch.Tensor | None = None,
               x8t: torch.Tensor | None = None) -> torch.Tensor:
    return _C.fp8_linear(x, weight, bias, w8, w_scale_inv, w8t, grad_dtype, bool(need_dx), bool(need_dw),
                         bool(fp8_wgrad), bool(fast_accum), float(eps), _algo_code("fp8_linear", algo), x8,
                         x_scale_inv, x8t)


def grad_accumulate(main_grad: torch.Tensor, reduced: torch.Tensor, scale: float, accumulate: bool) -> None:
    if float64.involves(main_grad, reduced):
        return float64.grad_accumulate(main_grad, reduced, scale, accumulate)
    _C.grad_accumulate(main_grad, reduced, float(scale), bool(accumulate))


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               runs: torch.Tensor, coeffs: torch.Tensor, device_table: torch.Tensor | None = None) -> None:
    _C.adamw_step(param, grad, exp_avg, exp_avg_sq, runs, coeffs, device_table)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, runs: torch.Tensor,
             coeffs: torch.Tensor, device_table: torch.Tensor | None = None) -> None:
    _C.sgd_step(param, grad, momentum_buffer, runs, coeffs, device_table)


def optim_device_table(runs: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """adamw_step / sgd_step's ``device_table`` layout, in pinned host memory: the runs (2n int64), then the
    coefficients (n x OPTIM_COEFFS float32), as bytes; copy it to the device (non_blocking) before the launch."""
    n = runs.shape[0]
    table = torch.empty(n * (16 + 4 * OPTIM_COEFFS), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    table[: 16 * n].view(torch.int64).copy_(runs.reshape(-1))
    table[16 * n:].view(torch.float32).copy_(coeffs.reshape(-1))
    return table


def host_max_agree(slots: torch.Tensor, rank: int, world: int, seq: int, values: torch.Tensor,
                   timeout_s: float) -> None:
    """The processes of one host agree on ``values``: each publishes its own for decision ``seq`` (1, 2, ...) in
    ``slots`` (a CPU int64 tensor of world x AGREE_RANK_WORDS words mapped shared by all of them), waits for the
    others' and leaves in ``values`` each value's maximum over the ranks. RuntimeError when a rank has not arrived
    after ``timeout_s``."""
    _C.host_max_agree(slots, rank, world, seq, values, timeout_s)
