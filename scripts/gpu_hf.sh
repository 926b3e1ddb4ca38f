#!/usr/bin/env bash
# examples/train_hf.py (HuggingFace LlamaForCausalLM, the built-in ~0.4 B GPU config) on 2 GPUs:
#   fp32, eager attention: ours vs FSDP2 over 10 steps, losses within 1e-5 relative (fails the stage otherwise);
#   bf16 (the default): ours and FSDP2, 30 steps (loss falls, tok/s side by side);
#   bf16 with HuggingFace activation checkpointing and torch.compile of each layer, ours and FSDP2, 15 steps.
# Logs and per-step losses (JSON lines) go to $OUT/hf/. Budget: about 6 minutes.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
N=${NPROC:-$(nvidia-smi -L | wc -l)}; N=$(( N > 2 ? 2 : N ))  # NPROC: a CPU dry run
D="$OUT/hf"; mkdir -p "$D"
status=0
run_hf() {  # run_hf NAME FLAGS...
    local name=$1; shift
    echo "== train_hf.py on $N GPU(s): $name ($*)"
    timeout -k 10 "${HF_TIMEOUT:-200}" torchrun --standalone --nproc-per-node "$N" examples/train_hf.py \
        --metrics-file "$D/$name.jsonl" "$@" > "$D/$name.log" 2>&1
    local rc=$?
    grep -E "^(model|compute|step +1 |summary)|Error|--compile" "$D/$name.log" | tail -n 6
    [ $rc -eq 0 ] || { echo "!! $name exited $rc"; status=1; }
}
run_hf fp32_ours --impl ours --dtype fp32 --attn-implementation eager --steps 10
run_hf fp32_fsdp2 --impl fsdp2 --dtype fp32 --attn-implementation eager --steps 10
python3 - "$D/fp32_ours.jsonl" "$D/fp32_fsdp2.jsonl" <<'PY' || status=1
import json, sys
ours, fsdp2 = ([json.loads(line)["loss"] for line in open(p)] for p in sys.argv[1:3])
err = max(abs(a - b) / abs(b) for a, b in zip(ours, fsdp2))
print(f"fp32 ours vs FSDP2, {len(ours)} steps: max relative loss difference {err:.2e} (limit 1e-5)")
print("ours :", ours, "\nfsdp2:", fsdp2)
sys.exit(0 if len(ours) == len(fsdp2) == 10 and err <= 1e-5 else 1)
PY
[ "${HF_QUICK:-0}" = 1 ] && { run_hf bf16_ours_ac_compile --impl ours --steps 15 --activation-checkpointing --compile
                              exit $status; }  # HF_QUICK=1: the fp32 parity and one compiled run only
run_hf bf16_ours --impl ours --steps 30
run_hf bf16_fsdp2 --impl fsdp2 --steps 30
run_hf bf16_ours_ac_compile --impl ours --steps 15 --activation-checkpointing --compile
run_hf bf16_fsdp2_ac_compile --impl fsdp2 --steps 15 --activation-checkpointing --compile
exit $status
