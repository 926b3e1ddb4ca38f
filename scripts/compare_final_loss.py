"""Compare two training runs: python3 scripts/compare_final_loss.py REF.jsonl OTHER.jsonl [--tol 0.02 | --exact].

Each file holds one JSON line per step ({"step", "loss", "grad_norm", ...}, train_gpt.py's --metrics-file).
Default: prints the final losses and the means over the last 10 steps, and exits 1 when those means differ by more
than --tol (relative to REF). The mean is the gate because one step's loss on a small batch jumps by several percent.
--exact: exits 1 unless every step's loss and gradient norm are bit-identical (a run repeated with one seed).
"""
import argparse
import json
import sys


def rows(path: str) -> list[dict]:
    return sorted((json.loads(line) for line in open(path) if line.strip()), key=lambda r: r["step"])


def compare_exact(ref: list[dict], other: list[dict]) -> int:
    keys = ("step", "loss", "grad_norm")
    for a, b in zip(ref, other):
        if any(a.get(k) != b.get(k) for k in keys):
            print(f"step {a['step']}: loss {a['loss']!r} vs {b.get('loss')!r}, grad_norm {a.get('grad_norm')!r} vs "
                  f"{b.get('grad_norm')!r}: the runs differ (first difference)")
            return 1
    print(f"{len(ref)} steps: every loss and gradient norm bit-identical (last loss {ref[-1]['loss']!r})")
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("ref")
    p.add_argument("other")
    p.add_argument("--tol", type=float, default=0.02)
    p.add_argument("--last", type=int, default=10)
    p.add_argument("--exact", action="store_true", help="every step's loss and grad_norm must be bit-identical")
    args = p.parse_args()
    ref_rows, other_rows = rows(args.ref), rows(args.other)
    if len(ref_rows) != len(other_rows) or len(ref_rows) < (1 if args.exact else args.last):
        print(f"runs differ in length or are too short: {len(ref_rows)} vs {len(other_rows)} steps")
        return 1
    if args.exact:
        return compare_exact(ref_rows, other_rows)
    ref, other = [r["loss"] for r in ref_rows], [r["loss"] for r in other_rows]
    ref_mean, other_mean = (sum(x[-args.last:]) / args.last for x in (ref, other))
    rel = (other_mean - ref_mean) / ref_mean
    print(f"{len(ref)} steps: final loss {ref[-1]:.4f} (ref) vs {other[-1]:.4f} "
          f"({(other[-1] - ref[-1]) / ref[-1]:+.2%}); "
          f"mean of the last {args.last}: {ref_mean:.4f} vs {other_mean:.4f} ({rel:+.2%}, limit {args.tol:.0%})")
    return 0 if abs(rel) <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
