"""lowcomm.fit: the whole run on your model, data and loss, on the loop of `lowcomm train`.

The built-in GPT through fit equals `lowcomm train` with the same settings; a tiny CNN on
generated images trains with ddp, diloco and desloc on 2 workers, counted in samples; a
stopped and resumed fit run equals the straight one; a dataset is dealt IID or by a key; an
object the worker processes cannot import is named before any worker starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import lowcomm
from _cli import TINY
from _cli import lowcomm as lowcomm_cli
from lowcomm.config import (
    CommConfig,
    ConfigError,
    PlacementConfig,
    RunConfig,
    TrainConfig,
    with_options,
)
from lowcomm.data import DataConfig
from lowcomm.data.config import DataError
from lowcomm.fitting import unimportable
from lowcomm.models import ModelConfig
from lowcomm.optim.adamw import AdamWConfig
from lowcomm.train.user_task import BatchStreamShard, DatasetTask

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from tiny_cnn import Bars, TinyCNN, cross_entropy, label  # noqa: E402

STEPS = 6
STOP = 3


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train_loss"] for line in lines]


def _summary(run_dir: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary


def test_fit_with_the_builtin_gpt_equals_lowcomm_train(tmp_path: Path) -> None:
    cli = lowcomm_cli(
        "train", *TINY, "--steps", "4", "--method", "diloco", "--diloco.sync-every", "2",
        "--out", str(tmp_path / "cli"),
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    config = TrainConfig(
        model=ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=16),
        data=DataConfig(micro_batch_size=2),
        run=RunConfig(eval_every=100, eval_batches=2, progress=False, plot=False),
        comm=CommConfig(seconds_per_microbatch=0.01),
    )
    result = lowcomm.fit(
        method="diloco", options=lowcomm.DiLoCoOptions(sync_every=2), workers=2, steps=4,
        out=tmp_path / "fit", config=config,
    )  # fmt: skip
    assert result.summary is not None and result.run_dir == (tmp_path / "fit").resolve()
    assert _losses(tmp_path / "fit") == pytest.approx(_losses(tmp_path / "cli"), abs=1e-6)
    assert result.summary["final_val_loss"] == pytest.approx(
        _summary(tmp_path / "cli")["final_val_loss"], abs=1e-6
    )
    assert "unit" not in result.summary and result.summary["tokens"] > 0


def _cnn_config(**overrides: Any) -> TrainConfig:
    config = TrainConfig(
        optim=AdamWConfig(lr=1e-2),
        data=DataConfig(micro_batch_size=8),
        run=RunConfig(eval_every=100, eval_batches=2, progress=False, plot=False, log_every=1),
        comm=CommConfig(seconds_per_microbatch=0.01),
    )
    return with_options(config, **overrides)


def _fit_cnn(out: Path, method: str, **arguments: Any) -> lowcomm.FitResult:
    options = {
        "diloco": lowcomm.DiLoCoOptions(sync_every=2),
        "desloc": lowcomm.DeslocOptions(param_period=2),
    }.get(method)
    config = arguments.pop("config", None) or _cnn_config()
    return lowcomm.fit(
        TinyCNN, Bars(256), Bars(64, seed=1), loss_fn=cross_entropy, method=method,
        options=options, workers=2, steps=STEPS, out=out, config=config, **arguments,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cnn_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cnn")
    for method in ("ddp", "diloco", "desloc"):
        _fit_cnn(root / method, method)
    return {method: root / method for method in ("ddp", "diloco", "desloc")}


@pytest.mark.parametrize("method", ["ddp", "diloco", "desloc"])
def test_a_user_cnn_trains_with_the_method_counted_in_samples(
    cnn_runs: dict[str, Path], method: str
) -> None:
    summary = _summary(cnn_runs[method])
    losses = _losses(cnn_runs[method])
    assert summary["method"] == method and summary["steps"] == STEPS
    assert summary["unit"] == "samples" and "tokens" not in summary
    assert summary["samples"] == STEPS * 2 * 8  # steps x workers x micro-batch
    assert summary["task"]["model"] == "tiny_cnn.TinyCNN"
    assert all(torch.isfinite(torch.tensor(losses)))
    assert min(losses[-2:]) < losses[0]  # it learns (bars are easy)
    assert summary["final_val_loss"] < 0.75  # below chance (ln 2 = 0.69 is chance; margin)
    assert (cnn_runs[method] / "model" / "state_dict.pt").is_file()


def test_a_stopped_and_resumed_fit_run_equals_the_straight_one(
    cnn_runs: dict[str, Path], tmp_path: Path
) -> None:
    stopped = _fit_cnn(tmp_path / "run", "diloco", config=_cnn_config(stop_after=STOP))
    assert stopped.summary is None
    resumed = _fit_cnn(tmp_path / "run", "diloco", resume=True)
    assert resumed.summary is not None
    assert _losses(tmp_path / "run") == _losses(cnn_runs["diloco"])
    assert resumed.summary["final_val_loss"] == _summary(cnn_runs["diloco"])["final_val_loss"]


def test_rerunning_into_a_run_directory_is_refused(cnn_runs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="already holds a run") as refused:
        _fit_cnn(cnn_runs["ddp"], "ddp")
    assert "pass overwrite=True" in str(refused.value) and "out=NEW_DIR" in str(refused.value)


def test_an_object_defined_in_a_notebook_is_named_before_any_worker_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    class Net(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(2, 2)

    Net.__module__ = "__main__"  # as a class defined in a notebook cell is
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    task = DatasetTask(Net, [(torch.zeros(2), 0)] * 8)
    problem = unimportable(task)
    assert problem is not None and "Net" in problem and "\n" not in problem
    assert "move it into a module" in problem
    with pytest.raises(ConfigError, match="Net is defined in __main__"):
        lowcomm.fit(Net, [(torch.zeros(2), 0)] * 8, workers=1, steps=1, out=tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_lambda_loss_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be sent to the worker processes") as error:
        lowcomm.fit(
            TinyCNN, Bars(64), loss_fn=lambda model, batch: model(batch[0]).sum(), workers=1,
            steps=1, out=tmp_path / "x",
        )  # fmt: skip
    assert "\n" not in str(error.value)


def test_a_dataset_run_refuses_a_token_budget(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token_budget: 100 counts tokens"):
        lowcomm.fit(
            TinyCNN, Bars(64), loss_fn=cross_entropy, workers=1, steps=1,
            out=tmp_path / "x", config=TrainConfig(run=RunConfig(token_budget=100)),
        )  # fmt: skip


def _labels(task: DatasetTask, config: TrainConfig, rank: int, batches: int) -> list[int]:
    shard = task.data(config, rank).shard
    return [int(y) for _ in range(batches) for y in shard.next_batch()[1]]


def test_a_dataset_is_dealt_iid_or_by_a_key_and_resumes_at_its_position() -> None:
    data = Bars(64)
    config = TrainConfig(
        data=DataConfig(micro_batch_size=4, split="non-iid"), placement=PlacementConfig(workers=2)
    )
    by_label = DatasetTask(TinyCNN, data, split_key=label)
    firsts = [_labels(by_label, config, rank, 3) for rank in range(2)]
    # Bars(64) holds 24 zeros and 40 ones: worker 1's block (the last 32) is all ones.
    assert set(firsts[1]) == {1} and firsts[0].count(0) > firsts[0].count(1)
    iid = DatasetTask(TinyCNN, data)
    config.data.split = "iid"
    shard = iid.data(config, 0).shard
    shard.next_batch()
    state = shard.state_dict()
    expected = shard.next_batch()
    again = iid.data(config, 0).shard
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.next_batch(), expected, strict=True))
    other = iid.data(config, 1).shard
    other.load_state_dict(other.state_dict())
    mine = {int(i) for i in iid._shard(config, 0, 0).shard.next_indices()}
    theirs = {int(i) for i in iid._shard(config, 1, 0).shard.next_indices()}
    assert not mine & theirs  # disjoint shards


def test_the_example_notebook_executes(tmp_path: Path) -> None:
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    for name in ("fit_notebook.ipynb", "tiny_cnn.py"):
        (tmp_path / name).write_text((EXAMPLES / name).read_text())
    notebook = nbformat.read(tmp_path / "fit_notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )  # fmt: skip
    client.execute()
    printed = [
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    ]
    assert any("64 samples, final validation loss" in text for text in printed)
    assert any("CellCNN is defined in __main__" in text for text in printed)
    assert any("run directory" in text for text in printed)  # the workers ran in the kernel
    assert (tmp_path / "runs" / "notebook" / "summary.json").is_file()
    assert not (tmp_path / "runs" / "cell").exists()


def test_a_stream_of_batches_is_dealt_in_turn_and_resumes_by_replay() -> None:
    batches = [torch.full((2,), float(index)) for index in range(7)]  # 3 per worker per pass
    first, second = BatchStreamShard(batches, 0, 2), BatchStreamShard(batches, 1, 2)
    assert [int(first.next_batch()[0]) for _ in range(5)] == [0, 2, 4, 0, 2]
    assert [int(second.next_batch()[0]) for _ in range(4)] == [1, 3, 5, 1]
    again = BatchStreamShard(batches, 1, 2)
    again.load_state_dict(second.state_dict())
    assert int(again.next_batch()[0]) == int(second.next_batch()[0]) == 3
    with pytest.raises(ValueError, match="cannot be re-dealt to 3"):
        BatchStreamShard(batches, 0, 3).load_state_dict(second.state_dict())
    with pytest.raises(DataError, match="fewer than 8"):
        BatchStreamShard(batches, 0, 8).next_batch()


def test_a_user_model_trains_on_a_dataloader(tmp_path: Path) -> None:
    loader = DataLoader(Bars(128), batch_size=8)  # (not shuffled: every worker sees one stream)
    result = lowcomm.fit(
        TinyCNN, loader, DataLoader(Bars(32, seed=1), batch_size=8), loss_fn=cross_entropy,
        method="ddp", workers=2, steps=4, out=tmp_path / "run", config=_cnn_config(),
    )  # fmt: skip
    assert result.summary is not None and result.summary["samples"] == 4 * 2 * 8
    assert result.summary["task"]["data"] == "batches from a DataLoader"
    with pytest.raises(ConfigError, match="is an iterator"):
        lowcomm.fit(
            TinyCNN, iter(loader), loss_fn=cross_entropy, workers=2, steps=1,
            out=tmp_path / "x", config=_cnn_config(),
        )  # fmt: skip


def test_a_hugging_face_dataset_is_a_map_style_dataset() -> None:
    datasets = pytest.importorskip("datasets")
    rows = {"x": [[float(i), 1.0] for i in range(16)], "label": [i % 2 for i in range(16)]}
    data = datasets.Dataset.from_dict(rows).with_format("torch")
    task = DatasetTask(TinyCNN, data, split_key=lambda row: row["label"])
    config = TrainConfig(
        data=DataConfig(micro_batch_size=4, split="non-iid"), placement=PlacementConfig(workers=2)
    )
    batch = task.data(config, 1).shard.next_batch()
    assert batch["x"].shape == (4, 2) and set(batch["label"].tolist()) == {1}
    assert task.count(batch) == (4, 4)
