"""DeviceHandle: streams, events and profiler labels for one device, the same calls on CPU and CUDA.

On CUDA the all-gather and reduce-scatter run on side streams ordered by events; on CPU every call here is a
no-op (there is one program order), so the callers have no device branches. Labels are ``record_function``
ranges, made only while a profiler records: they show in the PyTorch profiler on both devices (and in Nsight
under ``emit_nvtx``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from .._native import current_capture_id

_profiler_enabled = torch._C._autograd._profiler_enabled  # also true under emit_nvtx (Nsight)


class DeviceHandle:
    def __init__(self, device: torch.device):
        self.device = device
        self.has_streams = device.type == "cuda"
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if self.has_streams else None

    def new_stream(self) -> Optional[torch.cuda.Stream]:
        return torch.cuda.Stream(self.device) if self.has_streams else None

    def current_stream(self) -> Optional[torch.cuda.Stream]:
        """torch.cuda.current_stream(device) without its argument parsing, which took most of its host time (it
        is asked ~9 times per unit per step; measured with benchmarks/host_cost.py --pyprofile)."""
        if not self.has_streams:
            return None
        stream_id, index, device_type = torch._C._cuda_getCurrentStream(self.index)
        return torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=device_type)

    def use_stream(self, stream: Optional[torch.cuda.Stream]) -> contextlib.AbstractContextManager:
        """Make ``stream`` current inside the block, after it waited for the work issued so far on the current one."""
        if stream is None:
            return contextlib.nullcontext()
        current = self.current_stream()
        stream.wait_stream(current)
        if torch._C._cuda_getDevice() != self.index:  # restoring must also give the caller its device back
            return torch.cuda.stream(stream)
        return _OnStream(stream, current)

    def record_event(self, stream: Optional[torch.cuda.Stream]) -> Optional[torch.cuda.Event]:
        return stream.record_event() if stream is not None else None

    def wait_event(self, event: Optional[torch.cuda.Event]) -> None:
        """The current stream waits for ``event``."""
        if event is not None:
            self.current_stream().wait_event(event)

    def wait_stream(self, stream: Optional[torch.cuda.Stream]) -> None:
        """The current stream waits for everything issued so far on ``stream``. Under CUDA graph capture ``stream``
        is first forked from the current stream, so that it belongs to the capture even when nothing captured ran
        on it (waiting for work outside the capture would invalidate it) and ends joined to it."""
        if stream is None:
            return
        current = self.current_stream()
        if self.capturing():
            stream.wait_stream(current)
        current.wait_stream(stream)

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph."""
        return self.has_streams and torch.cuda.is_current_stream_capturing()

    def capture_id(self) -> int:
        """Which CUDA graph capture the current stream belongs to: 0 outside one; two captures differ even with
        only replays between them (a build without CUDA kernels cannot tell them apart: -1 for every one)."""
        if not self.capturing():
            return 0
        return current_capture_id(self.index) or -1

    def record_stream(self, tensor: torch.Tensor, stream: Optional[torch.cuda.Stream]) -> None:
        """``tensor`` (allocated on the current stream) is used on ``stream``: keep its memory until that use ends."""
        if stream is not None:
            if isinstance(tensor, DTensor):  # a tensor-parallel gradient: DTensor has no record_stream rule
                tensor = tensor._local_tensor
            tensor.record_stream(stream)

    @staticmethod
    def label(name: str) -> contextlib.AbstractContextManager:
        """A named range while a profiler records (a few microseconds each, so none otherwise)."""
        return record_function(name) if _profiler_enabled() else contextlib.nullcontext()


class _OnStream:
    """``torch.cuda.stream(stream)`` where the current device is the stream's, given that device's current stream
    (what that context manager looks up again on entry, with device checks this case does not need)."""

    __slots__ = ("stream", "previous")

    def __init__(self, stream: torch.cuda.Stream, previous: torch.cuda.Stream):
        self.stream, self.previous = stream, previous

    def __enter__(self):
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc):
        torch.cuda.set_stream(self.previous)
        return False


def cuda_median_ms(fn, iters: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream, timed by events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
