"""Data is what it claims to be: binary files refused, JSONL records that
lack the field say what they have, paths stored absolute, other families' options refused."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _cli import lowcomm
from lowcomm.data import DataError, read_documents

TINY = [
    "--workers", "2", "--model.n-layer", "1", "--model.n-embd", "32", "--model.n-head", "2",
    "--model.block-size", "16", "--micro-batch-size", "2", "--eval-batches", "1",
    "--progress", "False", "--plot", "False", "--vocab-size", "300",
]  # fmt: skip

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune. "
    * 400
)


def _lowcomm(
    *args: str, cwd: Path | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``lowcomm ARGS``, its workers threads of one process (in this one where it can be:
    :func:`_cli.lowcomm`)."""
    return lowcomm(*args, cwd=cwd, timeout=timeout)


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def _random_bytes(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.mark.parametrize(
    ("name", "payload"),
    [
        ("noise.txt", _random_bytes(20_000)),
        ("program.txt", Path(sys.executable).resolve().read_bytes()[:200_000]),
        ("latin1.txt", ("café déjà vu, naïve façade. " * 500).encode("latin-1")),
        ("zeros.txt", b"\x00" * 5000),
    ],
)
def test_a_file_that_is_not_utf8_text_is_refused_naming_it(
    tmp_path: Path, name: str, payload: bytes
) -> None:
    path = tmp_path / name
    path.write_bytes(payload)
    with pytest.raises(DataError, match=re.escape(name)):
        read_documents(str(path))
    # Inside a folder, the offending file is named too.
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "good.txt").write_text(TEXT)
    (folder / name).write_bytes(payload)
    with pytest.raises(DataError, match=re.escape(name)):
        read_documents(str(folder))


def test_a_few_stray_bytes_in_a_large_text_are_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "scraped.txt"
    path.write_bytes(TEXT.encode() + b"\xff" + TEXT.encode())
    [(_, text)] = read_documents(str(path))
    assert "\ufffd" in text and text.startswith("It is a truth")


def test_a_binary_jsonl_and_a_bad_gzip_are_refused_naming_them(tmp_path: Path) -> None:
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_bytes(_random_bytes(5000, seed=1))
    with pytest.raises(DataError, match=re.escape("records.jsonl")):
        read_documents(str(jsonl))
    fake_gzip = tmp_path / "book.txt.gz"
    fake_gzip.write_bytes(b"this is not gzip data")
    with pytest.raises(DataError, match=re.escape("book.txt.gz")):
        read_documents(str(fake_gzip))


def test_binary_data_is_a_one_line_error_on_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "weights.txt"
    path.write_bytes(_random_bytes(50_000, seed=2))
    line = _one_line_error(_lowcomm("train", "--data", str(path), *TINY, timeout=120))
    assert line.startswith("lowcomm: error: --data:") and "weights.txt" in line


def test_a_jsonl_record_without_the_field_lists_the_fields_it_has(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(
        json.dumps({"text": "fine"}) + "\n" + json.dumps({"id": 7, "content": "x"}) + "\n"
    )
    with pytest.raises(DataError) as caught:
        read_documents(str(path))
    message = str(caught.value)
    assert "corpus.jsonl:2" in message
    assert "'content'" in message and "'id'" in message
    path.write_text(json.dumps(["a", "list"]) + "\n")
    with pytest.raises(DataError, match="not a JSON object"):
        read_documents(str(path))


@pytest.mark.parametrize(
    ("args", "option", "fix"),
    [
        (
            ["--method", "co2", "--diloco.sync-every", "2"],
            "--diloco.sync-every",
            "--local.sync-every",
        ),
        (
            ["--method", "ddp", "--acco.dpu-warmup-steps", "3"],
            "--acco.dpu-warmup-steps",
            "no method options",
        ),
        (["--method", "desloc", "--local.outer-lr=0.5"], "--local.outer-lr", "--desloc."),
    ],
)
def test_an_option_of_another_methods_family_is_refused(
    args: list[str], option: str, fix: str
) -> None:
    line = _one_line_error(_lowcomm("train", *args, *TINY, timeout=120))
    assert line.startswith(f"lowcomm: error: {option}:"), line
    assert fix in line


def test_options_of_the_methods_own_family_are_accepted(tmp_path: Path) -> None:
    result = _lowcomm(
        "train", "--method", "co2", "--local.sync-every", "2", "--steps", "2",
        "--out", str(tmp_path / "run"), *TINY,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_resume_works_from_another_working_directory(tmp_path: Path) -> None:
    """Relative --data, --out and --cache-dir are stored absolute, so the run resumes from
    anywhere."""
    first, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    first.mkdir()
    elsewhere.mkdir()
    (first / "texts").mkdir()
    (first / "texts" / "a.txt").write_text(TEXT)
    (first / "texts" / "b.txt").write_text(TEXT.upper())
    started = _lowcomm(
        "train", "--data", "texts", "--cache-dir", "cache", "--out", "runs/r", "--steps", "4",
        "--stop-after", "2", "--eval-every", "2", *TINY, cwd=first,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr[-2000:]
    saved = json.loads((first / "runs" / "r" / "config.json").read_text())
    assert saved["data"]["data"] == str(first / "texts")
    assert saved["data"]["cache_dir"] == str(first / "cache")
    assert saved["run"]["out"] == str(first / "runs" / "r")
    resumed = _lowcomm("train", "--resume", str(first / "runs" / "r"), cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # With --progress False (saved in config.json) the resume is still announced.
    assert "lowcomm: resumed" in resumed.stdout and "from step 2" in resumed.stdout
    records = [
        json.loads(line)
        for line in (first / "runs" / "r" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert not (elsewhere / "runs").exists() and not (elsewhere / "cache").exists()
