"""The multi-rank harness survives garbage left by earlier tests in the launching process.

A process group in a reference cycle that the launching process has not collected yet is inherited by forked
ranks; collected there, its C++ destructor waits for worker threads that exist only in the parent, and the rank
hangs (a CI run once stalled 600 s this way inside an unrelated json.dumps)."""
import gc
import os
import tempfile

import torch
import torch.distributed as dist

from tests.harness import run_on_ranks


class _Cycle:
    def __init__(self, group):
        self.group = group
        self.me = self


def _collect_inherited_garbage():
    gc.collect()
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def test_forked_ranks_do_not_collect_a_process_group_left_in_a_cycle():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rdv')}", rank=0, world_size=1)
        group = dist.new_group([0])
        dist.all_reduce(torch.ones(1), group=group)
        enabled = gc.isenabled()
        gc.disable()  # the cycle stays uncollected until the ranks are forked, as between two tests
        try:
            _Cycle(group)
            del group
            dist.destroy_process_group()
            assert run_on_ranks(_collect_inherited_garbage, 2, timeout=60, start_method="fork") == [0, 1]
        finally:
            if enabled:
                gc.enable()
