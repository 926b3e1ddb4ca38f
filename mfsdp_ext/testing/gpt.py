"""A small GPT / Llama-style decoder, plus the glue that shards it with FSDP2 or mfsdp_ext.

The model: token embedding (+ learned positions, or rotary), ``n_layers`` pre-norm blocks (RMSNorm, causal
``F.scaled_dot_product_attention``, SwiGLU MLP), a final RMSNorm and an lm-head (optionally tied to the
embedding). Every module that owns parameters has ``reset_parameters()`` initialising *only its own*
parameters, so the model can be built on the meta device, sharded, materialised with ``to_empty`` and then
initialised in place (``GPT.init_weights()`` calls them all).

The glue (bottom of the file) lets the same script run PyTorch FSDP2 or our ``mfsdp_ext`` by a flag:
``load_impl("fsdp2" | "ours")`` returns the ``fully_shard`` / ``MixedPrecisionPolicy`` pair,
``shard_model`` applies ``fully_shard`` to each block and then the root, ``materialize`` initialises a
meta-built sharded model, ``build_sharded`` does one or the other path end to end, and ``grad_sync_context``
is the per-microbatch gradient-accumulation context. ``setup_distributed`` / ``teardown_distributed`` start and end
the process group in the order that lets the process exit cleanly.

Used by the examples (``examples/train_gpt.py``, ``examples/train_hf.py``, ``examples/training.py``), the benchmarks
(``benchmarks/step.py`` and others) and ``scripts/graph_probe.py``: ``from mfsdp_ext.testing import gpt``.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import gc
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    n_layers: int = 4
    dim: int = 256
    n_heads: int = 4
    n_kv_heads: int = 0  # grouped-query attention: heads of K and V (0: n_heads)
    ffn_dim: int = 0  # 0: Llama's rule, ~8/3 * dim rounded up to a multiple of 256
    vocab_size: int = 32000
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    rope: bool = True  # False: learned absolute positions
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    activation_checkpointing: bool = False
    ac_every: int = 1  # with activation_checkpointing: blocks 0, ac_every, 2 * ac_every, ... are checkpointed
    ac_skip_last: int = 0  # ... except the last ac_skip_last blocks (memory spent on less recomputation)

    def __post_init__(self) -> None:
        if self.ac_every < 1:
            raise ValueError(f"ac_every must be >= 1, got {self.ac_every}")
        if self.ac_skip_last < 0:
            raise ValueError(f"ac_skip_last must be >= 0, got {self.ac_skip_last}")
        if self.ffn_dim <= 0:
            self.ffn_dim = 256 * math.ceil(int(8 * self.dim / 3) / 256)
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.rope and (self.dim // self.n_heads) % 2:
            raise ValueError("rotary embeddings need an even head dimension")

    def checkpointed(self, block: int) -> bool:
        """Whether block number `block` recomputes its activations in backward."""
        return (self.activation_checkpointing and block % self.ac_every == 0
                and block < self.n_layers - self.ac_skip_last)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


# Presets used by train_gpt.py (--model) and as a reference for sizes.
PRESETS: dict[str, dict] = {
    # ~1 M parameters: 2 ranks on 2 CPU cores run tens of steps in about a minute
    "tiny": dict(n_layers=4, dim=128, n_heads=4, ffn_dim=384, vocab_size=512, max_seq_len=256),
    # ~30 M parameters
    "small": dict(n_layers=6, dim=512, n_heads=8, ffn_dim=1536, vocab_size=8192, max_seq_len=1024),
    # ~0.5 B parameters: the GPU default
    "medium": dict(n_layers=16, dim=1536, n_heads=12, ffn_dim=4096, vocab_size=32000, max_seq_len=2048),
    # ~1.3 B parameters
    "large": dict(n_layers=24, dim=2048, n_heads=16, ffn_dim=5632, vocab_size=32000, max_seq_len=2048),
}


# --------------------------------------------------------------------------------------------------------
# Modules. Each reset_parameters() touches only the module's own parameters (works on DTensor parameters).


class Linear(nn.Linear):
    """Bias-free linear layer initialised N(0, init_std)."""

    def __init__(self, in_features: int, out_features: int, init_std: float = 0.02, device=None) -> None:
        self.__dict__["init_std"] = init_std  # read by reset_parameters(), which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=False, device=device)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class Embedding(nn.Embedding):
    """Embedding initialised N(0, init_std)."""

    def __init__(self, num_embeddings: int, dim: int, init_std: float = 0.02, device=None) -> None:
        self.__dict__["init_std"] = init_std
        super().__init__(num_embeddings, dim, device=device)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); cos/sin: (seq, 1, head_dim // 2); "rotate half" convention.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = Linear(cfg.dim, cfg.dim, cfg.init_std, device)
        self.wk = Linear(cfg.dim, kv_dim, cfg.init_std, device)
        self.wv = Linear(cfg.dim, kv_dim, cfg.init_std, device)
        self.wo = Linear(cfg.dim, cfg.dim, out_std, device)

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism (tensor_parallel below) the projections hold this rank's heads only
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if rope is not None:
            cos, sin = rope
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None) -> None:
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.w1 = Linear(cfg.dim, cfg.ffn_dim, cfg.init_std, device)  # gate
        self.w3 = Linear(cfg.dim, cfg.ffn_dim, cfg.init_std, device)  # up
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, out_std, device)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm decoder block: the unit that fully_shard wraps."""

    def __init__(self, cfg: GPTConfig, device=None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.attn = Attention(cfg, device)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.mlp = SwiGLU(cfg, device)
        # Checkpointing happens *inside* forward, so FSDP hooks on this module stay outside the checkpointed
        # region (the order torchtitan uses: fully_shard(checkpoint_wrapper(block))).
        self.activation_checkpointing = cfg.activation_checkpointing

    def _forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            # no dropout, so no random state to replay; saving it would also read the CUDA generator's state, which
            # a CUDA graph capture does not allow
            return checkpoint(self._forward, x, rope, use_reentrant=False, preserve_rng_state=False)
        return self._forward(x, rope)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = Embedding(cfg.vocab_size, cfg.dim, cfg.init_std, device)
        self.pos_emb = None if cfg.rope else Embedding(cfg.max_seq_len, cfg.dim, cfg.init_std, device)
        self.layers = nn.ModuleList(Block(cfg, device) for _ in range(cfg.n_layers))
        for i, block in enumerate(self.layers):
            block.activation_checkpointing = cfg.checkpointed(i)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.dim, cfg.vocab_size, cfg.dim**-0.5, device)
        # Rotary tables are computed on first use per (seq_len, device) and cached; not buffers, so nothing
        # needs re-initialising after meta-device construction + to_empty().
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def init_weights(self) -> None:
        """Initialise every parameter in place (also after meta-device construction and ``to_empty``)."""
        self._rope_cache.clear()
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def _rope(self, seq_len: int, device: torch.device, dtype: torch.dtype):
        key = (seq_len, str(device), dtype)
        if key not in self._rope_cache:
            hd = self.cfg.head_dim
            inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
            angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
            self._rope_cache[key] = (angles.cos()[:, None, :].to(dtype), angles.sin()[:, None, :].to(dtype))
        return self._rope_cache[key]

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens: (batch, seq) int64. Returns logits, or the mean cross-entropy (fp32) if targets given."""
        _, s = tokens.shape
        if s > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s} > max_seq_len {self.cfg.max_seq_len}")
        x = self.tok_emb(tokens)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(s, device=tokens.device))
        else:
            rope = self._rope(s, tokens.device, x.dtype)
        for layer in self.layers:
            x = layer(x, rope)
        x = self.norm(x)
        if self.lm_head is not None:
            logits = self.lm_head(x)
        else:
            logits = F.linear(x, self.tok_emb.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def num_params(model: nn.Module) -> int:
    """Parameter count of the (unsharded) model; works for sharded DTensor parameters too."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()  # DTensor.numel() is the global size
    return n


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token (fwd + bwd = 3x fwd): 6 * matmul params + causal attention."""
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    per_layer = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim + 3 * cfg.dim * cfg.ffn_dim
    matmul = cfg.n_layers * per_layer + cfg.dim * cfg.vocab_size
    attn = cfg.n_layers * 2 * 2 * seq_len * cfg.dim / 2  # QK^T and PV, causal half
    return 6 * matmul + 3 * attn


# --------------------------------------------------------------------------------------------------------
# FSDP glue: one code path for PyTorch FSDP2 ("fsdp2") and mfsdp_ext ("ours").

IMPLS = ("fsdp2", "ours")


def load_impl(impl: str) -> tuple[Callable, type]:
    """Return (fully_shard, MixedPrecisionPolicy) of the chosen implementation (imports ours lazily)."""
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        return fully_shard, MixedPrecisionPolicy
    if impl == "ours":
        import mfsdp_ext

        return mfsdp_ext.fully_shard, mfsdp_ext.MixedPrecisionPolicy
    raise ValueError(f"unknown impl {impl!r}; choose from {IMPLS}")


def tensor_parallel(model: GPT, tp_mesh) -> GPT:
    """Megatron-style tensor parallelism of every block over ``tp_mesh`` (torchtitan's plan without sequence
    parallelism): colwise q/k/v and the MLP's gate/up, rowwise o and down. Embeddings, norms and the head stay
    whole on every tensor-parallel rank. Apply before fully_shard, which then shards over the data-parallel mesh."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    heads = (model.cfg.n_heads, model.cfg.n_kv_heads)
    if any(h % tp_mesh.size() for h in heads):
        raise ValueError(f"tensor_parallel: {tp_mesh.size()} ranks do not divide the heads {heads}")
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"attn.wq": col, "attn.wk": col, "attn.wv": col, "attn.wo": row, "mlp.w1": col, "mlp.w3": col,
            "mlp.w2": row}
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, plan)
    return model


