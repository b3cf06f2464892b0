"""How long a method keeps a collective queued, and the start-up line where the process
groups' timeout may not cover it: NCCL's watchdog counts from a collective's launch, and an
overlapped method waits for it steps later."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lowcomm.comm.torch_comm import process_group_timeout
from lowcomm.config import PlacementConfig, TrainConfig, with_options
from lowcomm.launch.devices import overlap_steps, watchdog_note
from lowcomm.launch.run import preflight
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.acco import AccoOptions
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.diloco import DiLoCoOptions


def _config(method: str, **fields: object) -> TrainConfig:
    config = TrainConfig(
        method=method,
        local=LocalOptions(sync_every=12),
        diloco=DiLoCoOptions(sync_every=12, overlap_steps=3, outer_delay=2),
        acco=AccoOptions(),
        placement=PlacementConfig(workers=4, device="cuda"),
    )
    return with_options(config, **fields)


@pytest.mark.parametrize(
    ("method", "steps"),
    [
        ("ddp", 0),
        ("diloco", 0),
        ("local_sgd", 0),
        ("co2", 12),  # a round of tau = 12 steps
        ("overlap_local_sgd", 12),
        ("streaming_diloco", 3),  # tau
        ("cocodc", 3),
        ("eager", 24),  # N = 2 rounds of H = 12
        ("diloco_delayed", 24),
        ("acco", 0),  # its chain is waited for within the step (it accumulates meanwhile)
        ("dpu", 1),  # the previous step's update
        ("wp", 1),
    ],
)
def test_a_methods_queued_steps_are_its_declared_overlap(method: str, steps: int) -> None:
    assert overlap_steps(_config(method)) == steps


def test_every_method_declares_a_finite_overlap() -> None:
    for method in STRATEGIES:
        assert 0 <= overlap_steps(_config(method)) < float("inf")


def test_a_long_overlap_on_nccl_is_told_the_steps_that_would_exceed_the_timeout() -> None:
    """co2 with tau = 12 at the default 300 s: the group's timeout is 375 s from the launch,
    so steps over 31.25 s on the slowest rank would end the run; the line says so and what to
    pass, and that value covers the window with the whole collective timeout to spare."""
    config = _config("co2")
    note = watchdog_note(config)
    assert note is not None and "\n" not in note
    assert "co2 keeps a collective queued for up to 12 steps" in note
    assert "incomplete 375 s after its launch" in note and "steps over 31.2 s" in note
    assert note.endswith("pass --collective-timeout-s 300 + 12 x S")
    for step_s in (31.25, 60.0, 1000.0):  # the advice, for steps of step_s seconds
        advised = replace(
            config,
            comm=replace(config.comm, collective_timeout_s=300 + 12 * step_s),
        )
        window_s = 12 * step_s
        timeout_s = process_group_timeout(advised.comm.collective_timeout_s).total_seconds()
        assert timeout_s >= window_s + config.comm.collective_timeout_s
    # The limit the line names is the window the default timeout covers exactly.
    assert process_group_timeout(300).total_seconds() == 12 * 31.25


@pytest.mark.parametrize(
    ("method", "fields"),
    [
        ("ddp", {}),  # nothing queued past its step
        ("streaming_diloco", {"diloco": DiLoCoOptions(sync_every=12, overlap_steps=1)}),
        ("dpu", {}),  # one step: a step as long as the timeout still fits
        ("co2", {"device": "cpu"}),  # Gloo: no watchdog aborts the process
        ("co2", {"workers": 1}),  # one process: no group
    ],
)
def test_no_line_where_a_step_as_long_as_the_timeout_fits(
    method: str, fields: dict[str, object]
) -> None:
    config = _config(method)
    assert watchdog_note(with_options(config, **fields)) is None


def test_the_line_is_printed_at_the_start_of_a_run(tmp_path: Path) -> None:
    config = _config("co2", out=str(tmp_path / "run"), steps=12)
    note = preflight(config)
    assert note is not None and watchdog_note(config) in note.splitlines()
