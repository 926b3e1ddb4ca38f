"""Train a small GPT with fully sharded data parallelism: mfsdp_ext (``--impl ours``) or PyTorch FSDP2.

    torchrun --nproc-per-node 2 examples/train_gpt.py                     # CPU / gloo, tiny model
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 30          # all GPUs / NCCL, medium model
    torchrun --nproc-per-node 2 examples/train_gpt.py --impl fsdp2        # the same job on PyTorch FSDP2
    torchrun --nproc-per-node 2 examples/train_gpt.py --ckpt-dir ckpt --ckpt-every 20   # DCP checkpoints ...
    torchrun --nproc-per-node 2 examples/train_gpt.py --ckpt-dir ckpt --resume          # ... and resume

Read top to bottom: set up the process group, build the model (on the meta device), shard each block and then
the root with ``fully_shard``, materialise and initialise the shards, and train (examples/training.py: AdamW,
gradient accumulation, synthetic Markov-chain data, DCP checkpoints). Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import training  # examples/training.py (this script's folder): the training loop, data, checkpoints

from mfsdp_ext.testing import gpt  # the model and the FSDP glue

warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")

# Per-preset run defaults: (micro-batch size per rank, sequence length, learning rate).
RUN_DEFAULTS = {
    "tiny": (8, 128, 3e-3),
    "small": (8, 256, 1e-3),
    "medium": (4, 1024, 6e-4),
    "large": (4, 2048, 3e-4),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=gpt.IMPLS, default="ours", help="ours = mfsdp_ext, fsdp2 = PyTorch FSDP2")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--model", choices=["auto", *gpt.PRESETS], default="auto", help="auto: tiny on CPU, medium on GPU")
    p.add_argument("--n-layers", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--n-heads", type=int)
    p.add_argument("--ffn-dim", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--learned-positions", action="store_true", help="learned absolute positions instead of rotary")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute (param) dtype; master weights and gradient reduction stay fp32. auto: bf16 on GPU, "
                        "fp32 on CPU")
    p.add_argument("--meta-init", action=argparse.BooleanOptionalAction, default=True,
                   help="build on the meta device, shard, then materialise only the local shards")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--fp8", action="store_true", help="--impl ours: FP8 weights and GEMMs for the blocks' linear "
                   "layers (MixedPrecisionPolicy(fp8=Fp8Policy(compute=True)); needs bf16 compute)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="default: each implementation's own default")
    p.add_argument("--extra-ours", action="append", default=[], metavar="KEY=VAL",
                   help="extra keyword for mfsdp_ext.fully_shard, e.g. use_symm_mem=auto (repeatable)")
    training.add_args(p)
    args = p.parse_args(argv)
    training.check_args(p, args)
    if args.fp8 and (args.impl != "ours" or args.dtype == "fp32"):
        p.error("--fp8 needs --impl ours and bf16 compute (--dtype bf16, the default on GPU)")
    if args.optimizer == "fused" and args.impl != "ours":
        p.error("--optimizer fused needs --impl ours (it steps mfsdp_ext's flat shards)")
    return args


def build_model(args, device: torch.device, mesh):
    preset = args.model if args.model != "auto" else ("medium" if device.type == "cuda" else "tiny")
    overrides = {k: v for k, v in dict(n_layers=args.n_layers, dim=args.dim, n_heads=args.n_heads,
                                       ffn_dim=args.ffn_dim, vocab_size=args.vocab_size).items() if v is not None}
    batch, seq, lr = RUN_DEFAULTS[preset]
    args.batch_size = args.batch_size or batch
    args.seq_len = args.seq_len or seq
    args.lr = args.lr or lr
    cfg = gpt.GPTConfig(**{**gpt.PRESETS[preset], **overrides, "max_seq_len": max(args.seq_len, 16)},
                        tie_embeddings=args.tie_embeddings, rope=not args.learned_positions,
                        activation_checkpointing=args.activation_checkpointing)

    compute_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32,
                     "auto": torch.bfloat16 if device.type == "cuda" else torch.float32}[args.dtype]
    _, MixedPrecisionPolicy = gpt.load_impl(args.impl)
    mp_extra = {}
    if args.fp8:
        import mfsdp_ext

        mp_extra["fp8"] = mfsdp_ext.Fp8Policy(compute=True)
    shard_kwargs = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype,
                                                                  reduce_dtype=torch.float32, **mp_extra))
    if args.reshard_after_forward is not None:
        shard_kwargs["reshard_after_forward"] = args.reshard_after_forward
    if args.impl == "ours":
        shard_kwargs.update(gpt.parse_kv(args.extra_ours))

    torch.manual_seed(args.seed)  # the same full model on every rank (non-meta path shards it)
    model = gpt.build_sharded(cfg, args.impl, device, args.meta_init, **shard_kwargs)
    return model, cfg, preset, compute_dtype, shard_kwargs


def train(args, device: torch.device, mesh) -> list[float]:
    model, cfg, preset, compute_dtype, shard_kwargs = build_model(args, device, mesh)
    extra = {k: v for k, v in shard_kwargs.items() if k not in ("mesh", "mp_policy")}
    describe = [f"model={preset} {gpt.num_params(model) / 1e6:.2f}M params {cfg.to_dict()}",
                f"compute={compute_dtype} master=fp32 reduce=fp32 meta_init={args.meta_init} "
                f"activation_checkpointing={args.activation_checkpointing} fully_shard extra={extra}"]
    return training.run(model, args, device, impl=args.impl, vocab_size=cfg.vocab_size,
                        flops_per_token=gpt.flops_per_token(cfg, args.seq_len), describe=describe)


def main(argv=None) -> None:
    gpt.run_distributed(train, parse_args(argv))


if __name__ == "__main__":
    main()
