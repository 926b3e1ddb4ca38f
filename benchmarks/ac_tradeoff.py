"""What saved memory buys: step time against peak memory as fewer blocks are recomputed, from step.py's JSON files.

    python3 benchmarks/ac_tradeoff.py RUN.json [RUN.json ...] --out DIR [--stem NAME]

Each RUN.json is one `benchmarks/step.py` report (e.g. config 6 with `--ac-skip-last K` for several K, and one
run with every block checkpointed that includes FSDP2). Every (config, variant) of every file becomes a row,
sorted by variant and then by the number of blocks recomputed; the chart plots step time against peak memory,
with FSDP2's peak as the line to stay under.
"""

from __future__ import annotations

import argparse
import json
import os

from step import BenchConfig  # (benchmarks/ is this script's directory)


def rows_of(paths: list[str]) -> tuple[list[dict], dict]:
    rows, env = [], {}
    for path in paths:
        report = json.load(open(path))
        env = env or report["environment"]
        for result in report["results"]:
            c = result["config"]
            n = c["n_layers"]
            model = BenchConfig(**c).model_config()  # the report's config: its own rule for what is recomputed
            recomputed = sum(map(model.checkpointed, range(n)))
            for name, v in result["variants"].items():
                rows.append(dict(variant=name, recomputed=recomputed, n_layers=n, ms=v["median_ms"],
                                 peak=v["peak_gib"], rest=v["resting_gib"], mfu=v.get("mfu"),
                                 source=os.path.basename(path)))
    rows.sort(key=lambda r: (r["variant"] != "fsdp2", r["variant"], -r["recomputed"]))
    return rows, env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--stem", default="ac_tradeoff")
    args = p.parse_args()
    rows, env = rows_of(args.runs)
    fsdp2 = [r for r in rows if r["variant"] == "fsdp2"]
    ref = fsdp2[0] if fsdp2 else None
    lines = [f"# What saved memory buys: blocks recomputed vs step time, {env.get('world')} x {env.get('gpu', 'cpu')}",
             "", f"{env.get('date', '')}, torch {env.get('torch')}; `benchmarks/step.py` medians (`--ac-skip-last K`: "
             "the last K blocks are not checkpointed), merged by `benchmarks/ac_tradeoff.py`. Peak = "
             "max_memory_allocated; MFU as in step.py (recompute not counted).", "",
             "| variant | blocks recomputed | step ms | MFU | peak GiB | rest GiB | vs FSDP2 time "
             "| peak - FSDP2's GiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = f"{ref['ms'] / r['ms']:.3f}x" if ref else "-"
        dpeak = f"{r['peak'] - ref['peak']:+.2f}" if ref else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        lines.append(f"| {r['variant']} | {r['recomputed']} / {r['n_layers']} | {r['ms']:.1f} | {mfu} | "
                     f"{r['peak']:.2f} | {r['rest']:.2f} | {vs} | {dpeak} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.stem)
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(dict(environment=env, rows=rows), f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no chart")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = [r for r in rows if r["variant"] == variant]
        ax.plot([r["peak"] for r in pts], [r["ms"] for r in pts], "o-", label=variant)
        for r in pts:
            ax.annotate(str(r["recomputed"]), (r["peak"], r["ms"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    if ref:
        ax.axvline(ref["peak"], color="gray", ls="--", lw=1, label="FSDP2's peak")
    ax.set_xlabel("peak GiB (max_memory_allocated)")
    ax.set_ylabel("step ms (median)")
    ax.set_title("step time vs memory; labels: blocks recomputed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print(f"wrote {stem}.md / .json / .png")


if __name__ == "__main__":
    main()
