"""The copy-engine collectives (mfsdp_ext.comm.copy_engine): the all-gather's piece mapping and the gradient
exchange's chunks on 2 and 4 gloo ranks, and the order in which they use their two buffers.

On GPUs each rank reads its peers' symmetric buffers directly (test_copy_engines below).
Here a gloo all-gather of the buffers takes the place of that mapping, inside the barrier, so the copies the
all-gather makes (which rank's buffer, which offset, which parameter piece, in place or through the staging buffer)
are checked against the plain all-gather on every group of a model, for shards that split parameters unevenly
across ranks; the gradients that arrive, against the plain all-to-all's.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mfsdp_ext import MixedPrecisionPolicy, fully_shard
from mfsdp_ext.comm.collectives import TORCH_TRANSPORT
from mfsdp_ext.comm.copy_engine import (
    BUFFER_ENV,
    BufferTurns,
    CopyEngineAllGather,
    CopyEngineReduceScatter,
    CopyEngineStage,
    auto_buffer_bytes,
    gathers_by_copy_engine,
    peer_order,
    plan,
    plan_both,
    reduces_by_copy_engine,
    window_pieces,
    windows,
)
from mfsdp_ext.core.device import DeviceHandle
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, rank_device, shard_tiny_lm


class _ExchangedStage:
    """CopyEngineStage's interface over CPU buffers: its barrier all-gathers every rank's buffers into ``peers``."""

    view = CopyEngineStage.view
    next_buffer = CopyEngineStage.next_buffer

    def __init__(self, nbytes: int):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.nbytes, self.device = nbytes, DeviceHandle(torch.device("cpu"))  # never capturing
        self.peers = [torch.zeros(2 * nbytes, dtype=torch.uint8) for _ in range(self.world)]
        self.turns = BufferTurns()
        self.barriers = 0

    def barrier(self) -> None:
        dist.all_gather(self.peers, self.peers[self.rank].clone())
        self.barriers += 1


def _rank_of(stage: _ExchangedStage, view: torch.Tensor) -> int:
    """Whose buffer ``view`` lies in."""
    storage = view.untyped_storage().data_ptr()
    return next(r for r, peer in enumerate(stage.peers) if peer.untyped_storage().data_ptr() == storage)


def _case_pieces_match_plain_gather():
    torch.manual_seed(5)
    # odd sizes: parameters split unevenly, some ranks' chunks empty or padded
    model = shard_tiny_lm(TinyLM(vocab=37, dim=12, ffn=20, n_layers=2, tie=False), fully_shard,
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    tokens, targets = batch(0, 8, seq=4, vocab=37)
    lm_loss(model, tokens, targets).backward()  # lazy init; the groups' layouts and views exist from here
    groups = [g for u in model._mfsdp_unit.context.units for g in u.groups if gathers_by_copy_engine(g)]
    assert groups
    paths = []
    for g in groups:
        stats = copy.copy(g.stats)
        slots = range(len(g.layout.slots))
        g.all_gather()
        plain = [g.unsharded.param_view(i).clone() for i in slots]
        assert any(p.abs().sum() > 0 for p in plain)  # the weights are not all zero: the copies must write them
        shard_bytes = g.layout.shard_numel * g.compute_dtype.itemsize
        third = -(-g.layout.shard_numel // 3) * g.compute_dtype.itemsize
        for nbytes in (shard_bytes, third):  # one window, then three
            stage = _ExchangedStage(nbytes)
            g.free_unsharded()  # as at lazy init: the pieces have no storage when the copies are planned
            op = CopyEngineAllGather(stage, g)
            assert len(op.windows) == (1 if nbytes == shard_bytes else 3), op.windows
            assert op.staged == (len(op.pieces) > stage.world)  # the tiny model's pieces are all small
            op.staged = len(paths) % 2 == 1 and op.staged  # every other gather copied in place: both ways checked
            if nbytes == shard_bytes:
                sources = [_rank_of(stage, source) for _, _, source in op.in_place[0][0]]
                turns = [peer_order(stage.rank, stage.world).index(source) for source in sources]
                assert turns == sorted(turns) and len(set(sources)) == stage.world, sources  # peer order, from all
            for gather in range(3):  # buffer 0, 1, 0, ...: one barrier per window (eager)
                g.unsharded.alloc()
                g.unsharded.data.zero_()  # so the copies must write every element
                g.all_gather(op)
                rounds = (gather + 1) * len(op.windows)
                assert stage.barriers == rounds and stage.turns.buffer == (rounds - 1) % 2
                for i in slots:
                    assert torch.equal(g.unsharded.param_view(i), plain[i]), (g.unit().name, i, gather, nbytes)
            paths.append("staged" if op.staged else "in place")
        g.stats = stats
        g.free_unsharded()
    return {"groups": len(groups), "paths": sorted(set(paths))}


def _case_arrived_match_plain_all_to_all():
    torch.manual_seed(7)
    # the bf16 wire (NCCL's default on one host; asked for here over gloo): gradients travel in bf16, summed in fp32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  reduce_comm_dtype=torch.bfloat16)
    model = shard_tiny_lm(TinyLM(vocab=37, dim=12, ffn=20, n_layers=2, tie=False), fully_shard, mp_policy=policy)
    tokens, targets = batch(0, 8, seq=4, vocab=37)
    lm_loss(model, tokens, targets).backward()
    groups = [g for u in model._mfsdp_unit.context.units for g in u.groups if reduces_by_copy_engine(g)]
    assert groups
    torch.manual_seed(100 + dist.get_rank())  # every rank its own gradients
    for g in groups:
        for info in g.infos:
            info.unsharded.grad = torch.randn_like(info.unsharded, dtype=g.compute_dtype)
        plain = TORCH_TRANSPORT.reduce_scatter_op(g, 0.5)
        packed_bytes = g.layout.rank_major_numel * g.reduce_comm_dtype.itemsize
        for nbytes in (packed_bytes, packed_bytes // 4 // 2 * 2):  # one window, then about four
            stage = _ExchangedStage(nbytes)
            op = CopyEngineReduceScatter(stage, g)
            assert (len(op.windows) == 1) == (nbytes == packed_bytes), op.windows
            for exchange in range(3):
                arrived = op(g, 0.5)
                assert stage.barriers == (exchange + 1) * len(op.windows) and arrived.scale == plain.scale
                assert torch.equal(arrived.parts, plain.parts), (g.unit().name, exchange, nbytes)
        assert plain.parts.abs().sum() > 0
        g.grads.drop_unsharded()
    return {"groups": len(groups)}


def test_arrived_match_plain_all_to_all(cpu_pool):
    print(cpu_pool.run(_case_arrived_match_plain_all_to_all)[0])


def test_pieces_match_plain_gather(cpu_pool):
    results = cpu_pool.run(_case_pieces_match_plain_gather)
    print(results[0])
    assert results[0]["paths"] == ["in place", "staged"], results[0]  # both ways of copying were checked


def test_windows_and_buffer_sizes():
    """A group larger than its buffer goes in windows that cover its shard once; the pack table of each window puts
    every gradient element where that window's buffer holds it; the buffers are capped by the resident state."""
    assert windows(10, 4) == [(0, 4), (4, 8), (8, 10)] and windows(8, 8) == [(0, 8)] and windows(0, 4) == [(0, 0)]
    shard, world = 10, 3
    # three parameters of 7, 12 and 11 elements, split over 3 ranks' shards of 10 (the layout's rank-major pieces)
    pieces = [(0, 0, 7, 0), (1, 0, 3, 7), (1, 3, 7, 10), (1, 10, 2, 20), (2, 0, 3, 17), (2, 3, 8, 22)]
    grads = [torch.arange(7.0) + 100, torch.arange(12.0) + 200, torch.arange(11.0) + 300]
    full = torch.zeros(world * shard)
    for param, first, count, offset in pieces:
        full[offset : offset + count] = grads[param][first : first + count]
    for start, stop in windows(shard, 4):
        width = stop - start
        out = torch.zeros(world * width)
        for param, first, count, offset in window_pieces(pieces, shard, world, start, stop).tolist():
            assert out[offset : offset + count].eq(0).all()  # no element written twice
            out[offset : offset + count] = grads[param][first : first + count]
        expect = torch.cat([full[r * shard + start : r * shard + stop] for r in range(world)])
        assert torch.equal(out, expect), (start, stop)



