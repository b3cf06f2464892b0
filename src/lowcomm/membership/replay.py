"""A fault trace (``--faults``, ``--fault-*``) replayed on the real worker processes of a
local ``--membership torchft`` job, and the job's goodput.

The simulated run of the same trace charges what each event costs on its clock; here the
events happen to processes:

- **crash** and **leave**: the launcher SIGKILLs the slot's worker process. An event placed by
  step is met at the start of that step: the worker, reaching it, publishes its step and waits
  there, so the kill lands at the step and not somewhere in the next one. An event placed by
  time is met at that many wall seconds after the job's training started (every first worker
  past its startup round). torchft cannot tell a leave from a crash, and neither can a kill.
- **join** and **rejoin**: the launcher starts a new worker process in the slot once the live
  workers reach the step (or at the time); it joins at their next round and is healed from a
  live one (a rejoin is healed too: the killed process kept no state).
- **slow**: the slot's worker sleeps after each step its factor less one times the step's own
  wall time, while the event is active.
- **link** (degraded or down): every worker's emulated link follows the event, as a simulated
  run's (:func:`link_time`): a transfer that starts on a link degraded to F takes its cost over
  F, one that starts while the link is down waits until it is up. An event placed by step is
  read at the step the worker trains, one placed by time on the job's run time.

With checkpoints the trace goes on where the job stopped: a resumed job's launcher replays the
events at or after the resume step (or, placed by time, after the run time the stopped job
reached), and its workers' run time continues the stopped job's (:attr:`Channel.before`).

**Goodput** (:func:`job_goodput`) is the simulated run's, on the wall clock: the tokens the
job committed over the tokens its M workers compute in the same time with no fault. Each
worker counts its step's tokens as pending and commits them when a round it takes part in
commits (a healed worker's first round, which it sits out, commits none of its own); a killed
worker's pending tokens are lost. The fault-free step time is the mean wall time of the
steps that ran with every worker in the quorum, no membership change and no slow worker,
over every worker; the time is from the training start to the last worker's last step.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowcomm.config import ConfigError

if TYPE_CHECKING:
    from lowcomm.config import TrainConfig
    from lowcomm.faults.trace import Event, FaultTrace

__all__ = ["Channel", "Replay", "job_goodput", "link_time", "replay_refusal", "trace_of"]

#: How often the launcher looks at the workers' steps and the time.
POLL_S = 0.01

#: Seconds a worker at its declared crash waits for the launcher's SIGKILL before it ends
#: itself (the launcher polls every POLL_S, so only a launcher that is gone leaves it waiting).
KILL_WAIT_S = 120.0

#: A slot's step before its worker has trained (and after its process died).
NOT_TRAINING = -1


def trace_of(config: TrainConfig) -> FaultTrace | None:
    """The job's trace (None: no faults), read or generated and validated."""
    from lowcomm.faults.run import run_trace

    return run_trace(config)


def replay_refusal(config: TrainConfig, trace: FaultTrace) -> str | None:
    """Why this trace cannot be replayed on live workers (one line), or None."""
    if config.placement.membership_options.lighthouse is not None:
        return (
            "--faults / --fault-* with --membership.lighthouse: the local launcher replays a "
            "trace on its worker processes; on a cluster, kill and start workers yourself"
        )
    return None


def without_faults(config: TrainConfig) -> TrainConfig:
    """The worker's own config: its trace is replayed on it by the launcher, not simulated."""
    from dataclasses import replace

    fault = replace(
        config.fault, faults=None, fault_mtbf_s=None, fault_replace_after_s=None,
        fault_slow_fraction=None, fault_slow_factor=None, fault_seed=None,
    )  # fmt: skip
    return replace(config, fault=fault)


@dataclass
class Channel:
    """What the launcher and a worker process share: every slot's current step and the
    wall time the job's training started (0 until it has)."""

    steps: Any  # (a multiprocessing Array of int, one per slot)
    started: Any  # (a multiprocessing Value of double)
    before: Any  # (the run seconds of the trace replayed before a resume: a Value of double)

    @classmethod
    def make(cls, context: Any, workers: int) -> Channel:
        return cls(
            context.Array("i", [NOT_TRAINING] * workers, lock=False),
            context.Value("d", 0.0, lock=False),
            context.Value("d", 0.0, lock=False),
        )

    def run_s(self) -> float | None:
        """The trace's run time now: seconds since the job's training started, plus those
        of the job it resumed (None: not started)."""
        started = float(self.started.value)
        return time.time() - started + float(self.before.value) if started > 0 else None


