"""Tests of the FP8 Linear (mfsdp_ext.fp8.linear): GEMM plumbing, accuracy within FP8 expectations, the
externally supplied FP8 weight, the warn-once fallback, the module swap and bad input. CPU always (torch 2.13's
CPU build runs torch._scaled_mm; elsewhere the labelled emulation stands in); CUDA with ``-m gpu``.

Tolerances (normwise relative error ||got - ref|| / ||ref|| against float64 on the unquantized bf16 values):
e4m3 keeps 3 mantissa bits, so rounding to it errs by at most 2^-4 of a value and by ~0.026 RMS (uniform error
over half an ulp of 2^-3, times the mean 1/mantissa ~0.72). A GEMM of two such operands sums K products whose
errors are independent, so its normwise error is ~sqrt(2) x 0.026 = 0.037: the bound is 2^-4. e5m2 (2 bits)
gradients: ~0.052 RMS, ~0.058 with the e4m3 weight: bound 2^-3. A bf16 wgrad only rounds its output: 2^-7.
Every FP8 result must also err by more than 2^-8 (so that a silent bf16 path would fail), and the GEMMs are
counted. The plumbing checks compare with the float64 product of the *dequantized* operands instead: only the
GEMM's accumulation and the output rounding (bf16: 2^-8 relative) differ.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mfsdp_ext
from mfsdp_ext import _native as N
from mfsdp_ext.fp8 import linear as FL
from mfsdp_ext.fp8.tensor import E4M3, E5M2, quantize

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")]
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]

BOUND = {E4M3: 2.0**-4, E5M2: 2.0**-3, "bf16": 2.0**-7}
FLOOR = 2.0**-8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def make_case(m=64, k=128, n=96, bias=True, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return lin.to(device), x.to(device), dy.to(device)


def run(module, x, dy):
    """Forward + backward; returns (y, dx, dW, db) (None where there is no gradient)."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    for p in module.parameters():
        p.grad = None
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad if module.bias is not None else None


def reference(module, x, dy):
    """float64 results on the same (unquantized) values."""
    w = module.weight.detach().double()
    b = module.bias.detach().double() if module.bias is not None else None
    x2, dy2 = x.double().reshape(-1, w.shape[1]), dy.double().reshape(-1, w.shape[0])
    y = x2 @ w.t() + (b if b is not None else 0)
    return y.view(dy.shape), (dy2 @ w).view(x.shape), dy2.t() @ x2, dy2.sum(0)


class GemmCounter:
    """Counts the FP8 GEMMs (native fp8_gemm calls) made since it was created; ``n = 0`` starts over."""

    def __init__(self):
        self._base = N.fp8_gemm_calls()

    @property
    def n(self) -> int:
        return N.fp8_gemm_calls() - self._base

    @n.setter
    def n(self, value: int) -> None:
        self._base = N.fp8_gemm_calls() - value


