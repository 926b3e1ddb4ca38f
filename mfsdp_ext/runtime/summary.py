"""One line per unit, printed at the root's first forward when asked (``MFSDP_EXT_SUMMARY=1`` or
``fully_shard(root, verbose=True)``): what each unit shards, in which dtypes, and over which collectives."""

from __future__ import annotations

import os

import torch.distributed as dist


def wanted(verbose: bool) -> bool:
    return verbose or os.environ.get("MFSDP_EXT_SUMMARY", "") not in ("", "0")


def unit_lines(root_module, units) -> list[str]:
    """The summary of ``units`` (FsdpUnit objects under ``root_module``), named by their module paths."""
    paths = {id(m): name or "<root>" for name, m in root_module.named_modules()}
    lines = []
    for unit in units:
        groups = "; ".join(_group_text(g) for g in unit.groups) or "no parameters of its own"
        lines.append(f"mfsdp_ext unit {'+'.join(paths.get(id(m), unit.name) for m in unit.modules)} ({unit.name}): "
                     f"{unit.config.strategy.value} | {groups}")
    return lines


def _group_text(g) -> str:
    numel = sum(info.shape.numel() for info in g.infos)
    compute = _short(g.compute_dtype)
    if g.fp8:
        compute = f"fp8 e4m3 ({'FP8 GEMMs' if g.fp8_compute else 'dequantized to ' + compute})"
    dtypes = f"{_short(g.dtype)}->{compute}, reduce {_short(g.reduce_dtype)}"
    if g.reduce_comm_dtype != g.reduce_dtype:
        dtypes += f" (sent in {_short(g.reduce_comm_dtype)})"
    if g.shard_group is None:
        held, comm = f"replicated {_bytes(numel * g.dtype.itemsize)}", "grads all-reduced"
    else:
        held = (f"sharded {_bytes(g.layout.shard_numel * g.dtype.itemsize)}/rank of "
                f"{_bytes(numel * g.dtype.itemsize)} over {g.world} ranks")
        ops = g.collectives
        comm = f"all-gather {'fp8 plain' if g.fp8 else ops.all_gather.name}, reduce-scatter {ops.reduce_scatter.name}"
        if g.sums_on_arrival:
            comm += " (as all-to-all + sum)"
    if g.offload is not None:  # CPUOffloadPolicy: the fp32 shard, gradients and optimizer state on the host
        held += f", in {'pinned ' if g.offload.pin_memory else ''}host memory"
    return f"{len(g.infos)} params ({len(g.trainable())} trainable), {_count(numel)}, {dtypes}, {held}, {comm}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _short(dtype) -> str:
    return str(dtype).replace("torch.", "").replace("float", "fp").replace("bfp16", "bf16")


def print_summary(root_module, units) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("\n".join(unit_lines(root_module, units)), flush=True)
