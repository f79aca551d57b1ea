"""BERT: encoder with an LM head, an optional pooler and binary (sentence-order) head."""
from megatron.core.models.bert.bert_model import BertModel

__all__ = ["BertModel"]