# ----------------------------------------------------------------------------------------------
# plumbing: each GEMM equals the float64 product of the dequantized operands
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2])
def test_gemms_use_the_quantized_operands(device, grad_dtype):
    lin, x, dy = make_case(device=device)
    FL.to_fp8_linear(lin, config=FL.Fp8LinearConfig(grad_dtype=grad_dtype, wgrad="fp8"))
    x.requires_grad_()
    y, dx, dw, db = run(lin, x, dy)
    xq, wq, dyq = quantize(x.detach()), quantize(lin.weight.detach()), quantize(dy, grad_dtype)
    xd, wd, dyd = (t.dequantize(torch.float64) for t in (xq, wq, dyq))
    y_ref = xd @ wd.t() + lin.bias.detach().double()
    fwd_tol = 2.0**-7 if device == "cuda" else 2.0**-8  # CUDA's forward uses fast accumulation
    assert rel(y, y_ref) <= fwd_tol
    assert rel(dx, dyd @ wd) <= 2.0**-8
    assert rel(dw, dyd.t() @ xd) <= 2.0**-8
    assert torch.allclose(db.double(), dy.double().sum(0), rtol=2.0**-7, atol=1e-2)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# accuracy against the unquantized layer, GEMM counts
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_forward_backward_within_fp8_expectations(device, grad_dtype, wgrad):
    m, k, n = (512, 1024, 768) if device == "cuda" else (64, 128, 96)
    lin, x, dy = make_case(m, k, n, device=device)
    y_ref, dx_ref, dw_ref, db_ref = reference(lin, x, dy)
    FL.to_fp8_linear(lin, config=FL.Fp8LinearConfig(grad_dtype=grad_dtype, wgrad=wgrad))
    gemms = GemmCounter()
    y, dx, dw, db = run(lin, x.requires_grad_(), dy)
    assert gemms.n == (3 if wgrad == "fp8" else 2)
    errs = {"y": rel(y, y_ref), "dx": rel(dx, dx_ref), "dw": rel(dw, dw_ref)}
    bounds = {"y": BOUND[E4M3], "dx": BOUND[grad_dtype], "dw": BOUND[grad_dtype] if wgrad == "fp8" else BOUND["bf16"]}
    print(f"{device} grad={grad_dtype} wgrad={wgrad}: " + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()))
    for key in errs:
        assert errs[key] <= bounds[key], (key, errs[key], bounds[key])
    assert errs["y"] >= FLOOR and errs["dx"] >= FLOOR  # FP8 really ran
    if wgrad == "fp8":
        assert errs["dw"] >= FLOOR
    assert rel(db, db_ref) <= 2.0**-7