@dataclass
class WorkerReplay:
    """A worker's side of the replay: publish its steps, wait for the kill at a crash placed
    on its step, sleep its slowdown."""

    channel: Channel
    trace: FaultTrace
    slot: int
    since_step: int = 0
    """The step this process started at: the trace's crashes before it were its predecessor's."""
    step: int = 0
    """The step it trains (the moment of the trace's events placed by step)."""
    assembling: int | None = None
    """How many workers start the job together, which its first round waits for: a resumed
    job's slots that had a worker at the stop (None: --workers)."""
    reports: bool = True
    """Whether this process publishes the worker's step: a worker of several ranks is killed
    once its rank 0, which writes the worker's records, has reached the crash's step (a rank
    that published first could have it killed before rank 0 wrote its last step)."""

    def at_step(self, step: int) -> None:
        """The worker is at the start of ``step``: say so, and stop here if the trace kills it
        here (the launcher's SIGKILL ends the process)."""
        if self.reports:
            self.channel.steps[self.slot] = step
        self.step = step
        if (
            any(
                e.kind in ("crash", "leave") and e.worker == self.slot and e.at_step == step
                for e in self.trace.events
            )
            and step >= self.since_step
        ):
            # Until the launcher's SIGKILL; a launcher that is gone sends none, so the
            # worker ends itself rather than stay behind.
            deadline = time.monotonic() + KILL_WAIT_S
            while time.monotonic() < deadline and os.getppid() != 1:
                time.sleep(1.0)
            raise SystemExit(
                f"worker {self.slot}: the launcher did not end it at its declared crash at "
                f"step {step} within {KILL_WAIT_S:g} s; ending it here"
            )

    def has_link_events(self) -> bool:
        return any(e.kind in ("link_degraded", "link_down") for e in self.trace.events)

    def link_model(self, clock_now: Callable[[], float]) -> Callable[[float, float], float]:
        """The emulated link's model under the trace's link events (``NetworkComm.link_model``,
        as a simulated run's): a transfer of modeled cost ``cost`` starting at ``start`` on
        the worker's clock (``clock_now``'s) takes ``cost / F`` on a link degraded to F, and
        on a link that is down starts once it is up. The trace's time is the job's run time,
        which the worker's clock is offset from by what they read now."""

        def transfer_time(start: float, cost: float) -> float:
            run_s = self.channel.run_s()
            moment = start + (0.0 if run_s is None else run_s - clock_now())
            return link_time(self.trace, self.step, moment, cost)

        return transfer_time

    def slow_down(self, step: int, step_s: float) -> bool:
        """Sleep the step's slowdown; whether the worker was slow at this step."""
        factor = _speed(self.trace, self.slot, step, self.channel.run_s())
        if factor > 1.0:
            time.sleep((factor - 1.0) * step_s)
            return True
        return False


def link_time(trace: FaultTrace, step: int, time_s: float, cost: float) -> float:
    """How long a transfer of modeled cost ``cost`` that starts at run time ``time_s`` of
    ``step`` takes under the trace's link events (the simulated run's rule,
    :meth:`lowcomm.faults.engine.WorkerFaults.transfer_time`): the wait for a link that is
    down (placed by time), then ``cost / F``."""
    begin = time_s
    factor = trace.link_factor(step=step, time=begin)
    while factor == 0.0:
        begin = max(
            event.at + float(event.duration or 0.0)
            for event in trace.events
            if event.kind == "link_down"
            and event.at_time is not None
            and event.at <= begin < event.at + float(event.duration or 0.0)
        )
        factor = trace.link_factor(step=step, time=begin)
    return (begin - time_s) + cost / factor


def _speed(trace: FaultTrace, slot: int, step: int, now: float | None) -> float:
    factor = 1.0
    for event in trace.events:
        if event.kind != "slow" or event.worker != slot:
            continue
        if event.at_step is not None:
            moment: float | None = float(step)
        else:
            moment = now
        if moment is None or moment < event.at:
            continue
        if event.duration is not None and moment >= event.at + event.duration:
            continue
        assert event.factor is not None
        factor *= event.factor
    return factor


