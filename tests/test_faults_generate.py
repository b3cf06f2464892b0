"""Generated fault traces: reproducible from the seed, per-worker streams, rates that match
the options, and one-line errors for bad options."""

from __future__ import annotations

import math

import pytest

from lowcomm.faults import (
    TORCHFT_HEARTBEAT_TIMEOUT_S,
    FaultOptions,
    TraceError,
    generate_trace,
    parse_trace,
)

OPTIONS = FaultOptions(
    duration_s=3600.0,
    mtbf_s=7200.0,
    replace_after_s=120.0,
    slow_fraction=0.1,
    slow_factor=3.0,
    seed=7,
)


def test_the_same_options_give_the_same_trace_bit_for_bit() -> None:
    first = generate_trace(OPTIONS, workers=32)
    second = generate_trace(OPTIONS, workers=32)
    assert first == second
    assert first.to_text() == second.to_text()
    assert [event.at_time for event in first.events] == [event.at_time for event in second.events]
    assert generate_trace(FaultOptions(**{**vars(OPTIONS), "seed": 8}), workers=32) != first


def test_a_generated_trace_written_out_reads_back_identically() -> None:
    trace = generate_trace(OPTIONS, workers=32)
    assert any(event.kind == "crash" for event in trace.events)  # something to round-trip
    again = parse_trace(trace.to_text(), workers=32)
    assert again == trace
    # a generated event's line is its line in that text, so messages point into it
    assert [event.line for event in again.events] == [event.line for event in trace.events]


def test_worker_k_events_do_not_change_when_the_run_grows() -> None:
    small = generate_trace(OPTIONS, workers=8)
    large = generate_trace(OPTIONS, workers=64)
    assert [event for event in large.events if event.worker is not None and event.worker < 8] == [
        *small.events
    ]


def test_changing_the_stragglers_leaves_the_crashes_alone() -> None:
    fewer_slow = FaultOptions(**{**vars(OPTIONS), "slow_fraction": 0.5, "slow_factor": 2.0})
    crashes = [
        [event for event in generate_trace(options, workers=32).events if event.kind != "slow"]
        for options in (OPTIONS, fewer_slow)
    ]
    assert crashes[0] == crashes[1]


def test_every_crash_is_followed_by_its_replacement_after_replace_after_s() -> None:
    trace = generate_trace(OPTIONS, workers=64)
    for worker in range(64):
        changes = [e for e in trace.membership_events() if e.worker == worker]
        assert [e.kind for e in changes] == ["crash", "join"] * (len(changes) // 2) + (
            ["crash"] if len(changes) % 2 else []
        )
        for crash, join in zip(changes[::2], changes[1::2], strict=False):
            assert join.at == pytest.approx(crash.at + OPTIONS.replace_after_s)
        assert all(0 <= e.at < OPTIONS.duration_s for e in changes)


def test_crash_and_straggler_rates_match_the_options_over_many_workers() -> None:
    workers = 4000
    trace = generate_trace(OPTIONS, workers=workers)
    crashes = sum(event.kind == "crash" for event in trace.events)
    # A slot's worker is up for mtbf on average, then down for replace_after_s: the expected
    # crashes per slot are duration / (mtbf + replace_after_s), about 0.49 here.
    expected = workers * OPTIONS.duration_s / (OPTIONS.mtbf_s + OPTIONS.replace_after_s)
    assert abs(crashes - expected) < 4 * math.sqrt(expected)
    slow = {event.worker for event in trace.events if event.kind == "slow"}
    expected_slow = workers * OPTIONS.slow_fraction
    spread = math.sqrt(workers * OPTIONS.slow_fraction * (1 - OPTIONS.slow_fraction))
    assert abs(len(slow) - expected_slow) < 4 * spread
    slow_event = next(event for event in trace.events if event.kind == "slow")
    assert (slow_event.at_time, slow_event.factor, slow_event.duration) == (0.0, 3.0, None)
    assert trace.speed_factor(slow_event.worker or 0, time=OPTIONS.duration_s) == 3.0


def test_no_failures_and_no_stragglers_give_an_empty_trace() -> None:
    assert generate_trace(FaultOptions(duration_s=100.0), workers=4).events == ()
    no_replacement = FaultOptions(duration_s=100.0, mtbf_s=50.0, seed=3)
    trace = generate_trace(no_replacement, workers=64)
    assert {event.kind for event in trace.events} == {"crash"}


def test_detection_defaults_to_torchfts_heartbeat_timeout() -> None:
    assert FaultOptions(duration_s=1.0).detection_s == TORCHFT_HEARTBEAT_TIMEOUT_S == 5.0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("duration_s", 0.0, "duration_s=0.0: a run lasts a finite time > 0; give its modeled"),
        ("mtbf_s", -1.0, "mtbf_s=-1.0: a mean time between failures is > 0; use math.inf"),
        ("replace_after_s", -2.0, "replace_after_s=-2.0: a replacement cannot join before"),
        ("slow_fraction", 1.5, "slow_fraction=1.5: a fraction of workers is in [0, 1]; e.g. 0.1"),
        ("slow_factor", 0.5, "slow_factor=0.5: a slowdown is >= 1; write 3 for three times"),
        ("detection_s", math.nan, "detection_s=nan: detection takes a finite time >= 0"),
        ("seed", -1, "seed=-1: a seed is a whole number >= 0; e.g. seed=0"),
    ],
)
def test_bad_options_end_in_one_line(field: str, value: float, message: str) -> None:
    options = {"duration_s": 10.0, field: value}
    with pytest.raises(ValueError) as caught:
        FaultOptions(**options)  # type: ignore[arg-type]
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_bad_worker_counts_and_a_trace_that_kills_everyone_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^workers=0: a run has at least one worker"):
        generate_trace(OPTIONS, workers=0)
    deadly = FaultOptions(duration_s=1000.0, mtbf_s=10.0, seed=1)  # never replaced
    # Each of the 2 workers crashes once and is never replaced: the second crash, line 3 of
    # the trace's text (after its header and the first crash), leaves nobody.
    with pytest.raises(
        TraceError,
        match=r"^<generated seed=1 .*>:3: 't=\S+ worker=\d crash': no worker is alive from t=",
    ):
        generate_trace(deadly, workers=2)
