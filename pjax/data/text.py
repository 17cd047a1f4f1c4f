"""Text in, token stream out: tokenizer loading, text sources, and the on-disk token cache (a corpus is
tokenized once into a flat file of token ids, memory-mapped from then on)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
from tokenizers import ByteLevelBPETokenizer, Tokenizer

from mesh.errors import ConfigError, cut, first_line
from pjax import assets
from pjax.config import DataConfig
from pjax.data.hub import hub_documents, is_saved_dataset

SOURCE_SUFFIXES = (".txt", ".jsonl", ".parquet")
_CACHE_FORMAT = 1  # bump when the cache layout or the tokenization procedure changes
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_BATCH_CHARS = 1 << 20  # text handed to one encode_batch call
_MISSING = object()


def _local_path(spec: str) -> Path | None:
    return assets.locate(spec)


def _looks_like_path(spec: str) -> bool:
    """Hub ids are 'name' or 'org/name'; anything else can only be a (missing) local path."""
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or Path(spec).suffix in (".json", *SOURCE_SUFFIXES)


# Tokenizer

def load_tokenizer(spec: str) -> Tokenizer | ByteLevelBPETokenizer:
    """A tokenizer from a `tokenizer.json`, a folder holding one (or `vocab.json` + `merges.txt`), or a hub name."""
    path = _local_path(spec)
    if path is not None and path.is_dir():
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            try:
                return ByteLevelBPETokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
            except Exception as e:  # tokenizers raises a bare Exception on malformed files
                raise ConfigError(f"data.tokenizer={spec}: its vocab.json/merges.txt pair does not load "
                                  f"({first_line(e, 30)}); point it at a valid tokenizer.") from None
        else:
            raise ConfigError(f"data.tokenizer={spec} is a folder without tokenizer.json or vocab.json+merges.txt; "
                              f"point it at a tokenizer file or folder.")
    if path is not None:
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:
            raise ConfigError(f"data.tokenizer={spec} is not a valid tokenizer.json ({first_line(e, 40)}); "
                              f"point it at one.") from None
    if _looks_like_path(spec):
        raise ConfigError(f"data.tokenizer={spec} does not exist; point it at a tokenizer.json or a tokenizer folder.")
    try:
        return Tokenizer.from_pretrained(spec)
    except Exception as e:
        raise ConfigError(f"data.tokenizer={spec} is no local path and did not load from the HuggingFace hub "
                          f"(unreachable or unknown name); use a local tokenizer path.") from e


def eos_id(tokenizer: Any) -> int | None:
    """The end-of-text id placed between documents, if the vocabulary has one."""
    for name in _EOS_NAMES:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return token
    return None


# Text sources: each yields documents (one per .txt file, JSON line, parquet row, dataset row)

def saved_dataset(spec: str) -> Path | None:
    """The folder `data.path` names if `save_to_disk` wrote it (read by pjax/data/hub.py)."""
    path = _local_path(spec)
    return path if path is not None and is_saved_dataset(path) else None


def source_files(spec: str) -> list[Path] | None:
    """The text files behind `data.path` (a folder's sorted), or None for a HuggingFace dataset."""
    path = _local_path(spec)
    if path is None:
        if _looks_like_path(spec):
            raise ConfigError(f"data.path={spec} does not exist; point it at a .txt/.jsonl/.parquet file, a folder of "
                              f"them or a dataset saved with save_to_disk.")
        return None
    if is_saved_dataset(path):
        return None
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)
        if not files:
            raise ConfigError(f"data.path={spec} is a folder with no .txt, .jsonl or .parquet files; add some or point elsewhere.")
        return files
    if path.suffix not in SOURCE_SUFFIXES:
        raise ConfigError(f"data.path={spec} has an unsupported type; use a .txt, .jsonl or .parquet file or a folder of them.")
    return [path]


def _text(where: str, text: Any, column: str = "text") -> str:
    """`text` if it is a usable document, else the one-line error for the place it came from."""
    if not isinstance(text, str):
        raise ConfigError(f"{where} has \"{column}\" {_show(text)}, not a string; every document needs its text as a "
                          f"string (data.column names the field).")
    if "\x00" in text:
        raise ConfigError(f"{where} holds NUL bytes, so it looks like a binary file, not text; point data.path at "
                          f"UTF-8 text.")
    return text


