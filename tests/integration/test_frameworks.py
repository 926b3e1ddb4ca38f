"""The frameworks train and checkpoint on mfsdp_ext exactly as on FSDP2 (CPU, 2 gloo ranks).

Each test runs a framework's example under examples/frameworks/ with ``torchrun --nproc-per-node 2``, once with
``--impl fsdp2`` and once with ``--impl ours`` (the example's one-line switch, ``mfsdp_ext.use_as_fsdp2()``), and
compares the per-step fp32 losses and grad norms (relative 1e-5). Checkpoints: a run that saved at step K is
resumed by a new process; its steps after K must equal the uninterrupted run's, for ours -> ours, FSDP2 -> ours and
ours -> FSDP2. Each test skips, saying which, when its framework is not installed (scripts/install.sh installs
them on the CPU path).

The frameworks' own CPU offload options (accelerate's cpu_offload=True, the Trainer's "offload", torchtitan's
--training.enable_cpu_offload) ride on launches that are there anyway (each launch costs 30-60 s of CI): a pair or a
resumed run with offload on, compared with FSDP2's run. On CPU, offload changes no fp32 number and a checkpoint loads
offloaded or not, so an offloaded run equals the plain one. All three pass torch's CPUOffloadPolicy()
(pin_memory=True), which FSDP2 cannot pin without an accelerator: FSDP2's runs get pin_memory=False (the examples'
CPU ONLY accommodation), ours what the framework passes; _offloaded checks which policy each run was given.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

EXAMPLES = os.path.join(ROOT, "examples", "frameworks")
PROBE = os.path.join(ROOT, "tests", "integration", "framework_probe.py")
RTOL = 1e-5


_IMPORTABLE: dict = {}


@pytest.fixture(autouse=True)
def _drop_checkpoints(tmp_path):
    """After each test, its runs' folders (checkpoints and dumps: GBs for torchtitan's MoE) go; the logs and
    metrics stay. The suite then needs the disk of one test's checkpoints, not of all of them."""
    yield
    for entry in os.scandir(tmp_path):
        if entry.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)


def _needs(module: str, install: str) -> None:
    """Skip the test, saying why, when ``module`` does not import in a fresh process like the runs' (torchtitan
    0.3.0 is installed but fails to import on torch < 2.12, for one)."""
    if module not in _IMPORTABLE:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            _IMPORTABLE[module] = f"{module} is not installed"
        else:
            out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                                 timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
            _IMPORTABLE[module] = "" if out.returncode == 0 else \
                f"{module} does not import: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    if _IMPORTABLE[module]:
        pytest.skip(f"{_IMPORTABLE[module]}; install it with {install}")


def _run(tmp, name: str, script: str, *args: str, counts: bool = False, env: dict | None = None,
         timeout: int = 600, ranks: int = 2, report_rank: int = 0) -> dict:
    """torchrun of an example on ``ranks`` CPU ranks; returns its per-step metrics (of ``report_rank``) and, with
    ``counts``, the gathers and reductions per step (of every rank)."""
    metrics = os.path.join(tmp, f"{name}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    if counts:
        cmd += [PROBE, os.path.join(tmp, f"{name}.counts")]
    cmd += [os.path.join(EXAMPLES, script), *args, "--metrics", metrics]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {}),
                # this checkout's mfsdp_ext, whatever is installed (as tests/integration/test_main_job.py)
                "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    t0 = time.time()
    out = subprocess.run(cmd, cwd=tmp, env=full_env, capture_output=True, text=True, timeout=timeout)
    log = out.stdout + out.stderr
    with open(os.path.join(tmp, f"{name}.log"), "w") as f:
        f.write(log)
    assert out.returncode == 0, f"{name} failed (rc {out.returncode}):\n{log[-6000:]}"
    rows = [json.loads(line) for line in open(f"{metrics}.rank{report_rank}")]
    result = {"steps": {r["step"]: r for r in rows}, "seconds": round(time.time() - t0, 1), "log": log}
    if counts:
        result["counts"] = [json.loads(line) for line in open(os.path.join(tmp, f"{name}.counts.rank0"))]
        result["counts_per_rank"] = [[json.loads(line) for line in open(os.path.join(tmp, f"{name}.counts.rank{r}"))]
                                     for r in range(ranks)]
    print(f"{name}: {len(rows)} steps in {result['seconds']} s")
    return result


