"""Tests for lowcomm.data: reading, tokenizer cache, sharding, resume and validation split."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from lowcomm.data import (
    BUNDLED_CORPUS_DIR,
    DataConfig,
    DataError,
    PreparedCorpus,
    WorkerShard,
    prepare_corpus,
    validation_batches,
)
from lowcomm.data import corpus as corpus_module

SMALL_VOCAB = 300
SOURCE_STRIDE = 1_000_000
"""Synthetic token ids encode (source, position) as source * SOURCE_STRIDE + position."""


def _bundled_excerpt(name: str, characters: int) -> str:
    with gzip.open(BUNDLED_CORPUS_DIR / name, "rt", encoding="utf-8") as handle:
        return handle.read(characters)


@pytest.fixture(scope="module")
def small_text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with excerpts of four novels, small enough to tokenize in well under a second."""
    folder = tmp_path_factory.mktemp("small_text")
    names = sorted(path.name for path in BUNDLED_CORPUS_DIR.glob("*.txt.gz"))[:4]
    for name in names:
        (folder / name.removesuffix(".gz")).write_text(
            _bundled_excerpt(name, 30_000), encoding="utf-8"
        )
    return folder


@pytest.fixture(scope="module")
def small_corpus(small_text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> PreparedCorpus:
    cache = tmp_path_factory.mktemp("cache")
    return prepare_corpus(
        DataConfig(data=str(small_text_dir), vocab_size=SMALL_VOCAB, cache_dir=str(cache))
    )


def _synthetic_corpus(
    train_lengths: list[int], val_lengths: list[int] | None = None
) -> PreparedCorpus:
    """A corpus whose token ids reveal where they came from (source and position)."""
    val_lengths = val_lengths or [0] * len(train_lengths)
    train: list[npt.NDArray[Any]] = []
    validation: list[npt.NDArray[Any]] = []
    for source, (train_length, val_length) in enumerate(
        zip(train_lengths, val_lengths, strict=True)
    ):
        stream = source * SOURCE_STRIDE + np.arange(train_length + val_length, dtype=np.int64)
        train.append(stream[:train_length])
        validation.append(stream[train_length:])
    return PreparedCorpus(
        tokenizer_path=Path("unused.json"),
        vocab_size=SOURCE_STRIDE * len(train_lengths),
        eot_id=0,
        source_names=[f"source{index}" for index in range(len(train_lengths))],
        train_tokens=train,
        val_tokens=validation,
        cache_key="synthetic",
        from_cache=False,
    )


# --- reading and tokenizing -------------------------------------------------------------------


def test_tokenizer_round_trips_text(small_corpus: PreparedCorpus) -> None:
    tokenizer = small_corpus.load_tokenizer()
    text = 'It is a truth universally acknowledged — "café", naïve 123!\n\n\tEnd.'
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert max(ids) < small_corpus.vocab_size
    # Trained merges must actually compress English (byte-level would be one id per byte).
    assert len(ids) < len(text.encode("utf-8"))


def test_token_streams_decode_back_to_the_sources(
    small_corpus: PreparedCorpus, small_text_dir: Path
) -> None:
    tokenizer = small_corpus.load_tokenizer()
    assert small_corpus.source_names == sorted(path.name for path in small_text_dir.iterdir())
    for name, train, validation in zip(
        small_corpus.source_names, small_corpus.train_tokens, small_corpus.val_tokens, strict=True
    ):
        stream = np.concatenate([train, validation])
        # One document per text file, followed by the end-of-text token.
        assert stream[-1] == small_corpus.eot_id
        assert int((stream == small_corpus.eot_id).sum()) == 1
        original = (small_text_dir / name).read_text(encoding="utf-8")
        assert tokenizer.decode(stream[:-1].tolist()) == original


def test_validation_split_is_the_tail_of_each_source(small_corpus: PreparedCorpus) -> None:
    for train, validation in zip(small_corpus.train_tokens, small_corpus.val_tokens, strict=True):
        total = len(train) + len(validation)
        assert len(validation) == math.ceil(total * 0.05)
        assert len(train) > 0


def test_cache_is_reused(
    small_text_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = DataConfig(data=str(small_text_dir), vocab_size=SMALL_VOCAB, cache_dir=str(tmp_path))
    first = prepare_corpus(config)
    assert not first.from_cache
    corpus_file = tmp_path / "corpora" / f"{first.cache_key}.tokens"
    assert first.token_file == corpus_file
    assert first.tokenizer_path == tmp_path / "tokenizers" / f"{first.cache_key}.json"
    modified = (first.tokenizer_path.stat().st_mtime_ns, corpus_file.stat().st_mtime_ns)

    def fail_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tokenizer was retrained although it is cached")

    monkeypatch.setattr(corpus_module, "_train_tokenizer", fail_training)
    second = prepare_corpus(config)
    assert second.from_cache
    assert (first.tokenizer_path.stat().st_mtime_ns, corpus_file.stat().st_mtime_ns) == modified
    assert second.vocab_size == first.vocab_size
    for a, b in zip(first.train_tokens, second.train_tokens, strict=True):
        np.testing.assert_array_equal(a, b)
    # Atomic writes leave no temporary files behind.
    leftovers = [path.name for path in tmp_path.rglob("*.tmp")]
    assert leftovers == []


def test_cache_key_depends_on_vocab_size_and_content(small_text_dir: Path, tmp_path: Path) -> None:
    base = prepare_corpus(
        DataConfig(data=str(small_text_dir), vocab_size=SMALL_VOCAB, cache_dir=str(tmp_path))
    )
    bigger = prepare_corpus(
        DataConfig(data=str(small_text_dir), vocab_size=SMALL_VOCAB + 20, cache_dir=str(tmp_path))
    )
    assert bigger.cache_key != base.cache_key
    assert not bigger.from_cache
    edited = tmp_path / "edited"
    edited.mkdir()
    for path in small_text_dir.iterdir():
        (edited / path.name).write_text(path.read_text(encoding="utf-8") + "!", encoding="utf-8")
    changed = prepare_corpus(
        DataConfig(data=str(edited), vocab_size=SMALL_VOCAB, cache_dir=str(tmp_path))
    )
    assert changed.cache_key != base.cache_key


def test_concurrent_preparers_train_once(
    small_text_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = corpus_module._train_tokenizer

    def counting_train(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(corpus_module, "_train_tokenizer", counting_train)
    config = DataConfig(data=str(small_text_dir), vocab_size=SMALL_VOCAB, cache_dir=str(tmp_path))
    results: list[PreparedCorpus] = []
    errors: list[BaseException] = []

    def prepare() -> None:
        try:
            results.append(prepare_corpus(config))
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=prepare) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(calls) == 1
    assert len(results) == 3
    for result in results[1:]:
        for a, b in zip(results[0].train_tokens, result.train_tokens, strict=True):
            np.testing.assert_array_equal(a, b)


def test_cache_dir_environment_variable_is_only_a_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWCOMM_CACHE_DIR", str(tmp_path / "from_env"))
    assert DataConfig().resolved_cache_dir() == tmp_path / "from_env"
    explicit = DataConfig(cache_dir=str(tmp_path / "explicit"))
    assert explicit.resolved_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("LOWCOMM_CACHE_DIR")
    assert DataConfig().resolved_cache_dir() == Path.home() / ".cache" / "lowcomm"


def test_jsonl_and_folder_input(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "nested").mkdir(parents=True)
    (data / "a.txt").write_text("Plain text file. " * 50, encoding="utf-8")
    with gzip.open(data / "nested" / "b.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write("Gzipped text file. " * 50)
    records: list[dict[str, str]] = [
        {"text": "First JSON document. " * 20, "id": "1"},
        {"text": "Second one. " * 20},
    ]
    (data / "c.jsonl").write_text(
        "\n".join(json.dumps(record) for record in records) + "\n\n", encoding="utf-8"
    )
    (data / "notes.md").write_text("ignored: not a supported suffix", encoding="utf-8")
    corpus = prepare_corpus(
        DataConfig(data=str(data), vocab_size=SMALL_VOCAB, cache_dir=str(tmp_path / "cache"))
    )
    assert corpus.source_names == ["a.txt", "c.jsonl", "nested/b.txt.gz"]
    streams = [
        np.concatenate([train, validation])
        for train, validation in zip(corpus.train_tokens, corpus.val_tokens, strict=True)
    ]
    end_of_text_counts = [int((stream == corpus.eot_id).sum()) for stream in streams]
    assert end_of_text_counts == [1, 2, 1]
    tokenizer = corpus.load_tokenizer()
    jsonl_text = tokenizer.decode(streams[1].tolist())
    assert jsonl_text == records[0]["text"] + records[1]["text"]
    # A single JSONL file works as --data too.
    single = prepare_corpus(
        DataConfig(
            data=str(data / "c.jsonl"), vocab_size=SMALL_VOCAB, cache_dir=str(tmp_path / "c")
        )
    )
    assert single.source_names == ["c.jsonl"]


def test_jsonl_custom_text_field(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"body": "Custom field text. " * 30}) + "\n", encoding="utf-8")
    corpus = prepare_corpus(
        DataConfig(
            data=str(path), text_field="body", vocab_size=SMALL_VOCAB, cache_dir=str(tmp_path)
        )
    )
    assert corpus.num_train_tokens > 0


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"text": "fine"}\n{"other": "no text field"}\n', "docs.jsonl:2 has no field 'text'"),
        ('{"text": "fine"}\nnot json\n', "docs.jsonl:2 is not valid JSON"),
        ('{"text": 5}\n', "docs.jsonl:1 field 'text' is int"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=expected):
        prepare_corpus(DataConfig(data=str(path), cache_dir=str(tmp_path)))


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_file.txt"
    with pytest.raises(DataError, match=r"--data: path '.*no_such_file.txt' does not exist"):
        prepare_corpus(DataConfig(data=str(missing), cache_dir=str(tmp_path)))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.md").write_text("not a text source", encoding="utf-8")
    with pytest.raises(DataError, match=re.escape("holds no .txt")):
        prepare_corpus(DataConfig(data=str(empty), cache_dir=str(tmp_path)))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"val_fraction": 1.5}, "--val-fraction: 1.5 is outside"),
        ({"val_fraction": 0.0}, "--val-fraction"),
        ({"vocab_size": 100}, "--vocab-size: 100"),
        ({"split": "random"}, "--split: unknown split 'random'"),
        ({"micro_batch_size": 0}, "--micro-batch-size: 0"),
        ({"text_field": ""}, "--text-field"),
        ({"data": ""}, "--data"),
    ],
)
def test_bad_config_names_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(DataError, match=field):
        DataConfig(**overrides)  # type: ignore[arg-type]


