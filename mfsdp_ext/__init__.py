"""mfsdp_ext: fully sharded data parallel (ZeRO) for PyTorch, a drop-in for FSDP2's ``fully_shard``."""

from . import optim  # mfsdp_ext.optim.AdamW / SGD: flat fused optimizers
from .api import fully_shard, microbatch, register_fsdp_forward_method, reset_parameters, share_comm_ctx
from .as_fsdp2 import use_as_fsdp2
from .core.mixed_precision import Fp8Policy, MixedPrecisionPolicy
from .core.states import Strategy
from .fp8.linear import Fp8Linear, Fp8LinearConfig, to_fp8_linear
from .graphs import graphed
from .runtime.finite_grads import NonFiniteGradError
from .runtime.module import FsdpModule
from .sharding.marks import no_shard


def build_info() -> dict:
    """What the native extension was built with.

    Returns:
        a dict: ``native``, ``cpu``, ``cuda``, ``cuda_arch``, ``fp8_gemm``, ``nccl``, ``nccl_version``, ``build``
        (ahead-of-time or just-in-time) and ``path``.
    """
    from . import _native

    return _native.build_info()


__all__ = ["optim", "fully_shard", "microbatch", "register_fsdp_forward_method", "no_shard", "reset_parameters",
           "MixedPrecisionPolicy", "Fp8Policy", "FsdpModule", "Strategy", "Fp8Linear", "Fp8LinearConfig",
           "to_fp8_linear", "build_info", "NonFiniteGradError", "use_as_fsdp2",
           "graphed", "share_comm_ctx"]
__version__ = "0.1.0"
