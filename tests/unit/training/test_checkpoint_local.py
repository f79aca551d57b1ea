"""Local non-persistent checkpoints (`--non-persistent-ckpt-type local`): each of 2 gloo ranks (DP=2, distributed
optimizer, fp32) writes its own file without communication; after a crash that left the persistent checkpoint at
iteration 2, a restart with `--load` picks the local checkpoint (iteration 3), and iterations 4-6 equal the uninterrupted run's bit
for bit (iteration 5 and 6 also check the optimizer shards). Loading the files at another world size fails with
a message naming both layouts.
"""
import os

import pytest

from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.harness import run_on_ranks

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --log-interval 10 --eval-iters 0 --transformer-impl local --seed 7 --num-workers 0 "
    "--attention-dropout 0 --hidden-dropout 0 --use-distributed-optimizer"
).split()


def _local_flags(root):
    return ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", os.path.join(root, "local")]


def _train_and_save(root):
    code, full = run_pretrain_in_process(BASE + ["--train-iters", "6"])
    assert code is None and len(full) == 6
    code, _ = run_pretrain_in_process(BASE + _local_flags(root) + [
        "--train-iters", "6", "--exit-interval", "3", "--save", os.path.join(root, "persistent"),
        "--save-interval", "2", "--non-persistent-save-interval", "3"])
    assert code in (None, 0)
    reset_training_state()
    return full[3:]


def _resume(root):
    code, resumed = run_pretrain_in_process(BASE + _local_flags(root) + [
        "--train-iters", "6", "--load", os.path.join(root, "persistent")])
    assert code is None
    reset_training_state()
    return resumed


def _crash_before_final_persistent_save(persistent):
    """The run also saved persistently when it exited (iteration 3); a job killed right after the local
    save would have left the persistent tracker at 2."""
    import shutil

    shutil.rmtree(os.path.join(persistent, "iter_0000003"))
    with open(os.path.join(persistent, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")


def _load_at_one_rank(root):
    with pytest.raises(ValueError, match=r"was written with layout \{'world_size': 2.*this rank runs \{'world_size': 1"):
        run_pretrain_in_process(BASE + _local_flags(root) + ["--train-iters", "6", "--load",
                                                            os.path.join(root, "persistent")])
    reset_training_state()
    return True


def test_local_non_persistent_checkpoint_resume(tmp_path):
    root = str(tmp_path)
    references = run_on_ranks(_train_and_save, 2, root, timeout=300)
    for rank in range(2):
        assert os.listdir(os.path.join(root, "local", f"rank_{rank:05d}")) == ["iter_0000003.pt"]
    _crash_before_final_persistent_save(os.path.join(root, "persistent"))
    for rank, (reference, resumed) in enumerate(zip(references, run_on_ranks(_resume, 2, root, timeout=300))):
        assert resumed == reference, f"rank {rank}: iterations 4-6 after the local checkpoint differ"
    assert run_on_ranks(_load_at_one_rank, 1, root, timeout=300) == [True]
