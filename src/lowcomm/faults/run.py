"""A training run's faults: which trace it replays, and what it refuses.

``lowcomm train`` takes either a trace file (``--faults FILE``) or generated-trace options
(``--fault-mtbf-s``, ``--fault-replace-after-s``, ``--fault-slow-fraction``,
``--fault-slow-factor``, ``--fault-seed``), never both; ``--fault-detection-s`` (torchft's
heartbeat timeout by default) goes with either.

**The generated trace's horizon.** Each worker slot draws its events from its own seeded
stream, one after the other, so a longer horizon only appends events: the events of a run are
the same whatever horizon covers it. The horizon is therefore not a run setting (no option
sets it). A trace without crashes covers :data:`GENERATED_HORIZON_S` modeled seconds. One
with crashes first covers :data:`FIRST_HORIZON_MTBFS` mean times between failures (capped at
:data:`GENERATED_HORIZON_S`), a few events per worker whatever the failure rate; when the
run's clock passes it, every worker extends it to twice as long at the same step (the step's
start is agreed, :mod:`lowcomm.faults.engine`), which appends the next events
(:func:`trace_extension`). A generated trace is made once per process and shared by its
workers.

**What runs with faults today.** Every worker as a thread of one process
(``--workers-per-process`` equal to ``--workers``), on either clock; as a process of its
own (``--workers-per-process 1``, the local launch or torchrun, on cpu, on either clock:
:mod:`lowcomm.faults.processes`), one rank per worker; or as one of K threads in each of
several processes (the local launch or torchrun, on cpu, on either clock:
:mod:`lowcomm.faults.stacked`, where a crash stops its worker's thread and no process is
killed). Under torchrun no process is killed either (its elastic agent would stop or
restart every worker): a crashed worker's process loses its state in place and waits outside
the quorum (:func:`lowcomm.faults.processes.lose_state`). A worker of several ranks (replicated)
runs as R threads of one process or of several, or as R processes (one per rank,
:mod:`lowcomm.faults.processes`): a crash takes its R ranks, and a join heals each of them
over its rank's outer group;
membership events (crash, leave, join, rejoin) placed by step (``step=N``) or by time
(``t=SECONDS``: each lands on the first step whose start, on the run's clock, is at or after
it; :mod:`lowcomm.faults.engine`); slow events by step or by time. The methods are those whose lost worker takes no state the others need and whose
membership rule is declared (:func:`supported_methods`); the methods whose optimizer state is
sharded across workers are refused with that reason (:data:`SHARDED_METHODS`); any other
method is refused as not yet supported. Link events scale (or stop) the modeled transfers of
the strategy's link; a link down is placed by time. Each refusal is one line, before any worker starts.

**The real clock.** The same engine runs on ``--clock real``: an event placed by time lands
on the first step starting at or after it on the wall clock (the workers' real clocks, agreed
as on the virtual clock), a slow worker's clock really sleeps its factor on its compute, the
detection of a crash and a wait for the quorum are real sleeps (exposed time), and a link
event stretches the real wait for each transfer it covers. A replay is then not bit for bit:
where a time-placed event lands depends on the machine's speed. On a GPU's real clock a
transfer is timed on the device, where the link's factor is not applied, so link events are
refused there.

**Checkpoints.** A run with faults checkpoints and resumes exactly: each worker saves where it
stands in the trace (:meth:`lowcomm.faults.engine.WorkerFaults.state_dict`), and the
checkpoint's fingerprint names the trace (:func:`faults_identity`), so a resume replays only
the trace it was written with.

Nothing here reads a file but :func:`run_trace` (the launch's pre-flight calls it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowcomm.faults.generate import TORCHFT_HEARTBEAT_TIMEOUT_S, FaultOptions, generate_trace
from lowcomm.faults.trace import FaultTrace, TraceError, load_trace

if TYPE_CHECKING:
    from lowcomm.config import FaultConfig, TrainConfig

__all__ = [
    "FIRST_HORIZON_MTBFS",
    "GENERATED_HORIZON_S",
    "SHARDED_METHODS",
    "FaultFlags",
    "FaultSettings",
    "check_values",
    "faults_identity",
    "faults_refusal",
    "run_trace",
    "supported_methods",
    "trace_extension",
    "trace_notes",
    "with_fault_placement",
]

#: Modeled seconds a generated trace covers (about 11.6 days of modeled time).
GENERATED_HORIZON_S = 1e6
#: A generated trace with crashes first covers this many mean times between failures.
FIRST_HORIZON_MTBFS = 8.0


def supported_methods() -> list[str]:
    """The methods that run with --faults: those that declare a membership rule."""
    from lowcomm.strategies import STRATEGIES

    return sorted(name for name, cls in STRATEGIES.items() if cls.membership is not None)


#: Methods whose optimizer state is sharded across workers: a lost worker takes a shard the
#: others need, and none of them re-shards from the survivors yet.
SHARDED_METHODS: frozenset[str] = frozenset({"zero1", "acco", "dpu", "wp"})


@dataclass(frozen=True)
class FaultSettings:
    """The fault options of a run (the ``--faults`` / ``--fault-*`` fields of TrainConfig)."""

    path: str | None
    mtbf_s: float | None
    replace_after_s: float | None
    slow_fraction: float | None
    slow_factor: float | None
    detection_s: float
    seed: int | None
    min_workers: int = 1
    quorum_wait_s: float = 1800.0

    @classmethod
    def of(cls, options: FaultConfig) -> FaultSettings:
        return cls(
            path=options.faults,
            mtbf_s=options.fault_mtbf_s,
            replace_after_s=options.fault_replace_after_s,
            slow_fraction=options.fault_slow_fraction,
            slow_factor=options.fault_slow_factor,
            detection_s=options.fault_detection_s,
            seed=options.fault_seed,
            min_workers=options.fault_min_workers,
            quorum_wait_s=options.fault_quorum_wait_s,
        )

    @property
    def generated_flags(self) -> list[str]:
        """The generated-trace options that were given."""
        given = {
            "--fault-mtbf-s": self.mtbf_s,
            "--fault-replace-after-s": self.replace_after_s,
            "--fault-slow-fraction": self.slow_fraction,
            "--fault-slow-factor": self.slow_factor,
            "--fault-seed": self.seed,
        }
        return [flag for flag, value in given.items() if value is not None]

    @property
    def enabled(self) -> bool:
        """Whether the run replays a trace (a file or a generated one)."""
        return self.path is not None or bool(self.generated_flags)

    def generated_options(self) -> FaultOptions:
        """The generated trace's options (defaults: no crash, no straggler, seed 0)."""
        return FaultOptions.given(
            duration_s=GENERATED_HORIZON_S,
            detection_s=self.detection_s,
            mtbf_s=self.mtbf_s,
            replace_after_s=self.replace_after_s,
            slow_fraction=self.slow_fraction,
            slow_factor=self.slow_factor,
            seed=self.seed,
        )


