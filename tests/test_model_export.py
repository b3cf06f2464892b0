"""OUT/model/: a finished run's deployed model, saved and loaded back."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _cli import TINY, lowcomm
from lowcomm.comm.torch_comm import TorchComm
from lowcomm.config import CommConfig, PlacementConfig, RunConfig, TrainConfig
from lowcomm.data import DataConfig, prepare_corpus
from lowcomm.launch import spawn_workers
from lowcomm.models import ModelConfig, build_model
from lowcomm.models.export import NoModelError, load_model, save_model
from lowcomm.strategies.diloco import DiLoCoOptions


def _tokenizer() -> Path:
    return prepare_corpus(DataConfig(micro_batch_size=2)).tokenizer_path


def _logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits, _ = model(idx)
    return logits


@pytest.mark.parametrize("family", ["gpt", "hf-gpt2"])
def test_save_then_load_gives_identical_logits(tmp_path: Path, family: str) -> None:
    torch.manual_seed(0)
    config = ModelConfig(family=family, n_layer=1, n_head=2, n_embd=32, block_size=16)
    model = build_model(config, vocab_size=300)
    save_model(model, tmp_path / "model", _tokenizer())
    loaded = load_model(tmp_path)  # a run directory: its model/ is read
    idx = torch.randint(0, 300, (2, 16))
    assert torch.equal(_logits(model, idx), _logits(loaded, idx))
    assert (tmp_path / "model" / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries


def test_hf_export_loads_with_transformers_alone(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = ModelConfig(family="hf-gpt2", n_layer=1, n_head=2, n_embd=32, block_size=16)
    model = build_model(config, vocab_size=300)
    save_model(model, tmp_path / "model", _tokenizer(), "<|endoftext|>")
    idx = torch.randint(0, 300, (2, 16))
    torch.save(idx, tmp_path / "idx.pt")
    _, loss = model.eval()(idx[:, :-1], idx[:, 1:])
    script = (
        "import sys, torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1] + '/model')\n"
        "t = transformers.PreTrainedTokenizerFast.from_pretrained(sys.argv[1] + '/model')\n"
        "assert len(t('hello world').input_ids) > 0\n"
        "assert t.eos_token == '<|endoftext|>' and t.eos_token_id is not None, t.eos_token\n"
        "idx = torch.load(sys.argv[1] + '/idx.pt')\n"
        "with torch.no_grad(): print(float(m(input_ids=idx, labels=idx).loss))\n"
        "assert 'lowcomm' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert loss is not None
    assert float(result.stdout.strip()) == pytest.approx(float(loss), rel=1e-5)


def test_a_path_without_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NoModelError, match="no saved model"):
        load_model(tmp_path)


def test_a_failed_write_leaves_the_old_model(tmp_path: Path) -> None:
    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16), 300)
    save_model(model, tmp_path / "model", None)
    with pytest.raises(TypeError):
        save_model(torch.nn.Linear(2, 2), tmp_path / "model", None)
    assert isinstance(load_model(tmp_path), type(model))
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def _diloco_runs(base: str) -> dict[str, dict[str, torch.Tensor]]:
    return {family: _diloco_run(str(Path(base) / family), family) for family in FAMILIES}


FAMILIES = ("gpt", "hf-gpt2")


def _diloco_run(out: str, family: str) -> dict[str, torch.Tensor]:
    from lowcomm.train.loop import train_worker

    config = TrainConfig(
        method="diloco",
        model=ModelConfig(family=family, n_layer=1, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
        diloco=DiLoCoOptions(sync_every=4),
        placement=PlacementConfig(workers=2),
        run=RunConfig(steps=6, eval_every=100, eval_batches=2, progress=False, plot=False, out=out),
        comm=CommConfig(network="wan", clock="virtual", seconds_per_microbatch=0.01),
    )
    summary = train_worker(config, TorchComm(), keep_parameters=True)
    assert summary.parameters is not None and summary.deployed_parameters is not None
    return {"local": summary.parameters, "deployed": summary.deployed_parameters}


@pytest.fixture(scope="module")
def diloco_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    _tokenizer()
    base = tmp_path_factory.mktemp("diloco")
    return base, spawn_workers(_diloco_runs, 2, (str(base),), timeout_s=180)[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_diloco_saves_the_global_parameters(
    diloco_results: tuple[Path, dict[str, dict[str, torch.Tensor]]], family: str
) -> None:
    base, results = diloco_results
    saved = load_model(base / family)
    flat = torch.cat([p.detach().reshape(-1) for p in saved.parameters()])
    assert torch.equal(flat, results[family]["deployed"])
    assert not torch.equal(flat, results[family]["local"])  # 6 steps, sync every 4: differ
    assert json.loads((base / family / "summary.json").read_text())["method"] == "diloco"


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowcomm: error: "), result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_finished_run_is_extended(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = lowcomm("train", *TINY, "--steps", "3", "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "step-000003" / "manifest.json").is_file()  # the last step's
    three = torch.cat([p.detach().reshape(-1) for p in load_model(out).parameters()])

    fewer = lowcomm("train", "--resume", str(out), "--steps", "2")
    assert "--steps: 2 is below the 3 steps" in _one_line_error(fewer)

    extended = lowcomm("train", "--resume", str(out), "--steps", "6")
    assert extended.returncode == 0, extended.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["extended_at_steps"] == [3]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(6))
    six = torch.cat([p.detach().reshape(-1) for p in load_model(out).parameters()])
    assert not torch.equal(three, six)
    assert (out / "checkpoints" / "step-000006" / "manifest.json").is_file()


def _eval_loss(result: subprocess.CompletedProcess[str]) -> float:
    assert result.returncode == 0, result.stderr[-3000:]
    return float(result.stdout.split()[1])


@pytest.mark.slow
def test_eval_and_generate_use_a_saved_model(tmp_path: Path) -> None:
    gpt, hf = tmp_path / "gpt", tmp_path / "hf"
    for out, family in ((gpt, "gpt"), (hf, "hf-gpt2")):
        done = lowcomm("train", *TINY, "--steps", "2", "--model.family", family, "--out", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
    # The run's validation split: the same loss the final validation reported.
    summary = json.loads((gpt / "summary.json").read_text())
    assert _eval_loss(lowcomm("eval", str(gpt))) == pytest.approx(summary["final_val_loss"])

    # The HF export, loaded with transformers alone, gives the loss lowcomm eval reports.
    from lowcomm.config import TrainConfig
    from lowcomm.data import validation_batches

    run = TrainConfig.from_dict(json.loads((hf / "config.json").read_text()))
    batches = validation_batches(prepare_corpus(run.data), 16, 2, run.run.eval_batches)
    torch.save(batches, tmp_path / "batches.pt")
    script = (
        "import sys, torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "losses = []\n"
        "for x, y in torch.load(sys.argv[2]):\n"
        "    with torch.no_grad(): logits = m(input_ids=x).logits\n"
        "    losses.append(float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), "
        "y.flatten())))\n"
        "print(sum(losses) / len(losses))\n"
        "assert 'lowcomm' not in sys.modules\n"
    )
    alone = subprocess.run(
        [sys.executable, "-c", script, str(hf / "model"), str(tmp_path / "batches.pt")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lowcomm_loss = _eval_loss(lowcomm("eval", str(hf / "model")))
    assert float(alone.stdout) == pytest.approx(lowcomm_loss, rel=1e-5)
    assert lowcomm_loss == pytest.approx(
        json.loads((hf / "summary.json").read_text())["final_val_loss"]
    )

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert math.isfinite(_eval_loss(lowcomm("eval", str(gpt), "--data", str(text))))

    args = ("generate", str(gpt), "--prompt", "The", "--max-new-tokens", "8", "--seed", "1")
    first, again = lowcomm(*args), lowcomm(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.startswith("The") and first.stdout == again.stdout


def test_eval_of_a_path_without_weights_is_one_line(tmp_path: Path) -> None:
    for command in (("eval", str(tmp_path)), ("generate", str(tmp_path), "--prompt", "a")):
        assert "no saved model here" in _one_line_error(lowcomm(*command))


def _flat(run: Path) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in load_model(run).parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ddp", "diloco"])
def test_extending_n_to_2n_equals_training_the_saved_state_n_more_steps(
    tmp_path: Path, method: str
) -> None:
    """The rule an extension follows: steps N..2N-1 take the schedule of a 2N-step run. With a
    constant rate after a warm-up inside the first N steps, that schedule is the same for
    either total on steps 0..N-1, so a finished N-step run extended to 2N must equal, parameter
    for parameter, one 2N-step run: the saved state at N trained N more steps under the same
    rule (optimizer moments, outer momentum, data order and random state included)."""
    flags = (
        *TINY,
        "--method",
        method,
        "--schedule.kind",
        "constant",
        "--schedule.warmup-steps",
        "2",
    )
    if method == "diloco":
        flags = (*flags, "--diloco.sync-every", "2")
    extended, straight = tmp_path / "extended", tmp_path / "straight"
    first = lowcomm("train", *flags, "--steps", "3", "--out", str(extended))
    assert first.returncode == 0, first.stderr[-3000:]
    more = lowcomm("train", "--resume", str(extended), "--steps", "6")
    assert more.returncode == 0, more.stderr[-3000:]
    whole = lowcomm("train", *flags, "--steps", "6", "--out", str(straight))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert torch.equal(_flat(extended), _flat(straight))
    losses = [
        [
            json.loads(line)["train_loss"]
            for line in (run / "metrics.jsonl").read_text().splitlines()
        ]
        for run in (extended, straight)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 6


@pytest.mark.slow
def test_an_extension_follows_the_schedule_of_the_new_total(tmp_path: Path) -> None:
    from lowcomm.optim.schedule import ScheduleConfig, learning_rate

    out = tmp_path / "run"
    first = lowcomm(
        "train", *TINY, "--steps", "4", "--schedule.warmup-steps", "2", "--out", str(out)
    )
    assert first.returncode == 0, first.stderr[-3000:]
    more = lowcomm("train", "--resume", str(out), "--steps", "8")
    assert more.returncode == 0, more.stderr[-3000:]
    rates = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    peak = TrainConfig().optim.lr
    schedule = ScheduleConfig(warmup_steps=2)
    assert rates[:4] == pytest.approx([learning_rate(schedule, peak, s, 4) for s in range(4)])
    assert rates[4:] == pytest.approx([learning_rate(schedule, peak, s, 8) for s in range(4, 8)])
