"""`--moe-use-upcycling` through `pretrain` (Megatron 0.13.1's flow): a dense checkpoint trained here is upcycled
into 4 experts (granularity 1) and saved as iteration 1 of --save; the upcycled model evaluates to the dense model's
validation loss (each expert is the dense MLP and the top-2 probabilities sum to 1), so does the saved checkpoint
(weights only, as Megatron writes it) loaded without the flag (and trains on), and upcycling into a --save that already holds a checkpoint is refused.
One in-process rank, about 15 s."""
import os

from tests.compat import megatron_fixtures as mf
from tests.functional.cli import reset_training_state
from tests.harness import run_on_ranks

COMMON = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 4095 "
    "--log-interval 1 --eval-iters 2 --eval-interval 100 --hidden-dropout 0 --attention-dropout 0 --seed 3 "
    "--lr 1e-3 --transformer-impl local --disable-bias-linear --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --ffn-hidden-size 48 --ckpt-format torch_dist"
).split()
MOE = "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall".split()


def _worker(root):
    dense_dir, up_dir = os.path.join(root, "dense"), os.path.join(root, "upcycled")
    results = {}
    code, _, _, _ = mf.run([*COMMON, "--train-iters", "2", "--save", dense_dir, "--save-interval", "2"])
    assert code is None
    code, _, results["dense"], _ = mf.run([*COMMON, "--train-iters", "2", "--load", dense_dir, "--skip-train"])
    assert code is None
    code, _, results["upcycling"], _ = mf.run([*COMMON, *MOE, "--train-iters", "2", "--moe-use-upcycling",
                                               "--load", dense_dir, "--save", up_dir, "--save-interval", "100",
                                               "--skip-train"])
    assert code is None
    results["tracker"] = open(os.path.join(up_dir, "latest_checkpointed_iteration.txt")).read().strip()
    code, _, results["loaded"], _ = mf.run([*COMMON, *MOE, "--train-iters", "2", "--load", up_dir, "--no-load-optim", "--skip-train"])
    assert code is None
    code, losses, _, _ = mf.run([*COMMON, *MOE, "--train-iters", "3", "--load", up_dir, "--no-load-optim"])
    results["trained"] = (code, len(losses))
    try:
        mf.run([*COMMON, *MOE, "--train-iters", "2", "--moe-use-upcycling", "--load", dense_dir, "--save", up_dir,
                "--save-interval", "100", "--skip-train"])
        results["again"] = None
    except RuntimeError as error:
        results["again"] = str(error)
    reset_training_state()
    return results


def test_upcycled_model_keeps_the_dense_loss(tmp_path):
    results = run_on_ranks(_worker, 1, str(tmp_path), timeout=600)[0]
    dense = results["dense"]
    assert set(dense) == {"valid", "test"}
    for name in ("upcycling", "loaded"):
        for split in ("valid", "test"):
            assert abs(results[name][split] - dense[split]) <= 1e-5 * dense[split], (name, results)
    assert results["tracker"] == "1"
    assert results["trained"] == (None, 2 * 2), results["trained"]
    assert results["again"] is not None and "already holds a checkpoint" in results["again"]