def test_plan(monkeypatch):
    """"auto": four buffers within 1% of the resident state, used only where the groups that need more than two
    rounds carry at most a quarter of the bytes; True: the largest group whole."""
    monkeypatch.delenv(BUFFER_ENV, raising=False)
    assert auto_buffer_bytes(16 * 10**9) == 40 * 10**6  # 4 x 40 MB = 1%
    need = int  # a "group" here is its need in bytes
    blocks = [("auto", 1 << 20)] * 8
    assert plan(blocks + [("auto", 2 << 20)], need, 1 << 19) == ([1 << 20] * 8 + [2 << 20], 1 << 19)  # 2 rounds
    assert plan(blocks + [("auto", 3 << 20)], need, 1 << 20) == ([], 0)  # 27% of the bytes in 3 rounds: NCCL's
    assert plan(blocks, need, 1 << 18) == ([], 0)  # every block in 4 rounds: NCCL's
    assert plan(blocks, need, 4 << 20) == ([1 << 20] * 8, 1 << 20)  # no larger than the largest group
    assert plan([("auto", 1000)], need, 4096) == ([1000], 1024)  # 256-byte aligned
    assert plan([(True, 3 << 20)] + blocks, need, 1 << 20) == ([3 << 20] + [1 << 20] * 8, 3 << 20)  # True: whole
    assert plan([], need, 1 << 20) == ([], 0)
    # "auto" takes both directions or neither; groups of 2 ranks: a 1 MiB bf16 shard, 2 MiB of packed gradients
    group = SimpleNamespace(layout=SimpleNamespace(shard_numel=1 << 19, rank_major_numel=1 << 20),
                            compute_dtype=torch.bfloat16, reduce_comm_dtype=torch.bfloat16)
    asked = [("auto", group)] * 8
    assert plan_both(asked, asked, 1 << 20) == (([group] * 8, 1 << 20), ([group] * 8, 1 << 20))  # 1 and 2 rounds
    assert plan_both(asked, asked, 1 << 19) == (([], 0), ([], 0))  # the exchange in 4 rounds: neither
    assert plan_both(asked, [], 1 << 20) == (([], 0), ([], 0))  # no exchange to take: neither
    assert plan_both([(True, group)], [], 1 << 19) == (([group], 1 << 20), ([], 0))  # True: as asked
    monkeypatch.setenv(BUFFER_ENV, "0.5")
    assert plan(blocks + [("auto", 3 << 20)], need, 1 << 20)[1] == 1 << 19


