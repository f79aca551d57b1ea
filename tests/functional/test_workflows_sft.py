"""The SFT round trip: a tiny Llama created here in Hugging Face format -> `hf_convert hf-to-megatron` ->
`pretrain_gpt.py --sft` (SFTTokenizer, JSONL conversations, loss on the answers only) -> `hf_convert
megatron-to-hf` -> `transformers` generates the answers it was fine-tuned on.

Independent references: the answers themselves (greedy generation by `transformers` from the rendered prompt
must reproduce them), and the answer loss of the original HF model (fine-tuning must cut it several times).
"""
import json
import math

import pytest
import torch

from tests.functional.cli import run_pretrain
from tools.checkpoint import hf_convert

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CONVERSATIONS = [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Name a red fruit."}, {"role": "assistant", "content": "A cherry."}],
    [{"role": "user", "content": "How many legs has a spider?"}, {"role": "assistant", "content": "Eight legs."},
     {"role": "user", "content": "And an ant?"}, {"role": "assistant", "content": "Six legs."}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there, friend."}],
]
SPECIALS = ["<unk>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_233>"]
VOCAB = 384  # the padded vocabulary (multiple of 128), also the HF model's vocab_size
MODEL_FLAGS = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear "
    "--position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights "
    "--max-position-embeddings 64 --seq-length 64 --make-vocab-size-divisible-by 128 --transformer-impl local "
    "--hidden-dropout 0.0 --attention-dropout 0.0"
).split()


def _make_tokenizer(directory):
    from megatron.training.tokenizer.sft_tokenizer import render_conversation

    texts = [render_conversation(c) for c in CONVERSATIONS] * 4
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=model, eos_token="</s>", unk_token="<unk>",
                                                pad_token="<SPECIAL_233>")
    assert len(fast) <= VOCAB
    fast.save_pretrained(str(directory))
    return fast


def _make_llama(directory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def _prompt_and_answers(tokenizer, conversation):
    """(prompt ids, answer ids) for every assistant turn: the prompt is everything before the answer."""
    from megatron.training.tokenizer.sft_tokenizer import render_turn

    pieces, out = [], []
    for message in conversation:
        text = render_turn(message["role"], message["content"])
        if message["role"] == "assistant":
            prompt = tokenizer("".join(pieces), add_special_tokens=False).input_ids
            out.append((prompt, tokenizer(text, add_special_tokens=False).input_ids))
        pieces.append(text)
    return out


def _answer_loss(model, tokenizer):
    total, count = 0.0, 0
    for conversation in CONVERSATIONS:
        for prompt, answer in _prompt_and_answers(tokenizer, conversation):
            ids = torch.tensor([prompt + answer])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(answer), reduction="sum").item()
            count += len(answer)
    return total / count


def test_hf_import_sft_export_generate(tmp_path):
    hf_dir, imported, sft_ckpt, exported = (tmp_path / name for name in ("hf", "imported", "sft", "exported"))
    tokenizer = _make_tokenizer(hf_dir)
    original = _make_llama(hf_dir).eval()
    from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer, render_conversation

    sft_tokenizer = SFTTokenizer(str(hf_dir))
    for conversation in CONVERSATIONS:  # the per-turn tokenization equals the whole conversation's
        tokens, target = sft_tokenizer.tokenize_conversation(conversation)
        assert tokens.tolist() == tokenizer(render_conversation(conversation), add_special_tokens=False).input_ids
        assert (target != -100).sum() == sum(len(a) for _, a in _prompt_and_answers(tokenizer, conversation))

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    hf_convert.main(["hf-to-megatron", "--load-dir", str(hf_dir), "--save-dir", str(imported),
                     "--make-vocab-size-divisible-by", "128"])

    flags = MODEL_FLAGS + (
        f"--sft --tokenizer-type SFTTokenizer --tokenizer-model {hf_dir} --data-path {data} --split 100,0,0 "
        f"--load {imported} --finetune --no-load-optim --no-load-rng --save {sft_ckpt} --save-interval 60 "
        "--ckpt-format torch --train-iters 60 --micro-batch-size 2 --global-batch-size 4 --lr 5e-3 "
        "--lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0 --eval-iters 0 --log-interval 10 --seed 3"
    ).split()
    result = run_pretrain(flags, timeout=400)
    assert result.returncode == 0, result.output[-5000:]
    losses = [entry["loss_values"]["lm loss"] for entry in result.iterations]
    assert len(losses) == 6 and losses[-1] < 0.3 * losses[0], losses

    hf_convert.main(["megatron-to-hf", "--load-dir", str(sft_ckpt), "--save-dir", str(exported)])
    tuned = transformers.AutoModelForCausalLM.from_pretrained(str(exported), local_files_only=True).eval()
    before, after = _answer_loss(original, tokenizer), _answer_loss(tuned, tokenizer)
    assert after < 0.25 * before and math.isfinite(after), (before, after)

    for conversation in CONVERSATIONS:
        for prompt, answer in _prompt_and_answers(tokenizer, conversation):
            with torch.no_grad():
                generated = tuned.generate(torch.tensor([prompt]), max_new_tokens=len(answer) + 1, do_sample=False,
                                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
            new = generated[0, len(prompt):].tolist()
            assert new[:len(answer)] == answer, (tokenizer.decode(new), tokenizer.decode(answer))


def test_packed_conversations_train(tmp_path):
    """--sft with --reset-attention-mask --reset-position-ids packs conversations (4 into 2 samples of 64 tokens
    here) and trains through the document-masked attention: the answer loss falls."""
    hf_dir = tmp_path / "hf"
    _make_tokenizer(hf_dir)
    _make_llama(hf_dir)
    imported = tmp_path / "imported"
    hf_convert.main(["hf-to-megatron", "--load-dir", str(hf_dir), "--save-dir", str(imported),
                     "--make-vocab-size-divisible-by", "128"])
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    flags = MODEL_FLAGS + (
        f"--sft --reset-attention-mask --reset-position-ids --tokenizer-type SFTTokenizer --tokenizer-model {hf_dir} "
        f"--data-path {data} --split 100,0,0 --load {imported} --finetune --no-load-optim --no-load-rng "
        "--ckpt-format torch --train-iters 20 --micro-batch-size 2 --global-batch-size 2 --lr 5e-3 "
        "--lr-decay-style constant --weight-decay 0.0 --eval-iters 0 --log-interval 5 --seed 3"
    ).split()
    result = run_pretrain(flags, timeout=400)
    assert result.returncode == 0, result.output[-5000:]
    losses = [entry["loss_values"]["lm loss"] for entry in result.iterations]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], losses
