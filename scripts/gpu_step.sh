#!/usr/bin/env bash
# End-to-end numbers on a GPU machine: the step benchmark (ours vs FSDP2) on 2 GPUs and, when present, on 4,
# then the example training job on all GPUs. Everything lands under $OUT (default ./gpu_check_out).
#
#   bash scripts/gpu_step.sh
#   EXTRA_OURS=use_symm_mem=auto bash scripts/gpu_step.sh        # + a column for ours with that keyword
#   STEPS=20 CONFIGS=1,4 TRAIN_IMPLS=ours TRAIN_ARGS="--microbatches 2" bash scripts/gpu_step.sh
#   BUILD=1 bash scripts/gpu_step.sh     # first: pip install --no-build-isolation --no-deps -e .
#
# Takes about 2 minutes per world size with the defaults on H200s; each torchrun is capped by `timeout`
# (STEP_TIMEOUT, TRAIN_TIMEOUT), so a hang costs at most its cap.
# step.py rewrites its report after every config, so a capped run still leaves the configs it finished.
set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
CONFIGS=${CONFIGS:-1,2,3,4,5}
EXTRA_OURS=${EXTRA_OURS:-}            # e.g. use_symm_mem=auto ; several columns: "use_symm_mem=auto;KEY=VAL"
TRAIN_STEPS=${TRAIN_STEPS:-30}
TRAIN_IMPLS=${TRAIN_IMPLS:-"ours fsdp2"}   # the example job once per implementation, same data and seed
TRAIN_ARGS=${TRAIN_ARGS:-}            # more train_gpt.py flags, e.g. "--no-meta-init" (identical init in both)
STEP_TIMEOUT=${STEP_TIMEOUT:-200}     # seconds per step.py run
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-80}    # seconds per train_gpt.py run

NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
SMOKE=()   # no GPU: a CPU smoke test of this script itself (tiny configs, 2 gloo processes)
if [ "$NGPU" = 0 ]; then
    echo "!! no GPU found: CPU smoke test with --tiny configs and 2 processes"
    NGPU=2 SMOKE=(--tiny) TRAIN_STEPS=${TRAIN_STEPS_CPU:-10}
fi
{
    echo "date: $(date -Is)"
    nvidia-smi -L 2>/dev/null
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
        "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
    env | grep -E '^(NCCL_|TORCH_SYMM|NVSHMEM_)' | sort
} 2>&1 | tee "$OUT/env.txt"

if [ "${BUILD:-0}" = 1 ]; then
    echo "== building mfsdp_ext (log: $OUT/build.log)"
    timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
        || { echo "build FAILED: tail of $OUT/build.log"; tail -20 "$OUT/build.log"; }
fi

IMPLS=ours,fsdp2
if ! python3 -c 'import mfsdp_ext; mfsdp_ext.fully_shard' >"$OUT/import_ours.log" 2>&1; then
    echo "!! mfsdp_ext is not importable (see $OUT/import_ours.log): running FSDP2 only"
    cat "$OUT/import_ours.log"
    IMPLS=fsdp2
    EXTRA_OURS=
    TRAIN_IMPLS=fsdp2
else
    python3 -c 'import mfsdp_ext._native as n; print("mfsdp_ext native:", n.build_info())' 2>&1 | tee -a "$OUT/env.txt"
fi

EXTRA_ARGS=()
IFS=';' read -r -a _extras <<<"$EXTRA_OURS"
for e in "${_extras[@]}"; do
    [ -n "$e" ] && EXTRA_ARGS+=(--extra-ours "$e")
done

status=0
run_step() {  # $1 = number of GPUs
    local n=$1
    echo "== step benchmark on $n GPU(s): impls=$IMPLS extra=${EXTRA_OURS:-none} configs=$CONFIGS steps=$STEPS"
    timeout -k 10 "$STEP_TIMEOUT" torchrun --standalone --nproc-per-node "$n" benchmarks/step.py \
        --configs "$CONFIGS" --impls "$IMPLS" "${EXTRA_ARGS[@]}" --steps "$STEPS" --warmup "$WARMUP" \
        --out "$OUT/step$n" "${SMOKE[@]}" 2>&1 | tee "$OUT/step$n.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "!! step benchmark on $n GPUs exited $rc"; status=1; }
    cat "$OUT/step$n"/step_"$n"*.md 2>/dev/null
}

if [ "$NGPU" -ge 2 ]; then run_step 2; else run_step "$NGPU"; fi
if [ "$NGPU" -ge 4 ]; then run_step 4; fi

for impl in $TRAIN_IMPLS; do
    echo "== examples/train_gpt.py on $NGPU GPU(s), impl=$impl, $TRAIN_STEPS steps"
    timeout -k 10 "$TRAIN_TIMEOUT" torchrun --standalone --nproc-per-node "$NGPU" examples/train_gpt.py \
        --impl "$impl" --steps "$TRAIN_STEPS" $TRAIN_ARGS 2>&1 | tee "$OUT/train_${impl}_${NGPU}gpu.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "!! train_gpt.py ($impl) exited $rc"; status=1; }
done

echo "== done: results in $OUT"
ls -R "$OUT"
exit $status
