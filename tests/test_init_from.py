"""--init-from and --tokenizer: a run starts from a saved model."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from _cli import SMALL, TINY, lowcomm
from lowcomm.data import END_OF_TEXT, DataConfig, DataError, prepare_corpus, resolve_end_of_text
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
    assert config["run"]["init_from"] == str(first)
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


def test_an_option_that_disagrees_with_the_model_is_refused_naming_both_values(
    tmp_path: Path,
) -> None:
    model = _saved(tmp_path / "model")
    line = _refusal(
        "--init-from", str(model), "--model.n-embd", "64", "--out", str(tmp_path / "run")
    )
    assert (
        f"--model.n-embd: 64 disagrees with the model --init-from {model / 'config.json'}" in line
    )
    assert "which has 32" in line


def test_weights_that_do_not_fit_their_config_name_the_tensor_and_both_shapes(
    tmp_path: Path,
) -> None:
    """Pre-flight compares the safetensors header's shapes with the model config.json
    describes (the weights themselves are not read)."""
    model = _saved(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    line = _refusal(
        "--init-from", str(model), "--model.n-embd", "64", "--out", str(tmp_path / "run")
    )
    vocab = _vocab()
    assert (
        f"tensor token_embedding.weight has shape ({vocab}, 32) in {model} but ({vocab}, 64) "
        f"in the model its config.json describes"
    ) in line


def test_another_family_is_refused(tmp_path: Path) -> None:
    model = _saved(tmp_path / "model")
    line = _refusal("--init-from", str(model), "--model.family", "hf-gpt2")
    assert "--model.family: 'hf-gpt2' disagrees with the model --init-from" in line
    assert "which has 'gpt'" in line


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


@pytest.mark.slow
def test_a_run_resumes_after_its_init_from_model_is_gone(tmp_path: Path) -> None:
    """The tokenizer an --init-from run took from the model is kept beside its checkpoints:
    deleting (or moving) the model does not strand the run."""
    model, out = _saved(tmp_path / "model"), tmp_path / "run"
    first = lowcomm("train", *TINY, "--steps", "4", "--init-from", str(model), "--out", str(out),
                    "--stop-after", "2")  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    copy = out / "checkpoints" / "tokenizer.json"
    assert copy.read_bytes() == (model / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["data"]["tokenizer"] == str(
        model / "tokenizer.json"
    )
    shutil.rmtree(model)

    # The first command again, with --resume auto: the model is gone, and the line says how
    # to continue.
    again = _refusal("--steps", "4", "--init-from", str(model), "--out", str(out),
                     "--resume", "auto")  # fmt: skip
    assert f"has a checkpoint: `lowcomm train --resume {out}` continues it" in again

    second = lowcomm("train", "--resume", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"is gone; resuming with the run's copy {copy}" in second.stderr
    assert [m["step"] for m in _metrics(out)] == [0, 1, 2, 3]
    assert json.loads((out / "config.json").read_text())["data"]["tokenizer"] == str(copy)


@pytest.mark.slow
def test_a_moved_run_directory_resumes_with_its_copied_tokenizer(tmp_path: Path) -> None:
    source = tmp_path / "tok" / "tokenizer.json"
    source.parent.mkdir()
    source.write_bytes(_tokenizer().read_bytes())
    out = tmp_path / "run"
    first = lowcomm("train", *TINY, "--steps", "4", "--tokenizer", str(source), "--out", str(out),
                    "--stop-after", "2")  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    moved = tmp_path / "elsewhere"
    out.rename(moved)
    source.unlink()

    # The same tokenizer read from another path is the same run: the fingerprint names it by
    # content. Another tokenizer is refused, naming data.tokenizer.
    other = _renamed_end(tmp_path / "other", "</s>")  # a tokenizer, not the same bytes
    refused = lowcomm("train", "--resume", str(moved), "--tokenizer", str(other))
    assert refused.returncode == 2
    assert "data.tokenizer='sha256:" in refused.stderr and "exact resume" in refused.stderr
    assert "is gone" not in refused.stderr  # --tokenizer was given: no copy taken

    second = lowcomm("train", "--resume", str(moved))
    assert second.returncode == 0, second.stderr[-3000:]
    assert [m["step"] for m in _metrics(moved)] == [0, 1, 2, 3]


def test_a_checkpoint_naming_its_tokenizer_by_path_still_resumes(tmp_path: Path) -> None:
    """Checkpoints written before the fingerprint named a tokenizer by content carry its path:
    that file's content is what they are compared by."""
    from lowcomm.config import TrainConfig
    from lowcomm.train.checkpoint import _by_content, fingerprint, tokenizer_identity

    source = tmp_path / "tokenizer.json"
    source.write_bytes(_tokenizer().read_bytes())
    config = TrainConfig()
    config.data.tokenizer = str(source)
    current = fingerprint(config)
    assert current["data"]["tokenizer"] == tokenizer_identity(str(source))
    assert current["data"]["tokenizer"].startswith("sha256:")

    legacy = {**current, "data": {**current["data"], "tokenizer": str(source)}}
    assert _by_content(legacy) == current
    source.unlink()
    assert _by_content(legacy)["data"]["tokenizer"] == str(source)  # gone: cannot match


