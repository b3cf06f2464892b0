"""Pre-flight of ``--init-from``, ``--model.config`` and ``--tokenizer``: read once, before any
worker starts (config files and weight headers only, never the weights)."""

from __future__ import annotations

from pathlib import Path

from lowcomm.config import ConfigError, TrainConfig


def check_init_from(config: TrainConfig) -> None:
    """Check the model ``--init-from`` names (or ``--model.config``) and the tokenizer the run
    will use. With ``--init-from``: the model's own ``tokenizer.json`` becomes the run's
    tokenizer unless ``--tokenizer`` is given (a model without one needs ``--tokenizer``), and
    ``--model.config`` and ``--model.family`` are set to the model's config.json and family,
    so that config.json records the architecture (a resume rebuilds it from there). Then the
    token placed after every document is settled (recorded in config.json).

    Raises:
        ConfigError: The first problem, in one line naming the option and the fix.
    """
    from lowcomm.models.init_from import (
        InitFromError,
        architecture_from_file,
        preflight_init_from,
        sharded_refusal,
        tokenizer_vocab_size,
    )

    _check_files(config)
    tokenizer = config.data.tokenizer
    try:
        if tokenizer is not None:
            tokenizer_vocab_size(tokenizer)
        if config.run.init_from is not None:
            initial = preflight_init_from(config.run.init_from, config.model)
            if tokenizer is None:
                if initial.tokenizer is None:
                    raise ConfigError(
                        f"--init-from: {initial.directory} has no tokenizer.json; pass "
                        f"--tokenizer FILE (the tokenizer the model was trained with: a BPE "
                        f"trained on the data would not match its embedding)"
                    )
                tokenizer = config.data.tokenizer = str(initial.tokenizer)
            architecture = initial.architecture
            if config.placement.worker_sharding == "fsdp" and (refusal := sharded_refusal(initial)):
                raise ConfigError(refusal)
            config.model.config = str(architecture.source)
            config.model.family = architecture.family
        elif config.model.config is not None:
            architecture = architecture_from_file(
                Path(config.model.config).expanduser(), config.model, "--model.config"
            )
        else:
            architecture = None
        if architecture is not None and tokenizer is not None:
            architecture.check_vocabulary(tokenizer_vocab_size(tokenizer), tokenizer)
        elif architecture is not None and config.data.vocab_size > architecture.vocab_size:
            raise ConfigError(
                f"--vocab-size: the BPE trained on the data may get {config.data.vocab_size} "
                f"tokens but the model's embedding in {architecture.source} has "
                f"{architecture.vocab_size} rows; pass --vocab-size {architecture.vocab_size} "
                f"or less, or --tokenizer FILE"
            )
    except (InitFromError, ImportError) as error:
        raise ConfigError(f"{error}{_resume_hint(config)}") from None
    except ValueError as error:  # a config transformers refuses
        raise ConfigError(str(error).strip().splitlines()[0]) from None
    _settle_end_of_text(config)


def _check_files(config: TrainConfig) -> None:
    """``--tokenizer`` and ``--model.config``, when given, are files."""
    tokenizer = config.data.tokenizer
    if tokenizer is not None and not Path(tokenizer).expanduser().is_file():
        raise ConfigError(
            f"--tokenizer: {tokenizer!r} is not a file; pass a tokenizer.json (e.g. a saved "
            f"model's), or omit --tokenizer to train a BPE on the data"
        )
    if config.model.config is not None and not Path(config.model.config).expanduser().is_file():
        raise ConfigError(
            f"--model.config: {config.model.config!r} is not a file; pass a model's config.json"
        )


def _resume_hint(config: TrainConfig) -> str:
    """With --resume auto and a checkpoint in the run directory, how to continue without the
    --init-from model (the checkpoint holds the weights)."""
    from lowcomm.train.checkpoint import has_checkpoint
    from lowcomm.train.rundir import run_directory

    if config.run.resume != "auto" or not has_checkpoint(run_directory(config)):
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