def _case_auto_choice():
    """What "auto" chooses for two of benchmarks/step.py's shapes (docs/api.md says so): on 2 ranks config 3 (48
    blocks of d1024) takes the copy engines in both directions with 13.0 MiB buffers, a block in 1 gather round and 2
    exchange rounds; config 2 (16 blocks of d2048: 3 and 6 rounds) keeps NCCL's collectives; on 4 ranks both do."""
    from mfsdp_ext.comm import copy_engine
    from mfsdp_ext.testing import gpt

    chosen = {}
    for name, (layers, dim, ffn) in {"config 3": (48, 1024, 2816), "config 2": (16, 2048, 5632)}.items():
        with torch.device("meta"):
            model = gpt.GPT(gpt.GPTConfig(n_layers=layers, dim=dim, n_heads=dim // 128, ffn_dim=ffn, vocab_size=32000))
        gpt.shard_model(model, fully_shard, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        groups = [g for layer in model.layers for g in layer._mfsdp_unit.groups] + model._mfsdp_unit.groups
        auto_bytes = copy_engine.auto_buffer_bytes(sum(copy_engine.resident_bytes(g) for g in groups))
        asked = [("auto", g) for g in groups]
        (gathers, gather_bytes), (reduces, reduce_bytes) = copy_engine.plan_both(asked, asked, auto_bytes)
        chosen[name] = (len(gathers), len(reduces), round(gather_bytes / 2**20, 1), round(reduce_bytes / 2**20, 1))
    expected = {2: {"config 3": (49, 49, 13.0, 13.0), "config 2": (0, 0, 0.0, 0.0)},
                4: {"config 3": (0, 0, 0.0, 0.0), "config 2": (0, 0, 0.0, 0.0)}}  # 4 ranks: 4 exchange rounds
    assert chosen == expected[dist.get_world_size()], chosen
    return chosen


def test_auto_choice(cpu_pool):
    print(cpu_pool.run(_case_auto_choice)[0])


def _case_benchmark_counts_buffers():
    """benchmarks/step.py's peak column adds the copy engines' buffers (outside the caching allocator) to
    max_memory_allocated: read from where the library keeps them, so a moved attribute fails here."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from step import comm_buffer_bytes

    model = shard_tiny_lm(TinyLM(vocab=37, dim=12, ffn=20, n_layers=2, tie=False), fully_shard)
    tokens, targets = batch(0, 8, seq=4, vocab=37)
    lm_loss(model, tokens, targets).backward()  # lazy init: the root's communication resources exist
    assert comm_buffer_bytes(model) == 0.0  # gloo: neither symmetric memory nor copy engines
    model._mfsdp_unit.context.comm.copy_engines.append(SimpleNamespace(buffer=torch.empty(1000, dtype=torch.uint8)))
    counted = comm_buffer_bytes(model)
    model._mfsdp_unit.context.comm.copy_engines.clear()
    assert counted == 1000.0, counted
    return counted


def test_benchmark_counts_buffers(cpu_pool):
    cpu_pool.run(_case_benchmark_counts_buffers)


def test_peer_order():
    """Each rank copies from itself first, then from every peer once; at each turn no two ranks read the same rank
    (a copy from one GPU's memory does not share its links with another's)."""
    for world in range(1, 9):
        orders = [peer_order(rank, world) for rank in range(world)]
        for rank, order in enumerate(orders):
            assert order[0] == rank and sorted(order) == list(range(world)), (world, rank, order)
        for turn in range(world):
            assert len({order[turn] for order in orders}) == world, (world, turn, orders)


def test_buffer_turns():
    """Buffers alternate; a barrier comes first at the first gather of each capture and at every eager gather
    after a capture (a replay leaves the buffers in an order the host does not know)."""
    turns = BufferTurns()
    seq = [0, 0, 0, 7, 7, 7, 0, 0, 9, 9, 7]
    got = [turns.next(capture) for capture in seq]
    assert got == [(0, False), (1, False), (0, False),  # eager: each gather's own barrier protects the one after
                   (1, True), (0, False), (1, False),  # capture 7: a barrier before its first gather only
                   (0, True), (1, True),  # eager after a capture: always
                   (0, True), (1, False),  # capture 9
                   (0, True)], got  # capture 7 again (a re-capture with the same id still starts with one)


# ----------------------------------------------------------------------------------------------- GPU: copy engines
def _case_copy_engines():
    """fully_shard(copy_engine_all_gather=True, copy_engine_reduce_scatter=True): every unit's bf16 weights gathered
    and its bf16 gradients exchanged by the copy engines through the peers' symmetric buffers. 3 eager steps, then 8
    steps of its whole step graphed (mfsdp_ext.graphed: the held units gathered inside the optimizer step, all of it
    replayed) with an eager evaluation forward before the last two, equal an eager twin on NCCL's collectives bit
    for bit (losses and fp32 shards); so does the default ("auto") with buffers too small for the larger groups,
    which go through in windows; the FP8 groups of an FP8 model keep the plain all-gather."""
    import os

    import mfsdp_ext
    from mfsdp_ext.comm.copy_engine import BUFFER_ENV

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(23)
    base = TinyLM(vocab=64, dim=64, ffn=128, n_layers=3, tie=False).to(rank_device())
    ours = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy, copy_engine_all_gather=True,
                         copy_engine_reduce_scatter=True)
    twin = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy, copy_engine_all_gather=False,
                         copy_engine_reduce_scatter=False)
    auto = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy)  # the default: "auto"
    opts = [mfsdp_ext.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, twin, auto)]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def make_step(model, opt):
        def train_step(tokens, targets):
            loss = lm_loss(model, tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return train_step

    eager_ours, eager_twin, eager_auto = (make_step(m, o) for m, o in zip((ours, twin, auto), opts))
    graphed = mfsdp_ext.graphed(eager_ours, warmup=2)
    losses, twin_losses, auto_losses = [], [], []
    os.environ[BUFFER_ENV] = "0.001"  # ~1 KB buffers for "auto": the embedding's 4 KB shard takes 4 windows
    try:
        for step in range(11):
            tokens, targets = (t.chunk(world)[rank] for t in batch(step, 32 * world, seq=16, vocab=64))
            if step == 9:  # an eager forward between replays: its gathers wait at a barrier first (copy_engine.py)
                with torch.no_grad():
                    losses.append(lm_loss(ours, tokens, targets).item())
                    twin_losses.append(lm_loss(twin, tokens, targets).item())
                    auto_losses.append(lm_loss(auto, tokens, targets).item())
            losses.append((eager_ours if step < 3 else graphed)(tokens, targets).item())
            twin_losses.append(eager_twin(tokens, targets).item())
            auto_losses.append(eager_auto(tokens, targets).item())
    finally:
        del os.environ[BUFFER_ENV]
    expected = {"copy_engine"} if world > 1 else {"plain"}
    for model in (ours, auto):
        ops = {op.name for u in model._mfsdp_unit.context.units for g in u.groups
               for op in (g.collectives.all_gather, g.collectives.reduce_scatter)}
        assert ops == expected, ops
    windowed = [len(g.collectives.all_gather.windows) for u in auto._mfsdp_unit.context.units for g in u.groups
                if world > 1]
    assert world == 1 or max(windowed) > 1, windowed
    assert graphed.captures == 1, graphed.captures
    assert losses == twin_losses and auto_losses == twin_losses, (losses, twin_losses, auto_losses)
    for (name, p), q, r in zip(ours.named_parameters(), twin.parameters(), auto.parameters()):
        assert torch.equal(p.to_local(), q.to_local()) and torch.equal(r.to_local(), q.to_local()), name
    fp8 = shard_tiny_lm(copy.deepcopy(base), fully_shard, copy_engine_all_gather=True,
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, fp8=mfsdp_ext.Fp8Policy()))
    lm_loss(fp8, tokens, targets).backward()
    fp8_ops = {(g.fp8, g.collectives.all_gather.name) for u in fp8._mfsdp_unit.context.units for g in u.groups}
    assert all(name == ("plain" if is_fp8 or world == 1 else "copy_engine") for is_fp8, name in fp8_ops), fp8_ops
    return {"losses": losses[-3:], "ops": sorted(ops)}


@pytest.mark.gpu
def test_copy_engines(gpu_pool_from_one):
    print(gpu_pool_from_one.run(_case_copy_engines)[0])
