"""Host time of the stream calls a unit makes per gather / reduction (one GPU): DeviceHandle vs torch.cuda's API.

    python3 benchmarks/device_handle.py

The sequence, as fully_shard runs it around an all-gather or a reduce-scatter: make a side stream current after
it waits for the current one, record an event on it, let the current stream wait for the event and for the side
stream. "torch.cuda" writes it with torch.cuda.current_stream(device) and torch.cuda.stream(...); "DeviceHandle" is
mfsdp_ext/device.py. Median of 7 rounds of 5000 sequences,
microseconds per sequence; also one current_stream call alone.
"""

import statistics
import sys

import kernels as K  # (time_host) benchmarks/kernels.py: this script's folder
import torch

from mfsdp_ext.core.device import DeviceHandle


def torch_cuda_sequence(device: torch.device, side: torch.cuda.Stream):
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        event = side.record_event()
    torch.cuda.current_stream(device).wait_event(event)
    torch.cuda.current_stream(device).wait_stream(side)


def handle_sequence(h: DeviceHandle, side: torch.cuda.Stream):
    with h.use_stream(side):
        event = h.record_event(side)
    h.wait_event(event)
    h.wait_stream(side)


def median_us(fn, calls: int) -> float:
    """Median over 7 rounds of kernels.py's time_host (``calls`` back-to-back calls), in microseconds."""
    for _ in range(calls // 2):
        fn()
    return statistics.median(K.time_host(fn, calls) for _ in range(7)) * 1e6


def main() -> int:
    if not torch.cuda.is_available():
        print("benchmarks/device_handle.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    h = DeviceHandle(device)
    side = h.new_stream()
    rows = {
        "sequence, torch.cuda": median_us(lambda: torch_cuda_sequence(device, side), 5000),
        "sequence, DeviceHandle": median_us(lambda: handle_sequence(h, side), 5000),
        "current_stream, torch.cuda": median_us(lambda: torch.cuda.current_stream(device), 20000),
        "current_stream, DeviceHandle": median_us(h.current_stream, 20000),
    }
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: host us per call")
    for name, us in rows.items():
        print(f"{name:32s} {us:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