def shard_model(model: GPT, fully_shard_fn: Callable, **kwargs) -> GPT:
    """Apply ``fully_shard`` bottom-up: each block is one unit, then the root (embeddings, norm, head)."""
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    fully_shard_fn(model, **kwargs)
    return model


def materialize(model: GPT, impl: str, device: torch.device) -> None:
    """Allocate and initialise a meta-device model after sharding (every rank initialises its shard)."""
    model.to_empty(device=device)
    if impl == "ours":
        import mfsdp_ext

        mfsdp_ext.reset_parameters(model)
        return
    model.init_weights()


def build_sharded(cfg: GPTConfig, impl: str, device: torch.device, meta_init: bool, tp_mesh=None,
                  **shard_kwargs) -> GPT:
    """A sharded GPT: built on the meta device and initialised shard by shard, or built whole on ``device`` from
    the current RNG state (the same weights on every rank for one seed) and then sharded; ``tp_mesh``: its blocks
    made tensor-parallel over it first (tensor_parallel)."""
    fully_shard_fn, _ = load_impl(impl)
    if meta_init:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg, device=device)
    if tp_mesh is not None:
        tensor_parallel(model, tp_mesh)
    shard_model(model, fully_shard_fn, **shard_kwargs)
    if meta_init:
        materialize(model, impl, device)
    return model


