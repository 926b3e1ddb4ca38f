"""benchmarks/timeline.py: the GPU-time breakdown of a profiled step, on a made-up timeline with known answers."""

from __future__ import annotations

from tests.conftest import load_script_modules

(timeline,) = load_script_modules("benchmarks", "timeline")


def test_breakdown_of_a_known_timeline():
    us = 1000.0  # the profiler's unit is microseconds; the breakdown reports milliseconds
    kernels = [
        ("gemm", 0 * us, 4 * us),
        ("ncclDevKernel_AllGather_RING_LL(x)", 2 * us, 7 * us),  # 4-7 ms: compute waits on it (3 ms exposed)
        ("rms_norm", 7 * us, 8 * us),
        ("gemm", 10 * us, 12 * us),  # 8-10 ms: nothing runs (2 ms, the host is late)
        ("gemm", 11 * us, 13 * us),  # overlaps the previous compute kernel: counted once
        ("ncclDevKernel_ReduceScatter_Sum_f32(x)", 13 * us, 14 * us),  # the tail: 1 ms exposed
    ]
    b = timeline.breakdown(kernels, largest=2)
    assert b["window_ms"] == 14.0
    assert b["compute_ms"] == 4.0 + 1.0 + 3.0
    assert b["idle_comm_ms"] == 3.0 + 1.0
    assert b["idle_none_ms"] == 2.0
    assert [(g["at_ms"], g["ms"]) for g in b["gaps"]] == [(4.0, 3.0), (8.0, 2.0)]
    assert b["gaps"][0]["communication"] == ["ncclDevKernel_AllGather_RING_LL"]
    assert b["gaps"][1]["communication"] == []
    assert "the host is late" in timeline.describe(b)


def test_interval_helpers():
    assert timeline.merge([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert timeline.complement([(1, 2), (4, 5)], (0, 6)) == [(0, 1), (2, 4), (5, 6)]
    assert timeline.intersect([(0, 3), (5, 9)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert timeline.breakdown([])["window_ms"] == 0.0
