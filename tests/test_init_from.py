"""--init-from and --tokenizer: a run starts from a saved model (issue 16, item 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from _cli import SMALL, TINY, lowcomm
from lowcomm.data import DataConfig, prepare_corpus
from lowcomm.models import ModelConfig, build_model
from lowcomm.models.export import save_model

#: The model TINY trains.
TINY_MODEL = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)


def _tokenizer() -> Path:
    return prepare_corpus(DataConfig(micro_batch_size=2)).tokenizer_path


def _vocab() -> int:
    return prepare_corpus(DataConfig(micro_batch_size=2)).vocab_size


def _saved(directory: Path, family: str = "gpt", vocab: int | None = None) -> Path:
    """A randomly initialised TINY-shaped model saved with the bundled corpus's tokenizer."""
    config = ModelConfig(family=family, n_layer=1, n_head=2, n_embd=32, block_size=16)
    save_model(build_model(config, vocab or _vocab()), directory, _tokenizer())
    return directory


def _refusal(*args: str) -> str:
    """The one line a refused `lowcomm train` prints (exit 2, no worker started)."""
    result = lowcomm("train", *TINY, "--steps", "2", *args)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowcomm: error: "), result.stderr[-3000:]
    assert "starting" not in result.stdout and "workers connected" not in result.stdout
    return lines[0]


def _metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_from_a_finished_run_starts_at_its_final_loss(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    done = lowcomm("train", *SMALL, "--steps", "40", "--optim.lr", "3e-3", "--out", str(first))
    assert done.returncode == 0, done.stderr[-3000:]
    final = json.loads((first / "summary.json").read_text())["final_val_loss"]
    random_init = _metrics(first)[0]["train_loss"]  # step 0's loss: at the random initial weights
    assert random_init - final > 1.0  # the first run learned something to start from

    warm = lowcomm(
        "train", *SMALL, "--steps", "1", "--seed", "1", "--init-from", str(first),
        "--out", str(second),
    )  # fmt: skip
    assert warm.returncode == 0, warm.stderr[-3000:]
    start = _metrics(second)[0]["train_loss"]  # step 0's loss: at the loaded weights
    # Train batches, not the validation ones: within noise of the final validation loss.
    assert abs(start - final) < 0.3 * (random_init - final), (start, final, random_init)
    # One step at the warm-up's first, small rate barely moves it.
    after_one = json.loads((second / "summary.json").read_text())["final_val_loss"]
    assert after_one == pytest.approx(final, abs=0.05)
    config = json.loads((second / "config.json").read_text())
    assert config["init_from"] == str(first)
    assert config["data"]["tokenizer"] == str(first / "model" / "tokenizer.json")


@pytest.mark.slow
def test_a_local_hf_directory_starts_a_run(tmp_path: Path) -> None:
    model = _saved(tmp_path / "hf", family="hf-gpt2")
    done = lowcomm(
        "train", *TINY, "--steps", "1", "--model.family", "hf-gpt2", "--init-from", str(model),
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert math.isfinite(summary["final_val_loss"])


def test_a_hub_name_is_refused(tmp_path: Path) -> None:
    line = _refusal("--init-from", "gpt2-no-such-dir", "--out", str(tmp_path / "run"))
    assert "--init-from: 'gpt2-no-such-dir' is not a local path" in line
    assert "downloads nothing" in line


def test_a_path_without_weights_is_refused(tmp_path: Path) -> None:
    line = _refusal("--init-from", str(tmp_path), "--out", str(tmp_path / "run"))
    assert f"--init-from: {tmp_path} holds no weights" in line


def test_a_shape_mismatch_names_the_first_tensor_and_both_shapes(tmp_path: Path) -> None:
    model = _saved(tmp_path / "model")
    line = _refusal(
        "--init-from", str(model), "--model.n-embd", "64", "--out", str(tmp_path / "run")
    )
    vocab = _vocab()
    assert (
        f"tensor token_embedding.weight has shape ({vocab}, 32) in {model} but ({vocab}, 64) "
        f"in the configured model"
    ) in line


def test_another_family_is_refused(tmp_path: Path) -> None:
    model = _saved(tmp_path / "model")
    line = _refusal("--init-from", str(model), "--model.family", "hf-gpt2")
    assert "holds a gpt model but --model.family is hf-gpt2" in line


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path: Path) -> None:
    model = _saved(tmp_path / "model", vocab=300)  # the bundled tokenizer has more tokens
    line = _refusal("--init-from", str(model), "--out", str(tmp_path / "run"))
    assert f"--tokenizer: {model / 'tokenizer.json'} has {_vocab()} tokens" in line
    assert "has 300 rows" in line


def test_a_missing_tokenizer_is_refused(tmp_path: Path) -> None:
    line = _refusal("--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path / "run"))
    assert "--tokenizer:" in line and "is not a file" in line


def test_init_from_with_resume_is_refused(tmp_path: Path) -> None:
    model = _saved(tmp_path / "model")
    line = _refusal("--init-from", str(model), "--resume", str(tmp_path))
    assert "--init-from:" in line and "with --resume" in line


def test_a_given_tokenizer_replaces_the_trained_bpe(tmp_path: Path) -> None:
    source = tmp_path / "tokenizer.json"
    source.write_bytes(_tokenizer().read_bytes())
    corpus = prepare_corpus(DataConfig(micro_batch_size=2, tokenizer=str(source)))
    trained = prepare_corpus(DataConfig(micro_batch_size=2))
    assert corpus.tokenizer_path != trained.tokenizer_path  # its own cache entry
    assert corpus.tokenizer_path.read_bytes() == source.read_bytes()
    assert [t.tolist() for t in corpus.train_tokens] == [t.tolist() for t in trained.train_tokens]