def setup_distributed(device_arg: str, timeout: Optional[datetime.timedelta] = None) -> torch.device:
    """init_process_group for torchrun: NCCL on this rank's GPU (device_arg "cuda", or "auto" with a GPU), else
    gloo on the CPU. Returns the rank's device."""
    # Before init_process_group: torch.distributed.nn and others that torch._dynamo imports bind
    # `group=group.WORLD` as default arguments. Imported later (torch does so lazily, e.g. at the first DTensor
    # collective) they hold the default group forever, so destroy_process_group() cannot stop gloo's worker
    # threads; one that frees a finished collective's tensors while the interpreter shuts down aborts the
    # process ("terminate called without an active exception").
    import torch._dynamo  # noqa: F401
    import torch.distributed as dist

    kwargs = {} if timeout is None else {"timeout": timeout}
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **kwargs)
    return device


def teardown_distributed(*meshes) -> None:
    """Destroy the process group so that its threads (gloo's workers, NCCL's watchdog) are joined here, while the
    interpreter is whole, and do not run on into its shutdown. That needs the groups' last references gone: call it
    after the model and optimizer are (sharded modules hold their groups in reference cycles, hence the gc), and
    pass the device meshes used: torch 2.13's mesh keeps its groups in ``_pg_registry``, and DTensor's global caches
    (sharding decisions, redistribute planners, mesh topology) keep the mesh."""
    import torch.distributed as dist

    gc.collect()
    for mesh in meshes:
        for m in (mesh, mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh):
            getattr(m, "_pg_registry", {}).clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(train: Callable, args) -> None:
    """Set up the process group, run ``train(args, device, mesh)`` and tear the group down even when it raises
    (once train() has returned, its model and optimizer are gone, so the group can really go)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = setup_distributed(args.device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    try:
        train(args, device, mesh)
    finally:
        teardown_distributed(mesh)


def forward_backward(model: nn.Module, impl: str, microbatches, loss_fn: Optional[Callable] = None) -> torch.Tensor:
    """Forward + backward of every (inputs, targets) microbatch, each loss divided by their number, gradients
    reduced on the last one. ``loss_fn(model, inputs, targets)`` gives a microbatch's mean loss (default:
    ``model(inputs, targets)``). Returns the summed loss (detached)."""
    k = len(microbatches)
    loss_sum = None
    for i, (x, y) in enumerate(microbatches):
        with grad_sync_context(model, impl, i, k):
            loss = (model(x, y) if loss_fn is None else loss_fn(model, x, y)) / k
            loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    return loss_sum


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grad_sync_context(model: nn.Module, impl: str, index: int, count: int):
    """Context for microbatch ``index`` of ``count``: gradients are reduced only on the last one."""
    is_first, is_last = index == 0, index == count - 1
    if count > 1:  # both: keep unsharded grads locally until the last microbatch (FSDP2's no-sync idiom)
        model.set_requires_gradient_sync(is_last)
    if impl == "ours":
        import mfsdp_ext

        return mfsdp_ext.microbatch(model, is_first=is_first, is_last=is_last)
    return contextlib.nullcontext()


def parse_kv(items) -> dict:
    """["a=1,b=auto", ...] or "a=1,b=auto" -> {"a": 1, "b": "auto"} (values parsed as Python literals when
    possible): the --extra-ours keyword arguments of train_gpt.py and step.py."""
    out = {}
    for item in [items] if isinstance(items, str) else items:
        for kv in item.split(","):
            if not kv:
                continue
            key, _, val = kv.partition("=")
            try:
                out[key.strip()] = ast.literal_eval(val)
            except (ValueError, SyntaxError):
                out[key.strip()] = val
    return out
