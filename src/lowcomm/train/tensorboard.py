"""``--tensorboard``: the run's metrics as TensorBoard event files under ``OUT/tensorboard/``.

Written by rank 0 through ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard``
package's event format), one point per step:

* against the step: ``loss/train``, ``loss/validation`` (when evaluated), ``lr``,
  ``utilization``, ``bytes/sent_per_worker`` (that step's) and ``bytes/sent_per_worker_total``;
* against the modeled time, in milliseconds on the run's clock (TensorBoard's x axis is an
  integer step): ``loss_vs_modeled_ms/train`` and ``loss_vs_modeled_ms/validation``.

Every point also carries the modeled time in seconds as its wall time, so TensorBoard's
*Relative* horizontal axis shows the run's clock.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (metrics.py imports this module)
    from lowcomm.train.metrics import StepRecord

DIRECTORY = "tensorboard"
"""The event files' directory inside the run directory."""

MISSING = "--tensorboard: needs the tensorboard package: pip install 'lowcomm[tensorboard]'"


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (which SummaryWriter writes through) is installed."""
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLog:
    """Logs each :class:`StepRecord` as scalars (see the module docstring)."""

    def __init__(self, run_dir: Path, bytes_before: float = 0.0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer: Any = SummaryWriter(log_dir=str(run_dir / DIRECTORY))
        self._bytes = bytes_before

    def write_step(self, record: StepRecord) -> None:
        step, seconds = record.step, record.clock_s
        self._bytes += record.bytes_sent_per_worker
        modeled_ms = round(seconds * 1000)
        scalars = {
            "loss/train": (record.train_loss, step),
            "lr": (record.lr, step),
            "utilization": (record.utilization, step),
            "bytes/sent_per_worker": (record.bytes_sent_per_worker, step),
            "bytes/sent_per_worker_total": (self._bytes, step),
            "loss_vs_modeled_ms/train": (record.train_loss, modeled_ms),
        }
        if record.val_loss is not None:
            scalars["loss/validation"] = (record.val_loss, step)
            scalars["loss_vs_modeled_ms/validation"] = (record.val_loss, modeled_ms)
        for tag, (value, x) in scalars.items():
            self._writer.add_scalar(tag, value, global_step=x, walltime=seconds)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
