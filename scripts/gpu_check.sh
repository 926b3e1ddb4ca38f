#!/usr/bin/env bash
# The whole GPU check on one GPU host, in stages run one after another:
#
#   bash scripts/gpu_check.sh [stage ...]
#
# Default stages: build tests kernels symm units optim step step6 hostcost memory noshard fp8 fp8train jit hf mainjob.
#   Not in the default list: race: the failed-step race test, also with its fix undone; repeat: the main job
#   run twice per mode with --deterministic, bit-identical; gpt200: 200 training steps, bf16 vs FP8; fp8step, fp8cache:
#   FP8 step rows on any GPU count; fp8host: the FP8 layer's host time; step6ac: config 6 with less recomputation;
#   ctas: NCCL_MAX_CTAS sweep; overlap: a matmul beside NCCL's all-gather vs copy engines; wire, wirefp8: the default
#   bf16-sent, fp32-summed gradients vs the fp32 reduce-scatter; native: native_collectives against
#   torch.distributed's collectives; timeline: where the GPU waits in each config's step; graphs: CUDA graph tests
#   and captured step rows, bf16 and FP8 (GRAPH_PROBE=1: the per-feature probe too; GRAPH_GPUS=2: on 2 of the GPUs);
#   graphhold: the whole-step graph with its first units held vs gathered per replay (GRAPH_CONFIGS, default 4);
#   peer: PyTorch's FSDP2 tests on the GPUs (PEER_TESTS, PEER_FILES); fastpath: configs 3 and 2 with defaults only, back to back and synchronised each step (the host time of a call);
#   graphs6: config 6 with graphs; graphsx: configs 3 and 1 captured/graphed over symmetric memory and native
#   collectives; graphsce: the copy-engine collectives under graphs, configs 1-5 (graphsce6: config 6; ceeager: the
#   same without graphs; cedefault: the default copy engines against NCCL's collectives, CE_CONFIGS); carveout: matmuls leaving SMs to NCCL; titan: torchtitan's Trainer at the 8B shape, see
#   scripts/gpu_titan.sh; nd: N-D layouts on 4 GPUs: Shard(1) GPU tests, dp2 x tp2 step rows at configs 1 and 6;
#   hosts2: 4 GPUs simulated as 2 hosts of 2 (MFSDP_EXT_SIMULATE_HOSTS=2, NCCL without P2P and shared memory),
#   configs 1 and 4 ours vs FSDP2; offload: CPU offload: its GPU tests, config 6 offloaded and not, ours and FSDP2, in one run (2 GPUs), and the
#   largest model each trains with and without offload (4 GPUs, where present; CAPACITY_BUDGET_S, default 300).
#   bash scripts/gpu_check.sh build fp8      FP8 quantizer / transpose / Linear only (GPU tests + both benchmarks)
#   bash scripts/gpu_check.sh build fp8train FP8 weights in fully_shard: GPU tests + step.py's FP8 variants (2 GPUs)
#
# Each stage logs to $OUT/<name>.log and writes its result tables (markdown, JSON) under $OUT; OUT defaults to
# ./gpu_check_out. PACK=1 also packs $OUT into $OUT.tgz at exit (also when interrupted). The script exits non-zero
# if a stage failed. The fsdp2_float8 rows (stages fp8step, fp8cache, fp8train, native) need torchao: pip install
# torchao first; without it those rows are skipped.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"   # NVLink multicast off, repository root, PYTHONPATH, $OUT
if [ "${PACK:-0}" = 1 ]; then
    trap 'tar czf "$OUT.tgz" -C "$OUT" . && echo "packed: $OUT.tgz"' EXIT
    trap 'exit 143' TERM INT   # a `timeout` around this script still packs the logs