def _assert_same(ref: dict, other: dict, what: str) -> None:
    """Every step of ``other`` (a resumed run: the steps after its checkpoint) equals ``ref``'s: loss and grad norm
    within RTOL relative."""
    assert other["steps"] and set(other["steps"]) <= set(ref["steps"]), (what, sorted(other["steps"]))
    worst = 0.0
    for step, row in other["steps"].items():
        for key in ("loss", "grad_norm"):
            a, b = ref["steps"][step][key], row[key]
            rel = abs(a - b) / abs(a)
            worst = max(worst, rel)
            assert rel <= RTOL, f"{what}: step {step} {key} {b!r} vs {a!r} (rel {rel:.3g})"
    print(f"{what}: {len(other['steps'])} steps, max rel {worst:.3g}")


def _offloaded(run: dict, impl: str, name: str) -> None:
    """The run's units were given CPU offload: the framework's CPUOffloadPolicy() for ours; for FSDP2 on CPU the
    unpinned one (FSDP2 pins only with an accelerator)."""
    expected = f"offload_policy: CPUOffloadPolicy(pin_memory={impl == 'ours'})"
    assert expected in run["log"], f"{name}: no '{expected}' in its log:\n{run['log'][-3000:]}"


RESUMES = (("ours", "ours"), ("ours", "fsdp2"), ("fsdp2", "ours"))  # (implementation, whose checkpoint it loads)


def _check_interop(tmp, run_resumed, full: dict, resumes=RESUMES) -> None:
    """Resume from step K's checkpoint: by default ours from ours, ours from FSDP2's, FSDP2 from ours; each equals
    the uninterrupted FSDP2 run."""
    for impl, source in resumes:
        _assert_same(full["fsdp2"], run_resumed(impl, source), f"{impl} resumed from {source}'s checkpoint")


# ----------------------------------------------------------------------------------------------- torchtitan
@pytest.fixture(scope="module")
def titan_assets(tmp_path_factory):
    _needs("torchtitan.train", "bash scripts/install.sh (torchtitan==0.3.0 and its dependencies)")
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "titan_assets.py"),
                          str(tmp_path_factory.mktemp("titan_assets"))], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1]  # the folder it made (the script prints it)


def _titan(tmp, assets, name, impl, config, *extra, dump=None, counts=False, ranks=2, env=None, report_rank=0):
    env = {"TITAN_ASSETS": assets, "TITAN_DUMP": dump or os.path.join(tmp, f"dump_{name}"), **(env or {})}
    return _run(tmp, name, "torchtitan_train.py", "--impl", impl, "--module", "titan_configs", "--config", config,
                *extra, counts=counts, env=env, ranks=ranks, report_rank=report_rank)


