"""mfsdp_ext.graphed: a whole training step (forward, loss, backward, optimizer step, zero_grad; microbatches inside
if the step has them) captured once as one CUDA graph and replayed.

    step = mfsdp_ext.graphed(train_step, warmup=2)     # train_step(*batch) -> loss
    for batch in data:
        loss = step(*batch)

The first ``warmup`` calls run eagerly (lazy initialisation, optimizer state, communicators); the next one captures
the step on static copies of its tensor arguments and replays it; later calls copy their arguments into those
copies and replay. What a replay cannot see is handled around it:
  * mfsdp_ext.optim's steps read their coefficients from device tables that the host fills before each replay,
    as an eager step computes them (step counters advance, a scheduler's lr is taken): the same bits as eager;
    torch optimizers must be built with ``capturable=True`` (torch's rule for stepping inside a graph);
  * every call checks, on every rank together (a replay is a collective), that nothing the graph depends on
    changed: argument shapes, dtypes and non-tensor values, the models' train/eval mode, the optimizers' parameter
    groups, the fully_shard buffers (a materialisation); if something did, the step is captured again;
  * after a replay, eager code (an evaluation) casts and gathers the weights afresh.
Without CUDA (or with CPU tensors) every call runs eagerly, with one warning: the same numbers, no graph.
"""

from __future__ import annotations

import warnings
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from .comm.host_agreement import MaxAgreement
from .core import registry
from .optim.base import FlatOptimizerMixin
from .runtime import capture, step_prefetch
from .runtime.context import FsdpContext


def graphed(train_step: Callable, *, warmup: int = 2) -> GraphedStep:
    """``train_step`` as a callable whose calls after the first ``warmup`` replay one CUDA graph of the whole step
    (see the module docstring).

    Args:
        train_step: the step: forward, backward and optimizer step, taking tensors (static shapes) and returning
            tensors.
        warmup: eager calls before the capture, at least 1 (the first call of a fully_shard model initialises it).

    Returns:
        a ``GraphedStep``, called like ``train_step``.

    Raises:
        ValueError: ``warmup`` < 1.
    """
    if warmup < 1:
        raise ValueError(f"mfsdp_ext.graphed: warmup must be at least 1 (the first step initialises the model "
                         f"eagerly), got {warmup}")
    return GraphedStep(train_step, warmup)


