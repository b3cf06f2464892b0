"""The run directory: where a configuration's run goes (:func:`run_directory`), and before a run
starts: refuse to overwrite a run, check it can be written, and clear it when asked
(``--overwrite``).

A directory *holds a run* when it has any file a run writes (:data:`RUN_FILES`). Other files
in it are never touched, so ``--out`` may point into a directory that holds other things, and
``--overwrite`` removes only what a run wrote.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lowcomm.config import ConfigError, TrainConfig, flat

#: The run's copy of a given --tokenizer, beside its checkpoints: a resume reads it when the
#: original (say, an --init-from model's tokenizer.json) has moved or is gone.
TOKENIZER_COPY = "checkpoints/tokenizer.json"

#: The run's copy of the model's config.json (--model.config, which --init-from sets): a resume
#: rebuilds the architecture from it when the original has moved or is gone.
MODEL_CONFIG_COPY = "checkpoints/model_config.json"

#: What a run writes into its directory (the checkpoints directory included).
RUN_FILES = (
    "config.json", "metrics.jsonl", "summary.json", "loss.png", "error.log", "checkpoints",
    "model", "tensorboard", "wandb",
)  # fmt: skip

#: Where a failed run's worker tracebacks go (the one-line error names it).
ERROR_LOG = "error.log"


def run_directory(config: TrainConfig) -> Path:
    """The run's directory: ``--out``, else the ``--resume`` directory, else
    ``runs/<method>-<network>-w<workers>-s<seed>``, plus ``-<hash>`` of the other settings
    that differ from their defaults (:func:`non_default_settings`)."""
    if config.run.out is not None:
        return Path(config.run.out)
    if config.run.resume is not None and config.run.resume != "auto":
        return Path(config.run.resume)
    name = f"{config.method}-{config.comm.network}-w{config.placement.workers}-s{config.run.seed}"
    differing = non_default_settings(config)
    if differing:
        # Runs that differ in any other setting (a learning-rate sweep) get their own directory.
        digest = hashlib.sha256(json.dumps(differing, sort_keys=True, default=str).encode())
        name += f"-{digest.hexdigest()[:6]}"
    return Path("runs") / name


def non_default_settings(config: TrainConfig) -> dict[str, Any]:
    """The settings, other than those in the default run name and those that only steer
    the run (output, resume, progress, plot, checkpointing, timeout), that differ from their
    defaults, as flat ``dotted.name: value`` pairs."""
    # The flat components' options by their own names (``workers``), as before they were
    # components: the hash, and so the directory of a run, stays the same.
    mine = _flatten(flat(config.to_dict()))
    defaults = _flatten(flat(TrainConfig().to_dict()))
    return {
        key: value
        for key, value in mine.items()
        if key not in _RUN_NAME_EXCLUDED and defaults.get(key, _MISSING) != value
    }


_MISSING = object()

#: Fields left out of the default run name's hash: the name spells the first four, the others
#: steer a run without changing what it computes.
_RUN_NAME_EXCLUDED = frozenset(
    {
        "method", "network", "workers", "seed", "out", "overwrite", "resume", "progress", "plot",
        "tensorboard", "log", "wandb_project", "wandb_name", "log_every",
        "stop_after", "checkpoint_every", "keep_checkpoints", "collective_timeout_s",
    }
)  # fmt: skip


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            result.update(_flatten(value, f"{prefix}{key}."))
        else:
            result[f"{prefix}{key}"] = value
    return result


def run_files(run_dir: Path) -> list[str]:
    """The names in ``run_dir`` that a run wrote (empty: the directory holds no run)."""
    if not run_dir.is_dir():
        return []
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def _option(config: TrainConfig) -> str:
    if config.run.resume is not None and config.run.resume != "auto":
        return "--resume"
    return "--out"


def check_run_dir(config: TrainConfig) -> str | None:
    """Check, before any worker starts, that the run may write its directory.

    Refused (with one line naming the fix): a path that is a file or lies under one, a
    directory that cannot be written, a new run into a directory holding a run (unless
    ``--overwrite``), and ``--resume auto`` on a directory holding another run.

    Returns:
        A line to print when a resume passes over damaged checkpoints (which one it uses and
        why), else None.

    Raises:
        ConfigError: the one-line reason.
    """
    directory = run_directory(config)
    option = _option(config)
    _check_writable(directory, option)
    held = run_files(directory)
    if config.run.resume is None:
        if held and not config.run.overwrite:
            from lowcomm.train.checkpoint import has_checkpoint

            resume = f", --resume {directory} to continue it" if has_checkpoint(directory) else ""
            raise ConfigError(
                f"{option}: {directory} already holds a run ({', '.join(held)}); pass --overwrite "
                f"to replace it{resume}, or --out NEW_DIR for a fresh one"
            )
        return None
    return _check_resumable(config, directory, held)


def _check_resumable(config: TrainConfig, run_dir: Path, held: list[str]) -> str | None:
    from lowcomm.train.checkpoint import (
        CheckpointError,
        find_resumable,
        fingerprint,
        has_checkpoint,
        preflight_ranks,
    )

    mine = fingerprint(config)
    if has_checkpoint(run_dir):
        try:
            found = find_resumable(
                run_dir,
                config.placement.world_size,
                mine,
                preflight_ranks(config.placement.ranks_per_process),
            )
        except CheckpointError as error:
            message = str(error)
            if config.run.resume == "auto":
                message = message.replace("--resume:", f"--resume auto: {run_dir}:", 1)
            raise ConfigError(message) from None
        return found.fallback_note()
    if config.run.resume == "auto" and held:
        # No checkpoint yet: a restart of the same run starts it afresh, another run is kept.
        try:
            saved = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
            # (Another worker count is the same run: an elastic restart before any checkpoint.)
            same = fingerprint(saved) == mine
        except (OSError, ValueError, TypeError):
            same = False
        if same and "summary.json" in held:
            raise ConfigError(
                f"--resume auto: {run_dir} holds this run, finished, and no checkpoint to "
                f"resume; pass --overwrite (without --resume) to run it again, or --out NEW_DIR"
            )
        if not same:
            raise ConfigError(
                f"--resume auto: {run_dir} holds another run without a checkpoint "
                f"({', '.join(held)}); pass --overwrite (without --resume) to replace it, or "
                f"--out NEW_DIR for a fresh one"
            )
    return None


def _check_writable(run_dir: Path, option: str) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(
            f"{option}: {run_dir} is an existing file, not a directory; pass a directory path "
            f"(new, or holding a run)"
        )
    existing = run_dir
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigError(
            f"{option}: {run_dir} lies under {existing}, which is a file; pass a directory path"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".lowcomm-probe-"):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(
            f"{option}: cannot write in {existing} ({reason}); pass a writable directory"
        ) from None


def clear_run(run_dir: Path) -> list[str]:
    """Remove what a run wrote in ``run_dir`` (``--overwrite``); return the names removed."""
    removed = run_files(run_dir)
    for name in removed:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for name in RUN_FILES:  # temporary files (model/: directories) of an interrupted write
        for leftover in [*run_dir.glob(f".{name}.tmp*"), *run_dir.glob(f".{name}.old*")]:
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
    return removed


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """A finished run's ``summary.json`` (None if the run has none: it stopped early)."""
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    summary: dict[str, Any] = json.loads(path.read_text())
    return summary