@dataclass
class FaultFlags:
    """The fault options a study (``bench compare``, ``reproduce``) gives every run it makes,
    as ``lowcomm train`` spells them; unset ones keep each run's own value."""

    faults: str | None = None
    """Replay this fault trace in every run (as lowcomm train --faults)."""

    fault_mtbf_s: float | None = None
    """Generated trace for every run: each worker's mean time between failures (s)."""

    fault_replace_after_s: float | None = None
    """Generated trace: seconds from a crash until a replacement joins."""

    fault_slow_fraction: float | None = None
    """Generated trace: the fraction of worker slots that straggle."""

    fault_slow_factor: float | None = None
    """Generated trace: a straggler's compute slowdown (>= 1)."""

    fault_detection_s: float | None = None
    """Seconds until the survivors detect a crash (default: lowcomm train's, torchft's
    heartbeat timeout)."""

    fault_seed: int | None = None
    """Generated trace: the seed of its draws (default 0): every run replays the same events."""

    fault_min_workers: int | None = None
    """The fewest live workers a round's quorum needs (default 1)."""

    fault_quorum_wait_s: float | None = None
    """Seconds a run waits for its quorum before it ends with a checkpoint (default 1800)."""

    def given(self) -> dict[str, Any]:
        """The options given, by their TrainConfig field names."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def flags(self) -> list[str]:
        """The options given, as command-line flags."""
        return [
            word
            for name, value in self.given().items()
            for word in (f"--{name.replace('_', '-')}", str(value))
        ]

    def merged(self, train: TrainConfig) -> TrainConfig:
        """``train`` (a study's shared training options) with these options set. An option
        given both here and under ``--train.`` with another value is refused; a run with
        faults runs its workers as threads of one process (``--workers-per-process``
        ``--workers`` when left at 1).

        Raises:
            ValueError: in one line.
        """
        defaults = type(train.fault)()  # (every option here is one of the fault component's)
        changes: dict[str, Any] = {}
        for name, value in self.given().items():
            under_train = getattr(train.fault, name)
            if under_train not in (value, getattr(defaults, name)):
                flag = name.replace("_", "-")
                raise ValueError(
                    f"--{flag}: given both as --{flag} {value} and as --train.{flag} "
                    f"{under_train}; they are one option, give it once"
                )
            changes[name] = value
        merged = replace(train, fault=replace(train.fault, **changes))
        return with_fault_placement(merged)


def with_fault_placement(config: TrainConfig) -> TrainConfig:
    """``config`` with its workers as threads of one process when it has faults and left
    ``--workers-per-process`` at 1 (faults run in that placement; unchanged otherwise)."""
    placement = config.placement
    if FaultSettings.of(config.fault).enabled and placement.workers_per_process == 1:
        return replace(config, placement=replace(placement, workers_per_process=placement.workers))
    return config


def check_values(settings: FaultSettings, workers: int | None = None) -> str | None:
    """The generated options', the detection time's and the quorum's own rules, in one
    line; the quorum's bound by the run's ``workers`` when given."""
    checks: list[tuple[str, float | None, bool, str]] = [
        (
            "--fault-detection-s",
            settings.detection_s,
            math.isfinite(settings.detection_s) and settings.detection_s >= 0,
            f"detection takes a finite time >= 0 seconds; e.g. {TORCHFT_HEARTBEAT_TIMEOUT_S:g} "
            "(torchft's heartbeat timeout, the default)",
        ),
        (
            "--fault-min-workers",
            settings.min_workers,
            1 <= settings.min_workers <= (settings.min_workers if workers is None else workers),
            f"a quorum needs between 1 and --workers ({workers}) live workers; e.g. 1 (the default)"
            if workers is not None
            else "a quorum needs 1 or more live workers; e.g. 1 (the default)",
        ),
        (
            "--fault-quorum-wait-s",
            settings.quorum_wait_s,
            math.isfinite(settings.quorum_wait_s) and settings.quorum_wait_s >= 0,
            "a run waits a finite time >= 0 seconds for its quorum; e.g. 1800 (the default)",
        ),
    ]
    if settings.mtbf_s is not None:
        ok = settings.mtbf_s > 0 and not math.isnan(settings.mtbf_s)
        checks.append(
            ("--fault-mtbf-s", settings.mtbf_s, ok, "a mean time between failures is > 0 seconds")
        )
    if settings.replace_after_s is not None:
        ok = settings.replace_after_s >= 0
        checks.append(
            (
                "--fault-replace-after-s",
                settings.replace_after_s,
                ok,
                "a replacement joins >= 0 seconds after the crash (inf: never)",
            )
        )
    if settings.slow_fraction is not None:
        ok = 0 <= settings.slow_fraction <= 1
        checks.append(
            ("--fault-slow-fraction", settings.slow_fraction, ok, "a fraction in [0, 1], e.g. 0.1")
        )
    if settings.slow_factor is not None:
        ok = math.isfinite(settings.slow_factor) and settings.slow_factor >= 1
        checks.append(("--fault-slow-factor", settings.slow_factor, ok, "a slowdown >= 1, e.g. 3"))
    if settings.seed is not None:
        ok = settings.seed >= 0
        checks.append(("--fault-seed", settings.seed, ok, "a whole number >= 0, e.g. 0"))
    for flag, value, ok, rule in checks:
        if not ok:
            return f"{flag}: {value} is not valid: {rule}"
    return None


def faults_refusal(config: TrainConfig) -> str | None:
    """Why this run's fault options cannot run (one line naming the option, the value, the
    rule and the fix), or None. Reads no file."""
    settings = FaultSettings.of(config.fault)
    problem = check_values(settings, config.placement.workers)
    if problem is not None:
        return problem
    if not settings.enabled:
        return None
    generated = settings.generated_flags
    if settings.path is not None and generated:
        return (
            f"--faults {settings.path} with {generated[0]}: a run replays one trace, a file or "
            "a generated one; drop --faults or the --fault-* options (--fault-detection-s "
            "goes with either)"
        )
    flag = f"--faults {settings.path}" if settings.path is not None else generated[0]
    # (--membership torchft replays the trace on its own processes: its placement rules
    # are lowcomm.membership.options')
    placed = None if config.placement.membership == "torchft" else _placement_refusal(config, flag)
    problem = placed or _method_refusal(config, flag)
    if problem is not None:
        return problem
    if config.optim.name != "adamw":
        return f"{flag}: not yet supported with --optim.name {config.optim.name}; use adamw"
    quantization = getattr(getattr(config, "diloco", None), "quantization", "none")
    if config.method in ("diloco", "diloco_delayed", "eager") and quantization != "none":
        return (
            f"{flag}: not yet supported with --diloco.quantization {quantization} (its "
            "two-step exchange is laid out for every worker); use none"
        )
    return None


def _placement_refusal(config: TrainConfig, flag: str) -> str | None:
    """Why the run's placement cannot replay faults yet, or None."""
    placement = config.placement
    supported = (
        "faults run today with every worker a thread of one process "
        f"(--workers-per-process {placement.workers}, either clock), a process of its own "
        "(--workers-per-process 1, on cpu: local launch or torchrun, either clock) or one of "
        "K threads in each of several processes (--workers-per-process K dividing --workers, "
        "on cpu: local launch or torchrun, either clock), a worker of several ranks "
        "replicated (as threads or as a process per rank) or sharded (--worker-sharding fsdp, "
        "a process per rank)"
    )
    in_process = placement.workers_per_process == placement.workers
    if not in_process and config.placement.device != "cpu":
        return (
            f"{flag}: not yet supported with worker processes on --device {config.placement.device} "
            f"(the quorum's groups are checked on Gloo only); {supported}"
        )
    return None


