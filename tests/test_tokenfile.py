"""Data that does not fit in memory: token files (.npy, .bin) mapped with numpy.memmap, the
text cache as a mapped token file, JSONL/parquet/save_to_disk read as streams, bad token files
refused in one line, and the corpus lock that waiting ranks report on."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from _cli import TINY, lowcomm, torchrun
from lowcomm.data import BUNDLED_CORPUS_DIR, DataConfig, DataError, WorkerShard, prepare_corpus
from lowcomm.data import corpus as corpus_module

VOCAB = 300


def _excerpt(characters: int = 60_000) -> str:
    with gzip.open(BUNDLED_CORPUS_DIR / "austen_emma.txt.gz", "rt", encoding="utf-8") as handle:
        return handle.read(characters)


@pytest.fixture(scope="module")
def book(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A text file and a cache in which its corpus (a trained 300-token BPE) is prepared."""
    folder = tmp_path_factory.mktemp("book")
    text = folder / "book.txt"
    text.write_text(_excerpt(), encoding="utf-8")
    cache = folder / "cache"
    prepare_corpus(DataConfig(data=str(text), vocab_size=VOCAB, cache_dir=str(cache)))
    return text, cache


def _tokens_of(text: Path, cache: Path) -> tuple[np.ndarray, Path]:
    corpus = prepare_corpus(DataConfig(data=str(text), vocab_size=VOCAB, cache_dir=str(cache)))
    assert corpus.from_cache
    return np.concatenate([*corpus.train_tokens, *corpus.val_tokens]), corpus.tokenizer_path


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train_loss"] for line in lines]


# --- the cache and given token files are mapped, not read -----------------------------------


def test_the_text_cache_is_a_token_file_every_rank_maps(book: tuple[Path, Path]) -> None:
    text, cache = book
    corpus = prepare_corpus(DataConfig(data=str(text), vocab_size=VOCAB, cache_dir=str(cache)))
    assert corpus.token_file is not None and corpus.token_file.suffix == ".tokens"
    assert all(isinstance(stream, np.memmap) for stream in corpus.train_tokens)
    assert corpus.token_file.stat().st_size == 2 * (corpus.num_train_tokens + corpus.num_val_tokens)
    described = json.loads(corpus.token_file.with_suffix(".json").read_text())
    assert described["dtype"] == "uint16" and described["num_documents"] == 1


def test_a_token_file_gives_the_corpus_of_its_text(book: tuple[Path, Path], tmp_path: Path) -> None:
    text, cache = book
    tokens, tokenizer = _tokens_of(text, cache)
    from_text = prepare_corpus(DataConfig(data=str(text), vocab_size=VOCAB, cache_dir=str(cache)))
    for name, write, dtype in (
        ("book.npy", lambda p: np.save(p, tokens.astype(np.uint32)), None),
        ("book.bin", lambda p: tokens.astype(np.uint16).tofile(p), "uint16"),
    ):
        path = tmp_path / name
        write(path)
        corpus = prepare_corpus(
            DataConfig(
                data=str(path), data_dtype=dtype, tokenizer=str(tokenizer), cache_dir=str(cache)
            )
        )
        assert isinstance(corpus.train_tokens[0], np.memmap)
        assert corpus.vocab_size == from_text.vocab_size and corpus.eot_id == from_text.eot_id
        assert corpus.num_documents == 1  # one end-of-text id in the file
        np.testing.assert_array_equal(corpus.train_tokens[0], from_text.train_tokens[0])
        np.testing.assert_array_equal(corpus.val_tokens[0], from_text.val_tokens[0])
        shards = [
            WorkerShard(c, rank=1, world_size=2, seq_len=16, micro_batch_size=4, seed=3)
            for c in (corpus, from_text)
        ]
        for _ in range(3):
            (x1, y1), (x2, y2) = shards[0].next_batch(), shards[1].next_batch()
            assert x1.equal(x2) and y1.equal(y2)


def test_the_check_of_a_token_file_is_done_once(
    book: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, cache = book
    tokens, tokenizer = _tokens_of(text, cache)
    path = tmp_path / "once.npy"
    np.save(path, tokens)
    config = DataConfig(data=str(path), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "c"))
    assert not prepare_corpus(config).from_cache
    from lowcomm.data import tokenfile

    def no_scan(*args: object) -> int:
        raise AssertionError("the token file was scanned again")

    monkeypatch.setattr(tokenfile, "_scan", no_scan)
    assert prepare_corpus(config).from_cache


# --- bad token files: one line naming the field, the value, the rule and the fix ------------


