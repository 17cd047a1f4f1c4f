"""Data: from text to sharded batches.

    text.py      tokenizers, text sources (files, JSONL, parquet, `datasets`), tokenizing, the token cache
    hub.py       HuggingFace `datasets` as a source (the `hub` extra)
    batches.py   packed windows, the seeded order, sharded global batches, the iterator's state
    stream.py    `data.streaming`: documents tokenized and packed as training consumes them
    prefetch.py  `data.prefetch`: a thread builds the next batches
    curriculum.py `data.curriculum`: each step's sequence length, windows cut shorter with the same tokens
    build.py     `build_data`: what a run trains on (cached or streamed)
"""
from pjax.data.build import build_data
from pjax.data.text import documents, load_tokenizer, load_tokens, split_eval, tokenize

__all__ = ["build_data", "documents", "load_tokenizer", "load_tokens", "split_eval", "tokenize"]
