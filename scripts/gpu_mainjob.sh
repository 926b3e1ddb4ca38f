#!/usr/bin/env bash
# The main job (scripts/train.sh) on all GPUs with the `small` model and a DCP checkpoint every 6 steps:
#   three runs of 12 steps, each must exit 0 (the first one's per-step losses are the reference);
#   then its step-12 checkpoint is removed and --resume continues from step 6: steps 7-12 must repeat the first
#   run's losses (printed: bit-exact where the GPU kernels are deterministic; the stage fails above 1e-3 relative).
# Checkpoints go to a scratch folder (not $OUT), logs to $OUT/mainjob/. Budget: about 3 minutes.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
D="$OUT/mainjob"; mkdir -p "$D"
T=$(mktemp -d -t gpu_mainjob.XXXX)
ARGS=(--model "${MODEL:-small}" --steps 12 --ckpt-every 6)  # MODEL=tiny: a CPU dry run
status=0
for i in $(seq "${RUNS:-3}"); do  # RUNS=1: a shorter check
    timeout -k 10 "${RUN_TIMEOUT:-150}" bash scripts/train.sh "${ARGS[@]}" --ckpt-dir "$T/ckpt$i" \
        --metrics-file "$D/run$i.jsonl" > "$D/run$i.log" 2>&1
    rc=$?; echo "main job run $i: exit $rc"; grep -E "^summary|terminate|Abort" "$D/run$i.log"
    [ $rc -eq 0 ] || status=1
done
rm -rf "$T/ckpt1/step-00000012"
timeout -k 10 "${RUN_TIMEOUT:-150}" bash scripts/train.sh "${ARGS[@]}" --ckpt-dir "$T/ckpt1" --resume \
    --metrics-file "$D/resumed.jsonl" > "$D/resumed.log" 2>&1
rc=$?; echo "resumed run: exit $rc"; grep -E "^resumed|^summary" "$D/resumed.log"
[ $rc -eq 0 ] || status=1
python3 - "$D/run1.jsonl" "$D/resumed.jsonl" <<'PY' || status=1
import json, sys
full, resumed = ({r["step"]: r["loss"] for r in map(json.loads, open(p))} for p in sys.argv[1:3])
steps = sorted(resumed)
diffs = [abs(resumed[s] - full[s]) / abs(full[s]) for s in steps]
print(f"resumed steps {steps}: exact {all(resumed[s] == full[s] for s in steps)}, max relative difference "
      f"{max(diffs):.2e}")
sys.exit(0 if steps == list(range(7, 13)) and max(diffs) <= 1e-3 else 1)
PY
rm -rf "$T"
exit $status
