"""FlatLayout on random shapes: whole rows per rank, no overlap, alignment, valid FP8 segment tables."""

import random

import pytest
import torch

from mfsdp_ext import _native
from mfsdp_ext.layout import ALIGN_ELEMS, FlatLayout


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


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_random_layouts(world):
    rng = random.Random(1234 + world)
    for _ in range(200):
        shapes = _random_shapes(rng)
        layout = FlatLayout(shapes, world)
        layout.validate()
        total = sum(s.numel() for s in shapes)
        assert layout.total_numel >= total
        for slot, shape in zip(layout.slots, shapes):
            assert slot.shape == shape and slot.offset % ALIGN_ELEMS == 0
            rows = [layout.local_rows(slot, r) for r in range(world)]
            owned = sum(r1 - r0 for r0, r1 in rows)
            assert owned == (shape[0] if len(shape) > 0 else 1)  # every row on exactly one rank
        for r in range(world):
            segs = torch.tensor(layout.local_segments(r), dtype=torch.int64).reshape(-1, 2)
            _native._C.check_segments(segs, layout.shard_numel)  # sorted, in bounds: the kernels' rule
            for slot, (a, b) in zip(layout.slots, segs.tolist()):
                lo, hi = layout.local_range(slot, r)
                assert b - a == hi - lo


def test_padding_stays_small_for_transformer_shapes():
    dim, ffn, vocab = 2048, 5632, 32000
    block = [torch.Size([dim])] + [torch.Size([dim, dim])] * 4 + [torch.Size([ffn, dim])] * 2 + \
        [torch.Size([dim, ffn]), torch.Size([dim])]
    for world in (2, 4, 8):
        for shapes in (block, [torch.Size([vocab, dim]), torch.Size([dim]), torch.Size([vocab, dim])]):
            layout = FlatLayout(shapes, world)
            total = sum(s.numel() for s in shapes)
            assert layout.total_numel - total <= 0.01 * total, (world, layout)


def test_scalar_rejected():
    with pytest.raises(ValueError, match="0-d"):
        FlatLayout([torch.Size([])], 2)
