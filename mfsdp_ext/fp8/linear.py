"""FP8 Linear: the forward GEMM and the input gradient (dgrad) in FP8, the weight gradient (wgrad) in FP8 or in
the compute dtype, on tensors quantized by the native per-tensor current-scaling quantizer, multiplied by the
native ``fp8_gemm`` (cuBLASLt with a per-shape plan cache on CUDA; torch._scaled_mm on CPU). The layer is one
C++ autograd function (``_native.fp8_linear``): forward and backward each run in native code (quantize, then the
GEMMs) with no Python in between, because in eager mode the host time per layer, not the GPU, decided whether FP8
beat bf16.

    y  = x @ W.T + b      fp8_gemm(x8 (M, K), W8 (N, K))       x8, W8: e4m3
    dx = dy @ W           fp8_gemm(dy8 (M, N), W8t (K, N))     dy8: config.grad_dtype; W8t = W8's transpose
    dW = dy.T @ x         fp8_gemm(dy8t (N, M), x8t (K, M))    wgrad="fp8": the transposes come from the same
                          or dy.T @ x in x's dtype              quantizer passes; wgrad="bf16": x kept as given

Hopper's FP8 GEMMs take both operands with the contraction dimension contiguous, so every FP8 operand is a
row-major (rows, K) tensor: ``fp8_gemm(a, b) = a @ b.T``.

The weight's FP8 form is an input: ``fp8_linear(..., fp8_weight=Fp8Tensor)`` (FP8 data (N, K), scale_inv and
optionally its transpose, e.g. gathered in FP8 by fully_shard) or, by default, the weight quantized on every
call with the same kernel. With ``fp8_weight`` the weight tensor's values are not read: it only receives the
gradient.

GEMM shapes FP8 GEMMs cannot take (M, K or N not a multiple of 16), GPUs without FP8 GEMMs (below sm_89) and
unsupported dtypes fall back, in ``Fp8Linear``, to ``F.linear`` with one warning per module naming it. On CPU,
torch._scaled_mm runs where the torch build has it (torch 2.13's CPU build does); otherwise the native code
emulates it (dequantize to fp32 and matmul), so the logic runs and is tested on CPU.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _native as N
from .._native import QUANTIZE_ALGOS
from ..core import registry
from .tensor import E4M3, E5M2, Fp8Tensor, quantize

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WGRAD_MODES = ("fp8", "bf16")


@dataclass(frozen=True)
class Fp8LinearConfig:
    """grad_dtype: FP8 dtype of the output gradient for dgrad (and FP8 wgrad). e5m2 (default, 2 mantissa bits,
        range 2^-16 .. 57344) or e4m3 (3 bits, range 2^-9 .. 448). Measured on CPU (dgrad of a 512x384 gradient
        against a 384x256 weight, normwise / worst-row relative error): Gaussian rows e4m3 0.037 / 0.047, e5m2
        0.059 / 0.072; rows scaled by exp(3 N(0,1)) (a per-tensor range of ~1e4) or one row 1e5x the rest:
        e4m3's small rows fall below its range (worst row 1.05 / 0.44), e5m2 stays at 0.059 / 0.073. The GEMMs
        cost the same, so the default is the one that degrades gracefully.
    wgrad: "fp8" (dy and x quantized, their transposes written by the same quantizer passes) or "bf16"
        (dy.T @ x in the input's dtype; keeps x for backward as nn.Linear does). Speed: benchmarks/fp8_linear.py.
    fast_accum: the forward GEMM's fast accumulation (as torchao; dgrad and wgrad always accumulate exactly).
    eps: amax floor of the scale, ``scale = fp8_max / max(amax, eps)``.
    quantize_algo: the native quantizer's CUDA algorithm ("auto", "two_pass", "fused"; same bits).
    reuse_input: FP8 layers called one after another on the same input tensor (the same object, unchanged since:
        same version; e.g. attention's q, k and v projections, the MLP's gate and up projections) quantize it once
        and share the FP8 copy and its transpose: the same bits as quantizing it per layer. What it keeps: the
        last input's FP8 copy, until that input is freed or another input comes (at most one activation's size
        in FP8). A write that bypasses the version counter (``x.data``) between two such calls is not seen:
        turn it off there.
    """

    grad_dtype: torch.dtype = E5M2
    wgrad: str = "fp8"
    fast_accum: bool = True
    eps: float = 1e-12
    quantize_algo: str = "auto"
    reuse_input: bool = True

    def __post_init__(self):
        if self.grad_dtype not in (E4M3, E5M2):
            raise ValueError(f"Fp8LinearConfig.grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                             f"got {self.grad_dtype}")
        if self.wgrad not in WGRAD_MODES:
            raise ValueError(f"Fp8LinearConfig.wgrad must be one of {WGRAD_MODES}, got {self.wgrad!r}")
        if not self.eps > 0:
            raise ValueError(f"Fp8LinearConfig.eps must be positive, got {self.eps}")
        if self.quantize_algo not in QUANTIZE_ALGOS:
            raise ValueError(f"Fp8LinearConfig.quantize_algo must be one of {sorted(QUANTIZE_ALGOS)}, "
                             f"got {self.quantize_algo!r}")


# ----------------------------------------------------------------------------------------------
# eligibility
# ----------------------------------------------------------------------------------------------
@functools.cache
def _cuda_capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def fp8_unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why ``fp8_linear(x, weight)`` cannot run as FP8 GEMMs, or None when it can."""
    if x.device.type == "cuda":
        cap = _cuda_capability(x.device.index if x.device.index is not None else torch.cuda.current_device())
        if cap < (8, 9):
            return f"the GPU is sm_{cap[0]}{cap[1]}; FP8 GEMMs need sm_89 or newer"
    elif x.device.type != "cpu":
        return f"device type {x.device.type!r} is not supported (CUDA or CPU)"
    if x.dtype not in COMPUTE_DTYPES or weight.dtype not in COMPUTE_DTYPES:
        return (f"input dtype {x.dtype} / weight dtype {weight.dtype}: FP8 quantization takes float32, bfloat16 "
                "or float16")
    if weight.dim() != 2 or x.dim() == 0:
        return f"input {tuple(x.shape)} / weight {tuple(weight.shape)} is not a linear layer's shape"
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if m % 16 or k % 16 or n % 16:
        return f"GEMM shape M={m}, K={k}, N={n}: FP8 GEMMs need each to be a multiple of 16"
    return None