def _method_refusal(config: TrainConfig, flag: str) -> str | None:
    """Why the run's method cannot replay faults, or None: its state is sharded across
    workers, or it has no membership rule yet."""
    from lowcomm.strategies import strategy_class

    supported = ", ".join(supported_methods())
    if config.method in SHARDED_METHODS:
        return (
            f"{flag}: --method {config.method} keeps its optimizer state sharded across "
            "workers, so a lost worker takes a shard the others need (it does not re-shard "
            f"from the survivors); use {supported} with faults"
        )
    if strategy_class(config.method).membership is None:
        return (
            f"{flag}: --method {config.method} is not yet supported with --faults; use {supported}"
        )
    desloc = getattr(config, "desloc", None)
    if (
        getattr(desloc, "rejoin_step", None) is not None
        and strategy_class(config.method).options_field == "desloc"
    ):
        return (
            f"{flag}: not with --desloc.rejoin-step, a rejoin of its own; write the rejoin in "
            "the trace (step=N worker=K rejoin after a leave)"
        )
    return None


#: How a checkpoint's fingerprint names a trace file: by its content.
TRACE_DIGEST = "sha256:"


def trace_digest(path: str) -> str:
    """A trace file's identity: ``sha256:<hex>`` of its bytes (its path as given where it
    cannot be read; the pre-flight names that problem)."""
    try:
        return TRACE_DIGEST + hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
    except OSError:
        return path


