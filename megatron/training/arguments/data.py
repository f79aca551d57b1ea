"""Flags of Megatron's "data and dataloader" and "tokenizer" groups.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

DATA_FLAGS = (
    flag("--data-path", nargs="*", help="Prefix, w1 p1 w2 p2 ..., or p1 p2 (nargs=*)."),
    flag("--split", type=str, help="Train/valid/test proportions."),
    flag("--train-data-path", nargs="*", help="Training blend, used instead of --data-path and --split."),
    flag("--valid-data-path", nargs="*", help="Validation blend, used instead of --data-path and --split."),
    flag("--test-data-path", nargs="*", help="Test blend, used instead of --data-path and --split."),
    flag("--data-args-path", type=str, help="Read blends from a file (JSON with train/valid/test for per-split)."),
    flag(
        "--per-split-data-args-path",
        type=str,
        help="Read blends from a file (JSON with train/valid/test for per-split).",
    ),
    flag("--data-cache-path", help="Index cache directory."),
    flag("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files", help="File reads instead of mmap."),
    flag("--mock-data", action="store_true", help="MockGPTDataset."),
    flag("--seq-length", type=int, help="Training sequence length."),
    flag("--encoder-seq-length", type=int, help="Encoder sequence length (alias of --seq-length for GPT)."),
    flag("--decoder-seq-length", type=int, help="Decoder sequence length (T5)."),
    flag("--retriever-seq-length", type=int, default=256),
    flag("--sample-rate", type=float, default=1.0),
    flag("--mask-prob", type=float, default=0.15, help="BERT/T5 masking."),
    flag("--short-seq-prob", type=float, default=0.1, help="BERT/T5 masking."),
    flag("--num-workers", type=int, default=2, help="DataLoader workers."),
    flag("--reset-position-ids", action="store_true", help="Document-boundary handling."),
    flag("--reset-attention-mask", action="store_true", help="Document-boundary handling."),
    flag("--eod-mask-loss", action="store_true", help="Document-boundary handling."),
    flag(
        "--no-create-attention-mask-in-dataloader",
        action="store_false",
        dest="create_attention_mask_in_dataloader",
        help="Omit the [1,S,S] mask.",
    ),
    flag("--num-dataset-builder-threads", type=int, default=1, help="Parallel index building."),
    flag("--object-storage-cache-path", type=str),
    flag("--mid-level-dataset-surplus", type=float, default=0.005, help="Blend oversampling margin."),
)

TOKENIZER_FLAGS = (
    flag("--vocab-size", type=int, help="NullTokenizer / TikTokenizer."),
    flag("--vocab-file", type=str, help="Tokenizer files."),
    flag("--merge-file", type=str, help="Tokenizer files."),
    flag("--vocab-extra-ids", type=int, default=0, help="T5 sentinels."),
    flag(
        "--tokenizer-type",
        type=str,
        choices=[
            "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
            "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer",
        ],
        help="Tokenizer class (the scripts set a default through args_defaults).",
    ),
    flag("--tokenizer-model", type=str, help="Tokenizer files."),
    flag("--tiktoken-pattern", type=str, help="TikTokenizer."),
    flag("--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer."),
    flag("--tiktoken-special-tokens", type=str, nargs="+", help="TikTokenizer."),
)


def _add_data_args(parser):
    """Register the "data and dataloader" group."""
    return add_group(parser, "data and dataloader", DATA_FLAGS, flag_help)


def _add_tokenizer_args(parser):
    """Register the "tokenizer" group."""
    return add_group(parser, "tokenizer", TOKENIZER_FLAGS, flag_help)
