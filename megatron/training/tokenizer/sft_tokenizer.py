"""`SFTTokenizer`: a local Hugging Face tokenizer plus Megatron's SFT chat prompt format (`--sft`).

`--tokenizer-type SFTTokenizer --tokenizer-model <dir> --sft-tokenizer-prompt-format nemotron-h-aligned`
(Megatron-LM's only format). The template, per turn (content stripped):
- system    -> `<SPECIAL_10>System\\n{content}\\n`
- user      -> `<SPECIAL_11>User\\n{content}\\n<SPECIAL_11>Assistant\\n`
- assistant -> `{content}\\n`
No BOS; pad = id of `<SPECIAL_233>`; eod = the tokenizer's eos; vocab size = len(tokenizer).

`tokenize_conversation(messages, return_target=True)` gives the tokens and the training target: system and
user turns (the user turn includes the `<SPECIAL_11>Assistant\\n` prefix) are `IGNORE_INDEX` in the target,
assistant turns are kept. Each turn is tokenized on its own and the pieces are concatenated, which is what
Megatron checks (every turn's tokens equal their slice of the whole conversation's tokens); a tokenizer for
which that fails (no special-token boundary) raises a ValueError naming the turn.
"""
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer

IGNORE_INDEX = -100
PROMPT_FORMATS = ("nemotron-h-aligned",)


@dataclass(frozen=True)
class PromptConfig:
    """How a prompt format renders a conversation (Megatron's `PromptConfig` fields)."""

    assistant_prefix_len: int
    """Tokens at the start of an assistant turn that are masked like the prompt."""
    pad_token: str
    """The token used for padding (its id is `pad`)."""
    has_bos: bool
    """Whether a BOS token starts the conversation."""
    has_system_role: bool
    """Whether system turns are allowed."""


_FORMATS = {
    "nemotron-h-aligned": PromptConfig(assistant_prefix_len=0, pad_token="<SPECIAL_233>", has_bos=False,
                                       has_system_role=True),
}


def render_turn(role: str, content: str, prompt_format: str = "nemotron-h-aligned") -> str:
    """The text of one turn in `prompt_format`."""
    if prompt_format not in _FORMATS:
        raise ValueError(f"--sft-tokenizer-prompt-format {prompt_format!r}: choose one of {list(PROMPT_FORMATS)}")
    content = content.strip()
    if role == "system":
        return f"<SPECIAL_10>System\n{content}\n"
    if role == "user":
        return f"<SPECIAL_11>User\n{content}\n<SPECIAL_11>Assistant\n"
    if role == "assistant":
        return f"{content}\n"
    raise ValueError(f"conversation role {role!r}: expected system, user or assistant")


def render_conversation(messages: Sequence[Dict[str, str]], prompt_format: str = "nemotron-h-aligned") -> str:
    """The whole conversation as text (what `transformers` sees at generation time)."""
    return "".join(render_turn(m["role"], m["content"], prompt_format) for m in messages)


class SFTTokenizer(MegatronTokenizer):
    """Megatron-LM's `SFTTokenizer(tokenizer_model, prompt_format)`."""

    def __init__(self, tokenizer_model: str, prompt_format: str = "nemotron-h-aligned"):
        super().__init__(tokenizer_model, prompt_format=prompt_format)
        if tokenizer_model is None or not os.path.isdir(tokenizer_model):
            raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: SFTTokenizer needs a local Hugging Face "
                                    "tokenizer directory (hub downloads are not used)")
        if prompt_format not in _FORMATS:
            raise ValueError(f"--sft-tokenizer-prompt-format {prompt_format!r}: choose one of {list(PROMPT_FORMATS)}")
        import transformers

        self._tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True)
        self._prompt_format = prompt_format
        self._prompt_config = _FORMATS[prompt_format]
        self._vocab = self._tokenizer.get_vocab()
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}
        pad = self._vocab.get(self._prompt_config.pad_token)
        if pad is None:
            raise ValueError(f"--tokenizer-model {tokenizer_model}: the {prompt_format} format pads with "
                             f"{self._prompt_config.pad_token}, which is not in the tokenizer's vocabulary")
        self._pad = pad

    def _ids(self, text: str) -> List[int]:
        return self._tokenizer(text, add_special_tokens=False).input_ids

    def tokenize_conversation(self, messages: Sequence[Dict[str, str]], return_target: bool = True,
                              add_generation_prompt: bool = False) -> Tuple[numpy.ndarray, Optional[numpy.ndarray]]:
        """(tokens, target) of a conversation; target is None unless `return_target`. With
        `add_generation_prompt` a final user turn is left open for the assistant's answer (inference)."""
        tokens: List[int] = [self._tokenizer.bos_token_id] if self._prompt_config.has_bos else []
        target: List[int] = [IGNORE_INDEX] * len(tokens)
        previous = None
        for turn, message in enumerate(messages):
            role = message.get("role")
            if role == "system" and (not self._prompt_config.has_system_role or turn != 0):
                raise ValueError(f"conversation turn {turn}: a system turn is allowed only first")
            if role == "assistant" and previous != "user":
                raise ValueError(f"conversation turn {turn}: an assistant turn must follow a user turn")
            ids = self._ids(render_turn(role, message.get("content", ""), self._prompt_format))
            if role == "assistant":
                if not message.get("content", "").strip():
                    raise ValueError(f"conversation turn {turn}: the assistant turn is empty")
                prefix = self._prompt_config.assistant_prefix_len
                target += [IGNORE_INDEX] * prefix + ids[prefix:]
            else:
                target += [IGNORE_INDEX] * len(ids)
            tokens += ids
            previous = role
        if add_generation_prompt and previous != "user":
            raise ValueError("add_generation_prompt needs a conversation that ends with a user turn")
        tokens_array = numpy.array(tokens, dtype=numpy.int64)
        return tokens_array, (numpy.array(target, dtype=numpy.int64) if return_target else None)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        return self._ids(text)

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode(ids)

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def eod(self) -> int:
        return self._tokenizer.eos_token_id

    @property
    def bos(self) -> Optional[int]:
        return self._tokenizer.bos_token_id

    @property
    def eos(self) -> int:
        return self._tokenizer.eos_token_id