def _show(value: Any) -> str:
    return "null" if value is None else f"of type {type(value).__name__}"


def _jsonl_documents(path: Path, column: str, where: tuple[str, str] | None = None) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            place = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{place} is not valid JSON ({e.msg}); fix or remove that line.") from None
            if not isinstance(record, dict) or column not in record:
                raise ConfigError(f"{place} has no \"{column}\" field; every JSON line needs one, e.g. "
                                  f"{{\"{column}\": \"...\"}}, or set data.column to the field holding the text.")
            if where is None or _selected(place, record.get(where[0], _MISSING), where):
                yield _text(place, record[column], column)


def _selected(place: str, value: Any, where: tuple[str, str]) -> bool:
    """Whether a record's `where[0]` field, compared as text, is `where[1]` (meta.task_field's tasks)."""
    if value is _MISSING:
        raise ConfigError(f"{place} has no \"{where[0]}\" field, which meta.task_field={where[0]} reads; give every "
                          f"record one, or name another field.")
    return str(value) == where[1]


def _file_documents(path: Path, column: str, where: tuple[str, str] | None = None) -> Iterator[str]:
    try:
        if path.suffix == ".txt":
            if where is not None:
                raise ConfigError(f"{path} is plain text, with no fields for meta.task_field={where[0]} to read; "
                                  f"point data.path at .jsonl or .parquet files.")
            yield _text(str(path), path.read_text(encoding="utf-8"))
        elif path.suffix == ".jsonl":
            yield from _jsonl_documents(path, column, where)
        else:
            yield from _parquet_documents(path, column, where)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                          f"convert it to UTF-8 or point data.path at a text file.") from None
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e}); check the file and its permissions.") from None


def _parquet_documents(path: Path, column: str, where: tuple[str, str] | None = None) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional: only parquet sources need it
    except ImportError as e:
        raise ConfigError(f"data.path={path} is a parquet file; run `pip install pyarrow` to read it.") from e
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise ConfigError(f"{path} is not a valid parquet file ({first_line(e, 40)}); re-write it.") from None
    if column not in parquet.schema_arrow.names:
        names = cut(", ".join(parquet.schema_arrow.names), 40)
        raise ConfigError(f"{path} has no \"{column}\" column (it has {names}); set data.column to the text's "
                          f"column.")
    if where is not None and where[0] not in parquet.schema_arrow.names:
        raise ConfigError(f"{path} has no \"{where[0]}\" column, which meta.task_field={where[0]} reads (it has "
                          f"{cut(', '.join(parquet.schema_arrow.names), 40)}); name one of those.")
    row = 0
    for batch in parquet.iter_batches(columns=[column] if where is None else [column, where[0]]):
        keys = batch.column(1).to_pylist() if where is not None else [None] * batch.num_rows
        for text, key in zip(batch.column(0).to_pylist(), keys):
            if where is None or _selected(f"{path} row {row}", key, where):
                yield _text(f"{path} row {row}", text, column)
            row += 1


def documents(spec: str, *, split: str = "train", column: str = "text", start: int = 0,
              streaming: bool = False, where: tuple[str, str] | None = None) -> Iterator[str]:
    """Every document of `data.path` from document `start` on, in a fixed order (local files read lazily);
    with `where` = (field, value) only the records whose field, as text, is that value."""
    files = source_files(spec)
    if files is None and where is not None:
        raise ConfigError(f"meta.task_field={where[0]} reads local .jsonl or .parquet files, and data.path={spec} is "
                          f"a dataset: save its split as one and point data.path at it.")
    if files is None:
        rows = hub_documents(spec, saved_dataset(spec), split, column, start, streaming)
        for row, text in enumerate(rows, start):
            yield _text(f"data.path={spec} (split {split}) row {row}", text, column)
        return
    if split != "train":
        raise ConfigError(f"data.split={split} applies only to a HuggingFace dataset (a hub name or a save_to_disk "
                          f"folder); data.path={spec} is neither, so leave data.split at train.")
    yield from islice((doc for path in files for doc in _file_documents(path, column, where)), start, None)


