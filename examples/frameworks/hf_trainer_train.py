"""The HuggingFace Trainer with FSDP2, on PyTorch FSDP2 or on mfsdp_ext: the same script, ``--impl fsdp2|ours``.

    torchrun --nproc-per-node 2 examples/frameworks/hf_trainer_train.py --impl ours --out DIR [--steps 6]
        [--accum 2] [--no-tied] [--cpu-offload fsdp|fsdp_config] [--save-steps K] [--resume DIR/checkpoint-K]
        [--metrics PATH]

A LlamaForCausalLM from a LlamaConfig (tie_word_embeddings=True by default), TrainingArguments(fsdp="full_shard
auto_wrap", fsdp_config={"version": 2, ...}) with sharded checkpoints, gradient accumulation, max_grad_norm=1.0,
AdamW with warm-up and linear decay, save_steps and trainer.train(resume_from_checkpoint=...). Per-step loss and
grad norm are the Trainer's own log (logging_steps=1). --cpu-offload: the Trainer's FSDP offload, said either way it
takes it: "fsdp" adds "offload" to the fsdp string (fsdp="full_shard offload auto_wrap"), "fsdp_config" sets
fsdp_config["cpu_offload"] = True; both become accelerate's cpu_offload=True, torch's CPUOffloadPolicy()
(pin_memory=True) for every fully_shard call. Rank 0 prints the policy accelerate passes ("offload_policy: ...").

The switch is one line before the Trainer prepares the model: ``mfsdp_ext.use_as_fsdp2()``.

CPU ONLY (2 gloo ranks; FSDP2 needs it as much as ours): use_cpu=True, and the accelerate accommodations of
accelerate_train.py: accelerate enables FSDP only for GPU-like backends; with --cpu-offload, FSDP2 (not ours) gets
CPUOffloadPolicy(pin_memory=False), since FSDP2 pins offloaded shards only with an accelerator (the Trainer has no
option for pin_memory).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from hf_llama import SyntheticDataset, build_model, exit_now, fsdp_units  # this script's folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["fsdp2", "ours"], default="ours")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--tied", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--cpu-offload", choices=["fsdp", "fsdp_config"], default=None,
                    help='the Trainer\'s FSDP offload: fsdp="full_shard offload auto_wrap" or '
                         'fsdp_config["cpu_offload"]=True')
    ap.add_argument("--save-steps", type=int, default=0)
    ap.add_argument("--resume", default=None, help="a checkpoint-N folder to resume from")
    ap.add_argument("--metrics", default="")
    args = ap.parse_args()

    if args.impl == "ours":
        import mfsdp_ext

        mfsdp_ext.use_as_fsdp2()  # THE SWITCH: the Trainer's (accelerate's) fully_shard is mfsdp_ext's
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cpu = not torch.cuda.is_available()
    if cpu:
        from accelerate_train import cpu_only_enable_fsdp, cpu_only_unpinned_offload

        cpu_only_enable_fsdp()
        if args.impl == "fsdp2":
            cpu_only_unpinned_offload()

    class StepMetrics(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                rank = int(os.environ.get("RANK", "0"))
                gn = float(logs.get("grad_norm", float("nan")))
                if rank == 0:
                    print(f"[{args.impl}] step {state.global_step} loss {logs['loss']} grad_norm {gn:.9f}",
                          flush=True)
                if args.metrics:
                    with open(f"{args.metrics}.rank{rank}", "a") as f:
                        f.write(json.dumps({"step": state.global_step, "loss": logs["loss"], "grad_norm": gn,
                                            "impl": args.impl}) + "\n")

    targs = TrainingArguments(
        output_dir=args.out, use_cpu=cpu, max_steps=args.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accum, learning_rate=1e-3, weight_decay=0.01, warmup_steps=2,
        max_grad_norm=1.0, logging_steps=1, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, save_only_model=False, report_to=[], seed=42, data_seed=42,
        dataloader_num_workers=0, disable_tqdm=True,
        fsdp="full_shard offload auto_wrap" if args.cpu_offload == "fsdp" else "full_shard auto_wrap",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True,
                     **({"cpu_offload": True} if args.cpu_offload == "fsdp_config" else {})},
    )
    trainer = Trainer(model=build_model(tied=args.tied), args=targs, train_dataset=SyntheticDataset(),
                      callbacks=[StepMetrics()])
    trainer.train(resume_from_checkpoint=args.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[{args.impl}] units: {fsdp_units(trainer.model)}", flush=True)
        # what accelerate gave every fully_shard call
        print(f"[{args.impl}] offload_policy: {trainer.accelerator.state.fsdp_plugin.cpu_offload!r}", flush=True)


if __name__ == "__main__":
    main()
    exit_now()
