"""Declared crashes kill worker processes: a crashed worker's process ends by SIGKILL at the
step its crash lands on, the others keep their bookkeeping over the live processes, a
process started for the slot at launch takes it over at its join, and the run's numbers are
those of the same trace with every worker a thread of one process (losses, modeled times,
quorums, bytes, the summary's faults block)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from _faults import trained as _run
from lowcomm.faults.processes import process_layout
from lowcomm.launch.run import run_training
from test_faults_processes import _config, _same_numbers

#: Worker 2 crashes for good at step 2 while worker 0 straggles.
KILL_TRACE = """\
step=2    worker=2  crash
step=1    worker=0  slow factor=3 for=3
"""

_KILLED = re.compile(
    r"lowcomm: worker process (\d+) \(pid (\d+)\) ended by SIGKILL as planned: "
    r"declared crash of worker (\d+) at step (\d+)"
)


def _killed(output: str, *, processes: list[int] | None = None) -> list[tuple[int, int]]:
    """The (worker, step) of each process the launcher saw end by a planned SIGKILL, each
    checked to be gone (and, given ``processes``, to be those ranks)."""
    found, ranks = [], []
    for process, pid, worker, step in _KILLED.findall(output):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
        found.append((int(worker), int(step)))
        ranks.append(int(process))
    if processes is not None:
        assert sorted(ranks) == processes
    return found


@pytest.mark.parametrize("method", ["ddp", "diloco", "local_adamw"])
def test_a_crash_kills_its_worker_process_and_the_numbers_are_those_of_one_process(
    method: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(KILL_TRACE)
    threads = _run(_config(method, tmp_path / "threads", trace, processes=False))
    assert _killed(capfd.readouterr().out) == []
    processes = _run(_config(method, tmp_path / "processes", trace, processes=True))
    assert _killed(capfd.readouterr().out) == [(2, 2)]
    _same_numbers(processes, threads)
    assert [r["quorum"] for r in processes[0]] == [3, 3, 2, 2, 2, 2, 2, 2]
    assert processes[1]["faults"]["rounds_dropped"] == (1 if method == "ddp" else 0)


#: Two crashes for good on four workers, a leave and its rejoin between them: the killed
#: workers' processes end at steps 2 and 6, the one that left keeps its process.
TWO_KILLS_TRACE = """\
step=2  worker=2  crash
step=3  worker=1  leave
step=5  worker=1  rejoin
step=6  worker=3  crash
step=4  worker=3  slow factor=2 for=2
"""


@pytest.mark.parametrize("method", ["streaming_diloco", "demo", "sparta"])
def test_two_workers_killed_on_four_give_the_numbers_of_one_process(
    method: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(TWO_KILLS_TRACE)
    threads = _run(_config(method, tmp_path / "t", trace, processes=False, workers=4))
    processes = _run(_config(method, tmp_path / "p", trace, processes=True, workers=4))
    assert sorted(_killed(capfd.readouterr().out)) == [(2, 2), (3, 6)]
    _same_numbers(processes, threads)
    assert [r["quorum"] for r in processes[0]] == [4, 4, 3, 2, 2, 3, 2, 2]


def test_a_crash_placed_by_time_kills_at_the_step_it_lands_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("t=0.05 worker=2 crash\nt=0.1 link factor=0.5 for=0.3\n")
    threads = _run(_config("ddp", tmp_path / "threads", trace, processes=False))
    processes = _run(_config("ddp", tmp_path / "processes", trace, processes=True))
    _same_numbers(processes, threads)
    (killed,) = _killed(capfd.readouterr().out)
    first = next(r["step"] for r in processes[0] if r["quorum"] == 2)
    assert killed == (2, first)


@pytest.mark.parametrize(
    ("trace_text", "worker"),
    [(KILL_TRACE, 2), ("step=2 worker=0 crash\nstep=5 worker=0 join\n", 0)],
)
@pytest.mark.parametrize("processes_again", [True, False])
def test_a_checkpoint_after_a_kill_resumes_to_the_uninterrupted_numbers(
    trace_text: str, worker: int, processes_again: bool, tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The run stops after step 4 with a worker killed at step 2: the checkpoint holds its
    file as its thread would have it, so the run resumed in processes (its process killed
    again at the start, a standing process taking over at its join) or in one process ends on
    the numbers of the run without a stop."""
    trace = tmp_path / "trace.txt"
    trace.write_text(trace_text)
    whole = _run(_config("diloco", tmp_path / "whole", trace, processes=False))
    out = tmp_path / "resumed"
    config = _config("diloco", out, trace, processes=True)
    config.run.stop_after = 4
    assert run_training(config, report=None) is None  # (stopped, with a checkpoint)
    assert _killed(capfd.readouterr().out) == [(worker, 2)]
    config = _config("diloco", out, trace, processes=processes_again)
    config.run.resume = str(out)
    _same_numbers(_run(config), whole)