def _refusal(tmp_path: Path, tokenizer: Path, name: str, dtype: str | None = None) -> str:
    config = DataConfig(
        data=str(tmp_path / name), data_dtype=dtype, tokenizer=str(tokenizer),
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    with pytest.raises(DataError) as caught:
        prepare_corpus(config)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_bad_token_files_are_refused_in_one_line(book: tuple[Path, Path], tmp_path: Path) -> None:
    text, cache = book
    tokens, tokenizer = _tokens_of(text, cache)
    np.save(tmp_path / "wide.npy", tokens.astype(np.int64))
    message = _refusal(tmp_path, tokenizer, "wide.npy")
    assert message.startswith("--data:") and "int64" in message and "uint16 or uint32" in message
    assert "astype(np.uint32)" in message
    (tmp_path / "odd.bin").write_bytes(tokens.astype(np.uint16).tobytes() + b"\x01")
    message = _refusal(tmp_path, tokenizer, "odd.bin", "uint16")
    assert message.startswith("--data:") and f"{2 * len(tokens) + 1:,} bytes" in message
    assert "whole number of uint16 ids" in message and "--data-dtype" in message
    message = _refusal(tmp_path, tokenizer, "odd.bin")
    assert message.startswith("--data-dtype: not given") and "--data-dtype uint16" in message
    out_of_range = tokens.astype(np.uint16)
    out_of_range[1234] = VOCAB + 5
    np.save(tmp_path / "range.npy", out_of_range)
    message = _refusal(tmp_path, tokenizer, "range.npy")
    assert f"token id {VOCAB + 5}" in message and "position 1,234" in message
    assert f"below {VOCAB}" in message and "--tokenizer" in message
    (tmp_path / "empty.bin").write_bytes(b"")
    message = _refusal(tmp_path, tokenizer, "empty.bin", "uint16")
    assert message.startswith("--data:") and "empty" in message
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.uint16))
    assert "empty" in _refusal(tmp_path, tokenizer, "empty.npy")
    np.save(tmp_path / "square.npy", tokens[:100].astype(np.uint16).reshape(10, 10))
    assert "(10, 10)" in _refusal(tmp_path, tokenizer, "square.npy")
    np.save(tmp_path / "narrow.npy", tokens.astype(np.uint16))
    message = _refusal(tmp_path, tokenizer, "narrow.npy", "uint32")
    assert message.startswith("--data-dtype: uint32 but") and "header says uint16" in message
    with pytest.raises(DataError, match=r"^--data-dtype: 'int8' is not a token id dtype; pass"):
        DataConfig(data="x.bin", data_dtype="int8")
    with pytest.raises(DataError, match=r"^--data-dtype: uint16 given, but --data 'a.txt'"):
        DataConfig(data="a.txt", data_dtype="uint16")
    np.save(tmp_path / "plain.npy", tokens)
    with pytest.raises(DataError, match=r"^--tokenizer: not given, and .*plain.npy holds token"):
        prepare_corpus(DataConfig(data=str(tmp_path / "plain.npy"), cache_dir=str(tmp_path)))


@pytest.mark.slow
def test_a_bad_token_file_is_a_one_line_error_on_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    result = lowcomm(
        "train", "--data", str(tmp_path / "odd.bin"), "--data-dtype", "uint16",
        "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run"), *TINY,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowcomm: error: --data"), result.stderr


# --- a run on a token file is the run on its text, and resumes exactly ----------------------


COMMON = ("train", "--method", "diloco", "--steps", "4", *TINY)