# Tokenization and cache

def _pieces(text: str) -> list[str]:
    # Cut before a newline that precedes a non-space, where byte-level BPE always starts a word: the pieces
    # tokenize exactly as the whole text (GPT-2, SmolLM2), and encode_batch runs them on all cores.
    return [p for p in re.split(r"(?=\n\S)", text) if p]


def encode_documents(texts: list[str], tokenizer: Any) -> list[list[int]]:
    """Each document's token ids (no special tokens), all tokenized in one parallel call."""
    pieces = [_pieces(text) for text in texts]
    encoded = iter(tokenizer.encode_batch([p for doc in pieces for p in doc], add_special_tokens=False))
    return [[i for _ in doc for i in next(encoded).ids] for doc in pieces]


def tokenize(docs: Iterable[str], tokenizer: Any) -> Iterator[np.ndarray]:
    """Token ids of the documents, in chunks, with the end-of-text id between documents."""
    eos = eos_id(tokenizer)
    pieces: list[str | None] = []  # None marks a document boundary
    size = 0

    def flush() -> np.ndarray:
        # No special tokens per piece: a BOS from a post-processor would land in every piece.
        encoded = iter(tokenizer.encode_batch([p for p in pieces if p is not None], add_special_tokens=False))
        ids: list[int] = []
        for piece in pieces:
            ids.extend([eos] if piece is None else next(encoded).ids)
        return np.asarray(ids, dtype=np.int64)

    for n, doc in enumerate(docs):
        if n and eos is not None:
            pieces.append(None)
        for piece in _pieces(doc):
            pieces.append(piece)
            size += len(piece)
            if size >= _BATCH_CHARS:
                yield flush()
                pieces, size = [], 0
    if pieces:
        yield flush()


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size < 2**16 else np.uint32


def cache_key(spec: str, tokenizer: Any, split: str = "train", column: str = "text",
              where: tuple[str, str] | None = None) -> str:
    """A hash of the sources (paths, sizes, mtimes, split, column, selected records) and the tokenizer's full
    definition."""
    files, saved = source_files(spec), saved_dataset(spec)
    if saved is not None:
        files = sorted(p for p in saved.rglob("*") if p.is_file())
    sources = [spec] if files is None else [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    vocab_hash = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    key = {"format": _CACHE_FORMAT, "sources": sources, "tokenizer": vocab_hash}
    # Only when not the defaults: the caches of runs made before these keys existed stay valid.
    key.update({name: value for name, value, default in (("split", split, "train"), ("column", column, "text"),
                                                         ("where", where and list(where), None)) if value != default})
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]


def load_tokens(data_cfg: DataConfig, tokenizer: Any, where: tuple[str, str] | None = None) -> np.memmap:
    """The whole corpus (or the records `where` selects: `documents`) as a read-only memory-mapped token array,
    tokenizing it on first use."""
    dtype = np.dtype(token_dtype(tokenizer.get_vocab_size()))
    cache_dir = data_cfg.cache_path
    key = cache_key(data_cfg.path, tokenizer, data_cfg.split, data_cfg.column, where)
    path = cache_dir / f"tokens-{key}-{dtype.name}.bin"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        # A unique name, then rename: no half-written cache, and processes sharing a file system race safely.
        tmp = cache_dir / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with tmp.open("wb") as f:
                docs = documents(data_cfg.path, split=data_cfg.split, column=data_cfg.column, where=where)
                for chunk in tokenize(docs, tokenizer):
                    f.write(chunk.astype(dtype).tobytes())
            if tmp.stat().st_size == 0:
                which = "" if where is None else f" with {where[0]}={where[1]}"
                raise ConfigError(f"data.path={data_cfg.path} holds no text{which}; point it at a non-empty corpus.")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return np.memmap(path, dtype=dtype, mode="r")


def split_eval(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval): the last `eval_fraction` of the token stream is held out."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={eval_fraction} is out of range; use a value in [0, 1).")
    n_eval = int(round(len(tokens) * eval_fraction))
    return tokens[: len(tokens) - n_eval], tokens[len(tokens) - n_eval:]