@pytest.mark.parametrize("device", DEVICES)
def test_nd_input_fp32_and_no_bias(device):
    for dtype, shape in ((torch.float32, (2, 8, 64)), (torch.bfloat16, (4, 4, 2, 64)), (torch.float16, (16, 64))):
        lin, _, _ = make_case(k=64, n=48, bias=dtype != torch.float16, dtype=dtype, device=device)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
        dy = torch.randn(*shape[:-1], 48, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
        refs = reference(lin, x, dy)
        FL.to_fp8_linear(lin)
        y, dx, dw, db = run(lin, x.requires_grad_(), dy)
        assert y.shape == (*shape[:-1], 48) and y.dtype == dtype and dx.shape == x.shape and dw.dtype == dtype
        grad_bound = BOUND[FL.Fp8LinearConfig().grad_dtype]  # the default gradient dtype
        for got, ref, bound in zip((y, dx, dw), refs, (BOUND[E4M3], grad_bound, grad_bound)):
            assert FLOOR <= rel(got, ref) <= bound
        assert (db is None) == (dtype == torch.float16)


# ----------------------------------------------------------------------------------------------
# the FP8 weight supplied from outside
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_transpose", [True, False])
def test_supplied_fp8_weight_matches_per_call_quantization(device, with_transpose):
    lin, x, dy = make_case(device=device)
    FL.to_fp8_linear(lin)
    per_call = run(lin, x.requires_grad_(), dy)
    wq = quantize(lin.weight.detach(), transpose=with_transpose)
    assert (wq.data_t is None) != with_transpose
    lin.set_fp8_weight(wq)
    with torch.no_grad():
        lin.weight.fill_(float("nan"))  # with fp8_weight the weight's values are not read
    supplied = run(lin, x, dy)
    for a, b in zip(per_call, supplied):
        assert torch.equal(a, b)
    assert (wq.data_t is None) != with_transpose  # backward made its own transpose and did not keep it
    lin.set_fp8_weight(None)
    assert torch.isnan(lin(x)).all()  # back to quantizing the (NaN) weight on every call
    with pytest.raises(ValueError, match="fp8_weight must be contiguous float8_e4m3fn of the weight's shape"):
        FL.fp8_linear(x, lin.weight, fp8_weight=quantize(lin.weight.detach()[:16]))
    with pytest.raises(ValueError, match="got torch.float8_e5m2"):
        FL.fp8_linear(x, lin.weight, fp8_weight=quantize(lin.weight.detach(), E5M2))
    wq_t = quantize(lin.weight.detach().t().contiguous())
    with pytest.raises(ValueError, match="with strides"):
        FL.fp8_linear(x, lin.weight, fp8_weight=FL.Fp8Tensor(wq_t.data.t(), wq_t.scale_inv))
    # the layer checks what it is given when it is given it (not at every forward)
    with pytest.raises(ValueError, match="fp8_weight must be contiguous float8_e4m3fn of the weight's shape"):
        lin.set_fp8_weight(quantize(lin.weight.detach()[:16]))
    assert lin._fp8_weight is None


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_only_where_needed(device):
    lin, x, dy = make_case(device=device)
    FL.to_fp8_linear(lin)
    full = run(lin, x.requires_grad_(), dy)
    gemms = GemmCounter()
    y, dx, dw, db = run(lin, x.detach(), dy)  # input without grad: no dgrad
    assert dx is None and torch.equal(dw, full[2]) and torch.equal(y, full[0]) and gemms.n == 2
    lin.weight.requires_grad_(False)  # frozen weight: no wgrad
    gemms.n = 0
    y, dx, dw, db = run(lin, x.requires_grad_(), dy)
    assert dw is None and torch.equal(dx, full[1]) and torch.equal(db, full[3]) and gemms.n == 2
    lin.weight.requires_grad_(True)
    gemms.n = 0
    with torch.no_grad():
        y = lin(x)
    assert gemms.n == 1 and not y.requires_grad and torch.equal(y, full[0])


@pytest.mark.parametrize("device", DEVICES)
def test_activation_checkpointing_recomputes_identically(device):
    from torch.utils.checkpoint import checkpoint

    lin, x, dy = make_case(device=device)
    FL.to_fp8_linear(lin)
    plain = run(lin, x.requires_grad_(), dy)
    xc = x.detach().clone().requires_grad_()
    for p in lin.parameters():
        p.grad = None
    y = checkpoint(lin, xc, use_reentrant=False)
    y.backward(dy)
    for a, b in zip(plain, (y.detach(), xc.grad, lin.weight.grad, lin.bias.grad)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# layers sharing an input quantize it once (Fp8LinearConfig.reuse_input)
# ----------------------------------------------------------------------------------------------
class QuantizeInputCounter:
    """Counts N.fp8_quantize_input calls (the reuse path's quantizations) while installed."""

    def __init__(self, monkeypatch):
        self.n = 0
        original = N.fp8_quantize_input

        def counted(*args, **kwargs):
            self.n += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(N, "fp8_quantize_input", counted)


def _qkv(reuse: bool, device: str):
    """Three FP8 layers of different widths on one shared input, as attention's q, k, v projections."""
    cfg = FL.Fp8LinearConfig(reuse_input=reuse)
    layers = [make_case(64, 128, n, bias=n == 96, device=device, seed=n)[0] for n in (96, 32, 48)]
    return [FL.to_fp8_linear(lin, config=cfg) for lin in layers]


def _run_shared(layers, x, between=None):
    """Forward of each layer on the same non-leaf input h = 2 x (``between(h)`` after the first), backward of the
    sum of their outputs' squares: outputs, dx and every parameter's gradient."""
    x = x.detach().clone().requires_grad_()
    h = x * 2
    ys = []
    for i, lin in enumerate(layers):
        for p in lin.parameters():
            p.grad = None
        if i == 1 and between is not None:
            between(h)
        ys.append(lin(h))
    sum(y.float().square().sum() for y in ys).backward()
    return [y.detach() for y in ys] + [x.grad] + [p.grad for lin in layers for p in lin.parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_shared_input_quantized_once_same_bits(device, monkeypatch):
    x = make_case(device=device)[1]
    separate = _run_shared(_qkv(False, device), x)
    counter = QuantizeInputCounter(monkeypatch)
    shared = _run_shared(_qkv(True, device), x)
    assert counter.n == 1, f"one input, {counter.n} quantizations"
    for a, b in zip(separate, shared):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_shared_input_changed_in_place_is_quantized_again(device, monkeypatch):
    def write(h):
        with torch.no_grad():
            h.add_(1.0)  # bumps the version: the next layer must not use the FP8 copy of the old values

    x = make_case(device=device)[1]
    separate = _run_shared(_qkv(False, device), x, between=write)
    counter = QuantizeInputCounter(monkeypatch)
    shared = _run_shared(_qkv(True, device), x, between=write)
    assert counter.n == 2
    for a, b in zip(separate, shared):
        assert torch.equal(a, b)


def test_shared_input_fp8_copy_goes_with_its_input():
    """What the cache keeps: the FP8 copy of the last input only while that input lives; a layer that needs the
    transpose (training) after one that did not (no_grad) quantizes again."""
    layers = _qkv(True, "cpu")
    x = make_case()[1].requires_grad_()
    with torch.no_grad():
        layers[0](x)
    assert FL._LAST_INPUT.entry is not None and FL._LAST_INPUT.entry.quantized[2] is None  # no transpose without grads
    y = layers[1](x)
    assert FL._LAST_INPUT.entry.quantized[2] is not None
    y.sum().backward()
    assert layers[1].weight.grad is not None
    del x, y
    assert FL._LAST_INPUT.entry is None


# ----------------------------------------------------------------------------------------------
# fallback: one warning per module, naming it
# ----------------------------------------------------------------------------------------------
def test_fallback_warns_once_per_module_and_matches_f_linear():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(64, 32).bfloat16())
    model.add_module("odd", nn.Linear(32, 20).bfloat16())  # out_features 20: not converted by default
    FL.to_fp8_linear(model, filter_fn=lambda fqn, m: True)
    assert isinstance(model.proj, FL.Fp8LinearMixin) and isinstance(model.odd, FL.Fp8LinearMixin)
    x_bad_m = torch.randn(10, 64).bfloat16()  # 10 tokens: not a multiple of 16
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y1 = model(x_bad_m)
        y2 = model(x_bad_m)
        model(torch.randn(16, 64).bfloat16())  # proj in FP8 now, odd still falls back: no new warning
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 2, msgs
    assert "'proj'" in msgs[0] and "M=10, K=64, N=32" in msgs[0] and "multiple of 16" in msgs[0]
    assert "'odd'" in msgs[1] and "N=20" in msgs[1]
    ref = F.linear(F.linear(x_bad_m, model.proj.weight, model.proj.bias), model.odd.weight, model.odd.bias)
    assert torch.equal(y1, ref) and torch.equal(y2, ref)
    direct = FL.Fp8Linear(24, 32, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match=r"Fp8Linear\(in_features=24, out_features=32\).*K=24"):
        direct(torch.randn(16, 24).bfloat16())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model(torch.empty(0, 64).bfloat16()).shape == (0, 20)  # empty input: F.linear, no warning


def test_unsupported_dtype_and_device_reasons():
    w = torch.randn(32, 64)
    assert "float64" in FL.fp8_unsupported_reason(torch.randn(16, 64, dtype=torch.float64), w)
    assert "multiple of 16" in FL.fp8_unsupported_reason(torch.randn(16, 60), torch.randn(32, 60))
    assert FL.fp8_unsupported_reason(torch.randn(2, 8, 64), w) is None
    assert "not a linear layer" in FL.fp8_unsupported_reason(torch.randn(16, 64), torch.randn(32, 64, 1))


# ----------------------------------------------------------------------------------------------
# the module swap, config, exports
# ----------------------------------------------------------------------------------------------
class InitLinear(nn.Linear):
    """A Linear subclass with its own initialisation (as examples/gpt.py's)."""

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 0.25)


class CustomForward(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_to_fp8_linear_swaps_in_place():
    model = nn.Sequential(InitLinear(64, 32), nn.ReLU(), CustomForward(32, 32), nn.Linear(32, 48), nn.Linear(48, 8))
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    FL.to_fp8_linear(model, filter_fn=lambda fqn, m: fqn != "4")
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    assert isinstance(model[0], FL.Fp8LinearMixin) and isinstance(model[0], InitLinear)
    assert type(model[3]) is FL.Fp8Linear and model[3]._fp8_name == "3"
    assert not isinstance(model[2], FL.Fp8LinearMixin)  # own forward: never converted
    assert not isinstance(model[4], FL.Fp8LinearMixin)  # filtered out
    model[0].reset_parameters()
    assert bool((model[0].weight == 0.25).all())  # the subclass's reset_parameters is kept
    assert "fp8(grad=float8_e5m2, wgrad=fp8)" in repr(model[3])
    cls = type(model[0])
    FL.to_fp8_linear(model)  # idempotent
    assert type(model[0]) is cls and cls.__mro__[1] is FL.Fp8LinearMixin
    small = nn.Sequential(nn.Linear(64, 20))
    FL.to_fp8_linear(small)  # default filter: dims must be multiples of 16
    assert not isinstance(small[0], FL.Fp8LinearMixin)
    m = FL.to_fp8_linear(nn.Linear(32, 32))
    assert isinstance(m, FL.Fp8Linear) and m._fp8_name == "Linear"


def test_config_validation_and_exports():
    with pytest.raises(ValueError, match="grad_dtype"):
        FL.Fp8LinearConfig(grad_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="wgrad must be one of"):
        FL.Fp8LinearConfig(wgrad="fp16")
    with pytest.raises(ValueError, match="eps must be positive"):
        FL.Fp8LinearConfig(eps=0.0)
    with pytest.raises(ValueError, match="quantize_algo must be one of"):
        FL.Fp8LinearConfig(quantize_algo="cooperative")
    assert mfsdp_ext.Fp8Linear is FL.Fp8Linear and mfsdp_ext.Fp8LinearConfig is FL.Fp8LinearConfig
    assert mfsdp_ext.to_fp8_linear is FL.to_fp8_linear


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gemm_against_float64_of_dequantized_operands(device):
    """fp8_gemm(a, b) = (a * sa) @ (b * sb).T + bias: each output dtype, bias fused (its dtype) or added after
    (fp32 output, or another dtype), e5m2 on either side, and the calls counted."""
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(48, 64, generator=g) * 30).to(E5M2).to(device)
    b = (torch.randn(32, 64, generator=g) * 30).to(E4M3).to(device)
    sa, sb = torch.tensor(0.013, device=device), torch.tensor(2.5, device=device)
    ref = (a.double() * 0.013) @ (b.double() * 2.5).t()
    bias = torch.randn(32, generator=g).to(device)
    calls = GemmCounter()
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        # fp32 output: CPU accumulates exactly in fp32; Hopper's FP8 tensor cores accumulate with fewer bits
        # (measured 6e-5 relative on an H200): 2^-12 there
        tol = (1e-6 if device == "cpu" else 2.0**-12) if out_dtype == torch.float32 else 2.0**-8
        got = N.fp8_gemm(a, b, sa, sb, None, out_dtype)
        assert got.dtype == out_dtype and got.shape == (48, 32) and rel(got, ref) <= tol
        for bias_dtype in (out_dtype, torch.float32):  # fused when it is the output's 16-bit dtype
            got = N.fp8_gemm(a, b, sa, sb, bias.to(bias_dtype), out_dtype)
            assert rel(got, ref + bias.to(bias_dtype).double()) <= tol
    # e4m3 x e5m2 (dgrad / wgrad operand order)
    got = N.fp8_gemm(b, a, sb, sa, None, torch.bfloat16)
    assert rel(got, ref.t()) <= 2.0**-8
    assert calls.n == 10
    with pytest.raises(TypeError, match="cannot both be float8_e5m2"):
        N.fp8_gemm(a, a, sa, sa)
    with pytest.raises(ValueError, match="must share K"):
        N.fp8_gemm(a, b[:, :32].contiguous(), sa, sb)
    with pytest.raises(ValueError, match="contiguous 2-D"):
        N.fp8_gemm(a.t(), b, sa, sb)
    with pytest.raises(TypeError, match="out_dtype must be"):
        N.fp8_gemm(a, b, sa, sb, None, torch.float64)
    with pytest.raises(TypeError, match="one-element float32"):
        N.fp8_gemm(a, b, sa.double(), sb)
    with pytest.raises(ValueError, match="bias must be contiguous of shape"):
        N.fp8_gemm(a, b, sa, sb, bias[:16])


def test_native_linear_bad_input():
    x, w = torch.randn(16, 32), torch.randn(48, 32)
    wq = quantize(w, transpose=True)
    with pytest.raises(ValueError, match="must share K"):
        N.fp8_linear(x[:, :16], w, None, wq.data, wq.scale_inv, wq.data_t, E5M2, False, False, True, True)
    with pytest.raises(TypeError, match="w8 must be float8_e4m3fn"):
        N.fp8_linear(x, w, None, quantize(w, E5M2).data, wq.scale_inv, None, E5M2, False, False, True, True)
    with pytest.raises(ValueError, match="algo must be one of"):
        N.fp8_linear(x, w, None, wq.data, wq.scale_inv, None, E5M2, False, False, True, True, algo="fast")
    with pytest.raises(ValueError, match="x8t needs x_scale_inv"):
        N.fp8_linear_backward(torch.randn(16, 48), E5M2, None, None, wq.data_t, None, torch.float32, torch.float32)


# ----------------------------------------------------------------------------------------------
# GPU only: the kernels a forward / backward runs
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_cuda_launches_per_call():
    """Our quantizer kernels exactly as planned, the GEMMs, and no stray PyTorch kernel (copies, elementwise
    ops, reductions) around them."""
    from mfsdp_ext.testing.models import run_profiled

    lin, x, dy = make_case(1024, 4096, 4096, bias=False, device="cuda")
    FL.to_fp8_linear(lin)
    x.requires_grad_()
    run(lin, x, dy)  # warm-up

    def kernels(fn):
        names = [n for n, _, _ in run_profiled(fn)[1] if "memcpy" not in n.lower() and "memset" not in n.lower()]
        ours = [n for n in names if "quant_" in n or "transpose_u8" in n]
        stray = [n for n in names if any(k in n for k in ("elementwise", "reduce_kernel", "copy_kernel", "fill"))]
        assert not stray, stray
        return len(ours), len(names) - len(ours)

    ours, gemm = kernels(lambda: lin(x))
    assert ours == 4 and 1 <= gemm <= 2, (ours, gemm)  # quantize x and W (each with its transpose), the GEMM
    y = lin(x)
    lin.weight.grad = None  # no accumulation kernel
    ours, gemm = kernels(lambda: y.backward(dy))
    assert ours == 2 and 2 <= gemm <= 4, (ours, gemm)  # quantize dy with its transpose, dgrad, wgrad
    lin.set_fp8_weight(quantize(lin.weight.detach(), transpose=True))
    x_new = x.detach().clone().requires_grad_()  # x itself was quantized already (reuse_input)
    ours, gemm = kernels(lambda: lin(x_new))
    assert ours == 2, "a supplied FP8 weight must not be re-quantized"
    ours, gemm = kernels(lambda: lin(x_new))
    assert ours == 0, "an input quantized by the last call must not be quantized again"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_cuda_quantizer_algorithms_give_identical_results():
    lin, x, dy = make_case(1024, 1024, 2048, device="cuda")
    FL.to_fp8_linear(lin)
    results = []
    for algo in ("two_pass", "fused"):
        lin.fp8_config = FL.Fp8LinearConfig(quantize_algo=algo)
        results.append(run(lin, x.requires_grad_(), dy))
    for a, b in zip(*results):
        assert torch.equal(a, b)


_SAC_FIRST_CALL = """
import functools, torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy
import mfsdp_ext

def policy(ctx, func, *args, **kwargs):  # torchtitan's kind: keep matmul outputs, recompute the rest
    if func in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE

torch.manual_seed(0)
block = nn.Sequential(nn.Linear(64, 96, bias=False), nn.ReLU(), nn.Linear(96, 64, bias=False)).to(torch.bfloat16)
mfsdp_ext.to_fp8_linear(block)
x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
y = checkpoint(block, x, use_reentrant=False,
               context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
y.float().sum().backward()
x2 = x.detach().requires_grad_(True)
block(x2).float().sum().backward()
assert torch.equal(x.grad, x2.grad)
print("ok")
"""


def test_selective_checkpointing_around_the_first_call():
    """torch's selective activation checkpointing (torchtitan's default) replays the ops of the forward in order at
    recompute: the first FP8 layer call of a process (a fresh interpreter) must not show it the one-time CPU probe
    of torch._scaled_mm, whose 16 x 16 outputs would otherwise stand in for the layer's at recompute."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SAC_FIRST_CALL], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
