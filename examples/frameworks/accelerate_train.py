"""HuggingFace accelerate's FSDP2 plugin on PyTorch FSDP2 or on mfsdp_ext: the same script, ``--impl fsdp2|ours``.

    torchrun --nproc-per-node 2 examples/frameworks/accelerate_train.py --impl ours [--steps 6] [--accum 2]
        [--no-tied] [--cpu-offload] [--ram-efficient] [--save-at K --ckpt DIR] [--load DIR --resume-step K]
        [--metrics PATH]

A LlamaForCausalLM from a LlamaConfig (tie_word_embeddings=True by default: accelerate then shards
[final norm, input embedding, output embedding] as one list unit), Accelerator(fsdp_plugin=
FullyShardedDataParallelPlugin(fsdp_version=2, ...)) with the decoder layers as units and sharded checkpoints, AdamW,
accelerator.accumulate / backward / clip_grad_norm_, accelerator.save_state / load_state. Batches are a function of
(step, microbatch, rank), so a resumed run sees the data of the uninterrupted one. --cpu-offload: the plugin's
cpu_offload=True, which accelerate turns into torch's CPUOffloadPolicy() (pin_memory=True) for every fully_shard call;
rank 0 prints the policy the plugin passes ("offload_policy: ...").

The switch is one line before the model is prepared: ``mfsdp_ext.use_as_fsdp2()`` (accelerate looks
torch.distributed.fsdp.fully_shard up when it shards the model).

CPU ONLY (2 gloo ranks; FSDP2 needs it as much as ours): Accelerator(cpu=True), and accelerate enables FSDP only
for GPU-like backends (AcceleratorState leaves MULTI_CPU alone): AcceleratorState.__init__ is wrapped to switch
MULTI_CPU to FSDP when an fsdp_plugin is given, as it does for MULTI_GPU. With --cpu-offload, for FSDP2 only:
FSDP2 pins the offloaded shards of CPUOffloadPolicy() (pin_memory=True), and pinning needs an accelerator ("Cannot
access accelerator device when none is available" at fully_shard): the policy the plugin makes of cpu_offload=True is
CPUOffloadPolicy(pin_memory=False) for FSDP2 on CPU. Ours takes accelerate's policy as it is (on a CPU mesh the
parameters are in host memory already: pin_memory is not used).
"""

from __future__ import annotations

import argparse

import torch
from hf_llama import batch, build_model, exit_now, fsdp_units, log_step  # this script's folder


def cpu_only_enable_fsdp() -> None:
    """CPU ONLY: what accelerate does for GPUs (DistributedType.FSDP when an fsdp_plugin is given), on MULTI_CPU."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        plugin = fsdp_plugin if fsdp_plugin is not None else self.__dict__.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if fsdp_plugin is not None and self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin

    AcceleratorState.__init__ = __init__


def cpu_only_unpinned_offload() -> None:
    """CPU ONLY, for FSDP2: the CPUOffloadPolicy() that the plugin makes of cpu_offload=True (accelerate's option, the
    Trainer's "offload", accelerate launch's --fsdp_offload_params) without pinning, which needs an accelerator."""
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    set_cpu_offload = FullyShardedDataParallelPlugin.set_cpu_offload

    def unpinned(self):
        set_cpu_offload(self)
        if isinstance(self.cpu_offload, CPUOffloadPolicy) and self.cpu_offload.pin_memory:
            self.cpu_offload = CPUOffloadPolicy(pin_memory=False)

    FullyShardedDataParallelPlugin.set_cpu_offload = unpinned


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["fsdp2", "ours"], default="ours")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--tied", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--cpu-offload", action="store_true",
                    help="the plugin's cpu_offload=True: fully_shard(..., offload_policy=CPUOffloadPolicy())")
    ap.add_argument("--ram-efficient", action="store_true",
                    help="cpu_ram_efficient_loading=True: accelerate shards the model on the meta device, then "
                         "broadcasts rank 0's weights and load_state_dict(..., assign=True)")
    ap.add_argument("--save-at", type=int, default=0, help="accelerator.save_state(--ckpt) after this step")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--load", default="", help="accelerator.load_state(DIR) before training")
    ap.add_argument("--resume-step", type=int, default=0, help="steps already done by the loaded checkpoint")
    ap.add_argument("--metrics", default="")
    args = ap.parse_args()

    if args.impl == "ours":
        import mfsdp_ext

        mfsdp_ext.use_as_fsdp2()  # THE SWITCH: accelerate's fully_shard is mfsdp_ext's from here on
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    cpu = not torch.cuda.is_available()
    if cpu:
        cpu_only_enable_fsdp()
        if args.impl == "fsdp2":
            cpu_only_unpinned_offload()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=args.ram_efficient,
        cpu_offload=args.cpu_offload)
    acc = Accelerator(cpu=cpu, fsdp_plugin=plugin, gradient_accumulation_steps=args.accum)
    assert acc.is_fsdp2, acc.distributed_type
    model = build_model(tied=args.tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = acc.prepare(model, opt)
    acc.print(f"[{args.impl}] units: {fsdp_units(model)}")
    acc.print(f"[{args.impl}] offload_policy: {acc.state.fsdp_plugin.cpu_offload!r}")  # what fully_shard was given
    if args.load:
        acc.load_state(args.load)
    rank = acc.process_index
    for step in range(args.resume_step + 1, args.steps + 1):
        losses = []
        for micro in range(args.accum):
            ids = batch(step, micro, rank).to(acc.device)
            with acc.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                losses.append(loss.detach())
                if acc.sync_gradients:
                    grad_norm = acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        loss = acc.reduce(torch.stack(losses).mean(), reduction="mean").item()
        gn = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        log_step(args.metrics, args.impl, step, loss, gn, rank)
        if args.save_at and step == args.save_at:
            acc.save_state(args.ckpt)
    acc.end_training()


if __name__ == "__main__":
    main()
    exit_now()
