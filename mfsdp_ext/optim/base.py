"""What AdamW and SGD share: the split of each step into flat parameters (one kernel per ParamGroup) and the
rest (torch's own step), lazy flat state, the refusal of options the kernels do not implement, and a
load_state_dict that copies loaded values into the flat buffers instead of replacing the state tensors.

A subclass (also a subclass of the torch optimizer it replaces) defines:
  STATE_NAMES        the per-parameter state tensors kept in flat buffers
  _init_flat(p, flat, i)          make a new parameter's state (views of its zeroed slots), or none yet
  _flat_key(group_index, p)       what besides the data its update depends on (merged runs share it); may
                                  advance per-parameter counters (AdamW's step)
  _run_kernel(group, flat, runs, keys, coeffs, device_table)   one native launch over the group's buffers with
                                  the coefficients _coeffs(keys) made (device_table: in a CUDA graph, runs and
                                  coefficients are read from it, see graph_tables.py)
  _torch_step(group, params)      torch's step for ``params`` (a subset of ``group["params"]``)
  _after_flat(group_index, p, flat, i)  state bookkeeping after the kernel (SGD's momentum buffer)
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from .. import _native
from ..params.group import owner_of
from ..runtime import step_prefetch
from .flat_state import FlatState, build_runs, flat_owner
from .graph_tables import GraphTables, ReplayPlan
from .in_backward import BackwardSteps


def _grad_view_owner(p: torch.Tensor):
    """(ParamGroup, index) when ``p.grad`` is p's view of that group's main_grad, else None."""
    owner = owner_of(p)
    if owner is None:
        return None
    group, i = owner
    return owner if group.infos[i].sharded is p and group.grads.attached_at(i) else None


if TYPE_CHECKING:  # what the mixin finds beside it in a subclass: the torch optimizer it replaces
    _Optimizer = torch.optim.Optimizer
else:
    _Optimizer = object


class FlatOptimizerMixin(_Optimizer):
    STATE_NAMES: tuple[str, ...] = ()
    # step() gathers the next forward's first two units (step_prefetch.py); False on an instance: the forward does
    gather_next_forward: bool = True
    _UNSUPPORTED: tuple[tuple[str, str], ...] = ()  # (group option, what to use instead) refused when truthy

    if TYPE_CHECKING:  # each subclass defines these (the module docstring says what they do)
        def _init_flat(self, p: torch.Tensor, flat: FlatState, i: int) -> None: ...
        def _flat_key(self, group_index: int, p: torch.Tensor) -> tuple: ...
        def _coeffs(self, keys: list) -> torch.Tensor: ...
        def _run_kernel(self, group, flat: FlatState, runs: torch.Tensor, keys: list, coeffs: torch.Tensor,
                        device_table=None) -> None: ...

    def _setup_flat(self, step_in_backward: bool = False) -> None:
        self._graph: GraphTables | None = None  # set while mfsdp_ext.graphed captures and replays this optimizer
        self._flat_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ParamGroup -> FlatState
        for group in self.param_groups:
            self._check_group(group)
        self._backward_steps: BackwardSteps | None = None
        if step_in_backward:
            self._backward_steps = BackwardSteps(self)
            if not self._backward_steps.items:
                raise ValueError(f"mfsdp_ext.optim.{type(self).__name__}(step_in_backward=True) steps CPU-offloaded "
                                 "parameters in backward, and none of the parameters given is offloaded (fully_shard("
                                 "..., offload_policy=CPUOffloadPolicy()) on a GPU mesh). Build it without "
                                 "step_in_backward")

    def _check_group(self, group: dict) -> None:
        name = type(self).__name__
        for option, instead in self._UNSUPPORTED:
            if group.get(option):
                raise ValueError(f"mfsdp_ext.optim.{name} does not implement {option}=True; {instead}")
        for option in ("lr", "betas", "momentum", "weight_decay"):
            values = group.get(option, ())
            if any(isinstance(v, torch.Tensor) for v in (values if isinstance(values, tuple) else (values,))):
                raise ValueError(f"mfsdp_ext.optim.{name}: {option} must be a float, not a Tensor (the kernel's "
                                 f"coefficients are computed on the host); LR schedulers work with float lrs, or "
                                 f"use torch.optim.{name} for a tensor {option}")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_flat_states"):
            self._check_group(self.param_groups[-1])
            if self._backward_steps is not None:
                self._backward_steps.register()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad. With ``set_to_none=False`` (between replays of a captured backward) the gradient
        shards of fully_shard parameters are zeroed one flat buffer per ParamGroup: one kernel and no DTensor
        dispatch per parameter. A buffer that also holds gradients of parameters this optimizer does not step is
        zeroed slice by slice (only this optimizer's)."""
        if set_to_none:
            return super().zero_grad(set_to_none=True)
        with torch.autograd.profiler.record_function(f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"):
            mine, rest = defaultdict(set), []  # ParamGroup -> indices of the gradient views held here; others
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    owner = _grad_view_owner(p)
                    if owner is not None:
                        mine[owner[0]].add(owner[1])
                    else:
                        rest.append(p)
            for group, indices in mine.items():
                if all(i in indices for i in group.trainable() if group.grads.attached_at(i)):
                    group.grads.main_grad.data.zero_()
                else:
                    for i in indices:
                        group.grads.main_grad.param_view(i).zero_()
            for p in rest:  # what torch's zero_grad does to each gradient
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def _flat(self, group) -> FlatState:
        flat = self._flat_states.get(group)
        if flat is None:  # made at the first step (after any materialize), as torch makes state lazily
            flat = self._flat_states[group] = FlatState(group, self.STATE_NAMES)
        return flat

    def _state_for(self, p, group, i) -> None:
        """p's state made on its first step (as torch does), or moved into the flat buffers when it holds other
        tensors (loaded, or made by torch's step). No empty entry is added to self.state (torch adds none)."""
        flat = self._flat(group)
        state = self.state.get(p)
        if not state:
            self._init_flat(p, flat, i)
        else:
            self._adopt(state, flat, i)

    def _adopt(self, state: dict, flat: FlatState, i: int) -> None:
        for name in self.STATE_NAMES:
            if name in state and state[name] is not None:
                state[name] = flat.adopt(name, i, state[name])

    def _split(self) -> tuple[dict, list[list], list]:
        """(ParamGroup -> [(index, p, group index)] for the flat kernels, per optimizer group the parameters for
        torch's step, and the flat parameters among them: they have a grad that is not main_grad's view)."""
        flat_work, adopt_after = defaultdict(list), []
        torch_work: list[list] = [[] for _ in self.param_groups]
        for gi, group in enumerate(self.param_groups):
            self._check_group(group)
            for p in group["params"]:
                owner = flat_owner(p)  # first: a stale parameter (re-materialized group) raises even without grad
                if p.grad is None:
                    continue
                if owner is not None:
                    self._state_for(p, *owner)
                # the flat kernel reads main_grad: a grad set by anything else (DCP's zero grads, a user's
                # tensor) goes through torch's step
                if owner is not None and owner[0].grads.attached_at(owner[1]):
                    flat_work[owner[0]].append((owner[1], p, gi))
                else:
                    torch_work[gi].append(p)
                    if owner is not None:
                        adopt_after.append((p, owner))
        return flat_work, torch_work, adopt_after

    @torch.no_grad()
    def step(self, closure=None):
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing and self._graph is None:
            raise RuntimeError(f"mfsdp_ext.optim.{type(self).__name__}.step() cannot be captured by torch.cuda.graph: "
                               "its learning rate and bias corrections are computed on the host at every step. "
                               "Capture forward and backward and step eagerly, or capture the whole step with "
                               "mfsdp_ext.graphed(...)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        done = self._backward_steps.take_done() if self._backward_steps is not None else set()
        flat_work, torch_work, adopt_after = self._split()
        if capturing and any(torch_work):
            raise RuntimeError(f"mfsdp_ext.optim.{type(self).__name__}: in a CUDA graph it steps fully_shard "
                               "parameters only (with their gradient shards); step the others with a torch "
                               "optimizer built with capturable=True")
        for group, params in zip(self.param_groups, torch_work):
            # DTensors and plain tensors apart: torch's foreach kernels (its CUDA default) refuse a mix
            for kind in (True, False):
                subset = [p for p in params if isinstance(p, DTensor) == kind]
                if subset:
                    self._torch_step(group, subset)
        for p, (group, i) in adopt_after:  # torch's step may have made new state tensors (SGD's first buffer)
            self._adopt(self.state[p], self._flat(group), i)
        # the next forward's first units: stepped first, then their all-gathers run under the other groups' steps
        stepped = list(flat_work)
        prefetch = step_prefetch.plan(stepped) if self.gather_next_forward else None
        first, rest = prefetch.order(stepped) if prefetch else ([], stepped)
        for group in first:
            if group not in done:  # done: stepped in backward (in_backward.py)
                self._step_group(group, flat_work[group])
        if prefetch:
            prefetch.issue()
        for group in rest:
            if group not in done:
                self._step_group(group, flat_work[group])
        return loss

    def _runs(self, group, items: list) -> tuple[torch.Tensor, list, list[int]]:
        """build_runs over ``items`` ((index, parameter, optimizer group index) of ``group``), each keyed by
        _flat_key, which advances what a step advances (AdamW's step)."""
        return build_runs(group, [(i, self._flat_key(gi, p)) for i, p, gi in items])

    def _step_group(self, group, items: list) -> None:
        """One kernel launch over the group's flat buffers (in a CUDA graph: reading its device table)."""
        flat = self._flat(group)
        runs, keys, _ = self._runs(group, items)
        coeffs = self._coeffs(keys)
        table = None
        if self._graph is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            table = self._graph.tables.get(group)
            if table is None:
                raise RuntimeError("mfsdp_ext.graphed: a parameter group was first stepped inside the capture; run "
                                   "warm-up steps that step every parameter before capturing")
            self._graph.items[group], self._graph.runs[group] = items, runs
            self._graph.pending[group] = _native.optim_device_table(runs, coeffs)
        self._run_kernel(group, flat, runs, keys, coeffs, table)
        for i, p, gi in items:
            self._after_flat(gi, p, flat, i)

    # ------------------------------------------------------------------ CUDA graphs (mfsdp_ext.graphed)
    def graph_begin(self) -> None:
        """Before a capture of the step: its kernels will read device tables, made here, outside the capture. A
        buffer made inside it would share addresses with the graph's temporaries freed before it, which each replay
        writes again before the optimizer reads the table: the host's coefficients would be overwritten."""
        self._graph = GraphTables(list(self._flat_states.keys()))

    def graph_upload(self) -> None:
        """Copy the coefficients of the step to be replayed into the device tables (on the current stream, before
        the replay)."""
        self._graph.upload()

    def graph_prologue(self) -> None:
        """Before a replay: this step's host work as an eager step does it (step counters, coefficients from the
        current hyperparameters), without the kernels, which the replay runs. Through the plan the last call left
        when it still holds (graph_tables.py), else parameter by parameter."""
        graph = self._graph
        plan = graph.plan
        keys = self._replay_keys(plan) if plan is not None and plan.valid_for(self) else None
        if keys is None:
            self._prologue_per_parameter()
            return
        plan.keys = keys
        distinct = list(dict.fromkeys(keys))
        row = {key: r for r, key in enumerate(distinct)}
        plan.fill(graph, self._coeffs(distinct), [row[key] for key in keys])

    def _prologue_per_parameter(self) -> None:
        """graph_prologue the long way, as an eager step: every parameter's key, then a plan for the next calls."""
        graph = self._graph
        done = {}
        for group, items in graph.items.items():
            runs, keys, firsts = self._runs(group, items)
            if not torch.equal(runs, graph.runs[group]):
                raise RuntimeError("mfsdp_ext.graphed: the optimizer's runs changed (parameters stepped apart); "
                                   "capture again")
            graph.pending[group] = _native.optim_device_table(runs, self._coeffs(keys))
            flat = self._flat(group)
            for i, p, gi in items:
                self._after_flat(gi, p, flat, i)
            by_index = {i: (gi, p) for i, p, gi in items}
            done[group] = runs, keys, [by_index[i] for i in firsts]
        self.graph_upload()
        params = [p for items in graph.items.values() for _, p, _ in items]
        graph.plan = ReplayPlan(graph, done, params, self._step_counters(params))

    def _step_counters(self, params: list) -> torch.Tensor | None:
        """One tensor holding the per-parameter counters a step advances by one (AdamW's ``step``); none here."""
        return None

    def _replay_keys(self, plan: ReplayPlan) -> list | None:
        """The keys of ``plan``'s runs for the next replay, advancing what a step advances; None (nothing advanced)
        when they no longer follow from the plan. Here: each run's first parameter's key, which must not have
        changed (a run's keys change together only through a step outside the graph, which drops the plan)."""
        keys = [self._flat_key(gi, p) for gi, p in plan.run_firsts]
        return keys if keys == plan.keys else None

    def _after_flat(self, group_index: int, p, flat: FlatState, i: int) -> None:
        pass

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the loaded state tensors of flat parameters are copied into the flat buffers (torch's
        load replaces the state tensors, which would detach them from the buffers the kernel steps)."""
        super().load_state_dict(state_dict)
        if self._graph is not None:  # new state tensors: the next replay's host work is done the long way
            self._graph.plan = None
        for group in self.param_groups:
            self._check_group(group)
            for p in group["params"]:
                owner = flat_owner(p)
                if owner is not None and self.state.get(p):
                    self._adopt(self.state[p], self._flat(owner[0]), owner[1])
