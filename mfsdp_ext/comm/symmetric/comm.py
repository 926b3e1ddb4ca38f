"""NCCL symmetric-memory collectives: a communicator, a symmetric pool, all-gather and reduce-scatter.

The native side is ``mfsdp_ext._C.SymmComm`` (csrc/symm_comm.cpp). This module builds it from a torch
``ProcessGroup`` and says clearly why it cannot when it cannot. It imports on every build (no NCCL or CUDA part
of the extension is needed until a communicator is made), and ``is_available()`` says what is missing.

How it works
    * The communicator is borrowed from ``ProcessGroupNCCL`` (``pg._get_backend(dev)._comm_ptr()``; init the
      group with ``init_process_group("nccl", device_id=...)`` so it exists) or, failing that, created by
      the extension from an ``ncclUniqueId`` shared through the group's store.
    * The pool is one or a few ``ncclMemAlloc`` regions, each registered once as an
      ``NCCL_WIN_COLL_SYMMETRIC`` window. Tensors are sub-allocated at 4096-aligned offsets by a
      deterministic allocator: **every rank must make the same alloc/free calls in the same order** (the
      offsets then agree, which is what NCCL's symmetric kernels require). Growing the pool and ``close()``
      are collective.
    * ``all_gather_into`` / ``reduce_scatter_into`` run ``ncclAllGather`` / ``ncclReduceScatter`` on the
      current torch CUDA stream. Both tensors must come from this pool; anything else belongs to the plain
      ``torch.distributed`` path (``mfsdp_ext.comm.collectives``). NCCL picks its symmetric kernels
      (``ncclSymkDevKernel_*``) only on one node with direct NVLink; NCCL never checks that they are faster,
      so choose per collective and size from measurement (benchmarks/collectives.py).
    * Averaging: NCCL < 2.30.3 has no symmetric ``ncclAvg`` (nor PreMulSum), so ``average=True`` reduces
      with SUM and multiplies the (1/world-sized) output by 1/world on the same stream.

Example::

    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    ok, why = symmetric.is_available(dist.group.WORLD)
    if ok:
        comm = symmetric.SymmetricComm(dist.group.WORLD, pool_bytes=512 << 20)
        full = comm.alloc_tensor(world * n, torch.bfloat16)
        shard = full[rank * n:(rank + 1) * n]          # in place: the all-gather input is our slot
        comm.all_gather_into(full, shard)
        ...
        comm.close()                                   # on every rank, before destroy_process_group()
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from ... import _native as _native_module
from ..hosts import group_hosts, torchrun_local_world_size

# defined once in C++ (csrc/symm_comm.h, symm_offset_allocator.h), read from the extension
MIN_NCCL_VERSION: int = _native_module.MIN_NCCL_VERSION  # NCCL 2.28.7
ALIGNMENT: int = _native_module.SYMM_ALIGNMENT  # window offset granularity of every pool allocation


def _native():
    return _native_module._C


def format_nccl_version(code: Optional[int]) -> str:
    if not code:
        return "none"
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def nccl_version() -> Optional[int]:
    """Version code of the NCCL library the extension loaded (e.g. 22809), or None if unknown."""
    try:
        return int(_native().nccl_version()) or None
    except Exception:
        return None


# ----------------------------------------------------------------------------------------------
# availability
# ----------------------------------------------------------------------------------------------
def _env_reason(allow_nvls: bool = False) -> Optional[str]:
    """Why the environment rules symmetric memory out, or None."""
    nvls = os.environ.get("NCCL_NVLS_ENABLE")
    if not allow_nvls and nvls not in (None, "", "0"):
        return (
            f"NCCL_NVLS_ENABLE={nvls!r}: NVLink multicast (NVLS) must stay off for this project "
            "(set NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1), or pass allow_nvls=True"
        )
    if os.environ.get("NCCL_CUMEM_ENABLE") == "0":
        return "NCCL_CUMEM_ENABLE=0: NCCL windows need cuMem (VMM) memory; unset it"
    if os.environ.get("NCCL_LOCAL_REGISTER") == "0":
        return "NCCL_LOCAL_REGISTER=0 disables NCCL buffer/window registration; unset it"
    return None


def _native_reason() -> Optional[str]:
    mod = _native()
    info = mod.symm_comm_build_info()
    if not info.get("built", False) or not hasattr(mod, "SymmComm"):
        return str(info.get("reason", "SymmComm was not compiled in"))
    version = nccl_version()
    if version is None:
        return "could not query the NCCL library version (ncclGetVersion)"
    if version < MIN_NCCL_VERSION:
        return (
            f"the loaded NCCL is {format_nccl_version(version)}; symmetric-memory collectives need "
            f">= {format_nccl_version(MIN_NCCL_VERSION)}"
        )
    return None


def _group_reason(group, check_hosts: bool) -> Optional[str]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None  # nothing to check yet; SymmetricComm needs an initialized group anyway
    if group is None:
        group = dist.group.WORLD
    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception as exc:
        return f"cannot query the group's backend ({exc})"
    if "nccl" not in backend:
        return f"the process group's backend is {backend!r}, not 'nccl'"
    size = dist.get_world_size(group)
    local = torchrun_local_world_size()
    single_node_world = local is not None and dist.get_world_size() <= local
    if local is not None and size > local:
        return (f"the group spans several nodes: {size} ranks > LOCAL_WORLD_SIZE {local} (symmetric kernels are "
                "single-node)")
    ndev = torch.cuda.device_count()
    if not single_node_world and not check_hosts and size > ndev:
        return (
            f"the group likely spans several nodes: {size} ranks but {ndev} visible GPUs here (symmetric kernels "
            "are single-node; pass check_hosts=True to compare host names instead)"
        )
    if check_hosts and size > 1:
        hosts = set(group_hosts(group))
        if len(hosts) > 1:
            return f"the group spans several hosts: {sorted(hosts)}"
    return None


def is_available(group=None, *, check_hosts: bool = False, allow_nvls: bool = False) -> tuple[bool, str]:
    """Whether the native symmetric path can be used, and why not.

    Returns ``(True, "ok: ...")`` or ``(False, reason)``. Cheap and local unless ``check_hosts=True``, which
    all-gathers host names over ``group`` (collective). Checks: torch CUDA build and a visible GPU, the
    extension and its NCCL support, NCCL >= 2.28.7 at run time, environment (NVLS must stay off here,
    cuMem/registration not disabled), and, when a process group is initialized, that it is NCCL and
    single-node.
    """
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build (no CUDA): symmetric memory needs CUDA and NCCL"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible (torch.cuda.is_available() is False)"
    for reason in (_native_reason(), _env_reason(allow_nvls)):
        if reason is not None:
            return False, reason
    reason = _group_reason(group, check_hosts)
    if reason is not None:
        return False, reason
    return True, f"ok: NCCL {format_nccl_version(nccl_version())}"


# ----------------------------------------------------------------------------------------------
# communicator + pool
# ----------------------------------------------------------------------------------------------
_uid_counters: dict = {}


def _borrow_comm_ptr(group, device: torch.device) -> int:
    """ProcessGroupNCCL's ncclComm_t for ``device`` as an int, or 0 when it cannot be had."""
    try:
        backend = group._get_backend(device)
        fn = getattr(backend, "_comm_ptr", None)
        return int(fn()) if fn is not None else 0
    except Exception:
        return 0