def faults_identity(config: TrainConfig) -> dict[str, object] | None:
    """What a checkpoint's state depends on in the run's faults (None: no faults): the trace
    (a file by its content, a generated one by its options), the workers it was validated
    against and the detection time. A resume must replay the same trace from the saved
    cursor, so a checkpoint is resumed only under the same identity. How long a run waits
    for a quorum and how few workers form one are not in it: a run that ended waiting for
    its quorum continues with other values of those."""
    settings = FaultSettings.of(config.fault)
    if not settings.enabled:
        return None
    trace: dict[str, object] | str
    if settings.path is not None:
        trace = trace_digest(settings.path)
    else:
        trace = {
            "mtbf_s": settings.mtbf_s,
            "replace_after_s": settings.replace_after_s,
            "slow_fraction": settings.slow_fraction,
            "slow_factor": settings.slow_factor,
            "seed": settings.seed,
        }
    return {
        "trace": trace,
        "workers": config.placement.workers,
        "detection_s": settings.detection_s,
    }


def run_trace(config: TrainConfig) -> FaultTrace | None:
    """The trace this run replays (None without faults), read or generated and validated
    against its workers: a malformed line (with its line number), worker 7 of 4 or a trace
    leaving no worker alive ends here, before any worker starts.

    Raises:
        TraceError: in one line (a ValueError, which ``lowcomm train`` prints as its error).
    """
    settings = FaultSettings.of(config.fault)
    if not settings.enabled:
        return None
    if settings.path is not None:
        trace = load_trace(settings.path, workers=config.placement.workers)
    else:
        trace = _generated(
            settings.generated_options(), config.placement.workers, _first_horizon(settings)
        )
    stepped_down = [e for e in trace.events if e.kind == "link_down" and e.at_step is not None]
    if stepped_down:
        event = stepped_down[0]
        line = f":{event.line}" if event.line else ""
        raise TraceError(
            f"{trace.source}{line}: {' '.join(event.to_text().split())!r}: a link down placed "
            "by step would stop the step that must end it; place it with t=SECONDS for=D"
        )
    _check_minimum(trace, settings.min_workers)
    linked = [e for e in trace.events if e.kind in ("link_degraded", "link_down")]
    if linked and config.comm.clock == "real" and config.placement.device != "cpu":
        event = linked[0]
        line = f":{event.line}" if event.line else ""
        raise TraceError(
            f"{trace.source}{line}: {' '.join(event.to_text().split())!r}: link events are "
            f"not yet modeled on the real clock of a GPU (--device {config.placement.device}: a transfer "
            "is timed on the device, where the link's factor is not applied); use --clock "
            "virtual or --device cpu, or drop the link events"
        )
    return trace


