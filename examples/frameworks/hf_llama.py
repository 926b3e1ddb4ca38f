"""What the accelerate, HF Trainer and Lightning examples share: a small LlamaForCausalLM built from a LlamaConfig
(nothing is downloaded), learnable synthetic batches that are a pure function of (step, microbatch, rank) so that a
resumed run sees exactly the data of the uninterrupted one, and the per-step metrics line."""

from __future__ import annotations

import json
import os
import sys

import torch


def build_model(tied: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(seed)  # the same initial weights on every rank and in every run
    return LlamaForCausalLM(cfg)


def batch(step: int, micro: int, rank: int, bs: int = 4, seq: int = 32, vocab: int = 512) -> torch.Tensor:
    """Each row an arithmetic progression mod vocab (random start and stride): a model can learn it."""
    g = torch.Generator().manual_seed(1000003 * step + 1009 * micro + rank)
    start = torch.randint(0, vocab, (bs, 1), generator=g)
    stride = torch.randint(1, 8, (bs, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


class SyntheticDataset(torch.utils.data.Dataset):
    """Rows of ``batch`` for frameworks that own the data loader."""

    def __init__(self, n: int = 512, seq: int = 32, as_dict: bool = True):
        self.n, self.seq, self.as_dict = n, seq, as_dict

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = batch(i, 0, 0, bs=1, seq=self.seq)[0]
        return {"input_ids": ids, "labels": ids.clone()} if self.as_dict else ids


def log_step(path: str, impl: str, step: int, loss: float, grad_norm: float, rank: int) -> None:
    if rank == 0:
        print(f"[{impl}] step {step} loss {loss:.9f} grad_norm {grad_norm:.9f}", flush=True)
    if path:
        with open(f"{path}.rank{rank}", "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": grad_norm, "impl": impl}) + "\n")


def fsdp_units(model) -> list[str]:
    """The modules FSDP2 (or mfsdp_ext, which is FSDP2's class too) made units of."""
    from torch.distributed.fsdp import FSDPModule

    return [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]


def exit_now(code: int = 0) -> None:
    """Leave without C++ static destructors: gloo on torch 2.13 sometimes aborts in one at exit ("terminate called
    without an active exception"), with FSDP2 as with ours, after the work is done."""
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