# ----------------------------------------------------------------------------------------------
# the layer function
# ----------------------------------------------------------------------------------------------
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               fp8_weight: Optional[Fp8Tensor] = None, config: Optional[Fp8LinearConfig] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with FP8 GEMMs (see the module docstring). The caller checks
    ``fp8_unsupported_reason`` first; this function does not fall back. The output has x's dtype.

    fp8_weight: the weight's FP8 form (data (N, K) e4m3 contiguous, scale_inv, optional data_t (K, N)) supplied
    from outside; default: ``weight`` quantized here, on every call. The input gradient uses its transpose
    ``data_t`` when it has one; otherwise backward transposes the FP8 weight (not kept between forward and
    backward: fully_shard frees the gathered weight in between)."""
    if fp8_weight is not None:
        _check_fp8_weight(fp8_weight, weight)
    return _fp8_linear(x, weight, bias, fp8_weight, config or Fp8LinearConfig())


def _check_fp8_weight(fp8_weight: Fp8Tensor, weight: torch.Tensor) -> None:
    if (fp8_weight.dtype != E4M3 or tuple(fp8_weight.shape) != tuple(weight.shape)
            or not fp8_weight.data.is_contiguous()):
        raise ValueError(f"mfsdp_ext.fp8.linear: fp8_weight must be contiguous float8_e4m3fn of the weight's "
                         f"shape {tuple(weight.shape)}, got {fp8_weight.dtype} {tuple(fp8_weight.shape)} "
                         f"with strides {fp8_weight.data.stride()}")


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                fp8_weight: Optional[Fp8Tensor], cfg: Fp8LinearConfig) -> torch.Tensor:
    """fp8_linear once fp8_weight is checked (Fp8Linear checks it in set_fp8_weight, not at every forward)."""
    grad = torch.is_grad_enabled()
    need_dx = grad and x.requires_grad
    need_dw = grad and weight.requires_grad
    fp8_wgrad = cfg.wgrad == "fp8"
    w = fp8_weight
    if w is None:
        w = quantize(weight.detach().contiguous(), E4M3, transpose=need_dx, eps=cfg.eps, algo=cfg.quantize_algo)
    xq = _LAST_INPUT.quantized(x, need_dw and fp8_wgrad, cfg) if cfg.reuse_input else (None, None, None)
    return N.fp8_linear(x, weight, bias, w.data, w.scale_inv, w.data_t if need_dx else None, cfg.grad_dtype,
                        need_dx, need_dw, fp8_wgrad, cfg.fast_accum, cfg.eps, cfg.quantize_algo, *xq)


class _QuantizedInput(NamedTuple):
    """An input as an FP8 layer quantized it, and what tells whether the same tensor is still unchanged."""

    source: weakref.ref  # the input tensor
    version: int
    data_ptr: int
    shape: torch.Size
    stream: int  # the CUDA stream it was quantized on (0 on CPU)
    eps: float
    quantized: tuple  # (x8, x_scale_inv, x8t or None): fp8_linear's x8 / x_scale_inv / x8t


class _LastInput:
    """The FP8 copy of the last input an FP8 layer quantized, for the next layer called on the same tensor
    (Fp8LinearConfig.reuse_input). Dropped as soon as that input is freed (a weakref callback), so it outlives its
    source only while another reference keeps the source alive."""

    def __init__(self):
        self.entry: Optional[_QuantizedInput] = None

    def quantized(self, x: torch.Tensor, need_t: bool, cfg: Fp8LinearConfig):
        """(x8, x_scale_inv, x8t or None) of ``x``: the last one when it is this x's and has what is needed, else
        made now and remembered."""
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        e = self.entry  # read once: the comparison and the use see the same entry
        if (e is not None and e.source() is x and e.version == x._version and e.data_ptr == x.data_ptr()
                and e.shape == x.shape and e.stream == stream and e.eps == cfg.eps
                and (e.quantized[2] is not None or not need_t)):
            return e.quantized
        made = N.fp8_quantize_input(x, need_t, cfg.eps, cfg.quantize_algo)
        self.entry = _QuantizedInput(weakref.ref(x, self._forget), x._version, x.data_ptr(), x.shape, stream,
                                     cfg.eps, made)
        return made

    def _forget(self, ref) -> None:
        entry = self.entry
        if entry is not None and entry.source is ref:
            self.entry = None


_LAST_INPUT = _LastInput()


def forget_last_input() -> None:
    """Drop the remembered FP8 input (at the edges of a CUDA graph capture: its buffers belong to one side)."""
    _LAST_INPUT.entry = None


class _DequantizedWeight(torch.autograd.Function):
    """``fp8_weight`` dequantized to ``weight``'s dtype, standing in for ``weight`` (whose values are not read):
    the gradient flows to ``weight`` unchanged. The fallback of a layer whose weight exists only in FP8."""

    @staticmethod
    def forward(ctx, weight, fp8_weight: Fp8Tensor):
        return fp8_weight.dequantize(weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ----------------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------------
class Fp8LinearMixin:
    """The FP8 forward of an ``nn.Linear`` (mixed in before it; see ``to_fp8_linear``)."""

    fp8_config: Fp8LinearConfig
    _fp8_name: Optional[str] = None
    _fp8_warned: bool = False
    _fp8_weight: Optional[Fp8Tensor] = None
    # True where the weight's values live only in _fp8_weight (fully_shard's FP8 groups with compute=True: the
    # gathered weight is FP8 and the parameter only receives the gradient): the fallback dequantizes it
    _fp8_weight_only: bool = False
    if TYPE_CHECKING:  # a mixin: the nn.Linear it is mixed into has these
        weight: torch.Tensor
        bias: Any
        in_features: int
        out_features: int

    def set_fp8_weight(self, fp8_weight: Optional[Fp8Tensor]) -> None:
        """Use this FP8 form of the weight (e.g. gathered in FP8) instead of quantizing the weight on every call;
        None: back to quantizing per call. Without its transpose (``data_t``), backward transposes it. Checked
        here (the error names the problem where it arises), not at every forward."""
        if fp8_weight is not None:
            _check_fp8_weight(fp8_weight, self.weight)
        self._use_fp8_weight(fp8_weight)

    def _use_fp8_weight(self, fp8_weight: Optional[Fp8Tensor]) -> None:
        """set_fp8_weight without the check, for a weight right by construction (fully_shard's gathered views, made
        from the parameters' own layout): a plain attribute, not nn.Module.__setattr__ (four times per layer and
        step)."""
        self.__dict__["_fp8_weight"] = fp8_weight

    def _fp8_fallback_warning(self, reason: str) -> None:
        if self._fp8_warned:
            return
        self._fp8_warned = True
        name = self._fp8_name or (f"{type(self).__name__}(in_features={self.in_features}, "
                                  f"out_features={self.out_features})")
        warnings.warn(f"mfsdp_ext Fp8Linear {name!r}: {reason}; this layer computes with F.linear in the input's "
                      "dtype instead of FP8 (warned once per module)", stacklevel=3)

    def _fallback_weight(self) -> torch.Tensor:
        if self._fp8_weight_only and self._fp8_weight is not None:
            return _DequantizedWeight.apply(self.weight, self._fp8_weight)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return F.linear(x, self._fallback_weight(), self.bias)
        reason = fp8_unsupported_reason(x, self.weight)
        if reason is not None:
            self._fp8_fallback_warning(reason)
            return F.linear(x, self._fallback_weight(), self.bias)
        return _fp8_linear(x, self.weight, self.bias, self._fp8_weight, self.fp8_config)

    def extra_repr(self) -> str:
        c = self.fp8_config
        return (super().extra_repr()  # type: ignore[misc]
                + f", fp8(grad={str(c.grad_dtype).replace('torch.', '')}, wgrad={c.wgrad})")


class Fp8Linear(Fp8LinearMixin, nn.Linear):
    """``nn.Linear`` computing in FP8 (same parameters, state dict and initialisation)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 config: Optional[Fp8LinearConfig] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_config = config or Fp8LinearConfig()




