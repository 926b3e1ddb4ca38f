"""The flat side of mfsdp_ext.optim: which parameters a flat kernel may step, their state buffers, and the run
table that one kernel launch per ParamGroup walks.

A parameter is *flat* when it is the current sharded parameter of a ParamGroup with an fp32 main weight. Its
state (``exp_avg``, ...) lives in a FlatBuffer of the group's shard layout, one per state name, and
``optimizer.state[p][name]`` is the DTensor view of its slot (``ParamGroup.as_dtensor``), so state_dict()
and DCP see torch's layout while the kernel sees one flat buffer.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from ..core.flat_buffer import FlatBuffer
from ..params import rows as param_rows
from ..params.group import ParamGroup, owner_of


def flat_owner(p: torch.Tensor) -> tuple[ParamGroup, int] | None:
    """(group, index) when a flat kernel can step ``p``, else None (torch's implementation steps it)."""
    owner = owner_of(p)
    if owner is None:
        return None
    group, i = owner
    if group.infos[i].sharded is not p:
        raise ValueError("mfsdp_ext.optim: a parameter given to the optimizer is no longer its module's parameter "
                         "(its group was re-created, e.g. by materializing a meta-device model after the optimizer "
                         "was built); build the optimizer after the model is initialized")
    if group.main_weight.data.is_meta or group.main_weight.dtype != torch.float32:
        return None
    return owner


class FlatState:
    """One optimizer's flat state buffers (fp32, zeroed) for one ParamGroup, and each parameter's DTensor views."""

    def __init__(self, group: ParamGroup, names: tuple[str, ...]):
        self.names = names
        self.buffers: dict[str, FlatBuffer] = {}  # made on first use (SGD without momentum makes none)
        self._group_ref = weakref.ref(group)  # a strong one would keep the WeakKeyDictionary's key alive
        self._views: dict[tuple[str, int], DTensor] = {}

    def _buffer(self, name: str) -> FlatBuffer:
        if name not in self.buffers:
            group = self._group_ref()
            buf = FlatBuffer(group.layout, torch.float32, group.main_weight.data.device, rank=group.rank)
            buf.data.zero_()
            self.buffers[name] = buf
        return self.buffers[name]

    def buffer(self, name: str) -> torch.Tensor:
        return self._buffer(name).data

    def view(self, name: str, i: int) -> DTensor:
        """Parameter i's state ``name``: a DTensor like the parameter, a view of the flat buffer (made once)."""
        key = (name, i)
        if key not in self._views:
            # param_alias: the slot as a tensor at storage offset 0 (same memory), which torch can deepcopy and
            # pickle inside a DTensor, as the parameters themselves are made
            self._views[key] = self._group_ref().as_dtensor(i, self._buffer(name).param_alias(i))
        return self._views[key]

    def fresh_view(self, name: str, i: int) -> DTensor:
        """The view with its slot zeroed: the state a parameter starts with."""
        self._buffer(name).chunk_slot(i).zero_()
        return self.view(name, i)

    def adopt(self, name: str, i: int, value: torch.Tensor) -> DTensor:
        """Copy ``value`` (a loaded or torch-made state tensor) into parameter i's slot; returns the view."""
        view = self.view(name, i)
        if value is not view:
            view._local_tensor.copy_(_local_part(self._group_ref(), i, value, view))
        return view


def _local_part(group: ParamGroup, i: int, value: torch.Tensor, view: DTensor) -> torch.Tensor:
    """This rank's rows of ``value``: a DTensor placed like the view, any other DTensor, or a full tensor."""
    if isinstance(value, DTensor):
        if value.placements == view.placements and value.shape == view.shape:
            return value._local_tensor
        value = value.full_tensor()
    if value.shape == view._local_tensor.shape and value.shape != view.shape:
        return value  # already this rank's rows
    return param_rows.local_of_full(group, i, value)


def build_runs(group: ParamGroup, items: Sequence[tuple[int, object]]) -> tuple[torch.Tensor, list[object], list[int]]:
    """The run table of one kernel launch: ``items`` are (parameter index, key), the key standing for
    everything the update depends on besides the data (optimizer group, step). Consecutive parameters with equal
    keys merge into one run covering their chunk slots and the alignment padding between them (all zero in
    weight, grad and state, so the update leaves it zero). Returns (runs, an int64 (n, 2) CPU tensor of
    [start, end) element ranges, the key of each run, and the parameter index each run starts with)."""
    slots = group.layout.slots
    rows: list[list[int]] = []
    keys: list[object] = []
    firsts: list[int] = []
    prev = None
    for i, key in sorted(items, key=lambda item: item[0]):
        slot = slots[i]
        end = slot.shard_offset + slot.chunk_numel
        if prev is not None and i == prev + 1 and key == keys[-1]:
            rows[-1][1] = end
        else:
            rows.append([slot.shard_offset, end])
            keys.append(key)
            firsts.append(i)
        prev = i
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2), keys, firsts
