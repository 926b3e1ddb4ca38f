"""Compare where two training runs end: python3 scripts/compare_final_loss.py REF.jsonl OTHER.jsonl [--tol 0.02].

Each file holds one JSON line per step ({"step", "loss", ...}, train_gpt.py's --metrics-file). Prints the final
losses and the means over the last 10 steps, and exits 1 when those means differ by more than --tol (relative to
REF). The mean is the gate because one step's loss on a small batch jumps by several percent.
"""
import argparse
import json
import sys


def losses(path: str) -> list[float]:
    rows = sorted((json.loads(line) for line in open(path) if line.strip()), key=lambda r: r["step"])
    return [r["loss"] for r in rows]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("ref")
    p.add_argument("other")
    p.add_argument("--tol", type=float, default=0.02)
    p.add_argument("--last", type=int, default=10)
    args = p.parse_args()
    ref, other = losses(args.ref), losses(args.other)
    if len(ref) != len(other) or len(ref) < args.last:
        print(f"runs differ in length or are too short: {len(ref)} vs {len(other)} steps")
        return 1
    ref_mean, other_mean = (sum(x[-args.last:]) / args.last for x in (ref, other))
    rel = (other_mean - ref_mean) / ref_mean
    print(f"{len(ref)} steps: final loss {ref[-1]:.4f} (ref) vs {other[-1]:.4f} ({(other[-1] - ref[-1]) / ref[-1]:+.2%}); "
          f"mean of the last {args.last}: {ref_mean:.4f} vs {other_mean:.4f} ({rel:+.2%}, limit {args.tol:.0%})")
    return 0 if abs(rel) <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