def _fp8_class(cls: type) -> type:
    if cls is nn.Linear:
        return Fp8Linear
    if cls not in registry.FP8_CLASSES:
        registry.FP8_CLASSES[cls] = type(f"Fp8{cls.__name__}", (Fp8LinearMixin, cls), {"__module__": cls.__module__})
    return registry.FP8_CLASSES[cls]


def default_fp8_filter(fqn: str, module: nn.Linear) -> bool:
    """Linear layers whose feature dims fit FP8 GEMMs (multiples of 16)."""
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def to_fp8_linear(module: nn.Module, filter_fn: Optional[Callable[[str, nn.Module], bool]] = None,
                  config: Optional[Fp8LinearConfig] = None) -> nn.Module:
    """Make the chosen ``nn.Linear`` layers of ``module`` (itself included) compute in FP8, in place: each one's
    class becomes an FP8 subclass of its own class, so parameters, state dict, hooks and ``reset_parameters``
    stay as they are. Layers with their own ``forward`` (not nn.Linear's) are never converted.

    Args:
        module: the model (or one layer).
        filter_fn: ``filter_fn(fqn, linear) -> bool`` chooses the layers; default: in and out features multiples of
            16 (the output head usually stays out: pass a filter).
        config: the layers' ``Fp8LinearConfig`` (default: ``Fp8LinearConfig()``).

    Returns:
        ``module``.
    """
    cfg = config or Fp8LinearConfig()
    chosen = filter_fn or default_fp8_filter
    for fqn, m in module.named_modules():
        if not isinstance(m, nn.Linear) or isinstance(m, Fp8LinearMixin) or type(m).forward is not nn.Linear.forward:
            continue
        if not chosen(fqn, m):
            continue
        name = fqn or type(m).__name__  # the root itself: its class name
        m.__class__ = _fp8_class(type(m))
        fp8: Any = m
        fp8._fp8_name, fp8.fp8_config = name, cfg
    return module