#: Worker 1 crashes twice and is replaced each time; worker 2 leaves and rejoins with its
#: state. So worker 1's slot has three processes in turn (ranks 1-3) and worker 2 keeps its
#: own (rank 4): five processes.
REPLACED_TRACE = """\
step=1  worker=1  crash
step=3  worker=1  join
step=2  worker=2  leave
step=4  worker=2  rejoin
step=5  worker=1  crash
step=6  worker=1  join
"""


@pytest.mark.parametrize("method", ["ddp", "diloco"])
def test_each_crash_kills_its_process_and_a_standing_process_takes_over_at_the_join(
    method: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(REPLACED_TRACE)
    threads = _run(_config(method, tmp_path / "threads", trace, processes=False))
    config = _config(method, tmp_path / "processes", trace, processes=True)
    assert process_layout(config) == (0, 1, 1, 1, 2)
    processes = _run(config)
    assert sorted(_killed(capfd.readouterr().out, processes=[1, 2])) == [(1, 1), (1, 5)]
    _same_numbers(processes, threads)
    assert [r["quorum"] for r in processes[0]] == [3, 2, 1, 2, 3, 2, 3, 3]


@pytest.mark.parametrize(
    ("trace_text", "quorums"),
    [
        ("step=2 worker=0 crash\n", [3, 3, 2, 2, 2, 2, 2, 2]),
        ("step=2 worker=0 crash\nstep=5 worker=0 join\n", [3, 3, 2, 2, 2, 3, 3, 3]),
    ],
)
def test_worker_0_killed_hands_the_run_directory_to_the_lowest_live_worker(
    trace_text: str, quorums: list[int], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Worker 0's process writes the run directory until its crash kills it; the lowest live
    worker writes on from the steps already there, with the same numbers."""
    trace = tmp_path / "trace.txt"
    trace.write_text(trace_text)
    threads = _run(_config("diloco", tmp_path / "threads", trace, processes=False))
    processes = _run(_config("diloco", tmp_path / "processes", trace, processes=True))
    assert _killed(capfd.readouterr().out, processes=[0]) == [(0, 2)]
    _same_numbers(processes, threads)
    assert [r["quorum"] for r in processes[0]] == quorums
    assert processes[1]["bytes_by_role"] == threads[1]["bytes_by_role"]


@pytest.mark.parametrize(
    ("trace_text", "quorums", "killed"),
    [
        ("step=2 worker=2 crash\nstep=5 worker=2 join\n", [3, 3, 2, 2, 2, 3, 3, 3], (2, 2)),
        ("t=0 worker=1 crash\n", [2] * 8, (1, 0)),
    ],
)
def test_on_the_real_clock_a_crash_kills_its_process_at_the_step_it_lands_on(
    trace_text: str, quorums: list[int], killed: tuple[int, int], tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Worker processes on the real clock: the crash kills the process at its step (one placed
    at time 0 lands on the first step, whatever the machine's speed), a join is taken over by
    the process standing by, and the run ends with its faults block."""
    trace = tmp_path / "trace.txt"
    trace.write_text(trace_text)
    config = _config("diloco", tmp_path / "real", trace, processes=True)
    config.comm.clock, config.comm.seconds_per_microbatch = "real", None
    config.fault.fault_detection_s = 0.05
    records, summary = _run(config)
    assert _killed(capfd.readouterr().out) == [killed]
    assert [r["quorum"] for r in records] == quorums
    assert summary["clock"] == "real"
    assert summary["faults"]["membership_changes"][0]["step"] == killed[1]
