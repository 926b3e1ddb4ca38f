"""Runs the main job (examples/train_gpt.py, arguments passed through) under torchrun and, from an atexit hook
(after main() has returned, before the interpreter shuts down), prints how many threads the rank still has.

1 means destroy_process_group() could join gloo's worker threads. More means they run on into the interpreter's
shutdown, where one that frees a finished collective's tensors needs the GIL and aborts the process
(``terminate called without an active exception``): rarely, so a clean exit code alone proves little.
"""

import atexit
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report() -> None:
    print(f"rank {os.environ.get('RANK')} threads at exit: {len(os.listdir('/proc/self/task'))}", flush=True)


atexit.register(_report)
sys.argv = [os.path.join(ROOT, "examples", "train_gpt.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
