"""DeviceHandle (mfsdp_ext/device.py): its stream calls do what torch.cuda's do, on CPU (no-ops) and CUDA."""

import pytest
import torch

from mfsdp_ext.core.device import DeviceHandle

HAS_CUDA = torch.cuda.is_available()


def test_cpu_calls_are_no_ops():
    h = DeviceHandle(torch.device("cpu"))
    assert h.new_stream() is None and h.current_stream() is None and h.record_event(None) is None
    with h.use_stream(None):
        pass
    h.wait_event(None)
    h.wait_stream(None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_streams_match_torch(device):
    """current_stream equals torch.cuda.current_stream; use_stream makes the side stream current, orders it after
    the work issued before (a value written on the caller's stream is seen), and gives back the caller's stream,
    a user stream as well as the default one."""
    h = DeviceHandle(torch.device(device))
    side = h.new_stream()
    user = torch.cuda.Stream()
    for outer in (torch.cuda.default_stream(), user):
        with torch.cuda.stream(outer):
            assert h.current_stream() == torch.cuda.current_stream() == outer
            x = torch.full((1 << 20,), 3.0, device="cuda")
            with h.use_stream(side):
                assert torch.cuda.current_stream() == side
                y = x * 2  # on the side stream, after x's fill on outer
            assert torch.cuda.current_stream() == outer
            h.wait_stream(side)
            assert torch.equal(y, torch.full_like(x, 6.0))
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