def trace_notes(trace: FaultTrace | None, config: TrainConfig) -> str | None:
    """What to say before a run replays ``trace`` (None: nothing): a trace file with no event
    (the run has no fault; an empty or comment-only file is valid, the fault-free baseline of
    a study), and events placed by step at or past ``--steps``, which never happen."""
    if trace is None:
        return None
    notes = []
    path = FaultSettings.of(config.fault).path
    if path is not None and not trace.events:
        notes.append(
            f"lowcomm: note: --faults {path} holds no event (only blank or # lines): the run "
            "has no fault; write one event a line, e.g. 'step=40 worker=3 crash'"
        )
    steps = config.run.steps
    late = [e for e in trace.events if e.at_step is not None and e.at_step >= steps]
    if late:
        first = late[0]
        line = f":{first.line}" if first.line else ""
        more = f" (and {len(late) - 1} more)" if len(late) > 1 else ""
        notes.append(
            f"lowcomm: note: {trace.source}{line}: {' '.join(first.to_text().split())!r}{more} "
            f"is at or past --steps {steps} (steps 0 to {steps - 1}): it never happens"
        )
    return "\n".join(notes) if notes else None


def _check_minimum(trace: FaultTrace, min_workers: int) -> None:
    """Refuse a trace placed by step that leaves fewer than ``min_workers`` alive: a run
    below its quorum takes no step, so the step of the join it waits for never comes (a
    trace placed by time is waited out on the run's clock, :mod:`lowcomm.faults.engine`).

    Raises:
        TraceError: in one line naming the event, the count and the fix.
    """
    events = trace.membership_events()
    if min_workers <= 1 or not events or events[0].at_step is None:
        return
    alive = set(range(trace.workers))
    for index, event in enumerate(events):
        assert event.worker is not None
        if event.kind in ("crash", "leave"):
            alive.discard(event.worker)
        else:
            alive.add(event.worker)
        moment_ends = index + 1 == len(events) or events[index + 1].at != event.at
        if moment_ends and len(alive) < min_workers:
            line = f":{event.line}" if event.line else ""
            raise TraceError(
                f"{trace.source}{line}: {' '.join(event.to_text().split())!r}: leaves "
                f"{len(alive)} live worker(s) from step {event.at_step} on, below "
                f"--fault-min-workers {min_workers}, and a run below its quorum takes no step "
                "to reach a join placed by step; join a worker at the same step, place the "
                "events by time (t=SECONDS: the run waits for the join), or lower "
                "--fault-min-workers"
            )