def _renamed_end(directory: Path, end: str, eos: object = None) -> Path:
    """The bundled corpus's tokenizer with its <|endoftext|> renamed ``end`` (same ids), and,
    with ``eos``, a tokenizer_config.json declaring it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_text(_tokenizer().read_text().replace(END_OF_TEXT, end))
    if eos is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return path


def test_a_tokenizer_ending_documents_with_another_token_tokenizes_the_same(
    tmp_path: Path,
) -> None:
    """Llama-style </s> in place of <|endoftext|> (same id): the same token streams, with
    that token after every document, in a cache entry of its own."""
    llama = _renamed_end(tmp_path / "llama", "</s>")
    config = DataConfig(micro_batch_size=2, tokenizer=str(llama))
    assert resolve_end_of_text(config) == "</s>"
    renamed = prepare_corpus(config)
    original = prepare_corpus(DataConfig(micro_batch_size=2, tokenizer=str(_tokenizer())))
    assert renamed.end_of_text == "</s>" and original.end_of_text == END_OF_TEXT
    assert renamed.eot_id == original.eot_id
    assert renamed.cache_key != original.cache_key
    assert [t.tolist() for t in renamed.train_tokens] == [t.tolist() for t in original.train_tokens]
    ends = sum(int((t == renamed.eot_id).sum()) for t in [*renamed.train_tokens,
                                                           *renamed.val_tokens])  # fmt: skip
    assert ends == renamed.num_documents


def test_the_declared_eos_token_and_end_of_text_pick_the_document_end(tmp_path: Path) -> None:
    declared = _renamed_end(tmp_path / "chat", "<|im_end|>", eos={"content": "<|im_end|>"})
    assert resolve_end_of_text(DataConfig(tokenizer=str(declared))) == "<|im_end|>"

    bare = _renamed_end(tmp_path / "bare", "<|im_end|>")
    with pytest.raises(DataError, match="--end-of-text TOKEN") as refused:
        resolve_end_of_text(DataConfig(tokenizer=str(bare)))
    assert "</s>" in str(refused.value) and "<eos>" in str(refused.value)
    chosen = DataConfig(tokenizer=str(bare), end_of_text="<|im_end|>")
    assert resolve_end_of_text(chosen) == "<|im_end|>"

    with pytest.raises(DataError, match=r"--end-of-text: '</s>' is not a token of"):
        resolve_end_of_text(DataConfig(tokenizer=str(bare), end_of_text="</s>"))
    with pytest.raises(DataError, match="--end-of-text: ' '"):
        DataConfig(end_of_text=" ")


def test_a_tokenizer_without_an_end_of_document_token_is_refused(tmp_path: Path) -> None:
    bare = _renamed_end(tmp_path / "bare", "<|im_end|>")
    line = _refusal("--tokenizer", str(bare), "--out", str(tmp_path / "run"))
    assert "--tokenizer:" in line and "--end-of-text TOKEN" in line


def test_the_end_of_document_token_enters_the_fingerprint_only_when_not_the_default() -> None:
    from lowcomm.config import TrainConfig
    from lowcomm.train.checkpoint import fingerprint

    config = TrainConfig()
    assert "end_of_text" not in fingerprint(config)["data"]
    config.data.end_of_text = END_OF_TEXT
    assert "end_of_text" not in fingerprint(config)["data"]
    config.data.end_of_text = "</s>"
    assert fingerprint(config)["data"]["end_of_text"] == "</s>"


@pytest.mark.slow
def test_a_model_whose_tokenizer_ends_documents_with_eos_starts_and_resumes(
    tmp_path: Path,
) -> None:
    """--init-from a model with a Llama-style tokenizer: the choice is recorded in
    config.json, and the resume (from the run's copy, the model deleted) places the same."""
    model = tmp_path / "model"
    save_model(build_model(TINY_MODEL, _vocab()), model, _renamed_end(tmp_path / "tok", "</s>"))
    out = tmp_path / "run"
    first = lowcomm("train", *TINY, "--steps", "4", "--init-from", str(model), "--out", str(out),
                    "--stop-after", "2")  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["data"]["end_of_text"] == "</s>"
    shutil.rmtree(model)
    second = lowcomm("train", "--resume", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert [m["step"] for m in _metrics(out)] == [0, 1, 2, 3]