def _group_alive(group) -> bool:
    """False once the process group has been destroyed (its communicator with it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    try:
        return group in dist.distributed_c10d._world.pg_map
    except Exception:
        return True


def _group_store(group):
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    getter = getattr(c10d, "_get_process_group_store", None)
    if getter is not None:
        try:
            return getter(group)
        except Exception:
            pass
    return c10d._get_default_store()


def _exchange_unique_id(native_mod, group) -> bytes:
    """Group rank 0 makes an ncclUniqueId; everyone reads it from the group's store."""
    import torch.distributed as dist

    name = getattr(group, "group_name", "default")
    n = _uid_counters.get(name, 0)
    _uid_counters[name] = n + 1
    key = f"mfsdp_ext/symm_comm/{name}/{n}"
    store = _group_store(group)
    if dist.get_rank(group) == 0:
        uid = bytes(native_mod.SymmComm.unique_id())
        store.set(key, uid)
        return uid
    return bytes(store.get(key))


class SymmetricComm:
    """An NCCL communicator for ``group`` with a symmetric-memory pool and symmetric collectives.

    Args:
        group: the torch ProcessGroup (NCCL, one node). Default: the world group.
        device: CUDA device of this rank. Default: ``torch.cuda.current_device()``.
        pool_bytes: bytes to reserve up front (collective). 0: reserve lazily on the first alloc.
        grow_bytes: size of a region added when an alloc does not fit (collective, like the alloc itself).
        borrow: use ProcessGroupNCCL's communicator when available; otherwise (or when False) create one.
        allow_nvls: accept NCCL_NVLS_ENABLE != 0 (off by default: NVLink multicast stays off here).

    Every rank must construct it, allocate, free and close in the same order. Without ``close()`` the pool
    and an owned communicator stay until the process exits: NCCL frees them only collectively, so garbage
    collection (at a different moment on each rank) must not.
    """

    def __init__(
        self,
        group=None,
        *,
        device: Optional[torch.device | int] = None,
        pool_bytes: int = 0,
        grow_bytes: int = _native_module.SYMM_DEFAULT_GROW_BYTES,
        borrow: bool = True,
        allow_nvls: bool = False,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("SymmetricComm needs an initialized torch.distributed NCCL process group")
        group = dist.group.WORLD if group is None else group
        ok, why = is_available(group, allow_nvls=allow_nvls)
        if not ok:
            raise RuntimeError(f"NCCL symmetric memory is unavailable: {why}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        C = _native()
        self.group = group
        self.device = device
        self._native = None
        self.borrowed = False
        if borrow:
            # The first all-reduce makes sure ProcessGroupNCCL's communicator exists (lazy init); the second
            # makes every rank take the same path (borrow or create), or they would wait on each other forever.
            flag = torch.ones(1, dtype=torch.int32, device=device)
            dist.all_reduce(flag, group=group)
            ptr = _borrow_comm_ptr(group, device)
            flag.fill_(1 if ptr else 0)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            if int(flag.item()) == 1:
                self._native = C.SymmComm(comm_ptr=ptr)
                self.borrowed = True
        if self._native is None:
            uid = _exchange_unique_id(C, group)
            with torch.cuda.device(device):
                self._native = C.SymmComm(
                    unique_id=uid, rank=dist.get_rank(group), world_size=dist.get_world_size(group), device=device.index
                )
        n = self._native
        if n.rank != dist.get_rank(group) or n.world_size != dist.get_world_size(group) or n.device != device.index:
            got = (n.rank, n.world_size, n.device)
            want = (dist.get_rank(group), dist.get_world_size(group), device.index)
            raise RuntimeError(f"SymmetricComm: communicator (rank, size, device) {got} != group's {want}")
        n.grow_bytes = int(grow_bytes)
        if pool_bytes:
            n.reserve(int(pool_bytes))

    # -- properties -------------------------------------------------------------------------
    @property
    def native(self):
        """The underlying ``mfsdp_ext._C.SymmComm``."""
        return self._native

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def world_size(self) -> int:
        return self._native.world_size

    @property
    def closed(self) -> bool:
        return self._native is None or self._native.closed

    def stats(self) -> dict:
        return self._native.stats()

    # -- pool -------------------------------------------------------------------------------
    def alloc_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D tensor of ``numel`` ``dtype`` elements in the symmetric pool (uninitialized).

        Same call sequence on every rank (offsets must agree). May grow the pool (collective).
        """
        nbytes = int(numel) * dtype.itemsize
        offset = self._native.alloc(nbytes)
        return self._native.tensor(offset, int(numel), dtype)

    def free_tensor(self, tensor: torch.Tensor) -> None:
        """Return a tensor's block to the pool. The tensor must be the one ``alloc_tensor`` returned (or a
        view starting at its first byte); finish (or order on the same stream) all work on it first."""
        offset = self._native.offset_of(tensor)
        if offset < 0:
            raise ValueError("free_tensor: the tensor is not in this symmetric pool")
        self._native.free(offset)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies entirely inside this pool's symmetric windows."""
        return self._native is not None and not self._native.closed and self._native.contains(tensor)

    # -- collectives ------------------------------------------------------------------------
    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out = cat([inp of rank r for r in ranks])`` on the current stream. Both in this pool;
        in place when ``inp`` is ``out``'s slot for this rank."""
        self._native.all_gather(inp, out)

    def reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, *, average: bool = False) -> None:
        """``out = sum over ranks of inp[rank*n:(rank+1)*n]`` (times 1/world when ``average``) on the
        current stream. bf16/fp16/fp32, both in this pool."""
        self._native.reduce_scatter(inp, out, average)

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Collective and idempotent: deregister the windows, free the pool, destroy an owned communicator.
        Call on every rank before ``destroy_process_group()`` when the communicator is borrowed."""
        n = self._native
        if n is None or n.closed:
            return
        if self.borrowed and (not _group_alive(self.group) or _borrow_comm_ptr(self.group, self.device) != n.comm_ptr):
            # The process group (and its communicator) is gone: any NCCL call on it would be a use after free.
            warnings.warn(
                "SymmetricComm.close(): the borrowed ProcessGroupNCCL communicator no longer exists (was "
                "destroy_process_group() called first?); abandoning the symmetric windows without deregistering",
                RuntimeWarning,
                stacklevel=2,
            )
            n.abandon()
            return
        n.close()

    def __enter__(self) -> SymmetricComm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._native is None:
            return "SymmetricComm(<not initialized>)"
        s = self._native
        return (
            f"SymmetricComm(rank={s.rank}, world_size={s.world_size}, device=cuda:{s.device}, "
            f"borrowed={self.borrowed}, capacity={s.capacity}, in_use={s.bytes_in_use}, closed={s.closed})"
        )
