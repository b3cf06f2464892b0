"""A quorum that cannot be formed: below --fault-min-workers live workers the run waits for
joins on its clock (modeled on the virtual clock, taking no real time; said every 30 s on
the real clock), and past --fault-quorum-wait-s ends with a checkpoint and one line saying
how to continue."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lowcomm.comm.inprocess import InProcessGroup
from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.faults.engine import SAY_EVERY_S, WorkerFaults, wait_saying
from lowcomm.faults.trace import TraceError, parse_trace
from lowcomm.launch.inprocess import train_in_process
from lowcomm.launch.run import preflight
from lowcomm.models import ModelConfig
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.train.checkpoint import step_directory

WORKERS = 3


def _config(out: Path, trace: Path, **overrides: Any) -> TrainConfig:
    config = with_options(
        TrainConfig(
            method="ddp",
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
            diloco=DiLoCoOptions(sync_every=2),
        ),
        workers=WORKERS,
        workers_per_process=WORKERS,
        steps=6,
        network="wan",
        clock="virtual",
        seconds_per_microbatch=0.01,
        eval_every=3,
        eval_batches=3,
        log_every=1,
        progress=False,
        plot=False,
        out=str(out),
        faults=str(trace),
        fault_detection_s=0.5,
        fault_min_workers=2,
    )
    return with_options(config, **overrides)


def _train(config: TrainConfig) -> list[dict[str, Any]]:
    config.validate()
    preflight(config)
    train_in_process(config)
    path = Path(str(config.run.out)) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _trace(tmp_path: Path, join_at: float) -> Path:
    path = tmp_path / "trace.txt"
    path.write_text(f"t=0.1 worker=1 crash\nt=0.1 worker=2 crash\nt={join_at:g} worker=1 join\n")
    return path


def test_a_quorum_below_the_minimum_waits_for_the_join_on_the_modeled_clock(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # (A wait of about 11.6 modeled days: a run that slept through it would never end.)
    join_at = 1e6
    records = _train(_config(tmp_path / "out", _trace(tmp_path, join_at), fault_quorum_wait_s=2e6))
    waited = next(r for r in records if r.get("membership_events"))
    events = waited["membership_events"]
    assert events[:2] == [{"worker": 1, "kind": "crash"}, {"worker": 2, "kind": "crash"}]
    assert events[2:] == [{"worker": 1, "kind": "join"}]  # (the join lands on the same step)
    assert waited["quorum"] == 2 and waited["clock_s"] > join_at
    assert max(waited["exposed_comm_s_per_worker"]) > join_at - 1.0  # (the wait is the step's)
    assert records[-1]["step"] == 5 and records[-1]["quorum"] == 2
    said = capfd.readouterr().out
    assert f"step {waited['step']}: the quorum needs --fault-min-workers 2" in said
    assert "waiting for worker 1, 2" in said and "a quorum of 2 formed after waiting" in said
    assert "still waiting" not in said  # (the virtual clock's wait is modeled in one line)


def test_no_quorum_in_the_wait_ends_with_a_checkpoint_and_a_line_saying_how_to_continue(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trace, out = _trace(tmp_path, 500.0), tmp_path / "out"
    records = _train(_config(out, trace, fault_quorum_wait_s=60.0))
    stopped_at = len(records)
    assert step_directory(out, stopped_at).is_dir()  # (the state before the step it waited at)
    assert not (out / "summary.json").exists()
    lines = [line for line in capfd.readouterr().out.splitlines() if "no quorum" in line]
    assert len(lines) == 1
    line = lines[0]
    assert f"no quorum at step {stopped_at}" in line and "worker 0 waited 60 s" in line
    assert "worker 1, 2 did not join" in line
    assert f"lowcomm train --resume {out} --fault-quorum-wait-s 120" in line

    # Resumed with a longer wait, it continues as the run that waited long enough does.
    resumed = _train(_config(out, trace, fault_quorum_wait_s=1000.0, resume=str(out)))
    whole = _train(_config(tmp_path / "whole", trace, fault_quorum_wait_s=1000.0))
    assert [r["train_loss"] for r in resumed] == [r["train_loss"] for r in whole]
    assert [r["clock_s"] for r in resumed] == [r["clock_s"] for r in whole]
    summary = json.loads((out / "summary.json").read_text())
    whole_summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["faults"] == whole_summary["faults"]
    assert summary["modeled_time_s"] == whole_summary["modeled_time_s"]


def test_a_trace_by_step_below_the_minimum_is_refused_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("step=2 worker=1 crash\nstep=2 worker=2 crash\nstep=4 worker=1 join\n")
    config = _config(tmp_path / "out", trace)
    config.validate()
    with pytest.raises(TraceError) as caught:
        preflight(config)
    message = str(caught.value)
    assert "\n" not in message and "below --fault-min-workers 2" in message
    assert "place the events by time" in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"fault_min_workers": 0}, "--fault-min-workers: 0 is not valid"),
        ({"fault_min_workers": 4}, "--fault-min-workers: 4 is not valid"),
        ({"fault_quorum_wait_s": -1.0}, "--fault-quorum-wait-s: -1.0 is not valid"),
        ({"fault_quorum_wait_s": float("inf")}, "--fault-quorum-wait-s: inf is not valid"),
    ],
)
def test_bad_quorum_options_are_refused_in_one_line(
    overrides: dict[str, Any], expected: str, tmp_path: Path
) -> None:
    config = _config(tmp_path / "out", tmp_path / "trace.txt", **overrides)
    with pytest.raises(ConfigError, match=expected) as caught:
        config.validate()
    assert "\n" not in str(caught.value)


# --- the real clock's lines, on a clock the test moves ------------------------------------


class _Clock:
    """A clock the test controls: ``wait_until`` moves it, nothing sleeps."""

    kind = "real"
    speed_factor = 1.0

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time

    def wait_until(self, deadline: float) -> None:
        self.time = max(self.time, deadline)

    @contextmanager
    def blocked(self) -> Iterator[None]:
        yield


def test_a_wait_says_every_30_seconds_who_is_missing_and_how_long_it_has_waited() -> None:
    clock, said = _Clock(), []
    wait_saying(
        now=clock.now, sleep_until=clock.wait_until, end=100.0, since=0.0, every_s=SAY_EVERY_S,
        say=said.append, line=lambda waited: f"waited {waited:g} s",
    )  # fmt: skip
    assert said == ["waited 30 s", "waited 60 s", "waited 90 s"]
    assert clock.time == 100.0


def test_a_wait_resumed_mid_way_says_the_time_since_it_began() -> None:
    clock, said = _Clock(), []
    clock.time = 45.0
    wait_saying(
        now=clock.now, sleep_until=clock.wait_until, end=70.0, since=0.0, every_s=SAY_EVERY_S,
        say=said.append, line=lambda waited: f"waited {waited:g} s",
    )  # fmt: skip
    assert said == ["waited 60 s"]


def test_on_the_real_clock_the_lowest_live_worker_says_so_every_30_seconds(
    tmp_path: Path,
) -> None:
    trace = parse_trace(
        "t=0 worker=1 crash\nt=0 worker=2 crash\nt=95 worker=1 join\n", workers=WORKERS
    )
    group, books = InProcessGroup(WORKERS), InProcessGroup(WORKERS, name="books")
    said: dict[int, list[str]] = {k: [] for k in range(WORKERS)}
    clocks = {k: _Clock() for k in range(WORKERS)}
    lost: dict[int, bool] = {}

    def work(k: int) -> None:
        faults = WorkerFaults(
            trace, slot=k, round_kind="step", detection_s=0.0, clock=clocks[k],  # type: ignore[arg-type]
            raw=group.comm(k), books=books.comm(k), min_workers=2, quorum_wait_s=600.0,
            say=said[k].append,
        )  # fmt: skip
        lost[k] = faults.quorum_lost(0)
        assert faults.members(0) == (0, 1)

    _threads(work, WORKERS)
    assert lost == {0: False, 1: False, 2: False}
    assert clocks[0].time == 95.0  # (the survivor waited; the dead have no time of their own)
    assert said[1] == said[2] == []
    first, *middle, last = said[0]
    assert "waiting for worker 1, 2" in first
    assert middle == [
        f"lowcomm: step 0: still waiting for worker 1, 2 to form a quorum of 2: waited {s} s "
        "of 600 s"
        for s in (30, 60, 90)
    ]
    assert "a quorum of 2 formed after waiting 95 s" in last


def _threads(work: Callable[[int], None], count: int) -> None:
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            work(rank)
        except BaseException as error:  # (re-raised on the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]


def test_a_run_resumed_with_fewer_workers_to_wait_for_goes_on_and_forgets_the_wait(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # (Steps of about 5 modeled seconds. Stopped waiting for 3 workers at step 1, resumed
    # needing 2, which it has: a later loss of its quorum waits its own full time.)
    trace, out = tmp_path / "trace.txt", tmp_path / "out"
    trace.write_text(
        "t=0.1 worker=1 crash\nt=0.1 worker=2 crash\nt=0.15 worker=1 join\n"
        "t=40 worker=1 crash\nt=75 worker=1 join\n"
    )
    options: dict[str, Any] = {"seconds_per_microbatch": 5.0, "fault_quorum_wait_s": 30.0}
    _train(_config(out, trace, fault_min_workers=3, **options))
    assert "no quorum at step 1" in capfd.readouterr().out
    options["fault_quorum_wait_s"] = 60.0  # (75 s is within 60 s of the second loss only)
    records = _train(_config(out, trace, fault_min_workers=2, resume=str(out), **options))
    said = capfd.readouterr().out
    assert "a quorum of 2 formed after waiting" in said and "no quorum" not in said
    assert records[-1]["step"] == 5
