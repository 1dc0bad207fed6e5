"""The tiny text side of the ImageReward tests: a BERT word list (:data:`WORDS`, written as a ``vocab.txt`` by
:func:`write_bert_vocab`) and the BLIP med config (:data:`MED`, ``med_config.json``'s keys) sized for it. The tiny
CLIP tokenizer is :func:`stepflow.testing.tiny_rewards.clip_tokenizer`."""

from __future__ import annotations

from pathlib import Path

#: BERT's special tokens, first in its vocab.txt (ids 0..4)
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["a", "photo", "of", "cat", "dog", "red", "cube", "on", "the", "table", "two", "##s", "sign", "open"]
MED = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
       "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
       "layer_norm_eps": 1e-12, "max_position_embeddings": 40, "model_type": "bert", "num_attention_heads": 4,
       "num_hidden_layers": 2, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": len(SPECIAL) + len(WORDS) + 2,
       "encoder_width": 768, "add_cross_attention": True}


def write_bert_vocab(d: Path) -> Path:
    """``d/vocab.txt``: :data:`SPECIAL` then :data:`WORDS`, one a line (a ``BertTokenizer`` folder); returns ``d``."""
    (d / "vocab.txt").write_text("\n".join(SPECIAL + WORDS) + "\n")
    return d
