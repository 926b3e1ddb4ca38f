#!/usr/bin/env bash
# Ours at a reference commit vs ours in this tree, on the same machine, interleaved (ref, new, ref, new), so that
# a code change is judged apart from the machine-to-machine spread of host-bound configs:
#
#   git archive -o ab_ref.tar <commit>        # the reference source, as a tarball
#   CONFIGS=2,3 ROUNDS=2 bash scripts/gpu_ab.sh ab_ref.tar
#
# Builds the reference in place in a temporary folder (the tree's own build is the installed one), runs benchmarks/step.py
# with --impls ours --no-floor for each side, and prints the medians side by side (logs under $OUT/ab).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

REF_TAR=$(realpath "${1:?usage: gpu_ab.sh REF_TARBALL}")
CONFIGS=${CONFIGS:-2,3}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-10}
NGPU=${NGPU:-2}
IMPL=${AB_IMPL:-ours}  # the step.py variant both sides run (ours_fused: with mfsdp_ext.optim.AdamW)
AB=$OUT/ab; mkdir -p "$AB"
REF=$(mktemp -d -t ab_ref.XXXX)
tar xf "$REF_TAR" -C "$REF"
(cd "$REF" && MAX_JOBS=16 python3 setup.py build_ext --inplace) > "$AB/build_ref.log" 2>&1 \
    || { echo "reference build failed:"; tail -20 "$AB/build_ref.log"; exit 1; }

for round in $(seq "$ROUNDS"); do
    for side in ref new; do
        root=$ROOT; [ $side = ref ] && root=$REF
        echo "== round $round: $side ($root)"
        # PYTHONPATH first: each side imports its own mfsdp_ext, whatever is installed
        PYTHONPATH=$root timeout -k 10 200 torchrun --standalone --nproc-per-node "$NGPU" "$root/benchmarks/step.py" \
            --configs "$CONFIGS" --impls "$IMPL" --no-floor --steps "$STEPS" --out "$AB/${side}_$round" ${AB_ARGS:-} \
            > "$AB/${side}_$round.log" 2>&1 || { echo "!! $side round $round failed"; tail -20 "$AB/${side}_$round.log"; }
    done
done
python3 - "$AB" "$IMPL" <<'EOF'
import glob, json, os, statistics, sys
ab, impl = sys.argv[1], sys.argv[2]
ms, peak = {}, {}
for path in sorted(glob.glob(os.path.join(ab, "*_*/*.json"))):
    side = os.path.basename(os.path.dirname(path)).split("_")[0]
    for result in json.load(open(path))["results"]:
        ours = result["variants"].get(impl, {})
        if "median_ms" in ours:  # a failed run records its error instead (see its log)
            ms.setdefault((result["id"], side), []).append(ours["median_ms"])
            peak[result["id"], side] = ours.get("peak_gib", float("nan"))
print(f"{impl}\n| cfg | ref ms (per round) | new ms (per round) | new/ref (medians) | peak GiB ref / new |\n|---|---|---|---|---|")
for cfg in sorted({c for c, _ in ms}):
    ref, new = ms.get((cfg, "ref"), []), ms.get((cfg, "new"), [])
    ratio = statistics.median(new) / statistics.median(ref) if ref and new else float("nan")
    print(f"| {cfg} | {', '.join(f'{x:.1f}' for x in ref)} | {', '.join(f'{x:.1f}' for x in new)} | {ratio:.3f} "
          f"| {peak.get((cfg, 'ref'), float('nan')):.2f} / {peak.get((cfg, 'new'), float('nan')):.2f} |")
EOF
