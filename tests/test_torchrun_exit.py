"""A torchrun rank that fails leaves as the local spawner's workers do: at once, without
tearing its process group down (``destroy_process_group()`` waits on the collective that
failed; with NCCL, until the watchdog fires). Unit tests: one Gloo rank on loopback, the
teardown and the exit recorded."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from lowcomm.config import ConfigError, PlacementConfig, RunConfig, TrainConfig


class _Exited(BaseException):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A torchrun-like environment of one rank; records teardowns and exits."""
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    calls = SimpleNamespace(destroyed=0)
    destroy = dist.destroy_process_group

    def record_destroy(*args: Any, **kwargs: Any) -> None:
        calls.destroyed += 1

    def record_exit(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(dist, "destroy_process_group", record_destroy)
    monkeypatch.setattr("lowcomm.launch.spawn.os._exit", record_exit)
    yield calls
    if dist.is_initialized():
        destroy()


def _fail(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("injected failure")


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise ConfigError("--x: injected refusal")


@pytest.mark.parametrize(("failure", "code"), [(_fail, 1), (_refuse, 2)])
def test_a_failing_train_rank_exits_without_teardown(
    one_rank: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    failure: Any,
    code: int,
) -> None:
    from lowcomm.launch.run import _join_torchrun

    monkeypatch.setattr("lowcomm.train.loop.train_worker", failure)
    config = TrainConfig(
        placement=PlacementConfig(workers=1),
        run=RunConfig(out=str(tmp_path / "run"), progress=False, plot=False),
    )
    task: Any = SimpleNamespace(reads_corpus=False)
    with pytest.raises(_Exited) as exited:
        _join_torchrun(config, None, None, task)
    assert exited.value.code == code
    assert one_rank.destroyed == 0
    err = capsys.readouterr().err
    expected = "injected failure" if code == 1 else "lowcomm: error: --x: injected refusal"
    assert expected in err, err


def test_a_failing_selftest_rank_exits_without_teardown(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowcomm.selftest import SelftestConfig, _run_as_torchrun_world

    monkeypatch.setattr("lowcomm.selftest.selftest_worker", _fail)
    with pytest.raises(_Exited) as exited:
        _run_as_torchrun_world(SelftestConfig(), 0.0)
    assert exited.value.code == 1 and one_rank.destroyed == 0
    assert "RuntimeError: injected failure" in capsys.readouterr().err
