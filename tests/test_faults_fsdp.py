"""Sharded workers (``--ranks-per-worker R --worker-sharding fsdp``, a process per rank) give
the losses of replicated workers (to 1e-6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowcomm.config import TrainConfig
from test_faults_rank_processes import STEPS, _close, _config, _run


def _sharded(out: Path, trace: Path, **extra: Any) -> TrainConfig:
    return _config("diloco", out, trace, processes=True, worker_sharding="fsdp", **extra)


def _same_losses(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(STEPS))
    for g, w in zip(got, want, strict=True):
        for name in ("train_loss", "val_loss"):
            assert _close(g[name], w[name]), (name, g, w)


def test_static_sharded_workers_give_the_replicated_losses_with_an_evaluation_between_syncs(
    tmp_path: Path,
) -> None:
    """No faults. The evaluation after step 2 deploys diloco's global parameters, not the
    training ones, which the next step trains on again."""
    options: dict[str, Any] = {"faults": None, "eval_every": 3}
    want = _run(_config("diloco", tmp_path / "r", tmp_path / "x", processes=False, **options))
    got = _run(_sharded(tmp_path / "s", tmp_path / "x", **options))
    _same_losses(got[0], want[0])
    assert got[0][2]["val_loss"] is not None