def test_torchtitan_llama3(tmp_path, titan_assets):
    """torchtitan's Trainer, Llama3 debug model, 2 microbatches per step, chunked loss, clipping, LR schedule:
    ours equals FSDP2 (losses, grad norms, and the gathers and reductions per step), and its CheckpointManager
    resumes exactly, also across the two implementations. The two cross resumes run with torchtitan's
    --training.enable_cpu_offload (its CPUOffloadPolicy() on every unit, the model initialised on the CPU): ours
    offloaded from FSDP2's checkpoint and FSDP2 offloaded from ours equal FSDP2's plain uninterrupted run."""
    tmp = str(tmp_path)
    full = {impl: _titan(tmp, titan_assets, f"llama_{impl}", impl, "llama3_debug_cpu", "--checkpoint.enable",
                         counts=True) for impl in ("fsdp2", "ours")}
    _assert_same(full["fsdp2"], full["ours"], "torchtitan Llama3: ours vs FSDP2")
    assert len(full["ours"]["steps"]) == 4
    for step, row in full["ours"]["steps"].items():  # torchtitan turns FSDP's division off on FSDPModules only
        ratio = row["grad_norm"] / full["fsdp2"]["steps"][step]["grad_norm"]
        assert abs(ratio - 1) < 1e-5, f"grad norm {ratio} x FSDP2's (1/world = gradients divided twice)"
    # the same collectives as FSDP2: the chunked loss keeps lm_head gathered and reduces it once per backward
    assert full["ours"]["counts"] == full["fsdp2"]["counts"], (full["ours"]["counts"], full["fsdp2"]["counts"])
    assert full["ours"]["counts"][-1]["reduce"] == 18, full["ours"]["counts"]  # 9 units x 2 microbatches

    def resumed(impl, source):
        dump = os.path.join(tmp, f"dump_{impl}_from_{source}")
        shutil.copytree(os.path.join(tmp, f"dump_llama_{source}", "checkpoint", "step-2"),
                        os.path.join(dump, "checkpoint", "step-2"))
        offload = impl != source  # the cross resumes run offloaded
        run = _titan(tmp, titan_assets, f"llama_{impl}_from_{source}", impl, "llama3_debug_cpu",
                     "--checkpoint.enable", *(["--training.enable_cpu_offload"] if offload else []), dump=dump)
        assert "Loading the checkpoint" in run["log"] and sorted(run["steps"]) == [3, 4], sorted(run["steps"])
        if offload:
            assert "Applied CPU Offloading to the model" in run["log"], run["log"][-3000:]
            _offloaded(run, impl, f"torchtitan {impl} from {source}")
        else:
            assert "offload_policy:" not in run["log"]
        return run

    _check_interop(tmp, resumed, full)


def test_torchtitan_qwen3_moe(tmp_path, titan_assets):
    """torchtitan's Trainer, Qwen3 MoE debug model (8 experts, top 2, no expert parallel): ours equals FSDP2, with the
    same collectives."""
    tmp = str(tmp_path)
    runs = {impl: _titan(tmp, titan_assets, f"qwen_{impl}", impl, "qwen3_moe_debug_cpu", counts=True)
            for impl in ("fsdp2", "ours")}
    _assert_same(runs["fsdp2"], runs["ours"], "torchtitan Qwen3 MoE: ours vs FSDP2")
    assert runs["ours"]["counts"] == runs["fsdp2"]["counts"], (runs["ours"]["counts"], runs["fsdp2"]["counts"])


def test_torchtitan_compile(tmp_path, titan_assets):
    """torchtitan's --compile.enable: each block compiled with fullgraph=True before fully_shard (its order), our
    hooks kept out of the compiled frames as FSDP2's are. Ours equals FSDP2 (losses, grad norms, the collectives)
    and breaks no more graphs (dynamo's graph_breaks log of both ranks)."""
    tmp = str(tmp_path)
    runs = {impl: _titan(tmp, titan_assets, f"compile_{impl}", impl, "llama3_debug_cpu", "--compile.enable",
                         counts=True, env={"TORCH_LOGS": "graph_breaks"}) for impl in ("fsdp2", "ours")}
    assert "Compiling each TransformerBlock with torch.compile" in runs["ours"]["log"], runs["ours"]["log"][-3000:]
    _assert_same(runs["fsdp2"], runs["ours"], "torchtitan compiled: ours vs FSDP2")
    assert runs["ours"]["counts"] == runs["fsdp2"]["counts"], (runs["ours"]["counts"], runs["fsdp2"]["counts"])
    breaks = {impl: run["log"].lower().count("graph break") for impl, run in runs.items()}
    assert breaks["ours"] <= breaks["fsdp2"], breaks
    print(f"graph breaks (both ranks): {breaks}")


