"""torchtitan 0.3.0 configs for torchtitan_train.py (``--module titan_configs --config NAME``).

Each starts from torchtitan's own config and changes only what is listed; the model, its FSDP wrapping (blocks, the
[norm, lm_head] list unit, the root), ChunkedLossWrapper, AdamW, the warm-up + linear-decay LR schedule, clipping
(max_norm 1.0) and the DCP CheckpointManager stay torchtitan's.

  llama3_debug_cpu     torchtitan's llama3_debugmodel, fp32, seq 256, local batch 2, global batch 8 (so 2 ranks
                       accumulate 2 microbatches), 4 steps, checkpoint interval 2
  llama3_debug_pp_cpu  llama3_debug_cpu on 4 ranks: pipeline parallel 2 (2 ranks of FSDP per stage) without activation
                       checkpointing (torchtitan's zero-bubble schedules refuse it: their split backward runs a
                       checkpointed region twice); the schedule by --parallelism.pipeline_parallel_schedule
  llama3_debug_pp_zb_cpu  the same with the plain cross-entropy loss, for the zero-bubble schedules: torchtitan's
                       chunked loss runs a backward of its own inside the loss, which their split backward does not see
                       (with FSDP2 the final norm is left without a gradient)
  qwen3_moe_debug_cpu  torchtitan's qwen3_moe_debug (no expert parallel), the same settings with 2 of its 8 layers,
                       8 experts of its 64, top 2 of its 8 (its 300 M parameters and 8 experts per token make a CPU
                       step slow) and seq 128, 2 steps
  llama3_debug_gpu     torchtitan's llama3_debugmodel in bf16 (its default policy), seq 2048, local batch 2, 4 steps,
                       checkpoint interval 2: the GPU checkpoint-resume check (benchmarks/titan_resume_check.py)
  qwen3_moe_debug_gpu  the same with torchtitan's qwen3_moe_debug (all 8 layers)
  llama3_8b_gpu        torchtitan's llama3_8b: the 8B shape, seq 8192, bf16 compute (torchtitan's default policy),
                       selective activation checkpointing, with TITAN_LAYERS layers (default 8) so that it fits
                       2 GPUs' memory with room for both implementations' peaks; no checkpoints, 10 steps;
                       TITAN_AC=full: full activation checkpointing of each block instead of torchtitan's selective
                       one (which saves every other matmul output: mfsdp_ext's FP8 GEMMs are native kernels it does
                       not see, so under it they are all recomputed)
  llama3_8b_pp_gpu     llama3_8b_gpu on 4 GPUs with pipeline parallel 2 (2 ranks of FSDP per stage): local batch
                       TITAN_PP_BATCH (default 4) in microbatches of 1 (a schedule needs at least as many microbatches
                       as stages); the schedule by --parallelism.pipeline_parallel_schedule. torchtitan itself turns
                       its CUDA graphs off under pipeline parallel
  qwen3_moe_gpu        torchtitan's qwen3_30b_a3b (dim 2048, 128 experts, top 8, vocab 151936), seq 4096, local batch
                       1, bf16 compute, its full activation checkpointing, with TITAN_LAYERS of its 48 layers (default
                       4); no checkpoints, 10 steps; expert parallel by --parallelism.expert_parallel_degree

Changes for every config:
  * local assets (titan_assets.py: a 2000-token tokenizer and a small corpus; TITAN_ASSETS names the folder)
  * attention: torchtitan's ScaledDotProductAttention in place of FlexAttention. Needed on CPU (FlexAttention has no
    CPU backward); on GPU it avoids compiling FlexAttention's kernels (no network, and the same attention for both
    implementations). torchtitan refuses attn_backend="sdpa" for language models, so the built config is edited.
  * parallelism.spmd_backend = "partial_dtensor": the default "spmd_types" makes FSDP2 itself fail at fully_shard on
    torch 2.13 (and ours, with the same cause: plain tensors given with dp_mesh_dims); "full_dtensor" works for
    both (--parallelism.spmd_backend full_dtensor)
  * no validator, fixed seed, log every step, no tensorboard
  * torchtitan's CUDA graph of forward + backward stays on (its default; on the CPU it runs eagerly, but zero_grad
    still keeps the gradients, zeroed in place, as under the graph), except under pipeline parallel, which torchtitan
    refuses it with, and the MoE configs (expert parallel); --training.disable_cuda_graphs turns it off
  * TITAN_FLOAT8=rowwise (GPU) or emulate (CPU, eager only): torchtitan's float8 converter (torchao's Float8Linear)
    on the linear layers, as torchtitan's *_float8 configs apply it
  * torch < 2.12 (the GPU image's 2.11): the plain cross-entropy loss in place of torchtitan's ChunkedLossWrapper
    (FSDP2 itself fails there in backward, "data is not allocated yet": torchtitan 0.3.0 targets torch >= 2.12)
  * TITAN_DUMP names the dump folder (checkpoints: TITAN_DUMP/checkpoint/step-N)
"""

from __future__ import annotations

import os

import torch
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = tuple(int(x) for x in torch.__version__.split(".")[:2])


def _use_sdpa(model_cfg) -> None:
    n = 0
    for layer in model_cfg.layers:
        if isinstance(layer.attention.inner_attention, FlexAttention.Config):
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
            n += 1
    assert n > 0, "no FlexAttention found to replace"