def _train(cache: Path, *args: str) -> None:
    result = lowcomm(*COMMON, "--cache-dir", str(cache), *args)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def token_runs(book: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The text and its tokens (.npy, .bin), and a 4-step run on the text."""
    text, cache = book
    folder = tmp_path_factory.mktemp("token_runs")
    tokens, tokenizer = _tokens_of(text, cache)
    np.save(folder / "book.npy", tokens)
    tokens.astype(np.uint16).tofile(folder / "book.bin")
    (folder / "tokenizer").write_text(str(tokenizer))
    _train(cache, "--data", str(text), "--vocab-size", str(VOCAB), "--out", str(folder / "text"))
    return folder


def _on_bin(folder: Path) -> tuple[str, ...]:
    tokenizer = (folder / "tokenizer").read_text()
    return ("--data", str(folder / "book.bin"), "--data-dtype", "uint16", "--tokenizer", tokenizer)


@pytest.mark.slow
def test_a_run_on_a_token_file_equals_the_run_on_its_text(
    book: tuple[Path, Path], token_runs: Path
) -> None:
    tokenizer = (token_runs / "tokenizer").read_text()
    on_npy = ("--data", str(token_runs / "book.npy"), "--tokenizer", tokenizer)
    _train(book[1], *on_npy, "--out", str(token_runs / "npy"))
    expected = _losses(token_runs / "text")
    assert len(expected) == 4 and _losses(token_runs / "npy") == expected


@pytest.mark.slow
def test_a_run_on_a_token_file_resumes_exactly(book: tuple[Path, Path], token_runs: Path) -> None:
    out = token_runs / "bin"
    _train(book[1], *_on_bin(token_runs), "--stop-after", "2", "--out", str(out))
    assert len(_losses(out)) == 2
    result = lowcomm("train", "--resume", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(out) == _losses(token_runs / "text")
    final = [
        json.loads((run / "summary.json").read_text())["final_val_loss"]
        for run in (token_runs / "text", out)
    ]
    assert final[0] == final[1]


@pytest.mark.slow
def test_a_run_on_a_token_file_resumes_on_more_workers(
    book: tuple[Path, Path], token_runs: Path
) -> None:
    out = token_runs / "elastic"
    _train(book[1], *_on_bin(token_runs), "--stop-after", "2", "--out", str(out))
    result = lowcomm("train", "--resume", str(out), "--workers", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [record["step"] for record in records]
    assert steps == list(range(steps[0], steps[0] + 4))
    change = records[2]["membership"]
    assert (change["step"], change["old_workers"], change["new_workers"]) == (steps[2], 2, 3)
    assert all("membership" not in record for record in records[:2] + records[3:])
    assert all(len(record["microbatches_per_worker"]) == 3 for record in records[2:])


# --- JSONL, parquet and save_to_disk datasets ------------------------------------------------


def _records() -> list[str]:
    text = _excerpt(40_000)
    return [text[begin : begin + 2_000] for begin in range(0, len(text), 2_000)]


def test_jsonl_parquet_and_a_saved_dataset_give_the_same_tokens(tmp_path: Path) -> None:
    records = _records()
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(records))
    )
    cache = str(tmp_path / "cache")
    reference = prepare_corpus(DataConfig(data=str(jsonl), vocab_size=VOCAB, cache_dir=cache))
    assert reference.num_documents == len(records)
    tokenizer = str(reference.tokenizer_path)
    expected = np.concatenate([*reference.train_tokens, *reference.val_tokens])
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")

    table = pyarrow.table({"id": list(range(len(records))), "text": records})
    inputs = [tmp_path / "records.parquet"]
    parquet.write_table(table, inputs[0], row_group_size=7)
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"text": records})
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "saved_dict"))
    inputs += [tmp_path / "saved", tmp_path / "saved_dict"]
    local = tmp_path / "local_dataset" / "data"  # a dataset repository's layout
    local.mkdir(parents=True)
    parquet.write_table(table, local / "train-00000-of-00001.parquet", row_group_size=5)
    inputs.append(tmp_path / "local_dataset")
    for path in inputs:
        corpus = prepare_corpus(DataConfig(data=str(path), tokenizer=tokenizer, cache_dir=cache))
        assert corpus.num_documents == len(records), path
        streams = np.concatenate([*corpus.train_tokens, *corpus.val_tokens])
        np.testing.assert_array_equal(streams, expected)
    with pytest.raises(DataError, match=r"^--data: .*records.parquet has no column 'body' \("):
        prepare_corpus(
            DataConfig(data=str(inputs[0]), text_field="body", tokenizer=tokenizer, cache_dir=cache)
        )
    with pytest.raises(DataError, match=r"column 'id' is int64, not a string; pass --text-field"):
        prepare_corpus(
            DataConfig(data=str(inputs[0]), text_field="id", tokenizer=tokenizer, cache_dir=cache)
        )


def test_parquet_without_pyarrow_is_refused_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(DataError, match=r"a.parquet needs pyarrow; install pyarrow \(pip install"):
        prepare_corpus(DataConfig(data=str(tmp_path / "a.parquet"), cache_dir=str(tmp_path)))


def test_a_dataset_dict_without_a_train_split_names_its_splits(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    both = {
        "a": datasets.Dataset.from_dict({"text": ["x"]}),
        "b": datasets.Dataset.from_dict({"text": ["y"]}),
    }
    datasets.DatasetDict(both).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"without a 'train' split \(its splits: a, b\); pass"):
        prepare_corpus(DataConfig(data=str(tmp_path / "dd"), cache_dir=str(tmp_path / "c")))


# --- ranks that wait for the tokenizing one wait on a file lock, saying so ----------------


def test_a_rank_waiting_for_the_corpus_lock_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(corpus_module, "WAIT_REPORT_FIRST_S", 0.2)
    monkeypatch.setattr(corpus_module, "WAIT_REPORT_EVERY_S", 0.2)
    lock = tmp_path / "locks" / "k.lock"
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with corpus_module.exclusive_lock(lock):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    lines: list[str] = []
    threading.Timer(0.9, release.set).start()
    started = time.monotonic()
    with corpus_module.exclusive_lock(lock, lines.append):
        waited = time.monotonic() - started
    thread.join()
    assert waited >= 0.8
    assert 2 <= len(lines) <= 5, lines
    assert lines[0].startswith("waiting 0 s for another process preparing the corpus (lock ")
    assert str(lock) in lines[0]


@pytest.mark.slow
def test_torchrun_ranks_prepare_a_fresh_corpus_without_a_collective_wait(tmp_path: Path) -> None:
    import subprocess

    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in _records()))
    launched = subprocess.run(
        [*torchrun(tmp_path), "--standalone", "--nproc-per-node", "2", "-m", "lowcomm", "train",
         "--steps", "2", "--data", str(jsonl), "--vocab-size", str(VOCAB),
         "--cache-dir", str(tmp_path / "fresh"), "--out", str(tmp_path / "run"), *TINY],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert len(_losses(tmp_path / "run")) == 2
    assert len(list((tmp_path / "fresh" / "corpora").glob("*.tokens"))) == 1