def test_torchtitan_float8(tmp_path, titan_assets):
    """torchtitan's float8 converter (torchao's Float8Linear on the blocks' and head's linear layers; on the CPU its
    emulated path, TITAN_FLOAT8=emulate) on top of our units: ours equals FSDP2 (losses, grad norms, the
    collectives)."""
    _needs("torchao.float8", "bash scripts/install.sh (torchao)")
    tmp = str(tmp_path)
    runs = {impl: _titan(tmp, titan_assets, f"float8_{impl}", impl, "llama3_debug_cpu", counts=True,
                         env={"TITAN_FLOAT8": "emulate"}) for impl in ("fsdp2", "ours")}
    assert "Float8 training active" in runs["ours"]["log"], runs["ours"]["log"][-3000:]
    _assert_same(runs["fsdp2"], runs["ours"], "torchtitan float8: ours vs FSDP2")
    assert runs["ours"]["counts"] == runs["fsdp2"]["counts"], (runs["ours"]["counts"], runs["fsdp2"]["counts"])


# schedule -> (config, the checkpoint resumes checked: (implementation, whose checkpoint it loads))
_PP = {"1F1B": ("llama3_debug_pp_cpu", RESUMES[1:2]),
       "Interleaved1F1B": ("llama3_debug_pp_cpu", RESUMES[:1]),
       "InterleavedZeroBubble": ("llama3_debug_pp_zb_cpu", ())}


@pytest.mark.parametrize("schedule", list(_PP))
def test_torchtitan_pipeline(tmp_path, titan_assets, schedule):
    """torchtitan's pipeline parallel 2 x FSDP 2 on 4 ranks (torch.distributed.pipelining drives the units through
    fully_shard.state(...)), 2 gradient-accumulation steps of 2 pipeline microbatches: 1F1B, torchtitan's default
    (one stage per rank, its chunked loss), Interleaved1F1B (two stages per rank) and InterleavedZeroBubble (two
    stages per rank, the weight gradients computed apart from the input gradients; plain cross-entropy: see
    titan_configs.py). Ours equals FSDP2: losses, grad norms, and every rank's gathers and reductions per step.
    torchtitan's CheckpointManager resumes exactly: ours from FSDP2's checkpoint (1F1B), ours from its own
    (Interleaved1F1B)."""
    config, resumes = _PP[schedule]
    tmp = str(tmp_path)
    args = (config, "--parallelism.pipeline_parallel_schedule", schedule, *(["--checkpoint.enable"] if resumes else []))
    # rank 3 holds the last stage (pipeline rank 1), which reports the loss; the others report -1 per microbatch
    full = {impl: _titan(tmp, titan_assets, f"pp_{impl}", impl, *args, counts=True, ranks=4, report_rank=3)
            for impl in ("fsdp2", "ours")}
    _assert_same(full["fsdp2"], full["ours"], f"torchtitan PP {schedule}: ours vs FSDP2")
    assert len(full["ours"]["steps"]) == 4 and full["ours"]["steps"][1]["loss"] > 0, full["ours"]["steps"]
    assert full["ours"]["counts_per_rank"] == full["fsdp2"]["counts_per_rank"], (
        full["ours"]["counts_per_rank"], full["fsdp2"]["counts_per_rank"])

    def resumed(impl, source):
        dump = os.path.join(tmp, f"dump_{impl}_from_{source}")
        shutil.copytree(os.path.join(tmp, f"dump_pp_{source}", "checkpoint", "step-2"),
                        os.path.join(dump, "checkpoint", "step-2"))
        run = _titan(tmp, titan_assets, f"pp_{impl}_from_{source}", impl, *args, dump=dump, ranks=4, report_rank=3)
        assert "Loading the checkpoint" in run["log"] and sorted(run["steps"]) == [3, 4], sorted(run["steps"])
        return run

    _check_interop(tmp, resumed, full, resumes)