@dataclass
class Replay:
    """The launcher's side: meets each crash, leave, join and rejoin of the trace on the
    job's processes (:class:`lowcomm.membership.local.LocalJob`)."""

    trace: FaultTrace
    channel: Channel
    workers: int
    since: tuple[int, float] = (0, 0.0)
    """Where a resumed job's trace stands (step, run seconds): the events before it
    happened in the job it resumes."""
    first: list[int] | None = None
    """The slots with a worker at the job's start (None: every slot)."""
    pending: list[Event] = field(default_factory=list)
    #: What the launcher did: each kill and start, with its wall time and the live steps.
    log: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        step, run_s = self.since
        self.pending = [
            event
            for event in self.trace.membership_events()
            if (event.at >= step if event.at_step is not None else event.at >= run_s)
        ]
        self.channel.before.value = run_s

    def training_started(self) -> float | None:
        """The wall time every first worker was past its startup round (None: not yet)."""
        started = float(self.channel.started.value)
        if started > 0:
            return started
        first = range(self.workers) if self.first is None else self.first
        if all(self.channel.steps[k] >= 0 for k in first):
            self.channel.started.value = time.time()
            return float(self.channel.started.value)
        return None

    def poll(self, job: Any) -> None:
        """Meet every event that is due now."""
        if self.training_started() is None:
            return
        now = self.channel.run_s()
        assert now is not None
        live_steps = [
            int(self.channel.steps[k])
            for k in range(self.workers)
            if job.alive(k) and self.channel.steps[k] >= 0
        ]
        while self.pending:
            event = self.pending[0]
            assert event.worker is not None
            if event.kind in ("crash", "leave"):
                if event.at_step is not None:
                    due = job.alive(event.worker) and self.channel.steps[event.worker] >= event.at
                else:
                    due = now >= event.at
            elif event.at_step is not None:
                due = bool(live_steps) and max(live_steps) >= event.at
            else:
                due = now >= event.at
            if not due:
                return
            self.pending.pop(0)
            entry: dict[str, Any] = {
                "event": event.kind, "worker": event.worker, "trace": event.to_text().strip(),
                "time": time.time(), "run_s": now, "live_steps": live_steps,
            }  # fmt: skip
            if event.kind in ("crash", "leave"):
                if job.alive(event.worker):
                    entry["killed"] = job.kill(event.worker)
                self.channel.steps[event.worker] = NOT_TRAINING
            else:
                since = max(live_steps) if live_steps else 0
                job.start(event.worker, since_step=int(since))
            self.log.append(entry)

    def run(self, job: Any) -> None:
        """Meet the events until every worker process has ended."""
        while job.any_alive():
            self.poll(job)
            time.sleep(POLL_S)


def job_goodput(
    config: TrainConfig, records: list[dict[str, Any]], started: float | None
) -> dict[str, Any]:
    """The job's goodput from every worker process's membership.json ``records`` (the
    module docstring); None figures where the job never trained or no step was clean."""
    from lowcomm.faults import goodput as accounting
    from lowcomm.membership.records import part_committed_tokens

    # (A resumed worker's record goes on from its checkpoint's; the job's part is its own.)
    committed = sum(part_committed_tokens(r) for r in records)
    clean_s = sum(float(r.get("clean_step_s") or 0.0) for r in records)
    clean_n = sum(int(r.get("clean_steps") or 0) for r in records)
    ends = [float(r["trained_until"]) for r in records if r.get("trained_until")]
    ratio: float | None = None
    lost: float | None = None
    span = None if started is None or not ends else max(ends) - started
    step_s = clean_s / clean_n if clean_n else None
    if span is not None and span > 0 and step_s is not None and step_s > 0:
        per_step = config.run.microbatches_per_step * config.tokens_per_microbatch()
        free = accounting.fault_free_tokens(
            workers=config.placement.workers, tokens_per_worker_step=per_step, fault_free_step_s=step_s,
            modeled_s=span,
        )  # fmt: skip
        ratio = accounting.goodput(committed_tokens=committed, fault_free_tokens=free)
        lost = accounting.worker_seconds_lost(
            workers=config.placement.workers, modeled_s=span, goodput=min(ratio, 1.0)
        )
    return {
        "committed_tokens": committed,
        "goodput": ratio,
        "worker_seconds_lost": lost,
        "fault_free_step_s": step_s,
        "run_s": span,
    }


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def check_replay(config: TrainConfig) -> FaultTrace | None:
    """The job's trace, refused in one line if it cannot be replayed on live workers."""
    trace = trace_of(config)
    if trace is None:
        return None
    problem = replay_refusal(config, trace)
    if problem is not None:
        raise ConfigError(problem)
    return trace
