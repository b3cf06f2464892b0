"""Pre-flight of ``--init-from`` and ``--tokenizer``: read once, before any worker starts."""

from __future__ import annotations

from pathlib import Path

from lowcomm.config import ConfigError, TrainConfig


def check_init_from(config: TrainConfig) -> None:
    """Check the model ``--init-from`` names and the tokenizer the run will use; with
    ``--init-from`` and no ``--tokenizer``, make the model's own ``tokenizer.json`` the run's
    tokenizer, and settle the token placed after every document (both recorded in
    config.json).

    Raises:
        ConfigError: The first problem, in one line naming the option and the fix.
    """
    from lowcomm.models.init_from import (
        InitFromError,
        initial_model,
        read_initial_weights,
        tokenizer_vocab_size,
    )

    tokenizer = config.data.tokenizer
    if tokenizer is not None and not Path(tokenizer).expanduser().is_file():
        raise ConfigError(
            f"--tokenizer: {tokenizer!r} is not a file; pass a tokenizer.json (e.g. a saved "
            f"model's), or omit --tokenizer to train a BPE on the data"
        )
    try:
        if tokenizer is not None:
            tokenizer_vocab_size(tokenizer)
        if config.init_from is not None:
            weights = read_initial_weights(config.init_from)
            initial_model(config.model, weights)  # the shapes fit
            if tokenizer is None and weights.tokenizer is not None:
                tokenizer = config.data.tokenizer = str(weights.tokenizer)
            if tokenizer is not None:
                tokens = tokenizer_vocab_size(tokenizer)
                if tokens > weights.vocab_size:
                    raise ConfigError(
                        f"--tokenizer: {tokenizer} has {tokens} tokens but the model's "
                        f"embedding in {weights.directory} has {weights.vocab_size} rows (larger "
                        f"ids would index past it); pass the tokenizer the model was trained with"
                    )
    except InitFromError as error:
        raise ConfigError(f"{error}{_resume_hint(config)}") from None
    _settle_end_of_text(config)


def _resume_hint(config: TrainConfig) -> str:
    """With --resume auto and a checkpoint in the run directory, how to continue without the
    --init-from model (the checkpoint holds the weights)."""
    from lowcomm.train.checkpoint import has_checkpoint
    from lowcomm.train.rundir import run_directory

    if config.resume != "auto" or not has_checkpoint(run_directory(config)):
        return ""
    return (
        f" (the run in {run_directory(config)} has a checkpoint: `lowcomm train --resume "
        f"{run_directory(config)}` continues it without --init-from)"
    )


def _settle_end_of_text(config: TrainConfig) -> None:
    """Record a given tokenizer's end-of-document token when it is not <|endoftext|> (so a
    resume, reading the run's copy of the tokenizer alone, places the same one)."""
    from lowcomm.data import END_OF_TEXT, DataError, resolve_end_of_text

    if config.data.tokenizer is None:
        return
    try:
        end_of_text = resolve_end_of_text(config.data)
    except DataError as error:
        raise ConfigError(str(error)) from None
    if end_of_text != END_OF_TEXT:
        config.data.end_of_text = end_of_text