_2D = {"tensor_parallel": ("llama3_debug_cpu", "--parallelism.tensor_parallel_degree", "partial_dtensor"),
       "expert_parallel": ("qwen3_moe_debug_cpu", "--parallelism.expert_parallel_degree", "partial_dtensor"),
       "tensor_parallel_full_dtensor": ("llama3_debug_cpu", "--parallelism.tensor_parallel_degree", "full_dtensor"),
       "expert_parallel_full_dtensor": ("qwen3_moe_debug_cpu", "--parallelism.expert_parallel_degree", "full_dtensor"),
       "hsdp": ("llama3_debug_cpu", "--parallelism.data_parallel_replicate_degree", "partial_dtensor")}


@pytest.mark.parametrize("layout", list(_2D))
def test_torchtitan_2d(tmp_path, titan_assets, layout):
    """torchtitan's own 2-D layouts on 4 ranks: tensor parallel 2 x FSDP 2 (Llama3: parallelize_module, then
    fully_shard over the dp mesh), expert parallel 2 (Qwen3 MoE: the experts DTensors over "ep", sharded over
    "efsdp" through shard_placement_fn's ShardPlacementResult, the rest over "fsdp"), each also under torchtitan's
    full_dtensor backend (every parameter a DTensor on the full mesh, fully_shard given dp_mesh_dims), and HSDP 2 x 2
    (Llama3: replicate x shard, fully_shard given the 2-D mesh). Ours equals FSDP2, with the same collectives. For
    TP and EP under partial_dtensor, torchtitan's CheckpointManager also resumes ours from FSDP2's checkpoint exactly
    (the other directions: test_torchtitan_llama3 on 2 ranks; each 4-rank launch costs about a minute of CI, so
    full_dtensor and HSDP run no resume)."""
    config, degree, backend = _2D[layout]
    tmp = str(tmp_path)
    saved = 2 if config.startswith("llama3") else 1  # of 4 and 2 steps
    resumes = RESUMES[1:2] if backend == "partial_dtensor" and layout != "hsdp" else ()  # ours from FSDP2's
    args = (config, degree, "2", "--parallelism.spmd_backend", backend,
            *(["--checkpoint.enable", "--checkpoint.interval", str(saved)] if resumes else []))
    full = {impl: _titan(tmp, titan_assets, f"{layout}_{impl}", impl, *args, counts=True, ranks=4)
            for impl in ("fsdp2", "ours")}
    _assert_same(full["fsdp2"], full["ours"], f"torchtitan {layout}: ours vs FSDP2")
    assert full["ours"]["counts"] == full["fsdp2"]["counts"], (full["ours"]["counts"], full["fsdp2"]["counts"])

    def resumed(impl, source):
        dump = os.path.join(tmp, f"dump_{impl}_from_{source}")
        shutil.copytree(os.path.join(tmp, f"dump_{layout}_{source}", "checkpoint", f"step-{saved}"),
                        os.path.join(dump, "checkpoint", f"step-{saved}"))
        run = _titan(tmp, titan_assets, f"{layout}_{impl}_from_{source}", impl, *args, dump=dump, ranks=4)
        assert "Loading the checkpoint" in run["log"] and min(run["steps"]) == saved + 1, sorted(run["steps"])
        return run

    _check_interop(tmp, resumed, full, resumes)


