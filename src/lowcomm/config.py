"""The typed configuration of a training run, one dataclass per component it configures.

:class:`TrainConfig` is the method and the components of a run: the model, the data, the
optimizer and its schedule (their own modules), where the workers run and who takes part in
each round
(:class:`PlacementConfig`), the links between them and the clock that times the run
(:class:`CommConfig`), the run's length, evaluation, output and checkpoints
(:class:`RunConfig`), the numerics (:class:`NumericsConfig`), the declared faults
(:class:`FaultConfig`) and one options group per method family. Each component checks its own
fields in its ``validate()``; :meth:`TrainConfig.validate` adds the checks that need several
components at once. The command line keeps one flat flag per field (``--workers``,
``--network``): the components' prefixes are omitted.

Each field's docstring is its description in docs/options.md, and its first sentence the
line ``lowcomm train --help`` gives it (:mod:`lowcomm.options_help`). Environment variables
never override a field. A config file (``lowcomm train --config``, :mod:`lowcomm.config_file`)
has the shape of :meth:`TrainConfig.to_dict`, as a run's config.json does; a file of the flat
shape, every option at the top level, is read too (:func:`nested`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import tyro

from lowcomm.comm.network import (
    INNER_LINK,
    OUTER_LINK,
    check_link,
    check_speed_factors,
)
from lowcomm.data import DataConfig
from lowcomm.faults.generate import TORCHFT_HEARTBEAT_TIMEOUT_S
from lowcomm.membership.options import MembershipOptions
from lowcomm.models import ModelConfig
from lowcomm.models.options import GPT_FAMILY
from lowcomm.optim.adamw import AdamWConfig
from lowcomm.optim.schedule import ScheduleConfig
from lowcomm.strategies.option_groups import with_method_options

if TYPE_CHECKING:
    from lowcomm.strategies.acco import AccoOptions
    from lowcomm.strategies.co2 import LocalOptions
    from lowcomm.strategies.desloc import DeslocOptions
    from lowcomm.strategies.diloco import DiLoCoOptions

#: Upper bound of --collective-timeout-s (about 31 years; a timedelta holds up to ~2.7e6 years).
MAX_TIMEOUT_S = 1e9


class ConfigError(ValueError):
    """A bad option: the message names the option, the value, the rule and the fix."""


@dataclass(kw_only=True)
class PlacementConfig:
    """Where the workers run: how many, their ranks, the processes and the device, and who
    takes part in each round (--membership)."""

    workers: int = 4
    """Number of data-parallel workers (each one process, or --ranks-per-worker processes)."""

    ranks_per_worker: int = 1
    """Ranks (processes) per worker: they share the worker's data-parallel work over the inner
    link (synchronous data parallel, AdamW moments sharded over the ranks); the method runs between
    workers over --network, each rank sending 1/R of the worker's payload. Runs workers x R
    processes; --micro-batch-size is per rank."""

    workers_per_process: int = 1
    """Workers simulated in one process: 1 (each worker its own process), --workers (all of
    them in this process, as threads on shared memory, no torch.distributed; the same numbers,
    a fraction of the memory and start-up; with --device cuda all on this process's GPU, a
    number that does not fit its memory refused up front), or a divisor K in between
    (--workers / K processes of K threads each, the in-process comm stacked on
    torch.distributed; also under torchrun, where --workers is then K x the processes; CPU
    only). With --ranks-per-worker R each worker is R threads."""

    worker_sharding: Literal["replicate", "fsdp"] = "replicate"
    """How a worker of --ranks-per-worker R > 1 holds its model: replicate (every rank the whole
    replica) or fsdp (FSDP2 over its R ranks, each holding 1/R; the method exchanges each rank's
    shards with the same rank of the other workers). The methods that cannot shard are refused
    with their reason; the model starts on the meta device, each rank making (or with
    --init-from reading) only its own shards."""

    device: Literal["cpu", "cuda"] = "cpu"
    """cpu (Gloo) or cuda (NCCL, one GPU per worker)."""

    membership: Literal["static", "torchft"] = "static"
    """Who takes part in each round: static or torchft (docs/membership.md). static: every
    worker, always; a dead worker ends the run. torchft: torchft's lighthouse decides each
    round's quorum; a dead worker is left out, a worker started later joins and heals."""

    membership_options: Annotated[MembershipOptions, tyro.conf.arg(name="membership")] = field(
        default_factory=MembershipOptions
    )

    def validate(self) -> None:
        """The worker and rank counts, and how the workers share processes."""
        if self.workers < 1:
            raise ConfigError(
                f"--workers: {self.workers} is not a positive worker count; pass 1 or more"
            )
        if self.ranks_per_worker < 1:
            raise ConfigError(
                f"--ranks-per-worker: {self.ranks_per_worker} is not a positive rank count; "
                f"pass 1 (flat workers) or more"
            )
        k, flag = self.workers_per_process, "--workers-per-process"
        if k < 1:
            raise ConfigError(
                f"{flag}: {k} must be 1 or more; pass 1 (a process per worker) or the workers "
                f"of one process, e.g. {self.workers} (all of them)"
            )
        if k > self.workers:
            raise ConfigError(
                f"{flag}: {k} is more than --workers {self.workers}; pass --workers {k} too "
                f"(every worker in one process), or a divisor of {self.workers}"
            )
        if self.workers % k:
            raise ConfigError(
                f"{flag}: {k} does not divide --workers {self.workers}; pass 1 (a process per "
                f"worker) or a divisor of --workers such as {self.workers}"
            )

    def sharing_refusal(self) -> str | None:
        """Why these workers cannot share processes at ``--workers-per-process`` for a reason
        of the placement alone (the option it refuses, the reason and the fix), or None."""
        k = self.workers_per_process
        if k == 1:
            return None
        if self.worker_sharding == "fsdp":
            return (
                "--worker-sharding fsdp is not supported: FSDP's collectives need "
                "torch.distributed process groups, which workers sharing a process do not "
                "have; use --workers-per-process 1 with fsdp, or --worker-sharding replicate"
            )
        if self.device == "cuda" and k < self.workers:
            return (
                f"--device cuda is not supported yet with {self.workers // k} processes of "
                f"{k} workers (the stacked comm's couriers move host tensors); use "
                f"--workers-per-process {self.workers} (every worker on this process's GPU) "
                f"or 1 (a GPU per worker)"
            )
        return None

    @property
    def world_size(self) -> int:
        """Ranks of the run: workers x ranks per worker (each a process, or a thread of one
        with --workers-per-process K > 1)."""
        return self.workers * self.ranks_per_worker

    @property
    def ranks_per_process(self) -> int:
        """Ranks each process of the run holds: 1, or with --workers-per-process K > 1 its K
        workers' K x R ranks (threads)."""
        k = self.workers_per_process
        return k * self.ranks_per_worker if k > 1 else 1

    @property
    def processes(self) -> int:
        """Processes of the run (world size / ranks per process)."""
        return self.world_size // self.ranks_per_process


