"""``--log wandb``: the run in Weights & Biases, written by rank 0 beside metrics.jsonl.

* every step: the fields of its metrics.jsonl line (``train_loss``, ``val_loss`` when
  evaluated, ``lr``, ``utilization``, ``bytes_sent_per_worker``, ``clock_s``, ...; the method's
  extras as ``extras/<name>``), at W&B step = the run's step;
* at the end: summary.json as the W&B run's summary, and the figures (``loss.png``) as images;
* the run's config.json as the W&B run's config.

The W&B files go under ``$WANDB_DIR`` if it is set, else the run directory (``OUT/wandb/``).
The W&B run's id is kept in ``OUT/wandb/run-id``, so ``--resume OUT`` continues the same W&B
run. ``WANDB_MODE=offline`` writes the run locally only (``wandb sync`` uploads it later).
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from lowcomm.atomic import atomic_write_text

if TYPE_CHECKING:  # (metrics.py imports this module)
    from lowcomm.config import TrainConfig
    from lowcomm.train.metrics import StepRecord

DIRECTORY = "wandb"
"""The directory inside the run directory that holds the W&B run id (and, without
$WANDB_DIR, W&B's own files)."""

MISSING = "--log wandb: needs the wandb package: pip install 'lowcomm[wandb]'"

NO_LOGIN = (
    "--log wandb: no W&B API key found (WANDB_API_KEY, ~/.netrc); run `wandb login`, or set "
    "WANDB_MODE=offline to write the run locally"
)

#: The figures a finished run directory holds, logged as images under these keys.
FIGURES = {"loss": "loss.png"}

#: The modes in which W&B writes nothing to its server (so it needs no login).
_LOCAL_MODES = frozenset({"offline", "disabled", "dryrun"})


def wandb_available() -> bool:
    """Whether the ``wandb`` package is installed."""
    return importlib.util.find_spec("wandb") is not None


def login_problem(environ: dict[str, str] | None = None) -> str | None:
    """:data:`NO_LOGIN` when W&B would run online without credentials, else None.

    Reads only the environment and the netrc file (where ``wandb login`` stores the key), so
    the launch refuses the run at once instead of a worker prompting for a key mid-start."""
    env = dict(os.environ) if environ is None else environ
    if env.get("WANDB_MODE", "").strip().lower() in _LOCAL_MODES:
        return None
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    path = Path(env["NETRC"]) if env.get("NETRC") else Path.home() / ".netrc"
    try:
        if netrc.netrc(str(path)).authenticators(host) is not None:
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return NO_LOGIN


def check_wandb() -> None:
    """The pre-flight of ``--log wandb``: raise ValueError (one line) without the package or,
    online, without a login."""
    from lowcomm.config import ConfigError

    if not wandb_available():
        raise ConfigError(MISSING)
    problem = login_problem()
    if problem is not None:
        raise ConfigError(problem)


def step_values(record: StepRecord) -> dict[str, Any]:
    """A metrics.jsonl line as W&B values: the same fields, the extras flattened so each is
    a chart of its own, a missing validation loss left out (rather than logged as null)."""
    values: dict[str, Any] = {}
    for key, value in json.loads(record.line()).items():
        if key == "extras":
            values.update({f"extras/{name}": extra for name, extra in value.items()})
        elif value is not None:
            values[key] = value
    return values


class WandbLog:
    """One W&B run per lowcomm run directory (see the module docstring)."""

    def __init__(self, config: TrainConfig, run_dir: Path, *, resumed: bool) -> None:
        import wandb

        ids = run_dir / DIRECTORY
        ids.mkdir(parents=True, exist_ok=True)
        id_file = ids / "run-id"
        if resumed and id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:8]  # (W&B's own ids: 8 lowercase letters and digits)
            atomic_write_text(id_file, run_id + "\n")
        self._run: Any = wandb.init(
            project=config.run.wandb_project,
            name=config.run.wandb_name or run_dir.resolve().name,
            id=run_id,
            resume="allow",
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            config=json.loads(config.to_json()),
        )

    def write_step(self, record: StepRecord) -> None:
        self._run.log(step_values(record), step=record.step)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        """Log the summary and the figures, then end the W&B run."""
        import wandb

        figures = {
            key: wandb.Image(str(run_dir / name))
            for key, name in FIGURES.items()
            if (run_dir / name).exists()
        }
        if figures:
            self._run.log(figures)
        self._run.summary.update(summary)
        self._run.finish()
