"""A pool of long-lived ranks (one process each) that runs test functions collectively.

Starting a process and importing torch costs seconds, so each world size gets one pool for the whole pytest
session; a test submits ``module:function`` and every rank runs it. A failure or a hang on any rank fails the
test with every rank's traceback, and the pool is restarted so the next test starts clean.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import queue
import socket
import sys
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    # NVLink multicast stays off on the shared GPU machines, however pytest was started
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.set_num_threads(1)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, fn_name, args = task
        # a rank still busy after 200 s (the parent gives up at 240 s) prints where it is stuck
        faulthandler.dump_traceback_later(200, exit=False)
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int, backend: str = "gloo"):
        self.world, self.backend = world, backend
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, port, self.backend, self.tasks[r],
                                                        self.results), daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 240.0) -> list:
        """Run ``fn(*args)`` on every rank; return the per-rank results (rank order)."""
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args))
        out, errors = [None] * self.world, []
        for _ in range(self.world):
            try:
                rank, ok, payload = self.results.get(timeout=timeout)
            except queue.Empty:
                msg = f"{fn.__name__}: a rank hung for {timeout}s (got: {errors or 'nothing'})"
                print(msg, file=sys.stderr, flush=True)  # visible even if the session is cut short
                self.restart()
                raise AssertionError(msg) from None
            if ok:
                out[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                if len(errors) == 1:
                    timeout = min(timeout, 30.0)  # the others may be stuck in a collective
        if errors:
            msg = f"{fn.__name__} failed:\n" + "\n".join(errors)
            print(msg, file=sys.stderr, flush=True)
            self.restart()
            raise AssertionError(msg)
        return out

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
