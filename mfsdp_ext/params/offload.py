"""HostOffload: FSDP2's ``CPUOffloadPolicy`` for a group on a CUDA mesh: its fp32 main weight, gradient and optimizer
state in host memory; the device holds its weights only gathered (or a kept compute-dtype shard, when asked).

[Note: CPU offload]
``main_weight`` and ``main_grad`` are host tensors (pinned with ``pin_memory=True``), so the parameters, their
``.grad`` and the optimizer state (made where the main weight is) are DTensors with CPU local tensors on the group's
mesh, as FSDP2's are; the optimizer steps them on the host. What the collectives read and write stays on the device:
  * weights: the compute-dtype shard is made on the host once per weights version (ParamGroup.sync_model_weight, at
    the first gather after an optimizer step): the host casts the main weight into a new pinned buffer
    (``compute_copy``, ``_native.cast``). Each all-gather then copies this rank's chunks from it into their slots of
    the unsharded buffer (one H2D copy per parameter on the all-gather stream, prefetched with the all-gather) and
    gathers in place, so the GPU holds no shard of an offloaded group, as with FSDP2's offload; what crosses PCIe
    per gather is the compute dtype (2 bytes per parameter for bf16) where FSDP2 sends the fp32 shard (4).
    ``cache_model_weight=True`` keeps the compute-dtype shard on the device instead, copied once per weights
    version: less PCIe traffic for ``param_dtype`` bytes per parameter / world of GPU memory. A new buffer per
    version (not one rewritten in place) is what keeps a copy in flight apart from the next version. An optimizer
    stepping in backward has the worker cast the next version right behind its step (``cast_ahead``), off the
    forward's critical path. Each group has its own HostOffload (``for_group``), which holds that shard.
  * gradients: the reduced shard (device, reduce dtype) goes D2H on the reduce-scatter stream right behind its
    reduction: straight into a fresh ``main_grad`` when nothing is to be added or cast, else into a staging buffer
    that the worker thread adds into ``main_grad`` (the native CPU ``grad_accumulate``) once the copy's event has
    completed, so the copy and the sum of one group overlap the backward of the others. Every host write to a
    ``main_grad`` during the backward runs on that one thread, in submission order; the root's final callback waits
    for it (``drain``), so ``.grad`` is complete when backward returns.
Staging buffers come from torch's pinned (caching host) allocator, one per copy: a non_blocking copy records its event
on the block, which is reused only once that copy is done. With ``pin_memory=False`` nothing is pinned and the copies
wait on the host, as CUDA copies between pageable memory and the device do (FSDP2's too).
On a CPU mesh everything is in host memory already: no HostOffload, the groups are plain (no staging, no thread).
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from .. import _native
from ..core import registry
from ..core.flat_buffer import FlatBuffer
from ..core.layout import FlatLayout

HOST = torch.device("cpu")


def host_offload(policy: Any, device: torch.device, *, fp8: bool) -> Optional[HostOffload]:
    """What ``fully_shard(offload_policy=policy)`` (torch's ``CPUOffloadPolicy``, or None for no offload) does for a
    unit on ``device``: a HostOffload, or None where nothing moves (no policy, or a CPU mesh).

    Raises:
        ValueError: offload with FP8 weights.
    """
    if policy is None:
        return None
    if fp8:
        raise ValueError("fully_shard: offload_policy=CPUOffloadPolicy() with FP8 weights (MixedPrecisionPolicy("
                         "fp8=...)) is not supported: the FP8 scales and casts are computed from the fp32 main weights "
                         "on the device every step. Pass offload_policy=None, or drop fp8=...")
    if device.type == "cpu":
        return None
    return HostOffload(pin_memory=bool(policy.pin_memory))


class HostOffload:
    """Where an offloaded group's main buffers live, its compute-dtype shard in host memory, and the copies of its
    weights and gradients to and from the device (see the note)."""

    def __init__(self, *, pin_memory: bool):
        self.pin_memory = pin_memory
        self.weight: Optional[FlatBuffer] = None  # the compute-dtype shard of the weights version last synced
        # a compute-dtype shard being cast on the worker (cast_ahead), and the writes to the main weight it saw
        self.ahead: Optional[tuple[Future, tuple]] = None

    def for_group(self) -> HostOffload:
        """A group's own HostOffload under this policy (it holds that group's compute-dtype shard)."""
        return HostOffload(pin_memory=self.pin_memory)

    def buffer(self, layout: FlatLayout, dtype: torch.dtype, rank: int) -> FlatBuffer:
        """A shard-layout buffer in host memory (the main weight, a gradient shard)."""
        try:
            return FlatBuffer(layout, dtype, HOST, rank=rank, pin_memory=self.pin_memory)
        except RuntimeError as e:
            raise _pinning_failed(layout.shard_numel * dtype.itemsize, e) from e

    def _staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)
        except RuntimeError as e:
            raise _pinning_failed(numel * dtype.itemsize, e) from e

    def sync_weight(self, main_weight: FlatBuffer, dtype: torch.dtype, version: tuple) -> bool:
        """``weight`` = ``main_weight`` in ``dtype`` at weights version ``version`` (ParamGroup.sync_model_weight's):
        the shard cast ahead when only optimizer steps wrote the main weight since (True), else cast now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[1] == version[1:4]:
            self.weight = ahead[0].result()
            return True
        self.weight = self.compute_copy(main_weight, dtype)
        return False

    def cast_ahead(self, main_weight: FlatBuffer, dtype: torch.dtype, unwritten: tuple) -> None:
        """Right after an optimizer step of the group queued on the worker (a step in backward:
        optim/in_backward.py), cast the compute-dtype shard of its new main weight there too, under the backward,
        instead of at the next gather on the main thread. (Beside an optimizer step on the main thread it would only
        compete with it for the host's threads and memory bandwidth: slower in a run at the 8B shape.)
        ``unwritten``: the group's weights_version()[1:] now; sync_weight takes the copy if the version then differs
        by optimizer steps alone (the step that made it)."""
        self.ahead = (run_on_worker(functools.partial(self.compute_copy, main_weight, dtype)), unwritten)

    def forget_weight(self) -> None:
        """New main-weight storage: no compute-dtype shard made from the old one is used again."""
        self.weight = self.ahead = None

    def compute_copy(self, main_weight: FlatBuffer, dtype: torch.dtype) -> FlatBuffer:
        """``main_weight`` cast to ``dtype`` on the host, into a new buffer: pinned, a block of torch's caching host
        allocator, which hands a block out again only once the copies that read it have completed, so a new weights
        version never overwrites a shard still being copied to the device."""
        copy = self.buffer(main_weight.layout, dtype, main_weight.rank)
        _native.cast(main_weight.data, copy.data)
        return copy

    def upload(self, host: torch.Tensor, device: torch.Tensor) -> None:
        """``device`` = ``host`` (same dtype and size): one H2D copy on the current stream."""
        device.copy_(host, non_blocking=self.pin_memory)

    def upload_slots(self, params: list[int], slots: list[torch.Tensor]) -> None:
        """Each of ``params``' chunk slot of ``weight`` into its place ``slots[k]`` on the device (this rank's slots
        of the unsharded buffer, where the all-gather reads and writes in place): one H2D copy each."""
        for i, slot in zip(params, slots):
            slot.copy_(self.weight.chunk_slot(i), non_blocking=self.pin_memory)

    def download_grad(self, main_grad: FlatBuffer, reduced: torch.Tensor, *, scale: float, accumulate: bool,
                      restart: list[int]) -> None:
        """``main_grad`` (host) = or += ``scale * reduced`` (``accumulate``), ``reduced`` being on the device, written
        by the current stream: the D2H copy goes on that stream, the sum on the worker after it. ``restart``: the
        parameters whose part of ``main_grad`` starts afresh (zeroed first, on the worker)."""
        direct = not accumulate and scale == 1.0 and reduced.dtype == main_grad.dtype and not restart
        target = main_grad.data if direct else self._staging(reduced.numel(), reduced.dtype)
        target.copy_(reduced, non_blocking=self.pin_memory)
        event = torch.cuda.current_stream(reduced.device).record_event() if reduced.is_cuda else None
        work = None if direct else functools.partial(_add_into, main_grad, target, scale, accumulate, restart)
        _worker().submit(event, work)


def _add_into(main_grad: FlatBuffer, staged: torch.Tensor, scale: float, accumulate: bool, restart: list[int]) -> None:
    for i in restart:
        main_grad.param_view(i).zero_()
    _native.grad_accumulate(main_grad.data, staged, scale, accumulate)


def _pinning_failed(nbytes: int, error: RuntimeError) -> RuntimeError:
    return RuntimeError(f"fully_shard(offload_policy=CPUOffloadPolicy()): {nbytes} bytes of pinned host memory could "
                        f"not be allocated ({error}). Pass offload_policy=CPUOffloadPolicy(pin_memory=False): the "
                        "same training from pageable memory, whose copies to and from the GPU wait on the host")


class _Worker:
    """The process's offload thread: runs each job once its CUDA event has completed, one after the other, in the
    order submitted (the native CPU kernels and ``Event.synchronize`` release the GIL): gradient sums, and the
    optimizer steps queued behind them (optim/in_backward.py)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsdp_ext-offload")
        self.pending: list[Future] = []

    def submit(self, event: Optional[torch.cuda.Event], work: Any) -> Future:
        """``work()`` once ``event`` (None: nothing to wait for) has completed, after the jobs submitted before."""
        future = self.executor.submit(_run, event, work)
        self.pending.append(future)
        return future

    def drain(self) -> None:
        """Wait for every job submitted so far; raise the first one's error, if any."""
        pending, self.pending = self.pending, []
        errors = [f.exception() for f in pending]  # waits for each
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise RuntimeError("mfsdp_ext: the host work of an offloaded group (a gradient's sum into its host shard, "
                               "or its optimizer step) failed") from first


def _run(event: Optional[torch.cuda.Event], work: Any) -> Any:
    if event is not None:
        event.synchronize()
    return work() if work is not None else None


def _worker() -> _Worker:
    worker = registry.OFFLOAD_WORKER.get("worker")
    if worker is None:
        worker = registry.OFFLOAD_WORKER["worker"] = _Worker()
    return worker


def run_on_worker(work: Any) -> Future:
    """``work()`` on the offload thread, after everything queued so far (e.g. an optimizer's step of a group whose
    gradient sum was queued: optim/in_backward.py); its future, which ``drain`` also waits for."""
    return _worker().submit(None, work)


def drain() -> None:
    """Wait until every offloaded gradient copied so far is in its host shard, and every job queued behind them
    (steps in backward, casts ahead) is done (nothing to do where none was: no offload, or a CPU mesh)."""
    worker = registry.OFFLOAD_WORKER.get("worker")
    if worker is not None and worker.pending:
        worker.drain()
