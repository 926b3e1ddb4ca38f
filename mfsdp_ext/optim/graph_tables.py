"""A flat optimizer's steps inside a CUDA graph (mfsdp_ext.graphed).

The captured kernel of each ParamGroup reads its runs and coefficients from a device table. Before each replay the
host computes the step's coefficients exactly as an eager step would (advancing the step counters, reading the
current lr) and copies them there: the same bits as eager, and schedulers work without a new capture.

The tables of all groups are slices of one device buffer, so a replay uploads them in one copy. The first replay
after a capture does the host work the long way (every parameter's key, as an eager step) and leaves a
``ReplayPlan``. Later replays only advance the counters in one call, compute one coefficient row per distinct key
and fill a copy of the plan's template. A plan is dropped when the optimizer steps outside the graph, when its state
is loaded, or when the keys no longer follow from it; the long way then runs again.
"""

from __future__ import annotations

import torch

from .. import _native
from ..core import registry

ROW_BYTES = 16 + 4 * _native.OPTIM_COEFFS  # one run: its [start, end) as int64, then its float32 coefficients


class GraphTables:
    """The device tables of one captured optimizer, and what the host fills them with before each replay."""

    def __init__(self, groups: list):
        self.tables: dict = {}  # ParamGroup -> its slice of the device buffer (the captured kernel reads it)
        self.offsets: dict = {}  # ParamGroup -> byte offset of that slice
        self.items: dict = {}  # ParamGroup -> the (index, parameter, optimizer group index) stepped in the capture
        self.runs: dict = {}  # ParamGroup -> the run table captured (its structure is the graph's)
        self.pending: dict = {}  # ParamGroup -> host table to copy before the next replay
        self.plan: ReplayPlan | None = None
        devices = {g.device for g in groups}
        if len(devices) > 1:
            raise ValueError(f"mfsdp_ext.graphed: one optimizer steps parameters on several devices ({devices}); "
                             "use one optimizer per device")
        # sized for one run per parameter, the most a group's run table holds; 48-byte rows keep every slice
        # aligned for the int64 and float32 views
        sizes = [len(g.infos) * ROW_BYTES for g in groups]
        self.buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=devices.pop() if devices else "cpu")
        offset = 0
        for group, size in zip(groups, sizes):
            self.offsets[group], self.tables[group] = offset, self.buffer[offset: offset + size]
            offset += size

    def upload(self) -> None:
        """Copy the pending host tables into the device tables (on the current stream, before the replay)."""
        for group, host in self.pending.items():
            self.tables[group][: host.numel()].copy_(host, non_blocking=True)
        self.pending.clear()


class ReplayPlan:
    """The host work of a replay, precomputed from one done the long way: per run (every group's, in order) its key
    and first parameter; a host image of the whole device buffer holding the runs, where the coefficients go
    each call; the step counters, which every replay advances by one."""

    def __init__(self, tables: GraphTables, done: dict, params: list, counters: torch.Tensor | None):
        """``done``: ParamGroup -> (runs, keys, (optimizer group index, parameter) starting each run) of the replay
        just prepared; ``params``: every parameter stepped; ``counters``: one tensor holding what each step
        advances by one, per parameter of ``params`` (AdamW's steps; None for SGD)."""
        self.keys: list = []
        self.run_firsts: list = []  # (optimizer group index, parameter) of each run's first parameter
        positions = []  # per run, the float32 index of its first coefficient in the buffer's image
        self.template = torch.zeros(tables.buffer.numel(), dtype=torch.uint8)
        for group, (runs, keys, firsts) in done.items():
            n, start = runs.shape[0], tables.offsets[group]
            self.template[start: start + 16 * n].view(torch.int64).copy_(runs.reshape(-1))
            positions += [(start + 16 * n) // 4 + _native.OPTIM_COEFFS * r for r in range(n)]
            self.keys += keys
            self.run_firsts += firsts
        columns = torch.arange(_native.OPTIM_COEFFS, dtype=torch.int64)
        self.coeff_index = (torch.tensor(positions, dtype=torch.int64).reshape(-1, 1) + columns).reshape(-1)
        self.counters = counters
        position = {id(p): k for k, p in enumerate(params)}
        self.first_positions = torch.tensor([position[id(p)] for _, p in self.run_firsts], dtype=torch.int64)
        self.steps_seen = registry.optimizer_steps()  # a step of this optimizer after this: outside the graph

    def valid_for(self, optimizer) -> bool:
        """False once ``optimizer`` stepped outside the graph (its counters and state moved on their own)."""
        return registry.last_step(optimizer) <= self.steps_seen

    def fill(self, tables: GraphTables, coeff_rows: torch.Tensor, row_of_run: list[int]) -> None:
        """Write this replay's coefficients (``coeff_rows[row_of_run[r]]`` for run r) and the runs into the device
        buffer: one host image, one copy."""
        host = torch.empty(self.template.numel(), dtype=torch.uint8, pin_memory=tables.buffer.is_cuda)
        host.copy_(self.template)
        per_run = coeff_rows.index_select(0, torch.tensor(row_of_run, dtype=torch.int64))
        host.view(torch.float32)[self.coeff_index] = per_run.reshape(-1)
        tables.buffer.copy_(host, non_blocking=True)
