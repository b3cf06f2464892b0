"""--log wandb: a run in W&B's offline mode writes the step records, the summary and loss.png
into its offline run, read back from W&B's own transaction log (records of W&B's protobuf);
a missing package or login is refused in one line before any worker starts."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from _cli import TINY, lowcomm
from lowcomm.config import ConfigError, RunConfig, TrainConfig
from lowcomm.launch.run import preflight
from lowcomm.train.metrics import loggers
from lowcomm.train.wandb_log import MISSING, NO_LOGIN, login_problem

#: W&B's transaction log (run-ID.wandb): a 7-byte header (":W&B", magic 0xBEE1, version 0),
#: then LevelDB's log format: 32 KiB blocks of chunks (CRC 4 bytes, length 2, type 1) that
#: are whole records (type 1) or their first, middle and last parts (2, 3, 4).
_BLOCK, _CHUNK_HEADER = 32768, 7


def _records(path: Path) -> list[Any]:
    """Every record of a W&B transaction log, parsed with W&B's protobuf classes."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    records, pending, position = [], b"", 7
    while position + _CHUNK_HEADER <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK_HEADER:  # the block's zero-filled trailer
            position += left
            continue
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
        if length == 0 and kind == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += _CHUNK_HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow
def test_an_offline_run_holds_the_step_records_the_summary_and_the_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    done = lowcomm(
        "train", *TINY[:-4], "--steps", "4", "--eval-every", "2", "--plot", "True",
        "--seconds-per-microbatch", "0.01", "--log", "jsonl", "wandb",
        "--wandb-project", "demo-project", "--out", str(out), processes=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (tmp_path / "wandb-dir" / "wandb").glob("offline-run-*")
    run_id = (out / "wandb" / "run-id").read_text().strip()
    assert run.name.endswith(run_id)
    records = _records(run / f"run-{run_id}.wandb")

    history = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            item = {entry.key or "/".join(entry.nested_key): json.loads(entry.value_json)
                    for entry in record.history.item}  # fmt: skip
            if "train_loss" in item:
                history.append(item)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == len(lines) == 4
    for logged, line in zip(history, lines, strict=True):
        assert logged["_step"] == line["step"]
        for key in ("train_loss", "lr", "utilization", "bytes_sent_per_worker", "clock_s",
                    "tokens", "microbatches_per_worker"):  # fmt: skip
            assert logged[key] == line[key], key
        assert logged.get("val_loss") == line["val_loss"]  # absent where not evaluated
    assert [line["step"] for line in lines if line["val_loss"] is not None] == [1, 3]

    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.project == "demo-project" and run_record.display_name == "run"
    summary = json.loads((out / "summary.json").read_text())
    logged_summary: dict[str, Any] = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            for entry in record.summary.update:
                logged_summary[entry.key or "/".join(entry.nested_key)] = json.loads(
                    entry.value_json
                )
    for key in ("final_val_loss", "final_train_loss", "bytes_sent_per_worker", "tokens",
                "modeled_time_s", "method"):  # fmt: skip
        assert logged_summary[key] == summary[key], key

    (image,) = (run / "files" / "media" / "images").glob("loss_*.png")
    assert image.read_bytes() == (out / "loss.png").read_bytes()


def test_without_the_package_the_run_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def without_wandb(name: str, *args: object) -> object:
        return None if name == "wandb" else real_find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_wandb)
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        preflight(TrainConfig(run=RunConfig(log=("jsonl", "wandb"), out=str(out))))
    assert str(refused.value) == MISSING
    assert MISSING == "--log wandb: needs the wandb package: pip install 'lowcomm[wandb]'"
    assert not out.exists()


def test_online_without_a_key_is_refused_in_one_line_naming_both_fixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    netrc = tmp_path / "netrc"
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(netrc))  # (none there)
    out = tmp_path / "run"
    done = lowcomm("train", *TINY, "--steps", "1", "--log", "wandb", "--out", str(out))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"lowcomm: error: {NO_LOGIN}"]
    assert "wandb login" in NO_LOGIN and "WANDB_MODE=offline" in NO_LOGIN
    assert not out.exists()
    # Each way to a key, or a mode that needs none, lets the run start.
    environ = {"NETRC": str(netrc)}
    assert login_problem(environ) == NO_LOGIN
    assert login_problem({**environ, "WANDB_MODE": "offline"}) is None
    assert login_problem({**environ, "WANDB_API_KEY": "k" * 40}) is None
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert login_problem(environ) is None
    # (a key for another W&B server is not one for this one)
    assert login_problem({**environ, "WANDB_BASE_URL": "https://wandb.example.com"}) == NO_LOGIN


def test_tensorboard_is_an_alias_of_log_tensorboard() -> None:
    assert loggers(TrainConfig()) == {"jsonl"}
    assert loggers(TrainConfig(run=RunConfig(tensorboard=True))) == {"jsonl", "tensorboard"}
    assert loggers(TrainConfig(run=RunConfig(log=("tensorboard",)))) == {"jsonl", "tensorboard"}
    assert loggers(TrainConfig(run=RunConfig(log=("wandb",), tensorboard=True) )) == {
        "jsonl", "tensorboard", "wandb"
    }  # fmt: skip
