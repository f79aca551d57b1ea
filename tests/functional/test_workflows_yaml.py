"""`pretrain_gpt.py --yaml-cfg examples/gpt3/gpt_config_tiny_cpu.yaml` trains, and logs the same losses as
the same run given as command-line flags (written out here by hand), with a flag overriding the file."""
from pathlib import Path

from tests.functional.cli import run_pretrain
from tests.harness import repo_root

CONFIG = Path(repo_root()) / "examples" / "gpt3" / "gpt_config_tiny_cpu.yaml"
EQUIVALENT = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--norm-epsilon 1e-5 --init-method-std 0.02 --normalization LayerNorm --no-persist-layer-norm "
    "--no-masked-softmax-fusion --no-bias-dropout-fusion --no-gradient-accumulation-fusion "
    "--micro-batch-size 4 --global-batch-size 8 --seq-length 128 --max-position-embeddings 128 "
    "--position-embedding-type learned_absolute --transformer-impl local --seed 1234 --optimizer adam --lr 1e-3 "
    "--min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --mock-data --tokenizer-type NullTokenizer --vocab-size 8191 "
    "--split 99,1,0 --log-interval 5 --eval-interval 10 --eval-iters 2"
).split()


def test_yaml_run_matches_command_line_run():
    from_yaml = run_pretrain(["--yaml-cfg", str(CONFIG), "--train-iters", "10"], timeout=300)
    from_cli = run_pretrain(EQUIVALENT + ["--train-iters", "10"], timeout=300)
    assert from_yaml.returncode == 0, from_yaml.output[-4000:]
    assert from_cli.returncode == 0, from_cli.output[-4000:]
    yaml_losses = [(e["iteration"], e["train_iters"], e["loss_values"]["lm loss"]) for e in from_yaml.iterations]
    cli_losses = [(e["iteration"], e["train_iters"], e["loss_values"]["lm loss"]) for e in from_cli.iterations]
    assert len(yaml_losses) == 2 and yaml_losses == cli_losses
    assert [v["value"] for v in from_yaml.validations] == [v["value"] for v in from_cli.validations]
