"""examples/train_hf.py: a HuggingFace LlamaForCausalLM under our fully_shard trains exactly as under FSDP2.

Both run the example's own training (train_hf.train: the built-in tiny config, fp32 on CPU, 10 steps of AdamW with
warm-up and clipping) on the 2 gloo ranks of a pool, with HuggingFace's activation checkpointing off and on.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.conftest import get_pool, load_script_modules

STEPS = 10


def _case_train_hf(impl: str, checkpointing: bool) -> dict:
    """This rank's losses, and how often a decoder layer's MLP started a forward per step (2 with checkpointing)."""
    train_hf = load_script_modules("examples", "checkpointing", "training", "train_hf")[-1]
    argv = ["--impl", impl, "--device", "cpu", "--steps", str(STEPS), "--log-every", "5"]
    args = train_hf.parse_args(argv + (["--activation-checkpointing"] if checkpointing else []))
    calls = []
    # a pre-hook: checkpointing's recomputation stops as soon as it has what backward needs, before post-hooks
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, _: calls.append(1) if type(module).__name__ == "LlamaMLP" else None)
    try:
        losses = train_hf.train(args, torch.device("cpu"), init_device_mesh("cpu", (dist.get_world_size(),)))
    finally:
        hook.remove()
    layers = train_hf.CONFIGS["cpu"][0]["num_hidden_layers"]
    return {"losses": losses, "mlp_forwards_per_layer_step": len(calls) / (layers * STEPS)}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ac", "ac"])
def test_train_hf_matches_fsdp2(checkpointing):
    pytest.importorskip("transformers")
    pool = get_pool(2)
    ours = pool.run(_case_train_hf, "ours", checkpointing)[0]
    fsdp2 = pool.run(_case_train_hf, "fsdp2", checkpointing)[0]
    errs = [abs(a - b) / abs(b) for a, b in zip(ours["losses"], fsdp2["losses"])]
    print({"ours": ours, "fsdp2": fsdp2, "max_rel_err": max(errs)})
    assert len(ours["losses"]) == len(fsdp2["losses"]) == STEPS
    assert max(errs) <= 1e-5, errs
    assert ours["losses"][-1] < ours["losses"][0] - 0.5, ours["losses"]  # it learns
    want = 2.0 if checkpointing else 1.0  # checkpointing recomputes each layer's forward in backward
    assert ours["mlp_forwards_per_layer_step"] == fsdp2["mlp_forwards_per_layer_step"] == want