def test_torchtitan_expert_parallel_experts_unit(tmp_path, titan_assets):
    """Expert parallel 2 on torch < 2.12 (no per-parameter meshes): torchtitan_train.py's "experts as their own
    unit" turns torchtitan's shard_placement_fn -> ShardPlacementResult into the earlier layout (the experts a
    fully_shard unit of their own on the "efsdp" mesh, the block one on "fsdp"). Forced here with
    TITAN_EXPERTS_UNIT=1: FSDP2 and ours in that layout equal FSDP2 in torchtitan's per-parameter one."""
    tmp = str(tmp_path)
    args = ("qwen3_moe_debug_cpu", "--parallelism.expert_parallel_degree", "2", "--parallelism.spmd_backend",
            "partial_dtensor")
    ref = _titan(tmp, titan_assets, "ep_per_param_fsdp2", "fsdp2", *args, ranks=4, env={"TITAN_EXPERTS_UNIT": "0"})
    assert "experts as their own unit" not in ref["log"]
    runs = {impl: _titan(tmp, titan_assets, f"ep_unit_{impl}", impl, *args, ranks=4, counts=True,
                         env={"TITAN_EXPERTS_UNIT": "1"}) for impl in ("fsdp2", "ours")}
    for impl, run in runs.items():
        assert "[torchtitan_train] experts as their own unit: 2 blocks" in run["log"], run["log"][-3000:]
        _assert_same(ref, run, f"torchtitan EP 2, experts as their own unit ({impl}) vs FSDP2 per-parameter meshes")
    assert len(ref["steps"]) == len(runs["ours"]["steps"]) == 2
    assert runs["ours"]["counts"] == runs["fsdp2"]["counts"], (runs["ours"]["counts"], runs["fsdp2"]["counts"])


# ----------------------------------------------------------------------------------------------- accelerate
def test_accelerate(tmp_path):
    """accelerate's FSDP2 plugin, LlamaForCausalLM with tied embeddings (one list unit [norm, embed, lm_head]),
    accumulation 2, clipping: ours equals FSDP2, and save_state / load_state resume exactly both ways; ours from
    FSDP2's checkpoint with the plugin's cpu_offload=True (an offloaded model loading a plain run's state)."""
    _needs("transformers", "pip install transformers")
    _needs("accelerate", "pip install accelerate (bash scripts/install.sh)")
    tmp = str(tmp_path)
    full = {impl: _run(tmp, f"acc_{impl}", "accelerate_train.py", "--impl", impl, "--steps", "4", "--save-at", "2",
                       "--ckpt", os.path.join(tmp, f"ckpt_{impl}")) for impl in ("fsdp2", "ours")}
    _assert_same(full["fsdp2"], full["ours"], "accelerate: ours vs FSDP2")
    assert "LlamaRMSNorm" in full["ours"]["log"]  # the tail list unit exists

    def resumed(impl, source):
        offload = (impl, source) == ("ours", "fsdp2")
        run = _run(tmp, f"acc_{impl}_from_{source}", "accelerate_train.py", "--impl", impl, "--steps", "4",
                   "--load", os.path.join(tmp, f"ckpt_{source}"), "--resume-step", "2",
                   *(["--cpu-offload"] if offload else []))
        if offload:
            _offloaded(run, impl, f"accelerate {impl} from {source}")
        return run

    _check_interop(tmp, resumed, full)


def test_accelerate_cpu_offload_ram_efficient_loading(tmp_path):
    """The plugin's cpu_offload=True (every fully_shard call given CPUOffloadPolicy()) for both implementations, and
    for ours also cpu_ram_efficient_loading=True: accelerate shards the model on the meta device, broadcasts rank 0's
    weights, moves the shards to the CPU (its offload branch) and loads them with load_state_dict(assign=True). Ours
    equals FSDP2 offloaded with the plain loading."""
    _needs("transformers", "pip install transformers")
    _needs("accelerate", "pip install accelerate (bash scripts/install.sh)")
    tmp = str(tmp_path)
    ref = _run(tmp, "acc_fsdp2_offload", "accelerate_train.py", "--impl", "fsdp2", "--steps", "2", "--cpu-offload")
    ours = _run(tmp, "acc_ours_offload_ram", "accelerate_train.py", "--impl", "ours", "--steps", "2",
                "--cpu-offload", "--ram-efficient")
    for impl, run in (("fsdp2", ref), ("ours", ours)):
        _offloaded(run, impl, f"accelerate {impl}")
    _assert_same(ref, ours, "accelerate cpu_offload + cpu_ram_efficient_loading: ours vs FSDP2 offloaded")


