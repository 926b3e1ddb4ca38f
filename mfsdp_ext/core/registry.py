"""Everything mfsdp_ext keeps once per process, in one place: the tables keyed by tensors, classes or process groups,
the counters, and the global optimizer hooks. Each entry says which module reads and writes it; nothing else of the
package holds state at module level (caches aside: host names, gloo's supported ops, the FP8 layer's last quantized
input).

Tables keyed by tensors are weak (``WeakIdKeyDictionary``): an entry goes with its tensor.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

# params/group.py: sharded parameter -> (weak reference to its ParamGroup, its index), how mfsdp_ext.optim finds the
# flat buffers behind a parameter without walking modules
GROUP_OF_PARAM = WeakIdKeyDictionary()
# params/replaced.py: a parameter fully_shard (or to_empty) replaced -> (its name, when it was the model's)
REPLACED_PARAMS = WeakIdKeyDictionary()
# params/replaced.py: optimizer -> how many parameters it held when checked for replaced ones
CHECKED_OPTIMIZERS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
# sharding/marks.py: parameters marked no_shard(...) -> True
NO_SHARD_MARKS = WeakIdKeyDictionary()
# sharding/groups.py (written) and sharding/params.py (read): parameters a unit took (the user's originals and our
# shards) -> the owner's class names
UNIT_OF_PARAM = WeakIdKeyDictionary()
# sharding/mesh.py (per_default_group): device type -> the default 1-D mesh over the world
DEFAULT_MESHES: dict[tuple, Any] = {}
# fp8/linear.py: an nn.Linear subclass -> its Fp8<Cls>(Fp8LinearMixin, Cls) subclass
FP8_CLASSES: dict[type, type] = {}
# api.py: a module class -> its FSDP<Cls>(FsdpModule, Cls) subclass
FSDP_CLASSES: dict[type, type] = {}
# runtime/post_forward.py: (id(mesh), N) -> (a weak reference to the mesh, the mesh viewed as (-1, N)):
# reshard_after_forward=N's groups
POST_FORWARD_MESHES: dict[tuple, Any] = {}
# comm/policy.py (per_default_group): shard ranks -> the process group of their reduce-scatters
# (set_separate_reduce_scatter_group)
REDUCE_SCATTER_GROUPS: dict[tuple, Any] = {}
# comm/native.py: shard process group -> its NcclTransport (one NCCL communicator per group and process)
NATIVE_TRANSPORTS: dict[Any, Any] = {}
# params/grads.py: groups holding gradient buffers a captured CUDA graph writes
GRAPH_GRAD_GROUPS: weakref.WeakSet[Any] = weakref.WeakSet()
# params/offload.py: "worker" -> the process's offload worker (one thread: offloaded gradients into their host
# shards, and the optimizer steps and casts queued behind them)
OFFLOAD_WORKER: dict[str, Any] = {}
# runtime/context.py: the contexts of the live roots, and their serial numbers (oldest first)
LIVE_CONTEXTS: weakref.WeakSet[Any] = weakref.WeakSet()
CONTEXT_SERIALS = itertools.count()


class _Counters:
    optimizer_steps = 0  # torch.optim steps, every optimizer's (the weights version counts them)
    buffers_generation = 0  # bumped whenever a group's flat buffers or collectives are replaced


# optimizer -> optimizer_steps() after its last step
_LAST_STEP: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_HOOKS: dict[str, Any] = {}  # name -> the handle of a global optimizer hook, registered once


def per_default_group(table: dict, key: Any, make: Callable[[], Any]) -> Any:
    """``table``'s value for ``key`` in the current default process group, made by ``make()`` the first time: a
    default group made after destroy_process_group (or one per rank thread of a threaded world) gets its own, also
    when it reuses a dead group's id."""
    world = dist.distributed_c10d._get_default_group()
    made_in, value = table.get((key, id(world)), (None, None))
    if made_in is not world:
        value = make()
        table[(key, id(world))] = (world, value)
    return value


def install_optimizer_hook(name: str, hook: Callable, *, pre: bool) -> None:
    """Register ``hook`` as a global optimizer step pre-hook (``pre``) or post-hook, once per ``name``."""
    if name not in _HOOKS:
        register = register_optimizer_step_pre_hook if pre else register_optimizer_step_post_hook
        _HOOKS[name] = register(hook)


def _count_step(optimizer, args, kwargs) -> None:
    _Counters.optimizer_steps += 1
    _LAST_STEP[optimizer] = _Counters.optimizer_steps


def watch_optimizer_steps() -> None:
    """Count every torch.optim optimizer's steps from now on (the first ParamGroup asks)."""
    install_optimizer_hook("count_steps", _count_step, pre=False)


def optimizer_steps() -> int:
    """torch.optim steps counted so far (every optimizer's)."""
    return _Counters.optimizer_steps


def last_step(optimizer) -> int:
    """optimizer_steps() right after ``optimizer``'s last step (0: it never stepped)."""
    return _LAST_STEP.get(optimizer, 0)


def optimizers_stepped_since(count: int) -> list:
    """The optimizers that stepped after optimizer_steps() was ``count``."""
    return [opt for opt, last in list(_LAST_STEP.items()) if last > count]


def buffers_generation() -> int:
    """Changes whenever a group's flat buffers or collectives are replaced (materialisation, the release of
    symmetric memory): what a captured CUDA graph addresses is then gone (mfsdp_ext.graphed captures again)."""
    return _Counters.buffers_generation


def bump_buffers_generation() -> None:
    _Counters.buffers_generation += 1
