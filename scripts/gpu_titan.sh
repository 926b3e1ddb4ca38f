#!/usr/bin/env bash
# torchtitan's Trainer on the Llama 3 8B shape (seq 8192, bf16, layers reduced to fit), 2 GPUs of one host:
# FSDP2, mfsdp_ext (bf16) and mfsdp_ext with FP8 weights (Fp8Policy(compute=True)), one after the other:
# tok/s/GPU and peak memory -> $OUT/titan_step_2gpu.{md,json} (benchmarks/titan_step.py), the runs' logs and
# per-step metrics in $OUT/titan_step_logs.tgz.
#
# Needs torchtitan 0.3.0 and the dependencies listed in WHEELS below: pip install them first, or let --setup do it
# (pip install --no-deps of that list; from the wheels in $WHEELS_DIR without network when WHEELS_DIR is set: on a
# host with network, WHEELS_DIR=DIR bash scripts/gpu_titan.sh --download fills it). torchtitan 0.3.0 targets
# torch >= 2.12; examples/frameworks/torchtitan_train.py covers the one name it imports that torch 2.11 lacks.
#   bash scripts/gpu_titan.sh --setup   install torchtitan if missing, build mfsdp_ext if needed, check the imports
#   bash scripts/gpu_titan.sh           the same, then the benchmark (about 5 minutes); FSDP2 runs first and again
#                                       last (fsdp2_rerun): a first run on a fresh machine can be slower
#   bash scripts/gpu_titan.sh nd        the same, then torchtitan's 2-D layouts on 4 GPUs (about 6 minutes): Llama 3 8B
#                                       shape (8 layers) with tensor parallel 2 x FSDP 2 (each implementation twice,
#                                       alternating: their spread), and
#                                       Qwen3 30B-A3B's MoE shape (4 layers) with expert parallel 2 (table moe_ep2):
#                                       where torch lacks FSDP2's per-parameter meshes (ShardPlacementResult, torch
#                                       >= 2.12; 2.11 here), torchtitan_train.py's "experts as their own unit" gives
#                                       FSDP2 and ours alike the experts as a fully_shard unit on the "efsdp" mesh
#   bash scripts/gpu_titan.sh pp        the same, then torchtitan's pipeline parallel 2 x FSDP 2 on 4 GPUs at the 8B shape
#                                       (TITAN_LAYERS, default 16; local batch 4 in microbatches of 1), 1F1B and
#                                       Interleaved1F1B (TITAN_PP_SCHEDULES), FSDP2 and ours: one table per schedule
#   bash scripts/gpu_titan.sh fast      the same, then torchtitan's fast paths on all GPUs here (TITAN_GPUS), one table each
#                                       (TITAN_FAST_MODES, default all): eager (--training.disable_cuda_graphs),
#                                       graphs (its default: its CUDA graph of forward + backward), compile
#                                       (--compile.enable), float8 (compile + torchao float8 rowwise through its
#                                       converter, TITAN_FLOAT8), fp8 (our FP8 weights, ours_fp8 only, without
#                                       compile: fully_shard refuses FP8 compute in a compiled module; compare it with
#                                       FSDP2's rows of the other modes of the same invocation); TITAN_LAYERS default 8
#   bash scripts/gpu_titan.sh hosts2    the same, then HSDP 2 (replicas) x 2 (shards) at the 8B shape (TITAN_LAYERS, default
#                                       4) on 4 GPUs answering as 2 hosts of 2 (MFSDP_EXT_SIMULATE_HOSTS=2: ours takes the
#                                       paths of a run across hosts), NCCL without P2P and shared memory for both
#                                       implementations (its network transport, as between hosts): losses, tok/s, peak
#   bash scripts/gpu_titan.sh resume    the same, then torchtitan's checkpoint resume on 4 GPUs (about 8 minutes):
#                                       its debug models in bf16, tensor parallel 2 and expert parallel 2, FSDP2 and
#                                       ours resumed from their own and each other's checkpoints
#                                       (benchmarks/titan_resume_check.py; bound: FSDP2 resumed from itself; the MoE runs
#                                       with torchtitan's --debug.deterministic: its token routing is otherwise not
#                                       bit-reproducible on GPU); each of the two checks runs 6 torchtitan starts,
#                                       80 s at most each; tables and logs to $OUT as nd's
#   TITAN_LAYERS (default 16; an out-of-memory run is retried with 4 fewer), TITAN_STEPS (10), TITAN_IMPLS,
#   TITAN_ND=moe (nd: the MoE table only), TITAN_RESUME=tp2 or moe (resume: that check only), TITAN_AC=full (full activation checkpointing instead of torchtitan's selective one; tables get _fullac).
set -uo pipefail
WHEELS=(torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
        torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchao==0.17.0)
# WHEELS_DIR made absolute: the install below runs from the repository root
[ -n "${WHEELS_DIR:-}" ] && WHEELS_DIR=$(mkdir -p "$WHEELS_DIR" && cd "$WHEELS_DIR" && pwd)
if [ "${1:-}" = "--download" ]; then  # on a host with network: the wheels for a Python 3.12 GPU host
    : "${WHEELS_DIR:?set WHEELS_DIR to the folder to download the wheels into}"
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --implementation cp \
        -d "$WHEELS_DIR" "${WHEELS[@]}"
