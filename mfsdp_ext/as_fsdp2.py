"""Run code written for PyTorch FSDP2 on mfsdp_ext: ``torch.distributed.fsdp.fully_shard`` becomes ours.

Frameworks call FSDP2 by its names: they import ``fully_shard`` from ``torch.distributed.fsdp`` (or
``torch.distributed._composable.fsdp``), at import time (torchtitan) or when they shard a model (accelerate, the
HF Trainer). ``use_as_fsdp2()`` points those names at mfsdp_ext's ``fully_shard`` and
``register_fsdp_forward_method``, and also the bindings that modules imported before the call made of torch's
functions, so it works wherever in a script it is called before the model is sharded::

    import mfsdp_ext
    mfsdp_ext.use_as_fsdp2()          # then build and train as with FSDP2

or, for a framework's own entry point, ``python -m mfsdp_ext.as_fsdp2 MODULE [ARGS]`` (under torchrun: ``torchrun
--nproc-per-node 8 -m mfsdp_ext.as_fsdp2 torchtitan.train ...``) switches, then runs MODULE as ``python -m``
would; ``python -m mfsdp_ext.as_fsdp2 path/to/SCRIPT.py [ARGS]`` runs a script as ``python SCRIPT.py`` would (its
folder first on sys.path, so its sibling modules import). Our units are ``torch.distributed.fsdp.FSDPModule``
instances and ``fully_shard`` takes torch's ``MixedPrecisionPolicy`` and ``OffloadPolicy``, so the frameworks'
checks and calls find what they expect.
``MixedPrecisionPolicy`` keeps its name: torch's policy objects are mapped onto ours.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable
from types import ModuleType

from .api import fully_shard, register_fsdp_forward_method, share_comm_ctx

# torch's namespaces whose FSDP2 names are switched (frameworks import from each); FSDP2's own module is not
_NAMESPACES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp", "torch.distributed.fsdp._fully_shard")


class Fsdp2Switch:
    """What ``use_as_fsdp2()`` changed; ``undo()`` (or leaving its ``with`` block) puts torch's names back."""

    def __init__(self, replaced: list[tuple[ModuleType, str, Callable]]):
        self.replaced = replaced

    @property
    def names(self) -> list[str]:
        return [f"{module.__name__}.{name}" for module, name, _ in self.replaced]

    def undo(self) -> None:
        for module, name, original in reversed(self.replaced):
            setattr(module, name, original)
        self.replaced = []

    def __enter__(self) -> Fsdp2Switch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def use_as_fsdp2() -> Fsdp2Switch:
    """Make FSDP2's ``fully_shard``, ``register_fsdp_forward_method`` and ``share_comm_ctx`` resolve to mfsdp_ext's:
    in torch's namespaces (``torch.distributed.fsdp``, its ``_fully_shard`` package, ``torch.distributed._composable
    .fsdp``) and in every module already imported that holds torch's functions (except torch's own internals, which
    keep FSDP2).

    Returns:
        an ``Fsdp2Switch`` whose ``undo()`` restores them (also usable as a context manager).
    """
    import torch.distributed._composable.fsdp  # noqa: F401  (both namespaces exist before they are switched)
    from torch.distributed.fsdp._fully_shard import _fully_shard as torch_impl  # FSDP2's own, never switched

    ours = {id(torch_impl.fully_shard): fully_shard,
            id(torch_impl.register_fsdp_forward_method): register_fsdp_forward_method,
            id(torch_impl.share_comm_ctx): share_comm_ctx}
    replaced = []
    for module_name, module in list(sys.modules.items()):
        if module is None or (module_name.startswith("torch.") and module_name not in _NAMESPACES):
            continue
        for name, value in list(vars(module).items()):
            if id(value) in ours:
                setattr(module, name, ours[id(value)])
                replaced.append((module, name, value))
    return Fsdp2Switch(replaced)


def run_script(path: str, argv: list[str]) -> None:
    """Run the file ``path`` as ``python path ARGS`` does: as ``__main__``, with ``sys.argv = [path, *argv]`` and the
    script's folder (symbolic links resolved) first on sys.path, where its sibling modules are found (runpy alone
    does not put it there). For launchers: ``python -m mfsdp_ext.as_fsdp2 SCRIPT.py``, and wrappers that run a
    script after setting something up (the tests' probes)."""
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.realpath(path)))
    runpy.run_path(path, run_name="__main__")


_USAGE = ("usage: python -m mfsdp_ext.as_fsdp2 MODULE | SCRIPT.py [ARGS...]\n"
          "  switches torch.distributed.fsdp.fully_shard to mfsdp_ext's, then runs MODULE as python -m would, or\n"
          "  SCRIPT.py (a path ending in .py) as python SCRIPT.py would")


def _main(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        print(_USAGE)
        return
    if not argv or argv[0].startswith("-"):
        raise SystemExit(_USAGE)
    use_as_fsdp2()
    if argv[0].endswith(".py"):
        run_script(argv[0], argv[1:])
        return
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
