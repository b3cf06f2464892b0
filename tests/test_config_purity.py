"""Configuration is pure. ``TrainConfig.validate()`` reads no file; what needs
the disk is the launch's pre-flight, with the same one-line errors."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lowcomm.comm.calibration import Calibration
from lowcomm.config import CommConfig, ConfigError, PlacementConfig, RunConfig, TrainConfig
from lowcomm.launch.run import preflight


def _no_disk(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every file-system read fail the test, and record what was attempted."""
    attempts: list[str] = []

    def refuse(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            attempts.append(f"{name}({args[0] if args else ''})")
            raise AssertionError(f"validate() touched the disk: {name}")

        return call

    for name in ("stat", "lstat", "listdir", "scandir", "readlink", "access"):
        monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    monkeypatch.setattr(builtins, "open", refuse("open"))
    return attempts


def test_validate_reads_no_file_whatever_paths_it_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    TrainConfig(
        method="diloco",
        placement=PlacementConfig(ranks_per_worker=2),
    ).validate()  # imports done before the ban
    config = TrainConfig(
        comm=CommConfig(calibration=str(tmp_path / "c.json")),
        run=RunConfig(out=str(tmp_path / "a"), resume=str(tmp_path / "b"), checkpoint_every=2),
    )
    config.data.data = str(tmp_path / "corpus.txt")
    attempts = _no_disk(monkeypatch)
    config.validate()  # --out differing from --resume needs the disk to tell: pre-flight's
    assert attempts == []


def test_a_calibration_of_other_shapes_is_refused_in_preflight(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    Calibration(
        seconds_per_microbatch=0.01,
        seconds_per_element=1e-9,
        micro_batch_size=8,
        block_size=64,
        num_params=1000,
    ).save(path)
    config = TrainConfig(
        comm=CommConfig(calibration=str(path)), run=RunConfig(out=str(tmp_path / "run"))
    )
    config.validate()  # the options alone are fine
    with pytest.raises(ConfigError) as refused:
        preflight(config)
    message = str(refused.value)
    assert message.startswith(f"--calibration: {path} was measured on micro-batches of 8 x 64")
    assert "\n" not in message


def test_out_differing_from_resume_is_refused_in_preflight(tmp_path: Path) -> None:
    config = TrainConfig(run=RunConfig(out=str(tmp_path / "a"), resume=str(tmp_path / "b")))
    config.validate()
    with pytest.raises(ConfigError, match=r"^--out: .* differs from --resume .*omit --out$"):
        preflight(config)
    # The same directory through a symbolic link is the same run directory.
    (tmp_path / "b").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "b")
    linked = TrainConfig(run=RunConfig(out=str(tmp_path / "link"), resume=str(tmp_path / "b")))
    with pytest.raises(ConfigError, match=r"--resume: .* holds no checkpoint"):
        preflight(linked)


def test_the_configuration_checks_itself_without_the_training_code() -> None:
    """``lowcomm.config`` sits below ``lowcomm.train``: importing it and validating a run,
    --worker-sharding included (accepted and refused), and each component alone, imports
    nothing of the training code.
    In a fresh interpreter, whose modules are only what these steps import."""
    script = (
        "import sys\n"
        "import lowcomm.config as c\n"
        "placement = c.PlacementConfig(ranks_per_worker=2, worker_sharding='fsdp')\n"
        "c.TrainConfig(method='diloco', placement=placement).validate()\n"
        "try:\n"
        "    placement = c.PlacementConfig(worker_sharding='fsdp')\n"
        "    c.TrainConfig(method='diloco', placement=placement).validate()\n"
        "except c.ConfigError as error:\n"
        "    assert 'leaves nothing to shard' in str(error), error\n"
        "else:\n"
        "    raise AssertionError('one rank per worker was not refused')\n"
        "for component in (c.PlacementConfig(), c.RunConfig(), c.CommConfig(), c.FaultConfig()):\n"
        "    component.validate()\n"
        "train = sorted(m for m in sys.modules if m.startswith('lowcomm.train'))\n"
        "assert not train, train\n"
    )
    source = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