fi
stages=${*:-build tests kernels symm units optim step step6 hostcost memory noshard fp8 fp8train jit hf mainjob}
status=0
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember failures, keep going
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1; local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0))s"; tail -n 25 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
}
for stage in $stages; do
    case $stage in
    build)
        nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
        # always: an older _C may be left from an earlier build, and the build is incremental
        run build env MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . ;;
    tests)  # every GPU test but the FP8 kernels' and Linear's (tests/fp8/: the fp8 stage)
        run tests timeout -k 10 420 python3 -m pytest -m gpu -q -s tests --ignore=tests/fp8 ;;
    optim)  # the fused AdamW step over configs 1 and 3's shards vs torch's foreach and fused AdamW, vs the bandwidth bound (1 GPU)
        run optim timeout -k 10 200 python3 benchmarks/optim.py --configs 1,3 --out "$OUT" ;;
    kernels) run kernels python3 benchmarks/kernels.py --out "$OUT" ;;
    symm) run symm env SKIP_PYTEST=1 bash scripts/gpu_symm.sh ;;  # its tests ran in the tests stage
    units)  # one unit's collectives at configs 1-4's sizes: grouped per parameter vs flat (2 GPUs; 4 if present)
        for n in 2 4; do
            [ "$(nvidia-smi -L | wc -l)" -ge $n ] && run units$n timeout -k 10 150 torchrun --standalone \
                --nproc-per-node $n benchmarks/collectives.py --units --out "$OUT"
        done ;;
    step) run step bash scripts/gpu_step.sh ;;
    nd)  # N-D layouts: Shard(1) placements on every collective path, then tensor parallel 2 x FSDP 2 (4 GPUs), fused
         # AdamW on both sides, configs 1 and 6 (step_4gpu_tp2.md)
        [[ " $stages " == *" tests "* ]] ||  # the tests stage runs them too
            run nd_tests timeout -k 10 300 python3 -m pytest -m gpu -q -s tests/sharding/test_shard_placement.py
        run nd_step timeout -k 10 300 torchrun --standalone --nproc-per-node 4 benchmarks/step.py --tp 2 \
            --configs 1,6 --impls ours_fused,fsdp2_fused --steps 6 --warmup 2 --init meta --out "$OUT" ;;
    hosts2)  # 4 GPUs answering as 2 hosts of 2 (MFSDP_EXT_SIMULATE_HOSTS=2, comm/hosts.py) with NCCL's traffic on
             # its network path (no P2P, no shared memory), the same settings for both implementations: the paths of
             # runs that span hosts (the fp32 gradient wire; symmetric memory and copy engines kept within a host):
             # configs 1 and 4 ours vs FSDP2 (losses from the same initial weights, step time)
        [ "$(nvidia-smi -L | wc -l)" -ge 4 ] || { echo "hosts2 needs 4 GPUs"; status=1; continue; }
        run hosts2_step env MFSDP_EXT_SIMULATE_HOSTS=2 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout -k 10 420 \
            torchrun --standalone --nproc-per-node 4 benchmarks/step.py --configs 1,4 \
            --impls ours_fused,fsdp2_fused --steps 10 --warmup 3 --no-floor --out "$OUT/hosts2" ;;
    offload)  # CPU offload (CPUOffloadPolicy(pin_memory=True)): the GPU offload tests; config 6 (the 8B shape,
              # seq 8192) on 2 GPUs, ours_fused, ours_offload (the bf16 shard copied per gather), ours_offload_kept
              # (kept on the GPU), ours_offload_ib (AdamW stepping in backward) and fsdp2_offload in one run: step time
              # back to back and synchronised, GPU peak, host and pinned memory ($OUT/offload_step6/step_2gpu.md);
              # then on 4 GPUs, where present, the largest model of config 6's width each trains with and without
              # offload ($OUT/offload_capacity/offload_capacity_4gpu.md). Both implementations' host optimizers run
              # on nproc / ranks CPU threads per rank (OMP_NUM_THREADS)
        cpus=$(nproc)
        run offload_tests timeout -k 10 180 python3 -m pytest -m gpu -q -s tests/params/test_offload.py
        run offload_step6 env OMP_NUM_THREADS=$(( cpus >= 4 ? cpus / 2 : 2 )) timeout -k 10 500 \
            torchrun --standalone --nproc-per-node 2 benchmarks/step.py --configs 6 \
            --impls ours_fused,ours_offload,ours_offload_kept,ours_offload_ib,fsdp2_offload --steps 3 --warmup 2 \
            --sync-steps 2 \
            --init meta --no-floor --out "$OUT/offload_step6"
        [ "$(nvidia-smi -L | wc -l)" -ge 4 ] &&
            run offload_capacity env OMP_NUM_THREADS=$(( cpus >= 8 ? cpus / 4 : 2 )) \
                timeout -k 10 $(( ${CAPACITY_BUDGET_S:-300} + 200 )) python3 benchmarks/offload_capacity.py \
                --nproc 4 --budget-s "${CAPACITY_BUDGET_S:-300}" --trial-timeout-s 150 --out "$OUT/offload_capacity" ;;
    step6)  # real size: the Llama-3-8B shape, seq 8192, activation checkpointing per block; MFU, bf16 and FP8 (2 GPUs)
        run step6 timeout -k 10 420 torchrun --standalone --nproc-per-node 2 benchmarks/step.py --configs 6 \
            --impls ours_fused,ours_fp8_fused,fsdp2 --steps 5 --warmup 2 --init meta --out "$OUT" ;;
    step6ac)  # what the fused optimizer's memory buys at config 6 (2 GPUs): ours_fused and FSDP2 with every block
              # recomputed (same run), then ours_fused with its last K blocks not recomputed
        run step6ac timeout -k 10 240 torchrun --standalone --nproc-per-node 2 benchmarks/step.py --configs 6 \
            --steps 5 --warmup 2 --init meta --impls ours_fused,fsdp2 --no-floor --out "$OUT/step6_ac"
        for k in ${AC_SKIP:-8 11 12 16}; do
            run step6ac_skip$k timeout -k 10 150 torchrun --standalone --nproc-per-node 2 benchmarks/step.py \
                --configs 6 --steps 5 --warmup 2 --init meta --impls ours_fused --ac-skip-last $k --no-floor \
                --out "$OUT/step6_skip$k"
        done
        run step6ac_table python3 benchmarks/ac_tradeoff.py "$OUT"/step6_ac/step_2gpu.json \
            "$OUT"/step6_skip*/step_2gpu.json --out "$OUT" --stem step_config6_ac_2gpu ;;
    hostcost)  # host time per unit per step in the hooks, config 3's shape, ours (also with native_collectives)
               # vs FSDP2 (2 GPUs)
        run hostcost env HOST_COST_NPROC=2 timeout -k 10 200 python3 benchmarks/host_cost.py --shape config3 \
            --impls ours,ours_native,fsdp2 --out "$OUT" ;;
    memory)  # what is live at the peak of forward+backward and of the optimizer step, by owner, ours vs FSDP2
        run memory timeout -k 10 300 torchrun --standalone --nproc-per-node 2 benchmarks/memory.py --configs 1,4 \
            --out "$OUT" ;;
    noshard)  # what no_shard saves: a frozen 24-layer tower sharded vs marked (2 GPUs)
        run noshard timeout -k 10 150 torchrun --standalone --nproc-per-node 2 benchmarks/no_shard.py --out "$OUT" ;;
    fp8)  # FP8 activation quantizer, FP8 transpose and FP8 Linear: GPU tests, kernel bandwidths, Linear benchmark
        run fp8_tests timeout -k 10 300 python3 -m pytest -m gpu -q -s tests/fp8
        run fp8_kernels timeout -k 10 150 python3 benchmarks/kernels.py --parts quant,transpose --tag fp8 --out "$OUT"
        run fp8_linear timeout -k 10 150 python3 benchmarks/fp8_linear.py --out "$OUT"
        run fp8_host_cost timeout -k 10 90 python3 benchmarks/fp8_host_cost.py --out "$OUT" ;;
    fp8step)  # FP8 step rows on every GPU here: configs 1, 2 and 4; config 6 (8B shape, seq 8192) on one GPU at 16
              # of its 32 layers (8 below 100 GiB of GPU memory: ~80 GiB peak at 16)
        # fsdp2_float8 needs torchao (pip install torchao); without it step.py skips those rows with a note
        ngpu=$(nvidia-smi -L | wc -l)
        gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
        run fp8step124 timeout -k 10 240 torchrun --standalone --nproc-per-node "$ngpu" benchmarks/step.py \
            --configs 1,2,4 --impls ours,ours_fp8,ours_fused,ours_fp8_fused,fsdp2,fsdp2_float8 --out "$OUT/fp8_step"
        layers=(); [ "$ngpu" -lt 2 ] && layers=(--layers $([ "$gib" -gt 102400 ] && echo 16 || echo 8))
        run fp8step6 timeout -k 10 240 torchrun --standalone --nproc-per-node "$ngpu" benchmarks/step.py --configs 6 \
            "${layers[@]}" --impls ours_fused,ours_fp8_fused --steps 6 --warmup 2 --init meta --out "$OUT/fp8_step6" ;;
    fp8cache)  # the FP8 shard: default (cache_model_weight=None: cast per gather, kept from a third gather on),
               # kept (True), cast per gather (False): peak and step time against FSDP2 + float8, configs 1, 4 and 5
               # (4 microbatches) on every GPU here (torchao: see fp8step)
        run fp8cache timeout -k 10 300 torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" \
            benchmarks/step.py --configs 1,4,5 --impls ours_fp8,ours_fp8_fused,fsdp2_float8 --steps 14 --warmup 3 \
            --extra-ours-fp8 mp.cache_model_weight=True --extra-ours-fp8 mp.cache_model_weight=False \
            --out "$OUT/fp8_cache" ;;
    fp8host)  # host time per FP8 Linear piece, and the profile of the whole layers (1 GPU)
        run fp8_host_cost timeout -k 10 120 python3 benchmarks/fp8_host_cost.py --profile --out "$OUT" ;;
    fp8train)  # Fp8Policy in fully_shard: FP8 vs bf16 training, FP8 all-gather bytes; step time vs bf16 / torchao
        run fp8train_tests timeout -k 10 300 python3 -m pytest -m gpu -q -s tests/params/test_fp8_training.py
        run fp8train_step timeout -k 10 240 torchrun --standalone --nproc-per-node 2 benchmarks/step.py \
            --configs 2,3 --impls ours,ours_fp8,fsdp2,fsdp2_float8 --out "$OUT/fp8_step" ;;
    native)  # native_collectives=True (our own NCCL communicator) vs torch.distributed's: GPU tests, steps of
             # configs 1-5 (bf16) and 1, 4 (FP8, with FSDP2 + torchao float8: see fp8step) with the fused optimizer
        run native_tests timeout -k 10 200 python3 -m pytest -m gpu -q -s tests/comm/test_native_collectives.py \
            tests/comm/test_symm_mem.py tests/sharding/test_shard_placement.py tests/comm/test_reduce_comm_dtype.py \
            -k "(native or symm) and not grouped_collectives and not symmetric_collectives"
        run native_step timeout -k 10 300 torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" \
            benchmarks/step.py --configs 1,4,2,3,5 --impls ours_fused,fsdp2 --extra-fused native_collectives=True \
            --steps 10 --warmup 3 --out "$OUT/native_step"
        run native_fp8step timeout -k 10 200 torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" \
            benchmarks/step.py --configs 1,4 --impls ours_fused,ours_fp8_fused,fsdp2,fsdp2_float8 \
            --extra-fp8-fused native_collectives=True --no-floor --steps 10 --warmup 3 --out "$OUT/native_fp8step" ;;
    timeline)  # where the GPU waits in each config's step: compute busy, idle under communication, idle with
               # nothing running (step.py --profile-dir: a GPU-only profiled step), bf16 configs 1-5 and FP8 1, 4
        run timeline_bf16 timeout -k 10 300 torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" \
            benchmarks/step.py --configs 4,5,1,2,3 --impls ours_fused --extra-fused native_collectives=True \
            --no-floor --steps 5 --warmup 2 --profile-dir "$OUT/timeline" --out "$OUT/timeline"
        run timeline_fp8 timeout -k 10 150 torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" \
            benchmarks/step.py --configs 1,4 --impls ours_fp8_fused --extra-fp8-fused native_collectives=True \
            --no-floor --steps 5 --warmup 2 --profile-dir "$OUT/timeline_fp8" --out "$OUT/timeline_fp8" ;;
    wire)  # the default reduction of bf16 grads summed in fp32 on one host (sent in bf16: all-to-all + sum) against the
           # fp32 reduce-scatter (MixedPrecisionPolicy(reduce_comm_dtype=float32)): GPU tests, one unit's collectives,
           # steps of configs 4, 1, 5 (FP8: stage wirefp8)
        n=$(nvidia-smi -L | wc -l)
        run wire_tests timeout -k 10 200 python3 -m pytest -m gpu -q -s tests/comm/test_reduce_comm_dtype.py -k bf16_wire
        run wire_units timeout -k 10 150 torchrun --standalone --nproc-per-node "$n" benchmarks/collectives.py --units \
            --out "$OUT/wire_units"
        run wire_step timeout -k 10 300 torchrun --standalone --nproc-per-node "$n" benchmarks/step.py \
            --configs 4,1,5 --impls ours_fused,fsdp2 --extra-fused mp.reduce_comm_dtype=float32 --no-floor \
            --steps 10 --warmup 3 --out "$OUT/wire_step" ;;
    wirefp8)  # the same with FP8 weights, configs 4 and 1 (a stage of its own, to keep each stage short)
        n=$(nvidia-smi -L | wc -l)
        run wire_fp8step timeout -k 10 200 torchrun --standalone --nproc-per-node "$n" benchmarks/step.py \
            --configs 4,1 --impls ours_fused,ours_fp8_fused --extra-fused mp.reduce_comm_dtype=float32 \
            --extra-fp8-fused mp.reduce_comm_dtype=float32 --no-floor --steps 10 --warmup 3 \
            --out "$OUT/wire_fp8step" ;;
    ctas)  # how many SMs NCCL's kernels take from compute (NCCL_MAX_CTAS per kernel), configs 4 and 1, ours (both
           # transports) vs FSDP2 under the same setting; CTAS="default 16 8 4" to choose the sweep
        for n in ${CTAS:-default 16 8 4 2}; do
            env_n=(); [ "$n" = default ] || env_n=(NCCL_MAX_CTAS=$n)
            run ctas_$n env "${env_n[@]}" timeout -k 10 200 torchrun --standalone --nproc-per-node \
                "$(nvidia-smi -L | wc -l)" benchmarks/step.py --configs 4,1 --impls ours_fused,fsdp2 \
                --extra-fused native_collectives=True --no-floor --steps 10 --warmup 3 ${CTAS_PROFILE:+--profile-dir "$OUT/ctas_$n"} \
                --out "$OUT/ctas_$n"
        done ;;
    overlap)  # a matmul beside an all-gather: NCCL's against copy engines (2 GPUs; 4 if present)
        for n in 2 4; do
            [ "$(nvidia-smi -L | wc -l)" -ge $n ] && run overlap$n timeout -k 10 120 torchrun --standalone \
                --nproc-per-node $n benchmarks/overlap.py --out "$OUT"
        done ;;
    gpt200)  # a GPT trained 200 steps in bf16 and in FP8 on every GPU here: the final losses must be within 2%
        for mode in bf16 fp8; do
            flag=(); [ $mode = fp8 ] && flag=(--fp8)
            run gpt200_$mode timeout -k 10 200 torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" \
                examples/train_gpt.py --steps 200 "${flag[@]}" --metrics-file "$OUT/gpt200_$mode.jsonl"
        done
        run gpt200_compare python3 scripts/compare_final_loss.py "$OUT/gpt200_bf16.jsonl" "$OUT/gpt200_fp8.jsonl" ;;
    repeat)  # run-to-run repeatability: the main job twice per mode (bf16, FP8) with one seed and --deterministic
             # (attention on SDPA's math backend); every step's loss and gradient norm must be bit-identical
        for mode in bf16 fp8; do
            flag=(); [ $mode = fp8 ] && flag=(--fp8)
            for r in 1 2; do
                run repeat_${mode}_$r timeout -k 10 100 torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" \
                    examples/train_gpt.py --steps 20 --deterministic "${flag[@]}" --metrics-file "$OUT/repeat_${mode}_$r.jsonl"
            done
            run repeat_${mode}_compare python3 scripts/compare_final_loss.py --exact "$OUT/repeat_${mode}_1.jsonl" \
                "$OUT/repeat_${mode}_2.jsonl"
        done ;;
    race)  # the failed-step race: its GPU tests RACE_RUNS times, then the race test once with the fix
           # undone (unit.py edited here, restored after), where it must fail
        for i in $(seq "${RACE_RUNS:-3}"); do
            run race$i timeout -k 10 120 python3 -m pytest -m gpu -q -s tests/test_robustness.py -k "gather_in_flight or failed_step"
        done
        cp mfsdp_ext/unit.py "$OUT/unit.py.fixed"
        python3 - <<'EOF'
