"""Every rank must shard the same model the same way: checked at the root's lazy init, before any all-gather.

Ranks that disagree (one Linear of another size, one module sharded on some ranks only, another dtype or
strategy) would otherwise pair mismatched collectives and hang or corrupt memory. The check is one all-gather
of a fixed-size signature (description length, CRC32 of the description) per rank, so it cannot hang whatever
the ranks hold; only when the signatures differ, which every rank then sees alike, one all_gather_object of the
descriptions lets every rank raise the same error naming the first line that differs.
fully_shard itself runs no collective, so a rank that calls it more or fewer times reaches this check too.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist


def describe(root_module, units) -> list[str]:
    """One line per unit and per group: what decides the collectives the unit will run."""
    paths = {id(m): name or "<root>" for name, m in root_module.named_modules()}
    lines = []
    for u in units:
        path = "+".join(paths.get(id(m), u.name) for m in u.modules)
        lines.append(f"unit {path} ({u.name}): {u.config.strategy.value}, "
                     f"reshard_after_forward={u.controls.reshard_after_forward}, comm=({u.config.comm.describe()})")
        for g in u.groups:
            params = ", ".join(f"{info.fqn}{tuple(info.shape)}" for info in g.infos)
            lines.append(f"  {path} group {g.dtype}->{g.compute_dtype} reduce {g.reduce_dtype}, requires_grad="
                         f"{g.requires_grad}, {'replicated' if g.replicated else f'sharded over {g.world}'}, "
                         f"mesh {tuple(g.mesh.shape)}: {params}")
    return lines


def check(root_module, units, mesh, device: torch.device) -> None:
    """Raise the same RuntimeError on every rank of ``mesh`` when their descriptions of the model differ."""
    if mesh.size() == 1:
        return  # one rank: nothing to compare, and no collective (FSDP2 issues none on one rank)
    lines = describe(root_module, units)
    sig = torch.tensor([len(lines), zlib.crc32("\n".join(lines).encode())], dtype=torch.int64, device=device)
    # The whole mesh in one group: the world's, or a 1-D mesh's. A 2-D mesh over part of the world is checked
    # along each dim (all dims always run), which catches a difference but may leave ranks of the other dim waiting.
    whole = mesh.size() == dist.get_world_size() or mesh.ndim == 1
    groups = [None if mesh.size() == dist.get_world_size() else mesh.get_group(0)] if whole else \
        [mesh.get_group(d) for d in range(mesh.ndim)]
    differing = []
    for group in groups:
        gathered = [torch.empty_like(sig) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, sig, group=group)
        if not all(torch.equal(s, gathered[0]) for s in gathered):
            differing.append(group)
    found = []
    for group in differing:  # every differing group's exchange runs before any rank raises
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, lines, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(every)))
        found.append(_first_difference(every, ranks))
    if found:
        raise RuntimeError(f"mfsdp_ext: the ranks shard different models (found at the first forward, before any "
                           f"all-gather). {found[0]} Build the same model and apply fully_shard to the same "
                           "modules, with the same arguments, on every rank.")


def _first_difference(every: list[list[str]], ranks: list[int]) -> str:
    first = every[0]
    for i in range(max(len(d) for d in every)):
        for r, desc in zip(ranks[1:], every[1:]):
            mine, theirs = (first[i] if i < len(first) else "<nothing>"), (desc[i] if i < len(desc) else "<nothing>")
            if mine != theirs:
                return (f"First difference, line {i + 1} of the units' description: rank {ranks[0]} has {mine!r}, "
                        f"rank {r} has {theirs!r}.")
    return "The descriptions differ only in length."