def _common(config, *, seq_len: int, local_batch_size: int, steps: int):
    _use_sdpa(config.model_spec.model)
    assets = os.environ.get("TITAN_ASSETS", os.path.join(HERE, "assets"))
    config.hf_assets_path = os.path.join(assets, "tokenizer")
    config.dataloader.dataset = "c4_test"
    config.dataloader.dataset_path = os.path.join(assets, "c4_test")
    config.training.seq_len = seq_len
    config.training.local_batch_size = local_batch_size
    config.training.steps = steps
    if _TORCH < (2, 12):  # FSDP2 of torch 2.11 fails in backward under torchtitan 0.3.0's chunked loss: plain CE
        config.loss = config.loss.loss_fn
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.enable = False
    config.debug.seed = 42
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False
    config.dump_folder = os.environ.get("TITAN_DUMP", os.path.join(HERE, "outputs", "titan"))
    float8 = os.environ.get("TITAN_FLOAT8")
    if float8:
        _float8(config, float8)
    return config


def _float8(config, recipe: str) -> None:
    """torchtitan's float8 converter (torchao's Float8Linear) on the model's linear layers, as its *_float8 configs
    apply it: recipe "rowwise" (GPU, SM89+) or "emulate" (its CPU path: float8 rounding emulated, not with compile)."""
    from torchtitan.components.quantization import Float8LinearConverter

    converter = Float8LinearConverter.Config(emulate=recipe == "emulate", model_compile_enabled=recipe != "emulate",
                                             **({} if recipe == "emulate" else {"recipe_name": recipe}))
    config.model_spec.model = converter.build().convert(config.model_spec.model)


def _cpu(config, steps: int):
    config = _common(config, seq_len=256, local_batch_size=2, steps=steps)
    config.training.mixed_precision_param = "float32"  # fp32 compute: the CPU comparison is exact to 1e-5
    config.checkpoint.interval = 2
    config.checkpoint.last_save_model_only = False
    return config


def llama3_debug_cpu():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = _cpu(llama3_debugmodel(), steps=4)
    config.training.global_batch_size = 8  # gradient accumulation: 8 / (2 per rank x 2 ranks) = 2 microbatches
    return config


def llama3_debug_pp_cpu():
    config = llama3_debug_cpu()
    config.parallelism.pipeline_parallel_degree = 2
    config.training.disable_cuda_graphs = True  # torchtitan refuses its CUDA graphs with pipeline parallel
    config.activation_checkpoint = None
    return config


def llama3_debug_pp_zb_cpu():
    config = llama3_debug_pp_cpu()
    config.loss = config.loss.loss_fn  # the plain cross-entropy: see the docstring
    return config


def qwen3_moe_debug_cpu():
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = _no_graphs_with_experts(_cpu(qwen3_moe_debug(), steps=2))
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    config.training.seq_len = 128
    for layer in config.model_spec.model.layers:
        _fewer_experts(layer.moe, num_experts=8, top_k=2)
    return config


def _fewer_experts(moe, *, num_experts: int, top_k: int) -> None:
    """Route among ``num_experts`` experts, ``top_k`` per token: set wherever the MoE config repeats those numbers."""
    routed, router = moe.routed_experts, moe.router
    moe.num_experts = routed.inner_experts.num_experts = routed.token_dispatcher.num_experts = num_experts
    router.num_experts = router.gate.out_features = num_experts
    routed.token_dispatcher.top_k = router.top_k = top_k


def _debug_gpu(config):
    """A debug model on GPU for checkpoint resume (benchmarks/titan_resume_check.py): bf16 compute (torchtitan's
    default policy), seq 2048, 4 steps, checkpoint interval 2 with the optimizer state."""
    config = _common(config, seq_len=2048, local_batch_size=2, steps=4)
    config.checkpoint.interval = 2
    config.checkpoint.last_save_model_only = False
    return config


def llama3_debug_gpu():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return _debug_gpu(llama3_debugmodel())


def qwen3_moe_debug_gpu():
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    return _no_graphs_with_experts(_debug_gpu(qwen3_moe_debug()))


def _gpu(config, *, seq_len: int, default_layers: int):
    """A benchmark run on GPU: TITAN_LAYERS of the model's layers, 10 steps, no profiler, no checkpoints."""
    config = _common(config, seq_len=seq_len, local_batch_size=1, steps=10)
    model = config.model_spec.model
    model.layers = model.layers[: int(os.environ.get("TITAN_LAYERS", str(default_layers)))]
    config.profiler.enable_profiling = False
    config.checkpoint.enable = False
    return config


def llama3_8b_gpu():
    from torchtitan.models.llama3.config_registry import llama3_8b

    config = _gpu(llama3_8b(), seq_len=8192, default_layers=8)
    if os.environ.get("TITAN_AC", "selective") == "full":
        from torchtitan.distributed.activation_checkpoint import FullAC

        config.activation_checkpoint = FullAC.Config()
    return config


def llama3_8b_pp_gpu():
    config = llama3_8b_gpu()
    config.parallelism.pipeline_parallel_degree = 2
    config.training.disable_cuda_graphs = True  # torchtitan refuses its CUDA graphs with pipeline parallel
    config.parallelism.pipeline_parallel_microbatch_size = 1
    config.training.local_batch_size = int(os.environ.get("TITAN_PP_BATCH", "4"))
    return config


def qwen3_moe_gpu():
    from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b

    return _no_graphs_with_experts(_gpu(qwen3_30b_a3b(), seq_len=4096, default_layers=4))


def _no_graphs_with_experts(config):
    """The MoE configs run with expert parallel, where torchtitan refuses its CUDA graphs with the default token
    dispatcher (it synchronises with the host): off."""
    config.training.disable_cuda_graphs = True
    return config