@dataclass(kw_only=True)
class RunConfig:
    """The run's length, evaluation, output, logging and checkpoints."""

    steps: int = 80
    """Optimizer steps to take. With --resume OUT of a finished run, steps above its steps
    extend it (from the final checkpoint every completed run writes; fewer are refused): the
    learning-rate schedule is recomputed for the new total (same warm-up, cosine decay
    stretched to the new --steps), so the extension restarts at the rate that total gives
    the finished step; summary.json's extended_at_steps records where the run was
    extended."""

    token_budget: int | None = None
    """End the run at the first step where the committed tokens (summed over workers) reach
    this, --steps still capping it; methods with a variable number of micro-batches per step
    (acco, dpu, wp) lay their learning-rate schedule out over it, and each of their workers
    computes its share (in proportion to 1 / its --speed-factors value) and then stops, so the
    run commits exactly the budget. With --faults, committed tokens are goodput's numerator (a
    dropped round's tokens and a lost worker's uncommitted ones do not count), so a faulty run
    trains on until it has committed the budget. For equal-token comparisons (bench compare
    and reproduce set it); None: the run takes --steps steps."""

    microbatches_per_step: int = 1
    """Micro-batches each worker accumulates per optimizer step (synchronous methods)."""

    max_grad_norm: float | None = 1.0
    """Clip the averaged gradient to this global L2 norm (None: no clipping)."""

    seed: int = 0
    """Random seed (model init and data order)."""

    out: str | None = None
    """Run directory (default: runs/<method>-<network>-w<workers>-s<seed>, plus -<hash> of
    the other settings that differ from their defaults). A directory holding a run is refused
    unless --overwrite or --resume is given."""

    overwrite: bool = False
    """Clear the run files (config, metrics, summary, plot, logs, checkpoints) of the run
    directory first: `--overwrite` (or `--overwrite True`). Without it, a new run into a
    directory that holds a run is refused."""

    eval_every: int = 20
    """Evaluate validation loss every this many steps (and at the end)."""

    eval_batches: int = 8
    """Validation batches per evaluation (split across workers)."""

    log_every: int = 10
    """Read the training loss and the finiteness check on the host, and gather every worker's
    step metrics, every this many steps (and before a checkpoint and at the end): each read
    waits for the device and each gather is a barrier of all workers. metrics.jsonl still has
    every step; a non-finite loss stops the run up to this many steps after it appeared."""

    progress: bool = True
    """Show a progress bar."""

    plot: bool = True
    """Draw OUT/loss.png (the loss against the step and against the clock) at the end of the
    run. False skips it and matplotlib's import: about 1.5 s of CPU per run, most of a short
    run's end (the test suite's runs pass --plot False)."""

    log: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)
    """Where the step records go besides OUT/metrics.jsonl (always written), e.g. `--log jsonl
    tensorboard wandb`. wandb: each step's records, the summary and loss.png in Weights & Biases
    (pip install 'lowcomm[wandb]', then `wandb login` or WANDB_MODE=offline)."""

    tensorboard: bool = False
    """Also write the metrics as TensorBoard event files under OUT/tensorboard/ (losses,
    learning rate, utilisation and bytes against the step; loss against the modeled time):
    `--tensorboard` (or `--tensorboard True`); needs pip install 'lowcomm[tensorboard]'."""

    wandb_project: str = "lowcomm"
    """With --log wandb: the W&B project."""

    wandb_name: str | None = None
    """With --log wandb: the W&B run's name (default: the run directory's name)."""

    checkpoint_every: int | None = None
    """Write a checkpoint to OUT/checkpoints every this many steps (None: never)."""

    keep_checkpoints: int = 2
    """Keep the newest this many checkpoints; older ones are deleted once a new one is whole."""

    resume: str | None = None
    """Resume from the latest checkpoint of this run directory (its config.json supplies the
    defaults), or `auto`: resume from OUT if it holds a checkpoint, else start afresh (for
    jobs that restart themselves, e.g. torchrun --max-restarts). With another --workers (or
    --ranks-per-worker) than the checkpoint's, it is re-sharded for them (elastic resume)."""

    stop_after: int | None = None
    """Stop after this many steps with a checkpoint, as a job with a time limit would;
    continue later with --resume OUT."""

    init_from: str | None = None
    """Start from this model instead of random weights: a finished run's OUT (its model/), a
    lowcomm model directory, or a local HF model directory (config.json and weights; only
    local paths are read, nothing is downloaded). Its tokenizer.json, when it has one, is the
    run's tokenizer unless --tokenizer is given. --model.* must describe the saved model (its
    embedding size comes from the weights). Not with --resume DIR (a resume continues its
    checkpoint)."""

    def validate(self) -> None:
        """The run's counts, sizes and limits, and its checkpoint and resume options."""
        if self.steps < 1:
            raise ConfigError(f"--steps: {self.steps} is not a positive step count; pass 1 or more")
        if self.microbatches_per_step < 1:
            raise ConfigError(
                f"--microbatches-per-step: {self.microbatches_per_step} must be 1 or more"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(
                f"--max-grad-norm: {self.max_grad_norm} must be positive, or None to disable"
            )
        if self.token_budget is not None and self.token_budget < 1:
            raise ConfigError(
                f"--token-budget: {self.token_budget} must be 1 or more tokens, or None for a "
                f"step budget"
            )
        if not 0 <= self.seed < 2**64:
            # torch.manual_seed takes a 64-bit unsigned seed, numpy's SeedSequence a non-negative one.
            raise ConfigError(f"--seed: {self.seed} must lie in [0, 2**64); pass e.g. 0")
        for flag, value in (
            ("--eval-every", self.eval_every),
            ("--eval-batches", self.eval_batches),
        ):
            if value < 1:
                raise ConfigError(f"{flag}: {value} must be 1 or more")
        if self.log_every < 1:
            raise ConfigError(
                f"--log-every: {self.log_every} must be 1 or more steps; pass e.g. 10"
            )
        self._validate_checkpointing()

    def _validate_checkpointing(self) -> None:
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(
                f"--checkpoint-every: {self.checkpoint_every} must be 1 or more (steps between "
                f"checkpoints), or None for no checkpoints"
            )
        if self.keep_checkpoints < 1:
            raise ConfigError(f"--keep-checkpoints: {self.keep_checkpoints} must be 1 or more")
        if self.stop_after is not None and not 1 <= self.stop_after < self.steps:
            raise ConfigError(
                f"--stop-after: {self.stop_after} must lie in [1, --steps {self.steps}); a run "
                f"that stops at its last step has nothing to resume"
            )
        if self.init_from is not None and self.resume not in (None, "auto"):
            raise ConfigError(
                f"--init-from: {self.init_from!r} with --resume {self.resume!r}; a resumed run "
                f"continues its checkpoint's weights, so pass one of them"
            )
        if self.overwrite and self.resume is not None:
            raise ConfigError(
                f"--overwrite: clears the run directory that --resume {self.resume} would "
                f"continue; pass one of them"
            )


@dataclass(kw_only=True)
class CommConfig:
    """The links between workers and between a worker's ranks, what travels on them, and the
    clock that times compute and transfers."""

    network: str = "wan"
    """Declared link between workers (the outer link): none, datacenter, ethernet, wan, slow-wan."""

    bandwidth_gbps: float | None = None
    """Override the preset's bandwidth, in Gbit/s."""

    latency_ms: float | None = None
    """Override the preset's one-hop latency, in milliseconds."""

    inner_network: str = "datacenter"
    """With --ranks-per-worker > 1: the link between the ranks of one worker (same presets)."""

    inner_bandwidth_gbps: float | None = None
    """Override the inner preset's bandwidth, in Gbit/s."""

    inner_latency_ms: float | None = None
    """Override the inner preset's one-hop latency, in milliseconds."""

    comm_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype gradients and pseudo-gradients travel in: bf16 sends a bfloat16 copy (half the
    bytes and the modeled transfer time) and reduces it in bfloat16, the result copied back
    into float32. Parameters and optimizer states travel in float32. Not with a method whose
    collectives run on a communication thread (acco, dpu, wp: `lowcomm methods` says which
    dtypes each method supports)."""

    collective_timeout_s: float = 300.0
    """A collective that does not complete within this many seconds fails the run."""

    clock: Literal["real", "virtual"] = "virtual"
    """real: wall time, with transfers delayed to the modeled time. virtual: modeled time per
    worker from the calibrated compute cost (see --compute-model; or --seconds-per-microbatch)
    and the network model."""

    seconds_per_microbatch: float | None = None
    """Virtual clock only: declared compute seconds per micro-batch (models a target device)."""

    compute_model: Literal["calibrated", "cpu-time"] = "calibrated"
    """Virtual clock without --seconds-per-microbatch: how compute is charged. calibrated:
    before training the workers time a micro-batch and an optimizer update in turn and agree
    on fixed costs (the same numbers whatever the machine's load). cpu-time: each worker's
    thread CPU time as it trains (moves with the load)."""

    calibration: str | None = None
    """Calibrated compute model: a JSON file of calibrated costs; read if it exists (no
    measuring), else measured and written there. Two runs with one file charge identically."""

    speed_factors: tuple[float, ...] = ()
    """Per-worker compute-time multipliers, e.g. 1 1 1 2 for one worker twice as slow."""

    def validate(self) -> None:
        """The links, the collective timeout and the clock's own options."""
        try:
            check_link(
                self.inner_network, self.inner_bandwidth_gbps, self.inner_latency_ms, INNER_LINK
            )
            check_link(self.network, self.bandwidth_gbps, self.latency_ms, OUTER_LINK)
            check_speed_factors(self.speed_factors)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if not 0 < self.collective_timeout_s <= MAX_TIMEOUT_S:
            # (A process group's timeout is a timedelta: inf or a huge value overflows it.)
            raise ConfigError(
                f"--collective-timeout-s: {self.collective_timeout_s} must be a positive number "
                f"of seconds up to {MAX_TIMEOUT_S:g}"
            )
        if self.seconds_per_microbatch is not None:
            if self.clock != "virtual":
                raise ConfigError(
                    "--seconds-per-microbatch: a declared compute cost needs --clock virtual"
                )
            if not (self.seconds_per_microbatch > 0 and math.isfinite(self.seconds_per_microbatch)):
                raise ConfigError(
                    f"--seconds-per-microbatch: {self.seconds_per_microbatch} must be a finite "
                    f"positive number of seconds"
                )
        self._validate_calibration()

    def _validate_calibration(self) -> None:
        if self.calibration is None:
            return
        if self.clock != "virtual" or self.seconds_per_microbatch is not None:
            raise ConfigError(
                f"--calibration: {self.calibration} calibrates the virtual clock's compute; it "
                f"needs --clock virtual without --seconds-per-microbatch"
            )
        if self.compute_model != "calibrated":
            raise ConfigError(
                f"--calibration: {self.calibration} needs --compute-model calibrated (this run "
                f"uses {self.compute_model}); drop --calibration or choose calibrated"
            )


@dataclass(kw_only=True)
class NumericsConfig:
    """The numerics and speed of a worker's compute: precision, recomputation, compilation."""

    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    """fp32, or bf16-mixed: forward and backward under torch.autocast in bfloat16 (CPU and
    CUDA), with float32 master parameters, gradients and optimizer states (so state bytes do
    not change); validation runs in float32."""

    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward instead of keeping them
    (a non-reentrant torch.utils.checkpoint per block: the built-in GPT's, a transformers
    model's decoder layers): less activation memory for one more forward per block; the same
    numbers."""

    compile: bool = False
    """Compile the forward of each transformer block with torch.compile (inductor; on the CPU
    it needs a C++ compiler on PATH), sharded or not: the same numbers to float32 rounding,
    after a compilation on the first micro-batch (and the first evaluation). Not with
    --workers-per-process > 1 (torch.compile is not thread-safe)."""

    tf32: bool = True
    """On cuda, float32 matmuls and convolutions use TF32 tensor cores (10-bit mantissa
    inputs, float32 accumulation): `--tf32 False` keeps them in full float32. No effect on
    the CPU."""


@dataclass(kw_only=True)
class FaultConfig:
    """Declared faults (lowcomm.faults.run: the rules and what runs with them)."""

    faults: str | None = None
    """Replay this fault trace. One event per line: step=N or t=S, worker=K or link, then crash,
    leave, join, rejoin, slow factor=F [for=D], link factor=F [for=D] or link down for=D
    (lowcomm.faults.trace). Not with the --fault-* options that generate a trace, which places
    every event by time (lowcomm.faults.run says what runs with faults today)."""

    fault_mtbf_s: float | None = None
    """Generated trace: each worker's mean time between failures (s)."""

    fault_replace_after_s: float | None = None
    """Generated trace: seconds from a crash until a replacement joins."""

    fault_slow_fraction: float | None = None
    """Generated trace: the fraction of worker slots that straggle."""

    fault_slow_factor: float | None = None
    """Generated trace: a straggler's compute slowdown (>= 1)."""

    fault_detection_s: float = TORCHFT_HEARTBEAT_TIMEOUT_S
    """Seconds until the survivors detect a crash. By default torchft's heartbeat timeout; a
    synchronous method waits it, then goes on without the dead worker."""

    fault_seed: int | None = None
    """Generated trace: the seed of its draws (default 0)."""

    fault_min_workers: int = 1
    """The fewest live workers a round's quorum needs. Below it the run waits for joins
    (placed by time; a trace placed by step that goes below it is refused)."""

    fault_quorum_wait_s: float = 1800.0
    """Seconds (on the run's clock) a run waits for a quorum of --fault-min-workers before it
    ends with a checkpoint; --resume with a longer wait (or fewer workers) continues it."""

    def validate(self) -> None:
        """The detection time's and the generated trace's own rules (a trace file is read by
        the launch's pre-flight; what runs with faults needs the whole run:
        :func:`lowcomm.faults.run.faults_refusal`)."""
        from lowcomm.faults.run import FaultSettings, check_values

        problem = check_values(FaultSettings.of(self))
        if problem is not None:
            raise ConfigError(problem)


#: How a component's field adds no prefix to its fields' flags (tyro's OmitArgPrefixes would
#: drop the prefixes above it too).
_FLAT = tyro.conf.arg(name="")

#: The components whose fields are flags of their own (``--workers``, not
#: ``--placement.workers``), and which a config file of the flat shape spells at its top level.
FLAT_COMPONENTS: dict[str, type[Any]] = {
    "placement": PlacementConfig,
    "run": RunConfig,
    "comm": CommConfig,
    "numerics": NumericsConfig,
    "fault": FaultConfig,
}

#: The component of each field a config of the flat shape holds at its top level.
FLAT_KEYS: dict[str, str] = {
    item.name: component
    for component, kind in FLAT_COMPONENTS.items()
    for item in dataclasses.fields(kind)
}


def nested(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict of the flat shape (``"workers": 4`` at the top level, as lowcomm wrote
    config.json before its components) in today's shape (``"placement": {"workers": 4}``);
    a dict already of today's shape is returned equal. A key both flat and in its component's
    table is refused: one of them would be dropped."""
    result = {key: value for key, value in values.items() if key not in FLAT_KEYS}
    for key, component in FLAT_KEYS.items():
        if key not in values:
            continue
        table = result.setdefault(component, {})
        if not isinstance(table, dict):
            return values  # a component given as a value: the reader names the problem
        if key in table:
            raise ConfigError(
                f"{key} is given twice, at the top level and as {component}.{key}; give it once"
            )
        result[component] = {**table, key: values[key]}
    return result


def flat(values: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`nested`: the flat components' fields at the top level."""
    result: dict[str, Any] = {}
    for key, value in values.items():
        if key in FLAT_COMPONENTS and isinstance(value, dict):
            result.update(value)
        else:
            result[key] = value
    return result


@dataclass(kw_only=True)
@with_method_options
class TrainConfig:
    """Train a model data-parallel with one lowcomm method."""

    method: str = "ddp"
    """Training method (see `lowcomm methods`): ddp, zero1, ..."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: Annotated[DataConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=DataConfig)
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    # The components' own fields are flags of their own (--workers, not --placement.workers),
    # also where TrainConfig is nested (bench compare's --train.workers).
    placement: Annotated[PlacementConfig, _FLAT] = field(default_factory=PlacementConfig)
    run: Annotated[RunConfig, _FLAT] = field(default_factory=RunConfig)
    comm: Annotated[CommConfig, _FLAT] = field(default_factory=CommConfig)
    numerics: Annotated[NumericsConfig, _FLAT] = field(default_factory=NumericsConfig)
    fault: Annotated[FaultConfig, _FLAT] = field(default_factory=FaultConfig)
    # One field per method option group (acco, local, diloco, desloc, ...), added by
    # @with_method_options from the methods' own declarations (strategies/declaration.py).
    if TYPE_CHECKING:
        # The groups of today's methods, named for the type checker only (so that
        # `replace(config, diloco=...)` and `config.diloco.sync_every` are checked); at run
        # time the decorator adds every declared group, a new method's included.
        acco: AccoOptions = field(default_factory=AccoOptions)
        local: LocalOptions = field(default_factory=LocalOptions)
        diloco: DiLoCoOptions = field(default_factory=DiLoCoOptions)
        desloc: DeslocOptions = field(default_factory=DeslocOptions)
    else:

        def __setattr__(self, name: str, value: Any) -> None:
            # A field that moved to a component (``config.workers = 2``) would otherwise be
            # set as a new attribute that nothing reads.
            if name not in self.__dataclass_fields__:
                raise AttributeError(_moved(name))
            object.__setattr__(self, name, value)

        def __getattr__(self, name: str) -> Any:
            raise AttributeError(_moved(name))

    def validate(self) -> None:
        """Check the options, each component alone and then the combinations; raise
        :class:`ConfigError` on the first problem. Reads no file and builds no model: the
        checks that do (the data path, the calibration file, the checkpoint to resume and its
        directory, the method on the real model, the run directory) are the launch's
        pre-flight, :func:`lowcomm.launch.run.preflight`."""
        from lowcomm.strategies import comm_dtype_problem, strategy_class

        try:
            strategy_class(self.method)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        for component in (self.placement, self.run, self.comm, self.fault):
            component.validate()
        self._validate_hierarchy()
        self._validate_placement()
        try:
            check_speed_factors(self.comm.speed_factors, self.placement.workers)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self._validate_clock()
        dtype_problem = comm_dtype_problem(self.method, self.comm.comm_dtype)
        if dtype_problem is not None:
            raise ConfigError(dtype_problem)
        self._validate_compile()
        self._validate_faults()

    def _validate_faults(self) -> None:
        """--faults and the --fault-* options with the rest of the run
        (lowcomm.faults.run.faults_refusal), and --membership with them
        (lowcomm.membership.options.membership_refusal)."""
        from lowcomm.faults.run import faults_refusal

        refusal = faults_refusal(self)
        if refusal is not None:
            raise ConfigError(refusal)
        from lowcomm.membership.options import membership_refusal

        refusal = membership_refusal(self)
        if refusal is not None:
            raise ConfigError(refusal)

    def _validate_clock(self) -> None:
        """The clock's compute charge on the device (--compute-model, --device)."""
        comm = self.comm
        if (
            self.placement.device == "cuda"
            and comm.clock == "virtual"
            and comm.seconds_per_microbatch is None
            and comm.compute_model == "cpu-time"
        ):
            raise ConfigError(
                "--compute-model cpu-time: on cuda the CPU time the virtual clock measures does "
                "not see GPU kernels; use --compute-model calibrated (the default: the passes "
                "are timed with CUDA events), --seconds-per-microbatch, or --clock real"
            )

    def _validate_compile(self) -> None:
        """--compile: one worker per process, and a C++ compiler for inductor's CPU kernels."""
        if not self.numerics.compile:
            return
        if self.placement.workers_per_process > 1:
            raise ConfigError(
                f"--compile: --workers-per-process {self.placement.workers_per_process} runs "
                f"workers as threads of one process, and torch.compile is not thread-safe; pass "
                f"--workers-per-process 1 or drop --compile"
            )
        import shutil

        compilers = ("g++", "c++", "clang++")
        if self.placement.device == "cpu" and not any(shutil.which(name) for name in compilers):
            raise ConfigError(
                "--compile: inductor builds CPU kernels with a C++ compiler and none is on "
                "PATH (g++, c++ or clang++); install one, or drop --compile"
            )

    def _validate_hierarchy(self) -> None:
        """--ranks-per-worker and --worker-sharding with the method and the optimizer."""
        from lowcomm.strategies import strategy_class
        from lowcomm.strategies.worker_sharding import sharding_refusal

        ranks = self.placement.ranks_per_worker
        refusal = strategy_class(self.method).hierarchical_refusal
        if ranks > 1 and refusal is not None:
            raise ConfigError(
                f"--ranks-per-worker: {ranks} with --method {self.method}: "
                f"{refusal}; use --ranks-per-worker 1 with this method"
            )
        sharding = sharding_refusal(self.method, self.placement.worker_sharding, ranks)
        if sharding is not None:
            raise ConfigError(sharding)
        self._validate_muon()

    def _validate_placement(self) -> None:
        """--workers-per-process with the method and the model: the placement's own refusals
        (:meth:`placement_refusal`), and a method whose workers must be threads of one
        process."""
        k, flag = self.placement.workers_per_process, "--workers-per-process"
        refusal = self.placement_refusal()
        if refusal is not None:
            raise ConfigError(f"{flag}: {k} with {refusal}")
        from lowcomm.strategies import strategy_class

        workers = self.placement.workers
        together = strategy_class(self.method).one_process_refusal
        if together is not None and k != workers:
            raise ConfigError(
                f"{flag}: {k} with --method {self.method}: {together}; pass "
                f"--workers-per-process {workers}"
            )

    def placement_refusal(self) -> str | None:
        """Why this run's workers cannot share processes at ``--workers-per-process`` (the
        option it refuses, the reason and the fix, in one line), or None when they can."""
        refusal = self.placement.sharing_refusal()
        if refusal is not None or self.placement.workers_per_process == 1:
            return refusal
        family = self.model.value("family")
        if self.model.dropout and family != GPT_FAMILY:
            return (
                f"--model.dropout {self.model.dropout} on --model.family {family} is not "
                f"supported: transformers' dropout draws from the process-global generator, "
                f"which the workers of one process would share; use --model.dropout 0, the "
                f"built-in gpt, or --workers-per-process 1"
            )
        return None

    def _validate_muon(self) -> None:
        """--optim.name muon: refused by a method that cannot take it, and with several
        ranks per worker (the method's own build refuses an SGD inner optimizer)."""
        from lowcomm.optim.muon import muon_refusal
        from lowcomm.strategies import strategy_class

        if self.optim.name != "muon":
            return
        refusal = strategy_class(self.method).muon_refusal
        if refusal is not None:
            raise ConfigError(str(muon_refusal(self.method, refusal)))
        if self.placement.ranks_per_worker > 1:
            raise ConfigError(
                f"--optim.name: muon with --ranks-per-worker {self.placement.ranks_per_worker}: "
                f"Muon's matrices are not split over a worker's ranks; use --ranks-per-worker 1 "
                f"or --optim.name adamw"
            )

    def tokens_per_microbatch(self) -> int:
        """Tokens in one worker's micro-batch (all its ranks)."""
        return self.data.micro_batch_size * self.model.block_size * self.placement.ranks_per_worker

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """The configuration :meth:`to_dict` produced (e.g. a run's config.json), or one of
        the flat shape (:func:`nested`); unknown keys are an error naming them."""
        built = _from_dict(cls, nested(values))
        assert isinstance(built, TrainConfig)
        return built


def with_options(config: TrainConfig, **options: Any) -> TrainConfig:
    """A copy of ``config`` with ``options`` set by the names of their flags (``workers=2``,
    as the flat shape spells them), each in its component; the components it leaves alone are
    shared with ``config``."""
    own: dict[str, Any] = {}
    changes: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        component = FLAT_KEYS.get(name)
        if component is None:
            own[name] = value
        else:
            changes.setdefault(component, {})[name] = value
    for component, values in changes.items():
        own[component] = dataclasses.replace(getattr(config, component), **values)
    return dataclasses.replace(config, **own)


def option_names() -> set[str]:
    """TrainConfig's options named as their flags are (``workers``, ``model``, ``diloco``):
    its own fields, the flat components' fields in place of the components."""
    own = {item.name for item in dataclasses.fields(TrainConfig)} - set(FLAT_COMPONENTS)
    return own | set(FLAT_KEYS)


def option_value(config: TrainConfig, name: str) -> Any:
    """The value of the option named as its flag is (``workers``: config.placement.workers)."""
    component = FLAT_KEYS.get(name)
    return getattr(config if component is None else getattr(config, component), name)


def _moved(name: str) -> str:
    """The error for an attribute TrainConfig does not have, naming its component's."""
    component = FLAT_KEYS.get(name)
    where = f"; it is config.{component}.{name}" if component is not None else ""
    return f"TrainConfig has no field {name!r}{where}"


def _from_dict(kind: type[Any], values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(kind)
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"config.json: unknown field(s) {', '.join(unknown)} for {kind.__name__}; the file "
            f"comes from another lowcomm version or was edited"
        )
    arguments: dict[str, Any] = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            arguments[name] = _from_dict(typing.cast(type[Any], hint), value)
        elif isinstance(value, list) and typing.get_origin(hint) is tuple:
            arguments[name] = tuple(value)
        else:
            arguments[name] = value
    return kind(**arguments)
