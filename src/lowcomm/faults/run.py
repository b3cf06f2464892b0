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
(``--workers-per-process`` equal to ``--workers``), one rank per worker, on the virtual clock;
membership events (crash, leave, join, rejoin) placed by step (``step=N``) or by time
(``t=SECONDS``: each lands on the first step whose start, on the run's clock, is at or after
it; :mod:`lowcomm.faults.engine`); slow events by step or by time. The methods are those whose lost worker takes no state the others need and whose
membership rule is declared (:func:`supported_methods`); the methods whose optimizer state is
sharded across workers are refused with that reason (:data:`SHARDED_METHODS`); any other
method is refused as not yet supported. Link events scale (or stop) the modeled transfers of
the strategy's link; a link down is placed by time. Each refusal is one line, before any worker starts.

Nothing here reads a file but :func:`run_trace` (the launch's pre-flight calls it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lowcomm.faults.generate import TORCHFT_HEARTBEAT_TIMEOUT_S, FaultOptions, generate_trace
from lowcomm.faults.trace import FaultTrace, TraceError, load_trace

if TYPE_CHECKING:
    from lowcomm.config import FaultConfig, TrainConfig

__all__ = [
    "FIRST_HORIZON_MTBFS",
    "GENERATED_HORIZON_S",
    "SHARDED_METHODS",
    "FaultSettings",
    "check_values",
    "faults_refusal",
    "run_trace",
    "supported_methods",
    "trace_extension",
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


def check_values(settings: FaultSettings) -> str | None:
    """The generated options' and the detection time's own rules, in one line."""
    checks: list[tuple[str, float | None, bool, str]] = [
        (
            "--fault-detection-s",
            settings.detection_s,
            math.isfinite(settings.detection_s) and settings.detection_s >= 0,
            f"detection takes a finite time >= 0 seconds; e.g. {TORCHFT_HEARTBEAT_TIMEOUT_S:g} "
            "(torchft's heartbeat timeout, the default)",
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
    problem = check_values(settings)
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
    problem = _placement_refusal(config, flag) or _method_refusal(config, flag)
    if problem is not None:
        return problem
    if config.optim.name != "adamw":
        return f"{flag}: not yet supported with --optim.name {config.optim.name}; use adamw"
    quantization = getattr(getattr(config, "diloco", None), "quantization", "none")
    if config.method == "diloco" and quantization != "none":
        return (
            f"{flag}: not yet supported with --diloco.quantization {quantization} (its "
            "two-step exchange is laid out for every worker); use none"
        )
    if config.run.resume is not None or config.run.checkpoint_every is not None:
        return (
            f"{flag}: not yet supported with checkpoints (--resume, --checkpoint-every): a "
            "checkpoint does not record the quorum yet; drop them"
        )
    if config.run.token_budget is not None:
        return f"{flag}: not yet supported with --token-budget; give --steps"
    return None


def _placement_refusal(config: TrainConfig, flag: str) -> str | None:
    """Why the run's placement or clock cannot replay faults yet, or None."""
    supported = (
        "faults run today with every worker a thread of one process on the virtual clock "
        f"(--workers-per-process {config.placement.workers} --clock virtual, --ranks-per-worker 1)"
    )
    if config.placement.workers_per_process != config.placement.workers:
        return (
            f"{flag}: not yet supported with --workers-per-process "
            f"{config.placement.workers_per_process} (worker processes or torchrun); {supported}"
        )
    if config.placement.ranks_per_worker != 1:
        return (
            f"{flag}: not yet supported with --ranks-per-worker {config.placement.ranks_per_worker}; "
            f"{supported}"
        )
    if config.comm.clock != "virtual":
        return f"{flag}: not yet supported on the {config.comm.clock} clock; {supported}"
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
    return trace


def _first_horizon(settings: FaultSettings) -> float:
    """The modeled seconds a generated trace first covers (see the module docstring)."""
    if settings.mtbf_s is None or not math.isfinite(settings.mtbf_s):
        return GENERATED_HORIZON_S
    return min(GENERATED_HORIZON_S, FIRST_HORIZON_MTBFS * settings.mtbf_s)


@functools.lru_cache(maxsize=8)
def _generated(options: FaultOptions, workers: int, horizon_s: float) -> FaultTrace:
    """The generated trace over ``horizon_s`` seconds, made once per process (its workers
    share it)."""
    return generate_trace(replace(options, duration_s=horizon_s), workers=workers)


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