p = "mfsdp_ext/unit.py"
s = open(p).read()
kept = "instead of reading the buffer early\n            unit.show_sharded_params()\n"
assert s.count(kept) == 1, "the abandoned-iteration code moved: update this stage"
open(p, "w").write(s.replace(kept, kept + "            unit.unshard_event = None  # the fix undone\n"))
EOF
        run race_unfixed_must_fail bash -c '! timeout -k 10 120 python3 -m pytest -m gpu -q -s tests/test_robustness.py -k gather_in_flight'
        cp "$OUT/unit.py.fixed" mfsdp_ext/unit.py ;;
    graphs)  # CUDA graphs: capture/replay tests (unless the tests stage ran them), and the captured step rows, bf16
             # and FP8, on every GPU here (GRAPH_PROBE=1: also the per-feature probe, 2 GPUs)
        [[ " $stages " == *" tests "* ]] ||
            run graph_tests timeout -k 10 200 python3 -m pytest -m gpu -q tests/runtime/test_capture.py \
                tests/runtime/test_graphs.py tests/comm/test_symm_mem.py tests/integration/test_main_job.py \
                -k "captured or graphed or cuda_graph"
        [ -n "${GRAPH_PROBE:-}" ] &&
            run graph_probe timeout -k 10 300 torchrun --standalone --nproc-per-node 2 scripts/graph_probe.py
        run graph_step timeout -k 10 420 torchrun --standalone --nproc-per-node "${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}" \
            benchmarks/step.py --configs 3,2,4,1,5 --impls fsdp2_fused,fsdp2_captured,ours_fused,ours_captured,\