# --- sampling ---------------------------------------------------------------------------------


def test_next_batch_targets_are_inputs_shifted_by_one(small_corpus: PreparedCorpus) -> None:
    shard = WorkerShard(small_corpus, rank=0, world_size=1, seq_len=32, micro_batch_size=4, seed=0)
    x, y = shard.next_batch()
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Each row is a real window of the corpus: x followed by y's last token.
    (source, start, stop), *_ = shard.window_token_ranges(shard.window_indices(0)[:1])
    expected = torch.from_numpy(small_corpus.train_tokens[source][start:stop].astype(np.int64))
    assert torch.equal(x[0], expected[:-1])
    assert torch.equal(y[0], expected[1:])


def test_training_windows_do_not_overlap() -> None:
    corpus = _synthetic_corpus([1000, 700])
    shard = WorkerShard(corpus, rank=0, world_size=1, seq_len=9, micro_batch_size=5, seed=3)
    assert shard.num_windows == 100 + 70
    rows = [torch.cat([x, y[:, -1:]], dim=1) for x, y in (shard.next_batch() for _ in range(34))]
    tokens = torch.cat(rows).flatten().tolist()
    assert len(tokens) == len(set(tokens)) == 170 * 10


def test_iid_shards_are_disjoint_and_equal_sized() -> None:
    corpus = _synthetic_corpus([1003, 517, 810])
    shards = [
        WorkerShard(corpus, rank=rank, world_size=4, seq_len=15, micro_batch_size=3, seed=7)
        for rank in range(4)
    ]
    for epoch in (0, 1):
        indices = [shard.window_indices(epoch) for shard in shards]
        assert len({len(index) for index in indices}) == 1
        merged = np.concatenate(indices)
        assert len(set(merged.tolist())) == len(merged)
        # Remainder dropped so that every worker has the same count.
        assert len(merged) == (shards[0].num_windows // 4) * 4
    # The tokens actually served are disjoint across workers within an epoch.
    seen = [
        {
            int(token)
            for _ in range(shard.batches_per_epoch)
            for token in shard.next_batch()[0][:, 0]
        }
        for shard in shards
    ]
    for first in range(4):
        for second in range(first + 1, 4):
            assert seen[first].isdisjoint(seen[second])
    # A new epoch is reshuffled, not replayed.
    assert not np.array_equal(shards[0].window_indices(0), shards[0].window_indices(1))


def test_iid_shards_draw_from_every_source() -> None:
    corpus = _synthetic_corpus([2000, 2000, 2000, 2000])
    for rank in range(4):
        shard = WorkerShard(corpus, rank=rank, world_size=4, seq_len=15, micro_batch_size=4, seed=1)
        sources = shard.window_sources(shard.window_indices(0))
        assert set(sources.tolist()) == {0, 1, 2, 3}


def test_non_iid_shards_draw_mostly_from_different_sources() -> None:
    # Unequal sources so that blocks straddle source boundaries.
    corpus = _synthetic_corpus([2400, 1600, 2000, 2000])
    dominant = []
    for rank in range(4):
        shard = WorkerShard(
            corpus, rank=rank, world_size=4, seq_len=15, micro_batch_size=4, seed=1, split="non-iid"
        )
        x, _ = shard.next_batch()
        served_sources = set((x[:, 0] // SOURCE_STRIDE).tolist())
        sources = shard.window_sources(shard.window_indices(0))
        assert served_sources <= set(sources.tolist())
        counts = np.bincount(sources, minlength=4)
        assert counts.max() / counts.sum() >= 0.5
        assert (counts > 0).sum() <= 2
        dominant.append(int(counts.argmax()))
        # The block is shuffled, not read in order.
        assert not np.array_equal(shard.window_indices(0), np.sort(shard.window_indices(0)))
    assert len(set(dominant)) == 4


def test_resume_matches_uninterrupted_run_across_epoch_boundary() -> None:
    corpus = _synthetic_corpus([700, 500])
    settings = {"world_size": 2, "seq_len": 7, "micro_batch_size": 4, "seed": 11}
    for split in ("iid", "non-iid"):
        uninterrupted = WorkerShard(corpus, rank=1, split=split, **settings)
        per_epoch = uninterrupted.batches_per_epoch
        assert per_epoch >= 3
        reference = [uninterrupted.next_batch() for _ in range(3 * per_epoch)]
        interrupted = WorkerShard(corpus, rank=1, split=split, **settings)
        stop = per_epoch - 2  # resume shortly before the epoch boundary
        for _ in range(stop):
            interrupted.next_batch()
        state = interrupted.state_dict()
        resumed = WorkerShard(corpus, rank=1, split=split, **settings)
        resumed.load_state_dict(state)
        for expected_x, expected_y in reference[stop:]:
            x, y = resumed.next_batch()
            assert torch.equal(x, expected_x)
            assert torch.equal(y, expected_y)
        assert resumed.epoch == 3
        # Consecutive epochs serve different orders (the reshuffle really happens).
        assert not torch.equal(reference[0][0], reference[per_epoch][0])


def test_load_state_dict_rejects_other_settings() -> None:
    corpus = _synthetic_corpus([1000])
    shard = WorkerShard(corpus, rank=0, world_size=2, seq_len=7, micro_batch_size=4, seed=1)
    other = WorkerShard(corpus, rank=0, world_size=2, seq_len=7, micro_batch_size=4, seed=2)
    with pytest.raises(ValueError, match="seed=2"):
        shard.load_state_dict(other.state_dict())


def test_too_small_corpus_raises_data_error() -> None:
    corpus = _synthetic_corpus([100])
    with pytest.raises(DataError, match=r"has 3 windows .* need at least 16"):
        WorkerShard(corpus, rank=0, world_size=4, seq_len=32, micro_batch_size=4, seed=0)


def test_validation_windows_never_overlap_training() -> None:
    corpus = _synthetic_corpus([900, 1200, 600], val_lengths=[100, 130, 90])
    boundaries = [900, 1200, 600]
    batches = validation_batches(corpus, seq_len=9, batch_size=4, num_batches=6)
    assert len(batches) == 6
    validation_tokens = []
    for x, y in batches:
        assert x.shape == y.shape == (4, 9)
        assert torch.equal(x[:, 1:], y[:, :-1])
        validation_tokens.extend(torch.cat([x, y[:, -1:]], dim=1).flatten().tolist())
    # Every validation token lies in its source's held-out tail...
    for token in validation_tokens:
        source, position = divmod(token, SOURCE_STRIDE)
        assert position >= boundaries[source]
    # ...validation windows do not overlap each other, and every source is represented.
    assert len(validation_tokens) == len(set(validation_tokens))
    assert {token // SOURCE_STRIDE for token in validation_tokens} == {0, 1, 2}
    # Training never serves a held-out token.
    shard = WorkerShard(corpus, rank=0, world_size=1, seq_len=9, micro_batch_size=4, seed=0)
    for _ in range(shard.batches_per_epoch):
        x, y = shard.next_batch()
        for token in torch.cat([x, y[:, -1:]], dim=1).flatten().tolist():
            source, position = divmod(token, SOURCE_STRIDE)
            assert position < boundaries[source]


def test_validation_batches_are_deterministic_and_capped() -> None:
    corpus = _synthetic_corpus([500, 500], val_lengths=[50, 30])
    first = validation_batches(corpus, seq_len=9, batch_size=2, num_batches=100)
    second = validation_batches(corpus, seq_len=9, batch_size=2, num_batches=100)
    # 5 + 3 whole windows exist: capped at 4 full batches.
    assert len(first) == 4
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert torch.equal(x1, x2)
        assert torch.equal(y1, y2)
    # Fewer windows than one batch: a single smaller batch.
    tiny = validation_batches(corpus, seq_len=9, batch_size=16, num_batches=2)
    assert len(tiny) == 1
    assert tiny[0][0].shape == (8, 9)
    with pytest.raises(DataError, match="validation split has no window"):
        validation_batches(corpus, seq_len=60, batch_size=2, num_batches=1)


# --- the real bundled corpus ------------------------------------------------------------------


def test_bundled_corpus_prepares_and_reloads(tmp_path: Path) -> None:
    config = DataConfig(cache_dir=str(tmp_path))
    corpus = prepare_corpus(config)
    assert len(corpus.source_names) == 6
    assert all(name.startswith("austen_") for name in corpus.source_names)
    assert corpus.vocab_size == 2048
    assert corpus.train_tokens[0].dtype == np.uint16
    # ~4 MB of English at 2048 BPE ids is roughly a million tokens.
    assert 500_000 < corpus.num_train_tokens < 2_000_000
    assert 0.04 < corpus.num_val_tokens / (corpus.num_train_tokens + corpus.num_val_tokens) < 0.06
    reloaded = prepare_corpus(config)
    assert reloaded.from_cache
    shards = [
        WorkerShard(reloaded, rank=rank, world_size=2, seq_len=128, micro_batch_size=8, seed=0)
        for rank in range(2)
    ]
    assert shards[0].batches_per_epoch == shards[1].batches_per_epoch > 100
    assert len(validation_batches(reloaded, seq_len=128, batch_size=8, num_batches=20)) == 20
    assert os.listdir(tmp_path / "tokenizers") == [f"{corpus.cache_key}.json"]