def _first_horizon(settings: FaultSettings) -> float:
    """The modeled seconds a generated trace first covers (see the module docstring)."""
    if settings.mtbf_s is None or not math.isfinite(settings.mtbf_s):
        return GENERATED_HORIZON_S
    return min(GENERATED_HORIZON_S, FIRST_HORIZON_MTBFS * settings.mtbf_s)


@functools.lru_cache(maxsize=8)
def _generated(options: FaultOptions, workers: int, horizon_s: float) -> FaultTrace:
    """The generated trace over ``horizon_s`` seconds, made once per process (its workers
    share it).

    Raises:
        TraceError: the drawn events leave no worker alive (or break another rule of a
            trace), naming the event and the options that change the draw: a generated
            trace has no line to edit."""
    try:
        return generate_trace(replace(options, duration_s=horizon_s), workers=workers)
    except TraceError as error:
        problem = str(error).split("; ", 1)[0]
        raise TraceError(
            f"{problem}; the trace is generated from --fault-*: give a longer --fault-mtbf-s, "
            "a shorter --fault-replace-after-s, more --workers or another --fault-seed"
        ) from None


def trace_extension(config: TrainConfig) -> tuple[Callable[[float], FaultTrace] | None, float]:
    """How the run's generated trace grows past its horizon, and that horizon: a function
    giving the same trace over a longer horizon (None: the trace is complete, a file or a
    generated trace without crashes) and the seconds it covers now."""
    settings = FaultSettings.of(config.fault)
    if settings.path is not None or not settings.enabled:
        return None, math.inf
    first = _first_horizon(settings)
    if first >= GENERATED_HORIZON_S:
        return None, math.inf
    options, workers = settings.generated_options(), config.placement.workers

    def extend(horizon_s: float) -> FaultTrace:
        return _generated(options, workers, horizon_s)

    return extend, first