fi
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"   # NVLink multicast off, repository root, PYTHONPATH, $OUT
# (found, not imported: torchtitan 0.3.0 itself does not import on torch 2.11 without the example's placeholder)
if ! python3 -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('torchtitan', 'spmd_types',
        'tyro', 'docstring_parser', 'typeguard', 'torchdata', 'datasets', 'dill', 'multiprocess', 'torchao')))"; then
    if [ -n "${WHEELS_DIR:-}" ]; then
        echo "== installing torchtitan and its missing dependencies from $WHEELS_DIR (--no-index --no-deps)"
        python3 -m pip install -q --no-deps --no-index "$WHEELS_DIR"/*.whl || exit 2
    else
        echo "== installing torchtitan and its missing dependencies (--no-deps)"
        python3 -m pip install -q --no-deps "${WHEELS[@]}" || exit 2
    fi
fi
python3 -c "import mfsdp_ext; assert mfsdp_ext.build_info()['cuda']" 2>/dev/null ||
    env MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 2
# from examples/frameworks/, where titan_configs.py imports from (python - puts the working directory on sys.path)
(cd examples/frameworks && python3 - <<'PY'
import torch
import torch.distributed.fsdp as f
if not hasattr(f, "DataParallelMeshDims"):  # as torchtitan_train.py does on torch < 2.12
    f.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
import torchtitan.train, titan_configs, mfsdp_ext
print("[gpu_titan] torch", torch.__version__, "torchtitan imports; mfsdp_ext", mfsdp_ext.build_info().get("build"))
PY
) || exit 2
[ "${1:-}" = "--setup" ] && exit 0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${1:-}" = "nd" ]; then
    [ "$(nvidia-smi -L | wc -l)" -ge 4 ] || { echo "gpu_titan.sh nd needs 4 GPUs"; exit 2; }
    WORK=$(mktemp -d -t gpu_titan_nd.XXXX)
    trap 'cp "$WORK"/titan_step_*.md "$WORK"/titan_step_*.json "$OUT"/ 2>/dev/null;
          tar czf "$OUT/titan_nd_logs.tgz" -C "$WORK" --exclude "dump_*" --exclude titan_assets . ' EXIT
    rc=0
    [ "${TITAN_ND:-}" = moe ] || {  # TITAN_ND=moe: the MoE table only
    timeout -k 10 330 python3 benchmarks/titan_step.py --out "$WORK" --nproc 4 --config llama3_8b_gpu --tag tp2 \
        --layers 8 --steps 8 --warmup 3 --impls fsdp2,ours,fsdp2_rerun,ours_rerun --deadline 320 --run-timeout 150 \
        -- --parallelism.tensor_parallel_degree 2
    rc=$?; }
    timeout -k 10 230 python3 benchmarks/titan_step.py --out "$WORK" --nproc 4 --config qwen3_moe_gpu --tag moe_ep2 \
        --layers 4 --steps 8 --warmup 3 --impls fsdp2,ours,fsdp2_rerun --deadline 220 --run-timeout 150 \
        -- --parallelism.expert_parallel_degree 2
    exit $(( rc || $? ))
fi
if [ "${1:-}" = "pp" ]; then  # pipeline parallel 2 x FSDP 2 on 4 GPUs, 1F1B and Interleaved1F1B (TITAN_PP_SCHEDULES)
    [ "$(nvidia-smi -L | wc -l)" -ge 4 ] || { echo "gpu_titan.sh pp needs 4 GPUs"; exit 2; }
    WORK=$(mktemp -d -t gpu_titan_pp.XXXX)
    trap 'cp "$WORK"/titan_step_*.md "$WORK"/titan_step_*.json "$OUT"/ 2>/dev/null;
          tar czf "$OUT/titan_pp_logs.tgz" -C "$WORK" --exclude "dump_*" --exclude titan_assets . ' EXIT
    rc=0
    for schedule in ${TITAN_PP_SCHEDULES:-1F1B Interleaved1F1B}; do
        timeout -k 10 300 python3 benchmarks/titan_step.py --out "$WORK" --nproc 4 --config llama3_8b_pp_gpu \
            --tag "pp2_$schedule" --layers "${TITAN_LAYERS:-16}" --steps 8 --warmup 3 --impls fsdp2,ours \
            --deadline 290 --run-timeout 140 -- --parallelism.pipeline_parallel_schedule "$schedule" || rc=1
    done
    exit $rc
fi
if [ "${1:-}" = "hosts2" ]; then  # HSDP 2 x 2 with the 4 GPUs answering as 2 hosts of 2, NCCL off NVLink for both
    [ "$(nvidia-smi -L | wc -l)" -ge 4 ] || { echo "gpu_titan.sh hosts2 needs 4 GPUs"; exit 2; }
    WORK=$(mktemp -d -t gpu_titan_hosts2.XXXX)
    trap 'cp "$WORK"/titan_step_*.md "$WORK"/titan_step_*.json "$OUT"/ 2>/dev/null;
          tar czf "$OUT/titan_hosts2_logs.tgz" -C "$WORK" --exclude "dump_*" --exclude titan_assets . ' EXIT
    MFSDP_EXT_SIMULATE_HOSTS=2 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout -k 10 400 python3 benchmarks/titan_step.py \
        --out "$WORK" --nproc 4 --tag hsdp2x2_hosts2 --layers "${TITAN_LAYERS:-4}" --steps "${TITAN_STEPS:-6}" --warmup 2 \
        --impls fsdp2,ours --deadline 390 --run-timeout 190 -- --parallelism.data_parallel_replicate_degree 2 \
        --parallelism.data_parallel_shard_degree 2
    exit $?
fi
if [ "${1:-}" = "fast" ]; then  # torchtitan's fast paths, FSDP2 vs ours, one table per mode (TITAN_FAST_MODES)
    N=${TITAN_GPUS:-$(nvidia-smi -L | wc -l)}
    WORK=$(mktemp -d -t gpu_titan_fast.XXXX)
    trap 'cp "$WORK"/titan_step_*.md "$WORK"/titan_step_*.json "$OUT"/ 2>/dev/null;
          tar czf "$OUT/titan_fast_logs.tgz" -C "$WORK" --exclude "dump_*" --exclude titan_assets . ' EXIT
    rc=0
    for mode in ${TITAN_FAST_MODES:-eager graphs compile float8 fp8}; do
        impls=fsdp2,ours; float8=; extra=(--training.disable_cuda_graphs)
        case $mode in
            eager) ;;                                     # torchtitan's plain path
            graphs) extra=() ;;                           # its default: forward + backward in its CUDA graph
            compile) extra+=(--compile.enable) ;;         # per-block torch.compile
            float8) extra+=(--compile.enable); float8=rowwise ;;   # compile + torchao float8 rowwise (its converter)
            fp8) impls=ours_fp8 ;;  # our FP8 weights (Fp8Policy(compute=True)); refused under torch.compile
            *) echo "unknown mode $mode"; exit 2 ;;
        esac
        TITAN_FLOAT8=$float8 timeout -k 10 400 python3 benchmarks/titan_step.py --out "$WORK" --nproc "$N" \
            --tag "fast_$mode" --layers "${TITAN_LAYERS:-8}" --steps "${TITAN_STEPS:-8}" --warmup 3 --impls "$impls" \
            --deadline 390 --run-timeout 180 -- "${extra[@]}" || rc=1
    done
    exit $rc
fi
if [ "${1:-}" = "resume" ]; then
    [ "$(nvidia-smi -L | wc -l)" -ge 4 ] || { echo "gpu_titan.sh resume needs 4 GPUs"; exit 2; }
    WORK=$(mktemp -d -t gpu_titan_resume.XXXX)
    trap 'cp "$WORK"/titan_resume_*.md "$WORK"/titan_resume_*.json "$OUT"/ 2>/dev/null;
          tar czf "$OUT/titan_resume_logs.tgz" -C "$WORK" --exclude resume_dumps --exclude titan_assets . ' EXIT
    rc=0
    [ "${TITAN_RESUME:-}" = moe ] || {  # TITAN_RESUME=tp2 / moe: that check only
    timeout -k 10 270 python3 benchmarks/titan_resume_check.py --out "$WORK" --nproc 4 --config llama3_debug_gpu \
        --tag tp2 --run-timeout 80 -- --parallelism.tensor_parallel_degree 2
    rc=$?; }
    [ "${TITAN_RESUME:-}" = tp2 ] && exit $rc
    timeout -k 10 270 python3 benchmarks/titan_resume_check.py --out "$WORK" --nproc 4 --config qwen3_moe_debug_gpu \
        --tag moe_ep2 --run-timeout 80 -- --parallelism.expert_parallel_degree 2 --debug.deterministic
    exit $(( rc || $? ))
fi
N=$(nvidia-smi -L | wc -l); N=$(( N > 2 ? 2 : N ))
# the tables go to $OUT, the runs' logs and per-step metrics into one archive next to them
FINAL_OUT=$OUT; WORK=$(mktemp -d -t gpu_titan.XXXX)
trap 'cp "$WORK"/titan_step_*.md "$WORK"/titan_step_*.json "$FINAL_OUT"/ 2>/dev/null;
      tar czf "$FINAL_OUT/titan_step_logs.tgz" -C "$WORK" --exclude "dump_*" --exclude titan_assets . ' EXIT
timeout -k 10 570 python3 benchmarks/titan_step.py --out "$WORK" --nproc "$N" --layers "${TITAN_LAYERS:-16}" \
    --steps "${TITAN_STEPS:-10}" --warmup 3 --impls "${TITAN_IMPLS:-fsdp2,ours,ours_fp8,fsdp2_rerun}" --ac "${TITAN_AC:-selective}" \
    --deadline 540