class GraphedStep:
    def __init__(self, train_step: Callable, warmup: int):
        self.train_step = train_step
        self.warmup = warmup
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool: Any = None  # the graph's memory pool, kept across captures
        self.key: tuple | None = None
        self.static_leaves: list = []  # the capture's tensor arguments (replays copy new ones into them)
        self.static_out: Any = None
        self.optimizers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> optimizer stepped
        self.contexts: list[weakref.ref] = []  # the fully_shard roots whose forward the captured step runs
        self.captures = 0
        self.hold_first_units = True  # the first units' gathers at the end of the graph (_hold_first_units)
        self.steps_at_capture = 0  # optimizer steps counted when the graph was captured
        self._agreement: MaxAgreement | None = None  # the ranks' decision before each call
        self._warned = False

    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not torch.cuda.is_available() or not tensors or not all(t.is_cuda for t in tensors):
            self._warn_eager("its tensors are not on a CUDA device" if torch.cuda.is_available() else
                             "CUDA is not available")
            return self.train_step(*args, **kwargs)
        self.calls += 1
        if self.calls <= self.warmup:
            return self._warm_up(args, kwargs)
        key = self._key(leaves, spec)
        if self.graph is None or not self._same_on_every_rank(key):
            return self._capture(leaves, spec)
        for static, new in zip(self.static_leaves, leaves):
            if isinstance(static, torch.Tensor):
                static.copy_(new)
        for opt in self._flat_optimizers():
            opt.graph_prologue()
        self.graph.replay()
        self._after_replay()
        return self._output()

    def _warm_up(self, args, kwargs):
        """An eager call before the capture; it notes the optimizers it steps and the models it runs."""
        iterations = {ctx: ctx.iteration.count for ctx in FsdpContext.live()}
        with self._recording_optimizers():
            out = self.train_step(*args, **kwargs)
        self.contexts = _ran(iterations)
        return out

    # ------------------------------------------------------------------ capture
    def _capture(self, leaves: list, spec):
        """Capture the step on static copies of this call's arguments, then replay it once for this call."""
        for ref in self.contexts:  # before anything is captured: a capture that raised halfway is lost
            if ref() is not None:
                capture.refuse_offload(ref(), "used in mfsdp_ext.graphed")
        # The last graph (if any) lives until the new one is captured into its pool: torch refuses a pool that no
        # graph holds. Its output is let go first, so the new capture reuses that memory; it is never replayed again.
        old_graph, self.graph, self.static_out = self.graph, None, None
        self._release_held()
        held = self._hold_first_units() if self.hold_first_units else []
        torch.cuda.synchronize()
        # made before the capture (as every buffer a replay's host side writes): inside it they could share memory
        # with the graph's temporaries
        self.static_leaves = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(self.static_leaves, spec)
        flat_optimizers = self._flat_optimizers()
        for opt in flat_optimizers:
            opt.graph_begin()
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        iterations = {ctx: ctx.iteration.count for ctx in FsdpContext.live()}  # held only while capturing
        for ctx in iterations:
            ctx.capture.graphed_step = self
        try:
            with self._recording_optimizers(), torch.cuda.graph(graph, pool=self.pool):
                out = self.train_step(*args, **kwargs)
                self._gather_held_units(iterations)
        finally:
            for ctx in iterations:
                ctx.capture.graphed_step = None
        del old_graph
        for opt in flat_optimizers:
            opt.graph_upload()
        self.contexts = _ran(iterations)
        for unit in held:
            if unit.context.iteration.count == iterations[unit.context]:  # the step did not run this model
                unit.held_by = None
                if not unit.config.strategy.keeps_weights_gathered:
                    unit.reshard()
        for ref in self.contexts:
            ref().capture.graph_steps.add(self)  # release_symmetric_memory() lets the graph go first
        self.graph, self.static_out = graph, out
        self.steps_at_capture = registry.optimizer_steps()
        self.key = self._key(leaves, spec)  # with the models and optimizers the step was seen to use
        self.captures += 1
        graph.replay()  # the capture ran nothing: this call's step
        self._after_replay()
        return self._output()

    def drop_graph(self) -> None:
        """Let the graph (and its pool) go; the next call captures again. For release_symmetric_memory(): NCCL
        keeps the symmetric windows that a live graph captured, and freeing them would wait for it."""
        self.graph = self.static_out = self.pool = None
        self._release_held()

    # ------------------------------------------------------------------ the first units across replays
    def _hold_first_units(self) -> list:
        """Before a capture: gather the first forward units of each model the last call ran (eagerly; usually
        that step's optimizer gathered them already) and hold them. The graph's forward reads them as they are and
        its optimizer step gathers them for the next replay, under its other groups' kernels (step_prefetch.py),
        as an eager step does: a replay does not start by waiting for their all-gathers. Only models the step
        runs: every rank runs those, in one order (another model, still alive on one rank only until its garbage
        is collected, would make a gather the other ranks never join). A model whose units another graphed step
        holds is left to it."""
        held = []
        for ctx in (ref() for ref in self.contexts):
            if ctx is None:
                continue
            order = ctx.order.forward or ctx.order.prev_forward
            if ctx.iteration.in_backward or ctx.iteration.open or not order or any(u.held_for_graph for u in ctx.units):
                continue
            for unit in order[:step_prefetch.FIRST_UNITS]:
                unit.unshard()
                unit.held_by = weakref.ref(self)
                held.append(unit)
        return held

    def _held_units(self, contexts) -> list:
        """The units of ``contexts`` (fully_shard roots' contexts; None ones skipped) that this step holds."""
        return [unit for ctx in contexts if ctx is not None for unit in ctx.units if unit.is_held_by(self)]

    def _release_held(self) -> None:
        """The units this step's graph held are free again: their next reshard frees them."""
        for unit in self._held_units(ref() for ref in self.contexts):
            unit.held_by = None

    def _gather_held_units(self, iterations: dict) -> None:
        """The end of the captured step: the held units gathered with the weights the step leaves (nothing when its
        optimizer did it), and the all-gather stream joined back into the capture."""
        for unit in self._held_units(ctx for ctx in iterations if ctx.iteration.count != iterations[ctx]):
            unit.unshard()
            if unit.unshard_event is not None:
                unit.context.device.wait_event(unit.unshard_event)
                unit.unshard_event = None

    def _after_replay(self) -> None:
        """Eager code after a replay sees new weights: a new weights epoch makes it cast and gather them."""
        for ctx in FsdpContext.live():
            ctx.iteration.weights_epoch += 1

    def _output(self):
        return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, self.static_out)

    # ------------------------------------------------------------------ what the graph depends on
    def _key(self, leaves: list, spec) -> tuple:
        arguments = tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else repr(x)
                          for x in leaves)
        # only the models the step uses: another one built or collected meanwhile changes nothing
        modes = tuple(ctx.root.module.training if ctx is not None else None
                      for ctx in (ref() for ref in self.contexts))
        optimizers = tuple((id(opt), tuple(tuple(map(id, g["params"])) for g in opt.param_groups))
                           for opt in self.optimizers.values())
        return (str(spec), arguments, modes, optimizers, registry.buffers_generation(), self._held_writes())

    def _held_writes(self) -> tuple:
        """What wrote the held units' weights (their gathered copies must follow): the writes version counters see,
        and the optimizers stepped outside the graph over their parameters (its replays count no step, and an
        optimizer of another model steps none of these)."""
        held = self._held_units(ref() for ref in self.contexts)
        if not held:
            return ()
        params = {id(info.sharded) for unit in held for g in unit.groups for info in g.infos}
        stepped = tuple(sorted(id(opt) for opt in registry.optimizers_stepped_since(self.steps_at_capture)
                               if any(id(p) in params for group in opt.param_groups for p in group["params"])))
        return tuple(tuple(g.weights_version()[1:] for g in unit.groups) for unit in held), stepped

    def _same_on_every_rank(self, key: tuple) -> bool:
        """Whether the graph still fits this call, decided together: a rank that replays while another captures
        would wait for it forever. Through host memory (comm/host_agreement.py; no device synchronisation). Also
        together: whether the held units' weights were written outside the graph on some rank (then the next
        captures hold none: ``hold_first_units``)."""
        changed, written = int(key != self.key), int(self.key is not None and key[5:] != self.key[5:])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if self._agreement is None:
                self._agreement = MaxAgreement()
            spec, arguments = key[0], [a[:2] if isinstance(a, tuple) else a for a in key[1]]  # not the rank's device
            crc = zlib.crc32(repr((spec, arguments)).encode())
            # maxima only: the argument checksum's maximum and (negated) minimum differ iff ranks disagree
            changed, crc_max, neg_crc_max, written = self._agreement.max([changed, crc, -crc, written])
            if crc_max != -neg_crc_max:
                raise RuntimeError("mfsdp_ext.graphed: the ranks called the step with different argument shapes or "
                                   "values; every rank must run the same step (a replay is a collective)")
        if written:  # weights written between steps: gathering the first units in the graph is not worth it
            self.hold_first_units = False
        return not changed

    # ------------------------------------------------------------------ optimizers
    def _recording_optimizers(self):
        """Notes every optimizer stepped inside (mfsdp_ext.optim's get device tables for the capture)."""
        def note(optimizer, args, kwargs):
            self.optimizers[id(optimizer)] = optimizer

        return _Hook(register_optimizer_step_pre_hook(note))

    def _flat_optimizers(self) -> list[FlatOptimizerMixin]:
        return [opt for opt in self.optimizers.values() if isinstance(opt, FlatOptimizerMixin)]

    def _warn_eager(self, why: str) -> None:
        if not self._warned:
            warnings.warn(f"mfsdp_ext.graphed: {why}; every call runs the step eagerly (same numbers, no graph)",
                          stacklevel=3)
            self._warned = True


class _Hook:
    """A registered hook as a context manager that removes it on exit."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def _ran(iterations: dict) -> list[weakref.ref]:
    """The fully_shard roots whose forward ran since ``iterations`` was taken (made since, too), oldest first."""
    return [weakref.ref(ctx) for ctx in FsdpContext.live() if ctx.iteration.count != iterations.get(ctx)]