# ----------------------------------------------------------------------------------------------- HF Trainer
def test_hf_trainer(tmp_path):
    """The HF Trainer with FSDP2 (tied embeddings, accumulation 2, clipping, warm-up + linear decay): ours equals
    FSDP2, and save_steps / resume_from_checkpoint resume exactly both ways. The two cross resumes run with the
    Trainer's FSDP offload, said both ways it takes it: ours with fsdp="full_shard offload auto_wrap", FSDP2 with
    fsdp_config["cpu_offload"]=True; each equals FSDP2's plain uninterrupted run."""
    _needs("transformers", "pip install transformers accelerate")
    _needs("accelerate", "pip install accelerate (bash scripts/install.sh)")
    tmp = str(tmp_path)
    full = {impl: _run(tmp, f"hf_{impl}", "hf_trainer_train.py", "--impl", impl, "--steps", "4", "--save-steps",
                       "2", "--out", os.path.join(tmp, f"out_{impl}")) for impl in ("fsdp2", "ours")}
    _assert_same(full["fsdp2"], full["ours"], "HF Trainer: ours vs FSDP2")

    offload = {("ours", "fsdp2"): "fsdp", ("fsdp2", "ours"): "fsdp_config"}

    def resumed(impl, source):
        how = offload.get((impl, source))
        run = _run(tmp, f"hf_{impl}_from_{source}", "hf_trainer_train.py", "--impl", impl, "--steps", "4",
                   "--out", os.path.join(tmp, f"out_{impl}_from_{source}"),
                   "--resume", os.path.join(tmp, f"out_{source}", "checkpoint-2"),
                   *(["--cpu-offload", how] if how else []))
        if how:
            _offloaded(run, impl, f"HF Trainer {impl} from {source}")
        return run

    _check_interop(tmp, resumed, full)


# ----------------------------------------------------------------------------------------------- Lightning
def test_lightning(tmp_path):
    """Lightning's ModelParallelStrategy, configure_model calling fully_shard (accumulation 2, clipping): ours
    equals FSDP2, and trainer.save_checkpoint / fit(ckpt_path=...) resume exactly both ways."""
    _needs("transformers", "pip install transformers")
    _needs("lightning", "pip install lightning (bash scripts/install.sh)")
    tmp = str(tmp_path)
    full = {impl: _run(tmp, f"lit_{impl}", "lightning_train.py", "--impl", impl, "--steps", "4", "--save-at", "2",
                       "--ckpt", os.path.join(tmp, f"ckpt_{impl}"), "--out", os.path.join(tmp, f"out_{impl}"))
            for impl in ("fsdp2", "ours")}
    _assert_same(full["fsdp2"], full["ours"], "Lightning: ours vs FSDP2")

    def resumed(impl, source):
        return _run(tmp, f"lit_{impl}_from_{source}", "lightning_train.py", "--impl", impl, "--steps", "4",
                    "--resume", os.path.join(tmp, f"ckpt_{source}"), "--out", os.path.join(tmp, f"out_r_{impl}"))

    _check_interop(tmp, resumed, full)


def test_lightning_fabric_no_backward_sync(tmp_path):
    """Fabric's no_backward_sync finds the units by isinstance(m, FSDPModule): ours reduces on the last microbatch
    only, as FSDP2 does, with the same numbers."""
    _needs("transformers", "pip install transformers")
    _needs("lightning", "pip install lightning (bash scripts/install.sh)")
    tmp = str(tmp_path)
    runs = {impl: _run(tmp, f"fabric_{impl}", "lightning_train.py", "--impl", impl, "--fabric", "--steps", "2",
                       counts=True) for impl in ("fsdp2", "ours")}
    _assert_same(runs["fsdp2"], runs["ours"], "Fabric: ours vs FSDP2")
    reduces = [c["reduce"] for c in runs["ours"]["counts"]]
    assert reduces == [c["reduce"] for c in runs["fsdp2"]["counts"]] == [4, 4], runs["ours"]["counts"]
