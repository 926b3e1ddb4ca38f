"""FlatLayout on random shapes: each rank holds exactly torch.chunk's rows (what DTensor's Shard(0) means), the
shard, param-major and rank-major arrangements agree with each other, and the FP8 segment tables are valid.

The collectives are simulated in one process: a per-parameter all-gather of every rank's chunk slots must give
the parameters in place, and a flat reduce-scatter of rank-major packed gradients must give each rank its rows.
"""

import random

import pytest
import torch
from torch.distributed.tensor import Shard

from mfsdp_ext import _native
from mfsdp_ext.core.layout import ALIGN_ELEMS, FlatLayout


def _random_shapes(rng: random.Random) -> list[torch.Size]:
    shapes = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.3:
            shapes.append(torch.Size([rng.randint(1, 40)]))  # bias / norm
        elif kind < 0.9:
            shapes.append(torch.Size([rng.randint(1, 300), rng.choice([1, 3, 7, 13, 64, 97, 128, 1000])]))
        else:
            shapes.append(torch.Size([rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)]))
    return shapes


def _dtensor_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(size, offset) of rank's rows as DTensor's Shard(0) computes them (a private name on older torch)."""
    fn = getattr(Shard, "local_shard_size_and_offset", None) or Shard._local_shard_size_and_offset
    return fn(rows, world, rank)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_rows_are_torch_chunk_rows(world):
    rng = random.Random(1234 + world)
    for _ in range(200):
        shapes = _random_shapes(rng)
        layout = FlatLayout(shapes, world)
        assert layout.shard_numel % ALIGN_ELEMS == 0 and layout.unsharded_numel >= sum(s.numel() for s in shapes)
        for slot, shape in zip(layout.slots, shapes):
            assert slot.shape == shape
            assert slot.shard_offset % ALIGN_ELEMS == 0 and slot.unsharded_offset % ALIGN_ELEMS == 0
            chunks = torch.arange(shape[0]).chunk(world)
            for r in range(world):
                r0, r1 = layout.local_rows(slot, r)
                want = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(r0, r1)) == want, (shape, world, r)
                # ... and what DTensor itself computes for Shard(0)
                size, offset = _dtensor_rows(shape[0], world, r)
                assert size == r1 - r0 and (size == 0 or offset == r0), (shape, world, r)
        for r in range(world):
            segs = torch.tensor(layout.local_segments(r), dtype=torch.int64).reshape(-1, 2)
            _native._C.check_segments(segs, layout.shard_numel)  # sorted, in bounds: the kernels' rule
            for slot, (a, b) in zip(layout.slots, segs.tolist()):
                assert a == slot.shard_offset and b - a == layout.local_numel(slot, r)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_simulated_gather_and_reduce_scatter(world):
    rng = random.Random(99 + world)
    gen = torch.Generator().manual_seed(world)
    for _ in range(50):
        shapes = _random_shapes(rng)
        layout = FlatLayout(shapes, world)
        full = [torch.randn(s, generator=gen) for s in shapes]
        # every rank's shard: its torch.chunk rows at the slot offsets, zero padding elsewhere
        shards = []
        for r in range(world):
            shard = torch.full((layout.shard_numel,), float("nan"))
            tensors, offsets = [], []
            for slot, p in zip(layout.slots, full):
                r0, r1 = layout.local_rows(slot, r)
                tensors.append(p[r0:r1].contiguous())
                offsets.append(slot.shard_offset)
            _native.pack(tensors, offsets, shard)  # writes every element: zeros between the rows
            shards.append(shard)
        # all-gather per parameter: rank r's chunk slot lands at row r * chunk_rows of the padded parameter
        unsharded = torch.full((layout.unsharded_numel,), float("nan"))
        for slot in layout.slots:
            for r in range(world):
                dst = slot.unsharded_offset + r * slot.chunk_numel
                unsharded[dst : dst + slot.chunk_numel] = shards[r][slot.shard_offset :][: slot.chunk_numel]
        for slot, p in zip(layout.slots, full):
            assert torch.equal(slot.view(unsharded), p)
        # reduce-scatter: every rank packs its full gradients rank-major; the sum of slice r is rank r's rows
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(world)]
        packed = []
        for g in grads:
            out = torch.full((layout.rank_major_numel,), float("nan"))
            tensors, offsets = [], []
            for slot, t in zip(layout.slots, g):
                for r in range(world):
                    r0, r1 = layout.local_rows(slot, r)
                    if r1 > r0:
                        tensors.append(t[r0:r1].contiguous())
                        offsets.append(r * layout.shard_numel + slot.shard_offset)
            _native.pack(tensors, offsets, out)
            packed.append(out)
        total = torch.stack(packed).sum(0)
        for r in range(world):
            reduced = total[r * layout.shard_numel :][: layout.shard_numel]
            assert not reduced.isnan().any()
            for i, slot in enumerate(layout.slots):
                r0, r1 = layout.local_rows(slot, r)
                n = (r1 - r0) * slot.row_numel
                want = sum(g[i] for g in grads)[r0:r1].reshape(-1)
                assert torch.allclose(reduced[slot.shard_offset :][:n], want, atol=1e-5)
                assert torch.all(reduced[slot.shard_offset + n : slot.shard_offset + slot.chunk_numel] == 0)


def test_padding_stays_small_for_transformer_shapes():
    dim, ffn, vocab = 2048, 5632, 32000
    block = [torch.Size([dim])] + [torch.Size([dim, dim])] * 4 + [torch.Size([ffn, dim])] * 2 + \
        [torch.Size([dim, ffn]), torch.Size([dim])]
    for world in (2, 4, 8):
        for shapes in (block, [torch.Size([vocab, dim]), torch.Size([dim]), torch.Size([vocab, dim])]):
            layout = FlatLayout(shapes, world)
            total = sum(s.numel() for s in shapes)
            assert layout.total_numel - total <= 0.01 * total, (world, layout)
            assert layout.rank_major_numel - total <= 0.01 * total, (world, layout)


def test_scalar_rejected():
    with pytest.raises(ValueError, match="0-d"):
        FlatLayout([torch.Size([])], 2)
