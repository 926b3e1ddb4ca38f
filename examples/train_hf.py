"""Train a HuggingFace causal LM (``LlamaForCausalLM``) with fully sharded data parallelism: mfsdp_ext or FSDP2.

    torchrun --nproc-per-node 2 examples/train_hf.py                          # CPU / gloo, tiny Llama, fp32
    torchrun --nproc-per-node 2 examples/train_hf.py --impl fsdp2             # the same job on PyTorch FSDP2
    torchrun --nproc-per-node 2 examples/train_hf.py --activation-checkpointing
    torchrun --nproc-per-node 8 examples/train_hf.py --model-config config.json   # GPUs, bf16, any Llama config

The model is built from a ``LlamaConfig`` (nothing is downloaded): a tiny one on CPU, a ~0.4 B one on GPU, or the
``config.json`` given. Every rank builds the whole model from one seed, then each decoder layer and finally the
root (embeddings, final norm, LM head) go under ``fully_shard``, exactly where FSDP2 users put them. Compute is
bf16 on GPU (fp32 master weights, fp32 gradient reduction) and fp32 on CPU. ``--activation-checkpointing`` uses
HuggingFace's own ``gradient_checkpointing_enable``; ``--compile`` compiles each decoder layer with
``torch.compile``. Training, progress lines, summary and checkpoints are the main job's (examples/training.py).
"""

from __future__ import annotations

import argparse
import functools
import os
import warnings

import torch
import torch.nn.functional as F
import training  # examples/training.py (this script's folder): the training loop, data, checkpoints

from mfsdp_ext.testing import gpt  # process group set-up and the FSDP glue

warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")

# LlamaConfig fields, and the run defaults (micro-batch per rank, sequence length, learning rate), per device
CONFIGS = {
    "cpu": (dict(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256), (8, 128, 3e-3)),
    "cuda": (dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048), (4, 1024, 6e-4)),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=gpt.IMPLS, default="ours", help="ours = mfsdp_ext, fsdp2 = PyTorch FSDP2")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--model-config", help="a LlamaConfig JSON file (e.g. a model's config.json); default: built in")
    p.add_argument("--attn-implementation", default="sdpa", help="HuggingFace's attn_implementation (sdpa, eager)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute dtype; master weights and gradient reduction stay fp32. auto: bf16 on GPU, fp32 on "
                        "CPU")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (under fully_shard)")
    training.add_args(p)
    args = p.parse_args(argv)
    training.check_args(p, args)
    if args.model_config and not os.path.isfile(args.model_config):
        p.error(f"--model-config {args.model_config}: no such file")
    return args


def llama_config(args, device: torch.device):
    try:
        from transformers import LlamaConfig
    except ImportError as exc:
        raise SystemExit(f"train_hf.py needs HuggingFace transformers ({exc}): pip install transformers") from exc

    fields, (batch, seq, lr) = CONFIGS[device.type]
    if args.model_config:
        config = LlamaConfig.from_json_file(args.model_config)
    else:
        config = LlamaConfig(**fields)
    config._attn_implementation = args.attn_implementation
    config.use_cache = False
    args.batch_size = args.batch_size or batch
    args.seq_len = args.seq_len or seq
    args.lr = args.lr or lr
    if args.seq_len > config.max_position_embeddings:
        raise SystemExit(f"--seq-len {args.seq_len} > the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    return config


def flops_per_token(c, seq_len: int) -> float:
    """Training FLOPs per token (fwd + bwd = 3x fwd): 6 * matmul parameters + causal attention."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    per_layer = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    matmul = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size
    return 6 * matmul + 3 * c.num_hidden_layers * 2 * seq_len * c.hidden_size


def compile_layers(model) -> None:
    """torch.compile every decoder layer's forward; the FSDP hooks around it stay eager, as in torchtitan."""
    for layer in model.model.layers:
        layer.forward = _explain_failure(torch.compile(layer.forward))


def _explain_failure(compiled):
    """torch.compile fails lazily, at the first call, from deep inside dynamo: say what failed and what to do."""

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise SystemExit(f"--compile: torch {torch.__version__} could not compile a decoder layer under "
                             f"fully_shard ({type(exc).__name__}: {first}); run without --compile") from exc

    return forward


def build_model(args, device: torch.device, mesh):
    from transformers import LlamaForCausalLM

    config = llama_config(args, device)
    compute_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32,
                     "auto": torch.bfloat16 if device.type == "cuda" else torch.float32}[args.dtype]
    fully_shard, MixedPrecisionPolicy = gpt.load_impl(args.impl)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)

    torch.manual_seed(args.seed)  # the same full model on every rank; fully_shard keeps each rank's rows
    with torch.device(device):
        model = LlamaForCausalLM(config)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if args.compile:
        compile_layers(model)
    return model, config, compute_dtype


def lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (the targets are the inputs shifted by one already)."""
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(args, device: torch.device, mesh) -> list[float]:
    model, config, compute_dtype = build_model(args, device, mesh)
    describe = [f"model=LlamaForCausalLM {gpt.num_params(model) / 1e6:.2f}M params "
                f"(hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} "
                f"heads / {config.num_key_value_heads} kv, ffn {config.intermediate_size}, vocab "
                f"{config.vocab_size}, attn {config._attn_implementation}; {args.model_config or 'built-in config'})",
                f"compute={compute_dtype} master=fp32 reduce=fp32 activation_checkpointing="
                f"{args.activation_checkpointing} compile={args.compile}"]
    return training.run(model, args, device, impl=args.impl, vocab_size=config.vocab_size,
                        flops_per_token=flops_per_token(config, args.seq_len), describe=describe, loss_fn=lm_loss)


def main(argv=None) -> None:
    gpt.run_distributed(train, parse_args(argv))


if __name__ == "__main__":
    main()
