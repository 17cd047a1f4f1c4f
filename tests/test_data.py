"""Tests for pjax/data/text.py (tokenizer, sources, token cache) and pjax/data/batches.py (windows, order, sharding)."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from mesh.errors import ConfigError
from mesh.mesh import CP, DATA, DP, MeshConfig, make_mesh
from pjax import assets
from pjax.data import build_data, text as data
from pjax.data.batches import DataIterator, epoch_order
from pjax.config import DataConfig, TrainConfig

SEQ = 32


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer(DataConfig().tokenizer)


@pytest.fixture(scope="module")
def tokens(tokenizer, tmp_path_factory) -> np.ndarray:
    cfg = DataConfig(path=str(assets.ROOT / "data/prideprejudice.txt"), cache_dir=str(tmp_path_factory.mktemp("cache")))
    return data.load_tokens(cfg, tokenizer)


def make_iter(tokens, batch_size=8, grad_accum=2, seed=0, mesh=None, **kw) -> DataIterator:
    return DataIterator(tokens, SEQ, batch_size, grad_accum, seed, mesh, **kw)


def as_numpy(batch) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


# -- tokenizer, sources, cache -----------------------------------------------------------------

def test_tokenizer_loads_shipped_gpt2_files_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default relative path must still find the embedded files
    tok = data.load_tokenizer(DataConfig().tokenizer)
    assert tok.encode("Hello world").ids == [15496, 995]
    assert tok.get_vocab_size() == 50257


def test_chunked_tokenization_equals_tokenizing_the_whole_text(tokenizer, tokens):
    text = (assets.ROOT / "data/prideprejudice.txt").read_text(encoding="utf-8")
    assert tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, tokenizer.encode(text).ids)
    assert 150_000 < len(tokens) < 180_000


def test_token_cache_is_created_once_and_reused(tokenizer, tmp_path, monkeypatch):
    src = tmp_path / "a.txt"
    src.write_text("It is a truth universally acknowledged.\nThat a single man.\n")
    cfg = DataConfig(path=str(src), cache_dir=str(tmp_path / "cache"))
    first = data.load_tokens(cfg, tokenizer)
    (cache_file,) = (tmp_path / "cache").iterdir()  # one file, no temporary left behind
    mtime = cache_file.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("re-tokenized although the cache exists")

    monkeypatch.setattr(data, "tokenize", fail)
    second = data.load_tokens(cfg, tokenizer)
    np.testing.assert_array_equal(first, second)
    assert cache_file.stat().st_mtime_ns == mtime


def test_token_cache_is_rebuilt_when_the_source_changes(tokenizer, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("one two three")
    cfg = DataConfig(path=str(src), cache_dir=str(tmp_path / "cache"))
    before = data.load_tokens(cfg, tokenizer)
    src.write_text("four five six seven")
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))
    after = data.load_tokens(cfg, tokenizer)
    assert len(list((tmp_path / "cache").iterdir())) == 2
    assert list(after) == tokenizer.encode("four five six seven").ids != list(before)


def test_folder_of_txt_and_jsonl_is_read_sorted_with_eos_between_documents(tokenizer, tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n" + json.dumps({"text": "third"}) + "\n")
    (tmp_path / "a.txt").write_text("first")
    cfg = DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = [*tokenizer.encode("first").ids, eos, *tokenizer.encode("second").ids, eos, *tokenizer.encode("third").ids]
    assert list(data.load_tokens(cfg, tokenizer)) == expected


def test_parquet_source_reads_the_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["first doc", "second doc"], "id": [1, 2]}), tmp_path / "x.parquet")
    assert list(data.documents(str(tmp_path / "x.parquet"))) == ["first doc", "second doc"]


def test_parquet_without_pyarrow_asks_to_install_it(tmp_path, monkeypatch):
    import sys

    (tmp_path / "x.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail like a missing package
    with pytest.raises(ConfigError, match="pip install pyarrow"):
        list(data.documents(str(tmp_path / "x.parquet")))


def test_missing_data_path_raises_config_error(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match=r"data\.path=.*does not exist"):
        data.load_tokens(DataConfig(path=str(tmp_path / "nope.txt"), cache_dir=str(tmp_path)), tokenizer)


def test_missing_tokenizer_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*does not exist"):
        data.load_tokenizer(str(tmp_path / "no_tokenizer"))


def test_eval_fraction_holds_out_the_tail(tokens):
    train, held = data.split_eval(tokens, 0.05)
    assert len(train) + len(held) == len(tokens) and len(held) == round(0.05 * len(tokens))
    np.testing.assert_array_equal(held, tokens[len(train):])
    with pytest.raises(ConfigError, match=r"data\.eval_fraction=1\.0"):
        data.split_eval(tokens, 1.0)


# -- windows and order -------------------------------------------------------------------------

def test_same_seed_gives_same_batches_and_another_seed_different(tokens):
    a, b, c = make_iter(tokens, seed=0), make_iter(tokens, seed=0), make_iter(tokens, seed=1)
    for _ in range(3):
        x, y, z = as_numpy(next(a)), as_numpy(next(b)), as_numpy(next(c))
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        assert not np.array_equal(x["inputs"], z["inputs"])


def test_every_window_is_read_once_per_epoch_except_the_dropped_remainder(tokens):
    it = make_iter(tokens, batch_size=64, grad_accum=4)
    for epoch in range(2):
        seen = np.concatenate([it.window_ids(epoch, s).ravel() for s in range(it.batches_per_epoch)])
        assert len(np.unique(seen)) == len(seen) == it.batches_per_epoch * 64
        dropped = np.setdiff1d(np.arange(it.num_windows), seen)
        assert len(dropped) == it.num_windows % 64
        np.testing.assert_array_equal(dropped, np.sort(epoch_order(0, epoch, it.num_windows)[len(seen):]))
    assert not np.array_equal(it.window_ids(0, 0), it.window_ids(1, 0))  # a fresh shuffle per epoch


def test_labels_are_inputs_shifted_by_one_and_match_the_token_stream(tokens):
    it = make_iter(tokens, batch_size=8, grad_accum=2)
    ids = it.window_ids(0, 0)
    batch = as_numpy(next(it))
    assert batch["inputs"].shape == (2, 4, SEQ) and batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["labels"][..., :-1], batch["inputs"][..., 1:])
    np.testing.assert_array_equal(batch["positions"], np.broadcast_to(np.arange(SEQ), (2, 4, SEQ)))
    for j in range(2):
        for r in range(4):
            start = ids[j, r] * SEQ
            np.testing.assert_array_equal(batch["inputs"][j, r], tokens[start:start + SEQ])
            np.testing.assert_array_equal(batch["labels"][j, r], tokens[start + 1:start + SEQ + 1])


@pytest.mark.parametrize("advance", [3, "epoch_end"])
def test_iterator_state_round_trips_and_continues_the_identical_stream(tokens, advance):
    small = tokens[: 40 * SEQ + 1]  # 40 windows: 5 batches per epoch, so rollover is reached fast
    it = make_iter(small)
    for _ in range(3 if advance == 3 else it.batches_per_epoch - 1):
        next(it)
    saved = json.loads(json.dumps(it.state()))
    restored = make_iter(small)
    restored.restore(saved)
    for _ in range(3):
        a, b = as_numpy(next(it)), as_numpy(next(restored))
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert it.state() == restored.state()
    with pytest.raises(ConfigError, match="differs from this run's"):
        make_iter(small, seed=1).restore(saved)


def test_eval_batches_read_the_held_out_windows_in_order(tokens):
    train, held = data.split_eval(tokens, 0.05)
    it = make_iter(train, eval_tokens=held)
    batches = [as_numpy(b) for b in it.eval_batches(3)]
    assert len(batches) == 3
    flat = np.concatenate([b["inputs"].reshape(-1, SEQ) for b in batches])
    np.testing.assert_array_equal(flat.ravel(), held[: 24 * SEQ])
    again = as_numpy(next(iter(it.eval_batches(1))))
    np.testing.assert_array_equal(again["labels"], batches[0]["labels"])
    n_avail = (len(held) - 1) // SEQ // 8
    assert sum(1 for _ in it.eval_batches(10**6)) == n_avail


def test_sequence_layout_permutes_tokens_and_positions_together(tokens):
    def zigzag(x):  # 4 chunks -> order 0, 3, 1, 2 (cp=2's load-balanced layout)
        chunks = np.split(x, 4, axis=-1)
        return np.concatenate([chunks[0], chunks[3], chunks[1], chunks[2]], axis=-1)

    it = make_iter(tokens, sequence_layout=zigzag)
    ids, batch = it.window_ids(0, 0), as_numpy(next(it))
    np.testing.assert_array_equal(batch["positions"][0, 0], zigzag(np.arange(SEQ)))
    stream = tokens[ids[1, 2] * SEQ:][: SEQ + 1]
    np.testing.assert_array_equal(batch["inputs"][1, 2], stream[batch["positions"][1, 2]])
    np.testing.assert_array_equal(batch["labels"][1, 2], stream[batch["positions"][1, 2] + 1])


# -- sharding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [dict(dp=2, tp=4), dict(dp=4, cp=2)])
def test_sharded_batches_hold_the_right_rows_on_each_device(tokens, sizes):
    mesh = make_mesh(MeshConfig(**sizes))
    it = make_iter(tokens, batch_size=16, grad_accum=2, mesh=mesh)
    expected = it.global_batch(0, 0)
    batch = next(it)
    for key, arr in batch.items():
        assert arr.shape == (2, 8, SEQ) and arr.sharding.spec == jax.sharding.PartitionSpec(None, DATA, CP)
        assert len(arr.addressable_shards) == 8
        for shard in arr.addressable_shards:
            assert shard.data.shape == (2, 8 // sizes["dp"], SEQ // sizes.get("cp", 1))
            np.testing.assert_array_equal(np.asarray(shard.data), expected[key][shard.index])


def test_global_batch_values_do_not_depend_on_the_mesh(tokens):
    one = make_iter(tokens, batch_size=16, grad_accum=2, mesh=make_mesh(MeshConfig(dp=1, tp=8)))
    four = make_iter(tokens, batch_size=16, grad_accum=2, mesh=make_mesh(MeshConfig(dp=4, tp=2)))
    for _ in range(2):
        a, b = as_numpy(next(one)), as_numpy(next(four))
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_batch_not_divisible_by_grad_accum_times_dp_raises_config_error(tokens):
    mesh = make_mesh(MeshConfig(dp=4, tp=2))
    with pytest.raises(ConfigError, match=r"train\.batch_size=6 is not divisible by train\.grad_accum\*mesh\.dp = 1\*4"):
        make_iter(tokens, batch_size=6, grad_accum=1, mesh=mesh)
    with pytest.raises(ConfigError, match=r"train\.batch_size=6 is not divisible by train\.grad_accum=4"):
        make_iter(tokens, batch_size=6, grad_accum=4)


def test_build_data_gives_sharded_train_batches_and_the_held_out_tail(tmp_path):
    mesh = make_mesh(MeshConfig(dp=2, cp=2, tp=2))
    train_iter, held, tok = build_data(DataConfig(cache_dir=str(tmp_path)),
                                            TrainConfig(seq_len=SEQ, batch_size=8, grad_accum=2), mesh)
    batch = next(train_iter)
    assert batch["inputs"].shape == (2, 4, SEQ) and batch["inputs"].sharding.mesh.shape[DP] == 2
    assert len(train_iter.tokens) + len(held) == len(data.load_tokens(DataConfig(cache_dir=str(tmp_path)), tok))
    assert next(train_iter.eval_batches(1))["labels"].shape == (2, 4, SEQ)


# -- HuggingFace datasets: split and column ----------------------------------------------------

WORDS = "the of and to a in is was he that it his her you as had with for she not at but be my on".split()


def corpus(n: int, seed: int = 0) -> list[str]:
    """n documents of 1 to 120 words: some shorter than a window, some spanning several."""
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, rng.integers(1, 120))) for i in range(n)]


def save_dataset(path, splits: dict[str, list[str]], column: str = "text"):
    """A DatasetDict saved with save_to_disk (an extra column, so that column choice matters)."""
    import datasets

    datasets.DatasetDict({name: datasets.Dataset.from_dict({column: docs, "id": list(range(len(docs)))})
                          for name, docs in splits.items()}).save_to_disk(str(path))
    return str(path)


def test_saved_dataset_reads_the_chosen_split_and_column_and_caches_each_apart(tokenizer, tmp_path):
    path = save_dataset(tmp_path / "ds", {"train": ["a b", "c d e"], "validation": ["v w", "x y z"]}, column="content")
    assert list(data.documents(path, column="content")) == ["a b", "c d e"]
    assert list(data.documents(path, split="validation", column="content", start=1)) == ["x y z"]
    cfg = DataConfig(path=path, column="content", cache_dir=str(tmp_path / "cache"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = [*tokenizer.encode("a b").ids, eos, *tokenizer.encode("c d e").ids]
    assert list(data.load_tokens(cfg, tokenizer)) == expected
    assert list(data.load_tokens(DataConfig(path=path, column="content", split="validation",
                                            cache_dir=cfg.cache_dir), tokenizer))[:2] == tokenizer.encode("v w").ids
    assert len(list((tmp_path / "cache").iterdir())) == 2  # a split is a cache of its own
    with pytest.raises(ConfigError, match=r"data\.split=test is not a split of .* \(it has train, validation\)"):
        list(data.documents(path, split="test", column="content"))
    with pytest.raises(ConfigError, match=r"has no column 'text' \(it has content, id\); set data\.column"):
        list(data.documents(path))


def test_column_names_the_jsonl_field_and_parquet_column_and_split_refuses_plain_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "one", "text": "no"}) + "\n")
    pq.write_table(pa.table({"body": ["two"]}), tmp_path / "b.parquet")
    assert list(data.documents(str(tmp_path), column="body")) == ["one", "two"]
    with pytest.raises(ConfigError, match=r'b\.parquet has no "text" column \(it has body\)'):
        list(data.documents(str(tmp_path / "b.parquet")))
    with pytest.raises(ConfigError, match=r"data\.split=validation applies only to a HuggingFace dataset"):
        list(data.documents(str(tmp_path), split="validation"))


# -- streaming ----------------------------------------------------------------------------------

def stream_iter(path, tokenizer, counter=None, eval_stride=0, **kw):
    def open_documents(start):
        for doc in data.documents(path, start=start, streaming=True):
            if counter is not None:
                counter.append(start)
            yield doc
    from pjax.data.stream import StreamIterator

    return StreamIterator(open_documents, tokenizer, SEQ, 8, 2, eval_stride=eval_stride, **kw)


def flat_inputs(batches) -> np.ndarray:
    return np.concatenate([np.asarray(b["inputs"]).reshape(-1, SEQ) for b in batches]).ravel()


def test_streamed_saved_dataset_is_read_lazily_and_equals_the_cached_stream_in_order(tokenizer, tmp_path, monkeypatch):
    import datasets

    docs = corpus(3000)
    path = save_dataset(tmp_path / "ds", {"train": docs})
    streamed = []  # really a stream: the split goes through an IterableDataset
    to_iterable = datasets.Dataset.to_iterable_dataset
    monkeypatch.setattr(datasets.Dataset, "to_iterable_dataset", lambda self, *a, **k: streamed.append(1) or
                        to_iterable(self, *a, **k))
    read: list[int] = []
    mesh = make_mesh(MeshConfig(dp=2, cp=2, tp=2))
    it = stream_iter(path, tokenizer, read, mesh=mesh)
    batches = [next(it) for _ in range(40)]
    assert streamed and len(read) < 400 < len(docs)  # ~20 documents a batch, a 64k-character chunk ahead
    assert batches[0]["inputs"].sharding.spec == jax.sharding.PartitionSpec(None, DATA, CP)
    cached = data.load_tokens(DataConfig(path=path, cache_dir=str(tmp_path / "cache")), tokenizer)
    np.testing.assert_array_equal(flat_inputs(batches), cached[:40 * 8 * SEQ])
    np.testing.assert_array_equal(np.asarray(batches[-1]["labels"])[-1, -1, -1], cached[40 * 8 * SEQ])


@pytest.mark.parametrize("stop_after", [7, 61])  # mid-document; past the end of the corpus (epoch 1)
def test_streaming_resume_gives_the_batches_of_an_uninterrupted_run(tokenizer, tmp_path, stop_after):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in corpus(200)))
    uninterrupted = stream_iter(str(path), tokenizer, eval_stride=5)
    expected = [as_numpy(next(uninterrupted)) for _ in range(stop_after + 5)]
    first = stream_iter(str(path), tokenizer, eval_stride=5)
    for _ in range(stop_after):
        next(first)
    saved = json.loads(json.dumps(first.state()))
    assert saved["epoch"] == (stop_after > 50) and saved["offset"] > 0
    resumed = stream_iter(str(path), tokenizer, eval_stride=5)
    resumed.restore(saved)
    for want in expected[stop_after:]:
        got = as_numpy(next(resumed))
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    with pytest.raises(ConfigError, match="held out every 5th document, this run every 4th"):
        stream_iter(str(path), tokenizer, eval_stride=4).restore(saved)
    with pytest.raises(ConfigError, match="is a streamed one"):
        make_iter(np.arange(10_000)).restore(saved)


def test_streaming_holds_out_every_kth_document_and_trains_on_the_others(tokenizer, tmp_path):
    docs = corpus(400)
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    it = stream_iter(str(path), tokenizer, eval_stride=4)
    eos = tokenizer.token_to_id("<|endoftext|>")

    def stream(keep):
        return np.concatenate([[*tokenizer.encode(d).ids, eos] for i, d in enumerate(docs) if keep(i)])

    assert it.num_eval_batches(3) == 3
    held = flat_inputs(list(it.eval_batches(3)))
    np.testing.assert_array_equal(held, stream(lambda i: i % 4 == 3)[:len(held)])
    np.testing.assert_array_equal(flat_inputs([next(it) for _ in range(30)]), stream(lambda i: i % 4 != 3)[:30 * 8 * SEQ])
    with pytest.raises(ConfigError, match=r"held-out split \(no document\) is under one batch"):
        stream_iter(str(path), tokenizer).num_eval_batches(1)
    assert DataConfig(eval_fraction=0.05, streaming=True).eval_stride == 20


# -- prefetch -----------------------------------------------------------------------------------

def test_prefetched_batches_and_positions_equal_the_iterator_s(tokens):
    from pjax.data.prefetch import Prefetcher

    plain, ahead = make_iter(tokens), Prefetcher(make_iter(tokens), depth=3)
    for _ in range(6):
        a, b = as_numpy(next(plain)), as_numpy(next(ahead))
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
        assert ahead.state() == plain.state()  # the batches taken, not those built ahead
    ahead.close()
    assert not any(t.name == "pjax-data-prefetch" for t in __import__("threading").enumerate())


def test_a_fault_in_the_prefetch_thread_is_raised_by_the_next_that_needs_that_batch(tokens):
    from pjax.data.prefetch import Prefetcher

    class Failing:
        def __init__(self):
            self.inner = make_iter(tokens)

        def __next__(self):
            if self.inner.step_in_epoch == 4:
                raise ConfigError("data/x.jsonl:9 is not valid JSON")
            return next(self.inner)

        def state(self):
            return self.inner.state()

    ahead = Prefetcher(Failing(), depth=2)
    for _ in range(4):
        next(ahead)
    with pytest.raises(ConfigError, match="x.jsonl:9 is not valid JSON"):
        next(ahead)
    assert ahead.state()["step_in_epoch"] == 4 and ahead._thread is None
