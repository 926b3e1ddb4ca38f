"""Run an example script (as ``python SCRIPT ARGS`` would) with collective counters, for
tests/integration/test_frameworks.py.

    torchrun --nproc-per-node 2 tests/integration/framework_probe.py COUNTS_PATH SCRIPT [ARGS...]

Per optimizer step, each rank appends a JSON line to COUNTS_PATH.rankR: the units' weight gathers and gradient
reductions of that step. FSDP2: calls of foreach_all_gather / foreach_reduce (one per unit's parameter group and
collective; a unit has one group per mesh). mfsdp_ext: a unit's unshard that gathered, and a unit that reduced in a
backward (once, also when it reduced a group early and the rest at its post-backward; not when it kept accumulating
under no-sync), each counted once per mesh its groups shard over (shard_placement_fn may give some their own). The
counters wrap both implementations' functions, so the example
switches between them as it would without this wrapper.
"""

from __future__ import annotations

import collections
import json
import os
import sys


def install_counters(path: str) -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    rank = os.environ.get("RANK", "0")
    counts = collections.Counter()

    def end_of_step(optimizer, args, kwargs):
        if not counts:
            return  # a container stepping its inner optimizers (torchtitan's), or a step with no backward
        with open(f"{path}.rank{rank}", "a") as f:
            f.write(json.dumps(dict(counts)) + "\n")
        counts.clear()

    register_optimizer_step_pre_hook(end_of_step)

    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp2_group

    fsdp2_reduce, fsdp2_gather = fsdp2_group.foreach_reduce, fsdp2_group.foreach_all_gather

    def foreach_reduce(*a, **k):
        counts["reduce"] += 1
        return fsdp2_reduce(*a, **k)

    def foreach_all_gather(*a, **k):
        counts["gather"] += 1
        return fsdp2_gather(*a, **k)

    fsdp2_group.foreach_reduce, fsdp2_group.foreach_all_gather = foreach_reduce, foreach_all_gather

    from mfsdp_ext.runtime import root as root_duties
    from mfsdp_ext.runtime.reduction import GradReduction
    from mfsdp_ext.runtime.unit import FsdpUnit

    reduce_groups, reduce_one = GradReduction.reduce_groups, GradReduction.reduce
    unshard, final_callback = FsdpUnit.unshard, root_duties.final_callback  # looked up when a backward queues it
    backward = [0]  # the backwards seen: a unit reducing some groups early and the rest at its post-backward
    reduced = set()  # reduces once in that backward, as FSDP2's one reduce-scatter of the unit's group

    def note_reduction(self, ctx, groups):
        for g in groups:
            key = (backward[0], id(self), id(g.shard_group))
            if g.grads.has_unsharded() and self.reduces_now(ctx, g) and key not in reduced:
                reduced.add(key)
                counts["reduce"] += 1

    def counted_reduce_groups(self, ctx, groups):
        note_reduction(self, ctx, groups)
        return reduce_groups(self, ctx, groups)

    def counted_reduce(self, ctx, g, *a, **k):
        note_reduction(self, ctx, [g])
        return reduce_one(self, ctx, g, *a, **k)

    def counted_final_callback(root):
        out = final_callback(root)
        backward[0] += 1
        return out

    def counted_unshard(self, *a, **k):
        before = [g.stats.all_gathers for g in self.groups]
        out = unshard(self, *a, **k)
        gathered = {id(g.shard_group) for g, n in zip(self.groups, before) if g.stats.all_gathers > n}
        counts["gather"] += len(gathered)
        return out

    GradReduction.reduce_groups, GradReduction.reduce = counted_reduce_groups, counted_reduce
    FsdpUnit.unshard, root_duties.final_callback = counted_unshard, counted_final_callback
    del torch


if __name__ == "__main__":
    counts_path, script, *argv = sys.argv[1:]
    install_counters(counts_path)
    from mfsdp_ext.as_fsdp2 import run_script

    run_script(script, argv)  # as python SCRIPT ARGS: its folder on sys.path; no switch (the example switches itself)
