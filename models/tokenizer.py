"""Byte-level BPE tokenizer (HF `tokenizers`), saved as tokenizer.json in every model directory."""
from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE: every byte is in the alphabet, so any text encodes, nothing is <unk>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
