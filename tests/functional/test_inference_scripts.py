"""The inference command lines end to end on CPU: a tiny GPT trained and saved by `pretrain_gpt.py`, then
loaded by `examples/inference/gpt/gpt_dynamic_inference.py` (the dynamic engine, sized by the
`--inference-dynamic-batching-*` flags, requests joining one per step) and by
`tools/run_text_generation_server.py --prompts` (the static engine): the greedy generations agree."""
import json
import os

from tests.functional.cli import run_pretrain

MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--tokenizer-type NullTokenizer --vocab-size 4095 --transformer-impl local").split()
PROMPTS = ["1 2 3 4 5", "7 8", "9 10 11 12 13 14 15 16 17"]


def _generations(output):
    """The '=' * 80 separated blocks the scripts print (prompt + generated text)."""
    blocks = output.split("=" * 80 + "\n")[1:]
    return [block.splitlines()[0] for block in blocks]


def test_dynamic_inference_example_equals_the_static_server_prompts_mode(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train = run_pretrain(MODEL + ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3",
                                  "--lr", "1e-3", "--mock-data", "--save", ckpt, "--save-interval", "3",
                                  "--eval-iters", "0", "--log-interval", "1"], timeout=300)
    assert train.returncode == 0, train.output[-3000:]
    load = ["--load", ckpt, "--inference-max-seq-length", "48", "--num-tokens-to-generate", "12", "--top_k", "1",
            "--prompts", *PROMPTS]
    out_path = str(tmp_path / "dynamic.json")
    dynamic = run_pretrain(MODEL + load + ["--inference-dynamic-batching", "--inference-dynamic-batching-buffer-size-gb",
                                           "0.001", "--inference-dynamic-batching-chunk-size", "8",
                                           "--inference-dynamic-batching-max-requests-override", "4",
                                           "--inference-dynamic-batching-max-tokens-override", "64",
                                           "--incoming-requests-per-step", "1", "--output-path", out_path],
                           timeout=300, script=os.path.join("examples", "inference", "gpt", "gpt_dynamic_inference.py"))
    assert dynamic.returncode == 0, dynamic.output[-3000:]
    static = run_pretrain(MODEL + load, timeout=300, script=os.path.join("tools", "run_text_generation_server.py"))
    assert static.returncode == 0, static.output[-3000:]
    saved = json.load(open(out_path))
    assert [r["prompt"] for r in saved] == PROMPTS and len(_generations(dynamic.output)) == len(PROMPTS)
    # NullTokenizer text is the token ids: the static engine's prompt + generation, minus the prompt's ids
    static_blocks = _generations(static.output)
    want = [[int(t) for t in block.split()][len(p.split()):] for block, p in zip(static_blocks, PROMPTS)]
    got = [r["generated_tokens"] for r in saved]
    assert len(want) == len(PROMPTS) and got == want, (got, want)
    assert all(len(tokens) == 12 for tokens in got)  # no eod (4095) sampled: every request ran its budget