ours_graphed,ours_fp8_fused,ours_fp8_captured,ours_fp8_graphed --steps 10 --warmup 3 --out "$OUT/graph_step" ;;
    fastpath)  # defaults only (no flags): configs 3 and 2 eager, captured and whole-step graphed, back to back and
               # synchronised after every step, with each call's host time (SYNC_CONFIGS overrides; GRAPH_GPUS or all)
        run fastpath timeout -k 10 400 torchrun --standalone --nproc-per-node "${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}" \
            benchmarks/step.py --configs "${SYNC_CONFIGS:-3,2}" --impls fsdp2_fused,fsdp2_captured,ours_fused,\
ours_captured,ours_graphed --steps 15 --warmup 3 --sync-steps 15 --no-floor --out "$OUT/fastpath" ;;
    cedefault)  # the default ("auto": the copy engines where they fit 1% of memory) against NCCL's collectives (both flags
                # False), same run: eager, captured and whole-step graphed, back to back and synchronised after every
                # step, step time and peak; FSDP2 captured as the reference (CE_CONFIGS, default 3,2; GRAPH_GPUS or all)
        off=copy_engine_all_gather=False,copy_engine_reduce_scatter=False
        run cedefault timeout -k 10 "${CE_TIMEOUT:-400}" torchrun --standalone \
            --nproc-per-node "${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}" benchmarks/step.py --configs "${CE_CONFIGS:-3,2}" \
            --impls fsdp2_captured,ours_fused,ours_captured,ours_graphed --extra-fused "$off" --extra-captured "$off" \
            --extra-graphed "$off" --steps 15 --warmup 3 --sync-steps 15 --no-floor --out "$OUT/cedefault" ;;
    peer)  # PyTorch's own FSDP2 tests on this host's GPUs, FSDP2 and ours (scripts/fsdp2_tests.py): PEER_TESTS names the
           # folder of test_fully_shard_*.py (PyTorch's, at the installed torch's version), PEER_FILES some of them
        python3 -c "import expecttest" 2>/dev/null || echo "peer: torch's test helpers import expecttest: python3 -m pip install expecttest"
        run peer timeout -k 10 "${PEER_TIMEOUT:-560}" python3 scripts/fsdp2_tests.py --tests "${PEER_TESTS:?set PEER_TESTS}" \
            ${PEER_FILES:+--files "$PEER_FILES"} --impl both --timeout 270 --logs "$OUT/peer_logs" \
            --out "$OUT/fsdp2_tests_gpu.md" ;;
    graphs6)  # config 6 (the 8B shape, seq 8192, activation checkpointing) with CUDA graphs, bf16 (GRAPH_GPUS or all)
        run graph_step6 timeout -k 10 300 torchrun --standalone --nproc-per-node "${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}" \
            benchmarks/step.py --configs 6 --impls fsdp2_fused,fsdp2_captured,ours_fused,ours_captured,ours_graphed \
            --steps 5 --warmup 2 --init meta --no-floor --out "$OUT/graph_step6" ;;
    graphsx)  # the captured and whole-step rows of configs 3 and 1 with our other transports: use_symm_mem=True
              # (NCCL symmetric kernels), native_collectives=True (our own communicator); GPU timelines of the graphed
              # steps in $OUT/graph_timeline (GRAPH_GPUS or all)
        run graph_transports timeout -k 10 360 torchrun --standalone --nproc-per-node "${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}" \
            benchmarks/step.py --configs 3,1 --impls fsdp2_captured,ours_captured,ours_graphed \
            --extra-captured use_symm_mem=True --extra-captured native_collectives=True \
            --extra-graphed use_symm_mem=True --extra-graphed native_collectives=True --no-floor --steps 10 --warmup 3 \
            --profile-dir "$OUT/graph_timeline" --out "$OUT/graph_transports" ;;
    carveout)  # configs 3 and 1 captured and graphed, both sides, with every cuBLAS matmul leaving N SMs free for the
               # communication kernels beside it (CARVEOUTS, default 0 16 32; NCCL_MAX_CTAS as set; GRAPH_GPUS, default 2)
        n=${GRAPH_GPUS:-2}
        for c in ${CARVEOUTS:-0 16 32}; do
            run carveout$c timeout -k 10 240 torchrun --standalone --nproc-per-node "$n" benchmarks/step.py \
                --configs ${CARVEOUT_CONFIGS:-3,1} --impls fsdp2_captured,ours_captured,ours_graphed --sm-carveout $c \
                --no-floor --steps 10 --warmup 3 --out "$OUT/carveout$c"
        done ;;
    graphsce)  # the copy-engine collectives against NCCL's under CUDA graphs, configs 1-5, then config 3 with
               # reshard_after_forward=False (2 GPUs) (GRAPH_GPUS or all); their GPU test unless the tests stage ran
        n=${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}
        both=copy_engine_all_gather=True,copy_engine_reduce_scatter=True
        [[ " $stages " == *" tests "* ]] ||
            run ce_tests timeout -k 10 150 python3 -m pytest -m gpu -q tests/comm/test_copy_engine.py -k "copy_engines"
        for configs in 3,1 2,4,5; do
            run ce_step_$configs timeout -k 10 240 torchrun --standalone --nproc-per-node "$n" benchmarks/step.py \
                --configs $configs --impls fsdp2_captured,ours_captured,ours_graphed --extra-captured $both \
                --extra-graphed $both --extra-captured copy_engine_reduce_scatter=True --no-floor --steps 10 \
                --warmup 3 --out "$OUT/ce_step_$configs"
        done
        [ "$n" = 2 ] && run ce_step_3_raf timeout -k 10 150 torchrun --standalone --nproc-per-node 2 benchmarks/step.py \
            --configs 3 --impls ours_graphed --extra-fsdp2-captured reshard_after_forward=False \
            --extra-captured $both,reshard_after_forward=False --extra-graphed $both,reshard_after_forward=False \
            --extra-graphed reshard_after_forward=False --no-floor --steps 10 --warmup 3 --out "$OUT/ce_step_3_raf"
        ;;
    ceeager)  # the copy-engine collectives without graphs: ours_fused on NCCL and with both flags against FSDP2 with
              # fused AdamW, configs 1-5 (GRAPH_GPUS or all)
        run ce_eager timeout -k 10 300 torchrun --standalone --nproc-per-node "${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}" \
            benchmarks/step.py --configs 3,1,2,4,5 --impls fsdp2_fused,ours_fused \
            --extra-fused copy_engine_all_gather=True,copy_engine_reduce_scatter=True --no-floor --steps 10 \
            --warmup 3 --out "$OUT/ce_eager" ;;
    graphsce6)  # config 6 (the 8B shape) captured on NCCL and with both copy-engine flags (GRAPH_GPUS or all)
        run ce_step_6 timeout -k 10 240 torchrun --standalone --nproc-per-node "${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}" \
            benchmarks/step.py --configs 6 --impls fsdp2_captured,ours_captured \
            --extra-captured copy_engine_all_gather=True,copy_engine_reduce_scatter=True --steps 5 --warmup 2 \
            --init meta --no-floor --out "$OUT/ce_step_6" ;;
    graphsfp8)  # why FP8 graphed gains little over bf16 graphed at config 4: FP8 eager, FP8 graphed and bf16 graphed,
                # with their GPU timelines in $OUT/fp8_timeline (GRAPH_GPUS or all)
        run graph_fp8 timeout -k 10 240 torchrun --standalone --nproc-per-node "${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}" \
            benchmarks/step.py --configs 4 --impls ours_fused,ours_graphed,ours_fp8_fused,ours_fp8_graphed --no-floor \
            --steps 10 --warmup 3 --profile-dir "$OUT/fp8_timeline" --out "$OUT/graph_fp8" ;;
    graphhold)  # the whole-step graph with its first units held across replays vs gathered at each replay's start
                # (hold_first_units=False), bf16 and FP8, config 4 (GRAPH_GPUS or all); its tests unless tests ran
        [[ " $stages " == *" tests "* ]] ||
            run graph_tests timeout -k 10 150 python3 -m pytest -m gpu -q tests/runtime/test_graphs.py \
                tests/comm/test_symm_mem.py -k "graphed_whole_step or graphed_two_optimizers or release_symmetric_memory_graphed"
        run graph_hold timeout -k 10 150 torchrun --standalone --nproc-per-node "${GRAPH_GPUS:-$(nvidia-smi -L | wc -l)}" \
            benchmarks/step.py --configs "${GRAPH_CONFIGS:-4}" --impls fsdp2_captured,ours_graphed_unheld,ours_graphed,\
ours_fp8_graphed_unheld,ours_fp8_graphed --no-floor --steps 10 --warmup 3 --out "$OUT/graph_hold" ;;
    titan) run titan bash scripts/gpu_titan.sh ;;   # torchtitan at the 8B shape, FSDP2 vs ours vs ours FP8 (torchtitan: gpu_titan.sh --setup)
    jit) run jit bash scripts/gpu_jit.sh ;;          # fresh venv, no ahead-of-time build: import compiles CUDA + NCCL
    hf) run hf bash scripts/gpu_hf.sh ;;             # train_hf.py: ours vs FSDP2 (fp32 1e-5), bf16, AC + compile
    mainjob) run mainjob bash scripts/gpu_mainjob.sh ;;  # main job x3 exits 0, kill-free resume from step 6
    *) echo "unknown stage $stage"; status=1 ;;
    esac
done
exit $status
