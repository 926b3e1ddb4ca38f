"""Where a profiled step's GPU time goes: compute busy, waiting with only communication kernels running (an exposed
transfer, or an NCCL kernel spinning until a late peer rank joins: the two look alike here), or waiting with
nothing running (the host is late: launch or Python cost, or a host wait).

    breakdown(kernels) -> dict    kernels: (name, start_us, end_us) of every kernel, copy and memset of one step

Kernels whose name starts with "nccl" are communication; everything else is compute. The window is the first
kernel's start to the last kernel's end. Used by ``benchmarks/step.py --profile-dir``.
"""

from __future__ import annotations

Interval = tuple[float, float]


def merge(intervals: list[Interval]) -> list[Interval]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def complement(intervals: list[Interval], window: Interval) -> list[Interval]:
    """The parts of window that merged, disjoint ``intervals`` do not cover."""
    out, at = [], window[0]
    for start, end in intervals:
        if start > at:
            out.append((at, min(start, window[1])))
        at = max(at, end)
    if at < window[1]:
        out.append((at, window[1]))
    return [(s, e) for s, e in out if e > s]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two merged, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def is_communication(name: str) -> bool:
    return name.lower().startswith("nccl")


def breakdown(kernels: list[tuple[str, float, float]], largest: int = 5) -> dict:
    """Milliseconds of the window: compute busy, idle while communication runs, idle with nothing running; and the
    ``largest`` idle gaps (offset from the window's start, length, and the communication kernels under them)."""
    if not kernels:
        return {"window_ms": 0.0, "compute_ms": 0.0, "idle_comm_ms": 0.0, "idle_none_ms": 0.0, "gaps": []}
    window = (min(k[1] for k in kernels), max(k[2] for k in kernels))
    compute = merge([(s, e) for n, s, e in kernels if not is_communication(n)])
    comm = merge([(s, e) for n, s, e in kernels if is_communication(n)])
    idle = complement(compute, window)
    idle_comm = intersect(idle, comm)
    gaps = []
    for start, end in sorted(idle, key=lambda g: g[0] - g[1])[:largest]:
        under = sorted({n.split("(")[0][:48] for n, s, e in kernels if is_communication(n) and s < end and e > start})
        gaps.append({"at_ms": (start - window[0]) / 1e3, "ms": (end - start) / 1e3, "communication": under})
    return {"window_ms": (window[1] - window[0]) / 1e3, "compute_ms": total(compute) / 1e3,
            "idle_comm_ms": total(idle_comm) / 1e3, "idle_none_ms": (total(idle) - total(idle_comm)) / 1e3,
            "gaps": gaps}


def describe(b: dict) -> str:
    lines = [f"GPU timeline of the profiled step: window {b['window_ms']:.1f} ms = compute busy {b['compute_ms']:.1f} "
             f"+ idle while only NCCL kernels run {b['idle_comm_ms']:.1f} (a transfer, or a wait for a late peer) "
             f"+ idle with nothing running {b['idle_none_ms']:.1f} (the host is late)"]
    for g in b["gaps"]:
        under = ", ".join(g["communication"]) or "nothing"
        lines.append(f"  gap at {g['at_ms']:.1f} ms: {g['ms']:.2f} ms, under it: {under}")
    return "\n".join(lines)
