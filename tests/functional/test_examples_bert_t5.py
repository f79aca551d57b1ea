"""examples/bert/train_bert_tiny_cpu.sh and examples/t5/train_t5_tiny_cpu.sh run unchanged (a small synthetic JSONL
corpus stands in for the quickstart one through $CORPUS): each trains its own WordPiece vocabulary with
`tokenizers`, preprocesses with --split-sentences, trains 30 iterations on CPU, and its `lm loss` must fall.
The full-size recipes are checked for Megatron's model shapes."""
import os
import subprocess
import sys

import pytest

from tests.functional.cli import parse_output
from tests.harness import repo_root
from tests.unit.data.masked_corpus import write_masked_corpus


@pytest.fixture(scope="module")
def corpus_jsonl(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("examples_corpus"))
    write_masked_corpus(directory, num_docs=300)
    return os.path.join(directory, "corpus.jsonl")


def _run_example(script, corpus, out):
    env = dict(os.environ, CORPUS=corpus, OUT=out, TRAIN_ITERS="30", LOG_INTERVAL="5", SPLIT="90,5,5",
               VOCAB_SIZE="200", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = repo_root() + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(["bash", os.path.join(repo_root(), script)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return parse_output(proc.stdout), proc.stdout


@pytest.mark.parametrize("script,loss_names,lower_case", [
    ("examples/bert/train_bert_tiny_cpu.sh", {"lm loss", "sop loss"}, True),
    ("examples/t5/train_t5_tiny_cpu.sh", {"lm loss"}, False),
])
def test_tiny_example_trains_and_its_loss_falls(corpus_jsonl, tmp_path, script, loss_names, lower_case):
    out = str(tmp_path / "work")
    result, output = _run_example(script, corpus_jsonl, out)
    losses = [it["loss_values"] for it in result.iterations]
    assert len(losses) == 6 and set(losses[0]) == loss_names, output[-3000:]
    first, last = losses[0]["lm loss"], losses[-1]["lm loss"]
    assert last < 0.85 * first, [it["lm loss"] for it in losses]
    vocab = open(os.path.join(out, "vocab.txt")).read().split("\n")
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert ("King" in vocab) != lower_case and any(tok.startswith("##") for tok in vocab)
    assert os.path.exists(os.path.join(out, "corpus_text_sentence.idx"))


@pytest.mark.parametrize("script,shape", [
    ("examples/bert/train_bert_340m_distributed.sh",
     ["--num-layers 24", "--hidden-size 1024", "--num-attention-heads 16", "--seq-length 512", "pretrain_bert.py"]),
    ("examples/t5/train_t5_220m_distributed.sh",
     ["--encoder-num-layers 12", "--decoder-num-layers 12", "--hidden-size 768", "--encoder-seq-length 512",
      "--decoder-seq-length 128", "--vocab-extra-ids 100", "BertWordPieceCase", "pretrain_t5.py"]),
])
def test_full_size_recipe_has_megatrons_shape(script, shape):
    text = " ".join(open(os.path.join(repo_root(), script)).read().split())
    for piece in shape:
        assert piece in text, piece
    assert subprocess.run(["bash", "-n", os.path.join(repo_root(), script)]).returncode == 0
