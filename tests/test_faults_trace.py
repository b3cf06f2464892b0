"""The fault trace format: parsing, validation messages, membership and slowdown queries,
and the text round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowcomm.faults import Event, FaultTrace, TraceError, load_trace, parse_trace

EXAMPLE = """\
# when      worker    what
step=40     worker=3  crash
step=60     worker=3  join
t=12.5      worker=1  slow factor=3 for=20
t=30        link      factor=0.1 for=10
"""


def test_the_hand_written_example_parses_to_its_events() -> None:
    trace = parse_trace(EXAMPLE, workers=4)
    assert trace.events == (
        Event(kind="crash", worker=3, at_step=40),
        Event(kind="join", worker=3, at_step=60),
        Event(kind="slow", worker=1, at_time=12.5, factor=3.0, duration=20.0),
        Event(kind="link_degraded", worker=None, at_time=30.0, factor=0.1, duration=10.0),
    )
    assert [event.line for event in trace.events] == [2, 3, 4, 5]


def test_events_are_sorted_steps_first_then_times_ties_in_file_order() -> None:
    text = (
        "t=5 worker=0 slow factor=2\n"
        "step=9 worker=1 crash\n"
        "t=1 link down for=1  # a comment after an event\n"
        "\n"
        "step=3 worker=2 leave\n"
        "step=9 worker=2 rejoin\n"
    )
    trace = parse_trace(text, workers=3)
    assert [(event.kind, event.line) for event in trace.events] == [
        ("leave", 5),
        ("crash", 2),
        ("rejoin", 6),
        ("link_down", 3),
        ("slow", 1),
    ]


def test_to_text_reads_back_to_an_equal_trace() -> None:
    text = (
        "step=2 worker=0 leave\nstep=7 worker=0 rejoin\nstep=8 worker=1 crash\n"
        "step=9 worker=1 join\nstep=3 worker=2 slow factor=1.5 for=4\n"
        "t=0.1 worker=2 slow factor=2.25\nt=1e-3 link factor=0.333 for=0.7\n"
        "t=4.125 link down for=3\n"
    )
    trace = parse_trace(text, workers=3)
    again = parse_trace(trace.to_text(), workers=3)
    assert again == trace
    assert again.to_text() == trace.to_text()


def test_membership_at_a_step_includes_the_events_at_that_step() -> None:
    trace = parse_trace(EXAMPLE, workers=4)
    assert trace.members(step=39) == (0, 1, 2, 3)
    assert trace.members(step=40) == (0, 1, 2)
    assert trace.members(step=59) == (0, 1, 2)
    assert trace.members(step=60) == (0, 1, 2, 3)


def test_membership_on_time_and_a_worker_that_leaves_and_rejoins() -> None:
    trace = parse_trace(
        "t=1 worker=0 leave\nt=2 worker=1 crash\nt=3.5 worker=0 rejoin\nt=4 worker=1 join\n",
        workers=3,
    )
    assert [trace.members(time=t) for t in (0.0, 1.0, 1.5, 2.0, 3.5, 4.0)] == [
        (0, 1, 2),
        (1, 2),
        (1, 2),
        (2,),
        (0, 2),
        (0, 1, 2),
    ]


def test_slowdowns_and_link_factors_over_their_intervals() -> None:
    trace = parse_trace(
        EXAMPLE + "t=25 worker=1 slow factor=2\nt=35 link down for=1\nstep=50 worker=0 slow "
        "factor=4 for=5\n",
        workers=4,
    )
    assert trace.speed_factor(1, step=0, time=12.4) == 1.0
    assert trace.speed_factor(1, step=0, time=12.5) == 3.0
    assert trace.speed_factor(1, step=0, time=30.0) == 6.0  # overlapping slowdowns multiply
    assert trace.speed_factor(1, step=0, time=32.5) == 2.0  # [12.5, 32.5) is over
    assert trace.speed_factor(1, step=0, time=1e6) == 2.0  # no for=: to the end
    assert trace.speed_factor(0, step=54, time=0.0) == 4.0
    assert trace.speed_factor(0, step=55, time=0.0) == 1.0
    assert trace.link_factor(step=0, time=29.9) == 1.0
    assert trace.link_factor(step=0, time=30.0) == pytest.approx(0.1)
    assert trace.link_factor(step=0, time=35.5) == 0.0
    assert trace.link_factor(step=0, time=40.0) == 1.0


def test_events_between_takes_each_clock_half_open() -> None:
    trace = parse_trace(EXAMPLE, workers=4)
    found = trace.events_between(since_step=39, until_step=60, since_time=12.5, until_time=30)
    assert [(event.kind, event.line) for event in found] == [
        ("crash", 2),
        ("join", 3),
        ("link_degraded", 5),
    ]


def test_a_query_without_the_clock_the_events_use_says_which_to_pass() -> None:
    trace = parse_trace(EXAMPLE, workers=4)
    with pytest.raises(ValueError, match="pass step="):
        trace.members(time=50.0)
    with pytest.raises(ValueError, match="pass since_time/until_time"):
        trace.events_between(since_step=0, until_step=100)
    only_time = parse_trace("t=3 worker=0 crash\n", workers=2)
    assert only_time.members(time=3.0) == (1,)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "step=4 worker=7 crash",
            "faults.txt:2: 'step=4 worker=7 crash': worker 7 of 4: a run of 4 workers has "
            "workers 0..3; name one of them or run with more workers",
        ),
        (
            "step=4 worker=1 crsh",
            "faults.txt:2: 'step=4 worker=1 crsh': unknown word 'crsh'; did you mean 'crash'?",
        ),
        (
            "step=4 wroker=1 crash",
            "faults.txt:2: 'step=4 wroker=1 crash': unknown key 'wroker'; did you mean 'worker'?",
        ),
        (
            "time=4 worker=1 crash",
            "faults.txt:2: 'time=4 worker=1 crash': unknown key 'time'; did you mean 't'?",
        ),
        (
            "worker=1 crash",
            "faults.txt:2: 'worker=1 crash': an event needs exactly one moment; start the line "
            "with step=N or t=SECONDS",
        ),
        (
            "step=x worker=1 crash",
            "faults.txt:2: 'step=x worker=1 crash': step=x is not a whole number; write e.g. "
            "step=3",
        ),
        (
            "step=4 worker=1",
            "faults.txt:2: 'step=4 worker=1': say what happens, one of crash, leave, join, "
            "rejoin, slow",
        ),
        (
            "step=4 worker=1 join",
            "faults.txt:2: 'step=4 worker=1 join': worker 1 is alive at this moment, so it "
            "cannot join; crash or leave it before, or drop this line",
        ),
        (
            "step=4 worker=1 slow factor=0.5",
            "faults.txt:2: 'step=4 worker=1 slow factor=0.5': factor=0.5 is how many times "
            "longer compute takes and must be >= 1; write factor=2 for half speed",
        ),
        (
            "step=4 worker=1 slow",
            "faults.txt:2: 'step=4 worker=1 slow': a slow event needs factor=F; add e.g. factor=3",
        ),
        (
            "step=4 link worker=1 down for=2",
            "faults.txt:2: 'step=4 link worker=1 down for=2': a link event names no worker; "
            "drop worker=",
        ),
        (
            "t=1 link down",
            "faults.txt:2: 't=1 link down': a link down for the rest of the run leaves no round "
            "able to finish; give for=D",
        ),
        (
            "step=1 worker=1 slow factor=2 for=2.5",
            "faults.txt:2: 'step=1 worker=1 slow factor=2 for=2.5': for=2.5 counts steps after "
            "step= and must be a whole number; place the event with t= to give it in seconds",
        ),
    ],
)
def test_a_bad_line_ends_in_one_line_naming_file_line_text_and_fix(text: str, message: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace(f"# header\n{text}\n", workers=4, source="faults.txt")
    assert str(caught.value) == message
    assert "\n" not in str(caught.value)


def test_a_crash_of_a_dead_worker_and_a_rejoin_after_a_crash_are_refused() -> None:
    with pytest.raises(TraceError, match=r"^f:3: 'step=5 worker=1 crash': worker 1 is not alive"):
        parse_trace("step=1 worker=1 crash\n\nstep=5 worker=1 crash\n", workers=2, source="f")
    with pytest.raises(TraceError, match=r"^f:2: .*crashed and lost its state.*write join"):
        parse_trace("step=1 worker=1 crash\nstep=5 worker=1 rejoin\n", workers=2, source="f")


def test_a_trace_that_leaves_no_worker_alive_names_when() -> None:
    text = "step=10 worker=0 crash\nstep=12 worker=2 leave\nstep=30 worker=1 crash\n"
    with pytest.raises(TraceError) as caught:
        parse_trace(text, workers=3, source="f")
    assert str(caught.value) == (
        "f:3: 'step=30 worker=1 crash': no worker is alive from step 30 on; a run needs one at "
        "every moment, so join or rejoin a worker by then, or drop this line"
    )
    # a replacement that joins at the same step keeps the run alive, whatever the line order
    assert parse_trace(text + "step=30 worker=0 join\n", workers=3).members(step=30) == (0,)


def test_membership_events_on_two_clocks_are_refused() -> None:
    with pytest.raises(TraceError, match=r"^f:2: .*must all use one clock.*line 1 uses step"):
        parse_trace("step=1 worker=1 crash\nt=5 worker=1 join\n", workers=2, source="f")


def test_a_trace_built_in_code_is_sorted_and_validated_too() -> None:
    trace = FaultTrace(
        workers=2,
        events=(
            Event(kind="join", worker=0, at_time=2.0),
            Event(kind="crash", worker=0, at_time=1.0),
        ),
    )
    assert [event.kind for event in trace.events] == ["crash", "join"]
    with pytest.raises(TraceError, match="worker 5 of 2"):
        FaultTrace(workers=2, events=(Event(kind="crash", worker=5, at_time=1.0),))


def test_load_trace_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "faults.txt"
    path.write_text(EXAMPLE)
    assert load_trace(path, workers=4) == parse_trace(EXAMPLE, workers=4)
    with pytest.raises(TraceError, match=r"faults.txt:2: 'step=40 worker=3 crash': worker 3 of 2"):
        load_trace(path, workers=2)
    with pytest.raises(TraceError, match="cannot read the fault trace"):
        load_trace(tmp_path / "missing.txt", workers=4)


def test_a_binary_file_is_refused_as_not_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"step=1 \xd4\xff\x00 crash\n")
    with pytest.raises(TraceError, match=r"model.bin: not a fault trace \(byte 7 is not UTF-8"):
        load_trace(path, workers=4)
