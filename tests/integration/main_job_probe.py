"""Runs the main job (examples/train_gpt.py, arguments passed through) under torchrun and, from an atexit hook
(after main() has returned, before the interpreter shuts down), prints how many threads the rank still has.

1 means destroy_process_group() could join gloo's worker threads (torch's autograd device workers aside). More
means they run on into the interpreter's shutdown, where one that frees a finished collective's tensors needs the GIL
and aborts the process
(``terminate called without an active exception``): rarely, so a clean exit code alone proves little.
"""

import atexit
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _report() -> None:
    # not counted: the autograd engine's per-device workers (pt_autograd_N), which a CUDA build of torch keeps for
    # the process's whole life (8 with torch 2.14.1+cu130 on a machine without a GPU) and which hold no collective
    names = [_thread_name(t) for t in os.listdir("/proc/self/task")]
    count = sum(n is not None and not n.startswith("pt_autograd_") for n in names)
    print(f"rank {os.environ.get('RANK')} threads at exit: {count}", flush=True)


def _thread_name(tid: str):
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # it ended meanwhile
        return None


atexit.register(_report)  # before mfsdp_ext and torch are imported: it runs after their exit handlers
from mfsdp_ext.as_fsdp2 import run_script  # noqa: E402

run_script(os.path.join(ROOT, "examples", "train_gpt.py"), sys.argv[1:])  # as python examples/train_gpt.py would
