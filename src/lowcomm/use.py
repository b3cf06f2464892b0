"""``lowcomm eval`` and ``lowcomm generate``: use a model a run saved (``OUT/model/``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch
import tyro

from lowcomm.models.export import load_model, load_tokenizer, model_directory

if TYPE_CHECKING:
    from lowcomm.config import TrainConfig


@dataclass(kw_only=True)
class EvalConfig:
    """Validation loss and perplexity of a saved model."""

    path: Annotated[str, tyro.conf.Positional]
    """A finished run's directory (OUT) or a model directory (OUT/model)."""

    data: str | None = None
    """A text file to evaluate on, tokenized with the model's tokenizer (default: the run's
    validation split, the batches its final validation used)."""

    batches: int | None = None
    """Batches to evaluate (default: the run's --eval-batches; with --data, every window)."""


@dataclass(kw_only=True)
class GenerateConfig:
    """Sample text from a saved model."""

    path: Annotated[str, tyro.conf.Positional]
    """A finished run's directory (OUT) or a model directory (OUT/model)."""

    prompt: str
    """The text to continue."""

    max_new_tokens: int = 64
    """Tokens to sample."""

    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""

    seed: int = 0
    """Random seed of the sampling."""


def _run_config(directory: Path) -> TrainConfig | None:
    """The TrainConfig of the run that saved the model in ``directory`` (None if unknown)."""
    from lowcomm.config import TrainConfig

    candidate = directory.parent / "config.json"
    if not candidate.is_file():
        return None
    return TrainConfig.from_dict(json.loads(candidate.read_text()))


def _batches(config: EvalConfig, directory: Path, block_size: int) -> list[tuple[Any, Any]]:
    """The (inputs, targets) batches to evaluate on."""
    if config.data is not None:
        tokenizer = load_tokenizer(directory)
        if tokenizer is None:
            raise ValueError(f"--data: {directory} has no tokenizer.json to tokenize it with")
        data = Path(config.data)
        if not data.is_file():
            raise ValueError(f"--data: {config.data!r} is not a file; pass a text file")
        ids = torch.tensor(tokenizer.encode(data.read_text()).ids, dtype=torch.long)
        windows = ids[: (len(ids) - 1) // block_size * block_size + 1]
        count = (len(windows) - 1) // block_size
        if count < 1:
            raise ValueError(f"--data: {config.data!r} has fewer than {block_size + 1} tokens")
        inputs = windows[:-1].reshape(count, block_size)
        targets = windows[1:].reshape(count, block_size)
        pairs = [(inputs[i : i + 8], targets[i : i + 8]) for i in range(0, count, 8)]
        return pairs[: config.batches] if config.batches is not None else pairs
    run = _run_config(directory)
    if run is None:
        raise ValueError(f"{directory}: no run config.json beside it; pass --data FILE")
    from lowcomm.data import prepare_corpus, validation_batches

    corpus = prepare_corpus(run.data)
    return validation_batches(
        corpus, seq_len=run.model.block_size,
        batch_size=run.data.micro_batch_size * run.placement.ranks_per_worker,
        num_batches=config.batches if config.batches is not None else run.run.eval_batches,
    )  # fmt: skip


def evaluate(config: EvalConfig) -> dict[str, float]:
    """The mean loss over the batches (the mean of per-batch means, as training's validation
    computes it) and its perplexity."""
    directory = model_directory(Path(config.path))
    model = load_model(directory)
    block_size = _block_size(model)
    losses = []
    with torch.no_grad():
        for inputs, targets in _batches(config, directory, block_size):
            _, loss = model(inputs, targets)
            assert loss is not None
            losses.append(float(loss.double()))
    mean = sum(losses) / len(losses)
    return {"val_loss": mean, "perplexity": math.exp(mean), "batches": float(len(losses))}


def _block_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None) or getattr(model, "hf_config", None)
    for name in ("block_size", "n_positions", "max_position_embeddings"):
        if config is not None and hasattr(config, name):
            return int(getattr(config, name))
    raise ValueError("the saved model's config names no context length")


def generate(config: GenerateConfig) -> str:
    """The prompt followed by ``max_new_tokens`` sampled tokens, decoded."""
    if config.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens: {config.max_new_tokens} is negative; pass >= 0")
    if config.temperature < 0:
        raise ValueError(f"--temperature: {config.temperature} is negative; pass >= 0")
    directory = model_directory(Path(config.path))
    tokenizer = load_tokenizer(directory)
    if tokenizer is None:
        raise ValueError(f"{directory}: no tokenizer.json; cannot encode the prompt")
    model = load_model(directory)
    block_size = _block_size(model)
    ids = list(tokenizer.encode(config.prompt).ids)
    generator = torch.Generator().manual_seed(config.seed)
    with torch.no_grad():
        for _ in range(config.max_new_tokens):
            context = torch.tensor([ids[-block_size:] or [0]], dtype=torch.long)
            logits, _ = model(context)
            last = logits[0, -1].float()
            if config.temperature == 0:
                token = int(last.argmax())
            else:
                probabilities = torch.softmax(last / config.temperature, dim=-1)
                token = int(torch.multinomial(probabilities, 1, generator=generator))
            ids.append(token)
    return str(tokenizer.decode(ids))


def run_eval(config: EvalConfig) -> None:
    result = evaluate(config)
    print(
        f"val_loss {result['val_loss']:.6f}  perplexity {result['perplexity']:.3f}  "
        f"batches {int(result['batches'])}"
    )


def run_generate(config: GenerateConfig) -> None:
    print(generate(config))
