"""Lightning's ModelParallelStrategy with a LightningModule whose configure_model calls fully_shard, on PyTorch FSDP2
or on mfsdp_ext: the same script, ``--impl fsdp2|ours``.

    torchrun --nproc-per-node 2 examples/frameworks/lightning_train.py --impl ours --out DIR [--steps 6] [--accum 2]
        [--save-at K --ckpt PATH] [--resume PATH] [--metrics PATH]
    torchrun --nproc-per-node 2 examples/frameworks/lightning_train.py --impl ours --fabric [--steps 4]

Trainer: a small LlamaForCausalLM; configure_model shards each decoder layer, then the root, on the mesh Lightning
gives (self.device_mesh["data_parallel"]) with torch's MixedPrecisionPolicy; accumulate_grad_batches,
gradient_clip_val=1.0, trainer.save_checkpoint (a distributed checkpoint) and trainer.fit(ckpt_path=...). Per optimizer
step: the rank-mean loss and the grad norm before clipping. Batches are a function of (step, microbatch, rank).
--fabric: the same model under Fabric's ModelParallelStrategy(parallelize_fn=...), gradient accumulation with
fabric.no_backward_sync (which finds the units by isinstance(m, FSDPModule)) and fabric.clip_gradients.

The switch is one line before the script imports fully_shard: ``mfsdp_ext.use_as_fsdp2()``. No CPU-only change is
needed: Lightning runs ModelParallelStrategy on accelerator="cpu" with gloo.
"""

from __future__ import annotations

import argparse
import os

ap = argparse.ArgumentParser()
ap.add_argument("--impl", choices=["fsdp2", "ours"], default="ours")
ap.add_argument("--out", default="lightning_out")
ap.add_argument("--fabric", action="store_true", help="Lightning Fabric with no_backward_sync instead of the Trainer")
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--accum", type=int, default=2)
ap.add_argument("--save-at", type=int, default=0, help="trainer.save_checkpoint(--ckpt) after this optimizer step")
ap.add_argument("--ckpt", default="")
ap.add_argument("--resume", default=None, help="trainer.fit(ckpt_path=...)")
ap.add_argument("--metrics", default="")
args = ap.parse_args()

if args.impl == "ours":
    import mfsdp_ext

    mfsdp_ext.use_as_fsdp2()  # THE SWITCH: before the imports below bind FSDP2's names

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hf_llama import SyntheticDataset, batch, build_model, exit_now, fsdp_units, log_step  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

ACCELERATOR = "cuda" if torch.cuda.is_available() else "cpu"


def shard(model, mesh):
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


class LitLlama(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build_model(tied=False)
        self._losses = []

    def configure_model(self):
        shard(self.model, self.device_mesh["data_parallel"])

    def training_step(self, _batch, idx):
        # the tokens are a function of (optimizer step, microbatch, rank), not of the loader's position, so a run
        # resumed from a checkpoint sees exactly the batches of the uninterrupted run
        ids = batch(self.trainer.global_step + 1, idx % self.trainer.accumulate_grad_batches, self.global_rank)
        loss = self.model(input_ids=ids.to(self.device), labels=ids.to(self.device)).loss
        self._losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer):
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None], 2.0)
        self._grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def on_train_batch_end(self, outputs, _batch, idx):
        if (idx + 1) % self.trainer.accumulate_grad_batches:
            return
        loss = torch.stack(self._losses).mean()
        dist.all_reduce(loss)
        self._losses = []
        log_step(args.metrics, args.impl, self.trainer.global_step, float(loss) / dist.get_world_size(),
                 self._grad_norm, self.global_rank)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class SaveAt(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, _batch, idx):
        if args.save_at and trainer.global_step == args.save_at and (idx + 1) % trainer.accumulate_grad_batches == 0:
            trainer.save_checkpoint(args.ckpt)


def train_trainer() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    L.seed_everything(42, workers=True)
    trainer = L.Trainer(
        accelerator=ACCELERATOR, devices=int(os.environ.get("LOCAL_WORLD_SIZE", "2")), num_nodes=1,
        strategy=ModelParallelStrategy(data_parallel_size=int(os.environ.get("WORLD_SIZE", "2")),
                                       tensor_parallel_size=1),
        max_steps=args.steps, accumulate_grad_batches=args.accum, gradient_clip_val=1.0,
        default_root_dir=args.out, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[SaveAt()])
    module = LitLlama()
    loader = torch.utils.data.DataLoader(SyntheticDataset(as_dict=False), batch_size=4)
    trainer.fit(module, loader, ckpt_path=args.resume)
    if trainer.global_rank == 0:
        print(f"[{args.impl}] units: {fsdp_units(module)}", flush=True)


def train_fabric() -> None:
    from lightning.fabric.strategies import ModelParallelStrategy

    fabric = L.Fabric(accelerator=ACCELERATOR, devices=int(os.environ.get("LOCAL_WORLD_SIZE", "2")),
                      strategy=ModelParallelStrategy(parallelize_fn=lambda m, mesh: shard(m, mesh["data_parallel"]),
                                                     data_parallel_size=int(os.environ.get("WORLD_SIZE", "2")),
                                                     tensor_parallel_size=1))
    fabric.launch()
    model = fabric.setup(build_model(tied=False))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    for step in range(1, args.steps + 1):
        losses = []
        for micro in range(args.accum):
            ids = batch(step, micro, fabric.global_rank).to(fabric.device)
            with fabric.no_backward_sync(model, enabled=micro < args.accum - 1):  # reduce on the last microbatch
                loss = model(input_ids=ids, labels=ids).loss
                fabric.backward(loss / args.accum)
            losses.append(loss.detach())
        grad_norm = fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss)
        log_step(args.metrics, args.impl, step, float(loss) / dist.get_world_size(),
                 float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
                 fabric.global_rank)
    if fabric.global_rank == 0:
        print(f"[{args.impl}] units: {fsdp_units(model)}", flush=True)


if __name__ == "__main__":
    train_fabric() if args.fabric else train_trainer()
    exit_now()
