"""DCP checkpoints of a training job, written as torchtitan writes them for FSDP2, and resume from the latest one.

A checkpoint is the folder ``<ckpt-dir>/step-<N>``: one ``torch.distributed.checkpoint`` save of the model and
optimizer state (``get_state_dict``: sharded DTensors, each rank writes its shards), the learning-rate scheduler and
the step. That is the whole training state of the example jobs: their data are a function of the step
(training.MarkovCorpus.batch) and they draw no random numbers after initialisation (no dropout), so a resumed run
repeats an uninterrupted one bit for bit. DCP writes ``.metadata`` last, once every rank's shards are written: a
folder without it is a save that was interrupted, and resume passes over it.
"""

from __future__ import annotations

import os
import re
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_STEP_DIR = re.compile(r"step-(\d+)")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def latest(root: str) -> tuple[int, str] | None:
    """(step, folder) of the newest complete checkpoint under ``root``, or None."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _STEP_DIR.fullmatch(name)
        if m and os.path.exists(os.path.join(root, name, ".metadata")):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return max(found) if found else None


def _state(model, optimizer, scheduler, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "train": {"step": step, "scheduler": scheduler.state_dict()}}


def save(root: str, step: int, model, optimizer, scheduler) -> tuple[str, float]:
    """Collective. Returns (folder, seconds)."""
    t0 = time.perf_counter()
    path = step_dir(root, step)
    dcp.save(_state(model, optimizer, scheduler, step), checkpoint_id=path)
    dist.barrier()  # every rank returns once the checkpoint is complete
    return path, time.perf_counter() - t0


def load(path: str, model, optimizer, scheduler) -> int:
    """Collective: loads ``path`` into the model, optimizer and scheduler in place; returns its step."""
    state = _state(model, optimizer, scheduler, step=-1)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["train"]["scheduler"])
    return int(state["train"]["step"])

