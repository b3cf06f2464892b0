"""``lowcomm plan``: the analytic model of compute, communication and memory per method.

Everything here is closed-form (docs/ALGORITHMS.md §0.2, §0.4, §2.4, §5.6):

* compute per optimizer step: ``6 N B_tok / (F * MFU)`` seconds per worker for ``B_tok``
  tokens per worker per step (or a declared number of seconds per step);
* communication: the ring cost model of :class:`~lowcomm.comm.network.NetworkProfile`,
  applied to each method's collectives and averaged over its sync period (ACCO: two
  RS+AG pairs per committed step, and committed steps that absorb more tokens when
  communication is slower than compute);
* hiding: a method that overlaps a collective with ``w`` steps of compute exposes only
  ``max(0, t_comm - w * t_step)``; a blocking method exposes all of it (the overlap
  extension of §5.6 with omega = 1);
* memory per worker, ACCO's convention: bf16 parameters and gradients (2 + 2 bytes per
  parameter), AdamW master and moments ``K = 12`` bytes per parameter (divided by M when
  sharded), each extra model-sized buffer 2 bytes per parameter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from lowcomm.comm.base import CollectiveKind
from lowcomm.comm.network import INNER_LINK, OUTER_LINK, NetworkProfile, check_link
from lowcomm.faults.generate import TORCHFT_HEARTBEAT_TIMEOUT_S, FaultOptions
from lowcomm.faults.goodput import (
    Exposure,
    StepCosts,
    expected_dropped_rounds,
    expected_exposure,
    expected_last_sync_lost,
    goodput_decoupled,
    goodput_local,
    goodput_synchronous,
    landed,
    none_in,
    over_crash_counts,
    worker_seconds_lost,
)
from lowcomm.optim.adamw import AdamWConfig
from lowcomm.optim.quantize import QuantizationFormat
from lowcomm.strategies.declaration import CostModel, Timing, Transfer
from lowcomm.strategies.option_groups import with_method_options
from lowcomm.strategies.two_step import shard_payload_bytes

if TYPE_CHECKING:
    from lowcomm.config import TrainConfig
    from lowcomm.strategies import Strategy

#: Named model sizes (parameters).
MODEL_SIZES: dict[str, float] = {
    "tiny": 3.7e6,
    "125m": 125e6,
    "350m": 350e6,
    "1b": 1.0e9,
    "1.3b": 1.3e9,
    "7b": 7.0e9,
    "7.5b": 7.5e9,
}


#: Model width d of the named sizes past ``tiny`` (GPT-2 / GPT-3 shapes), for Muon's share.
_WIDTHS: dict[str, int] = {
    "125m": 768, "350m": 1024, "1b": 2048, "1.3b": 2048, "7b": 4096, "7.5b": 4096,
}  # fmt: skip
#: Vocabulary (GPT-2's) and context of the embeddings those shapes are priced with.
_VOCAB, _CONTEXT = 50257, 2048


@dataclass(kw_only=True)
@with_method_options
class PlanConfig:
    """Predict time, bytes and memory of a method at any scale.

    The method's options are train's own (--diloco.sync-every, --local.sync-every, ...), with
    train's defaults; options of another method's group are refused."""

    method: str = "ddp"
    """Method to model (see `lowcomm methods`; every name of the library's methods)."""

    params: str = "1b"
    """Model size: a number of parameters (e.g. 7.5e9) or a name: tiny, 125m, 350m, 1b, 1.3b, 7b, 7.5b."""

    tokens: float = 1e9
    """Tokens to train on (all workers together)."""

    workers: int = 4
    """Data-parallel workers M."""

    ranks_per_worker: int = 1
    """Ranks R per worker (hierarchical workers): each rank computes 1/R of the worker's batch,
    gradients are averaged over the inner link every step, and each rank sends 1/R of every
    outer payload over --network (R transfers in parallel)."""

    worker_sharding: Literal["replicate", "fsdp"] = "replicate"
    """As `lowcomm train --worker-sharding`: fsdp shards each worker's parameters, gradients,
    optimizer and method state over its R ranks (memory per rank 1/R of the worker's), and
    each micro-batch all-gathers the fp32 parameters twice (forward, backward) and
    reduce-scatters the gradients over the inner link, in place of the gradient all-reduce
    and the reassembly of outer payloads."""

    inner_network: str = "datacenter"
    """With --ranks-per-worker > 1: the link between the ranks of a worker (same presets)."""

    inner_bandwidth_gbps: float | None = None
    """Override the inner preset's bandwidth (Gbit/s)."""

    inner_latency_ms: float | None = None
    """Override the inner preset's latency (ms)."""

    tokens_per_step: float = 524288
    """Tokens per optimizer step, all workers together (global batch in tokens)."""

    flops: float = 312e12
    """Peak FLOP/s per worker (312e12: an A100 in bf16)."""

    mfu: float = 0.4
    """Model FLOP utilisation per worker."""

    seconds_per_step: float | None = None
    """Declared compute seconds per step per worker (overrides flops and mfu)."""

    network: str = "wan"
    """Link preset: datacenter, ethernet, wan, slow-wan (or none)."""

    bandwidth_gbps: float | None = None
    """Override the preset's bandwidth (Gbit/s)."""

    latency_ms: float | None = None
    """Override the preset's latency (ms)."""

    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    """As `lowcomm train --precision` (same default). Compute is priced by --flops/--mfu
    either way; memory follows ACCO's convention below whichever is chosen."""

    comm_dtype: Literal["fp32", "bf16"] = "fp32"
    """As `lowcomm train --comm-dtype` (same default): the dtype gradients and
    pseudo-gradients travel in, so 4 (fp32) or 2 (bf16) bytes per communicated element
    unless --bytes-per-element says otherwise."""

    bytes_per_element: float | None = None
    """Bytes per communicated element (None: from --comm-dtype; 1 = fp8; 0.5 = 4-bit). The
    DiLoCo family's --diloco.quantization, when set, sizes its outer exchange itself (an
    all-gather of the encoded payloads, as training sends it)."""

    optimizer_bytes: float = 12.0
    """K: bytes per parameter of the optimizer (fp32 master + two moments = 12)."""

    solve_bandwidth: float | None = None
    """Find the bandwidth (Gbit/s) needed to reach this utilisation (0 < U < 1)."""

    json: bool = False
    """Print machine-readable JSON instead of a table."""

    optim: AdamWConfig = dataclasses.field(default_factory=AdamWConfig)
    """As train's --optim.*; the plan reads --optim.name: adamw (K bytes per parameter of
    state, --optimizer-bytes) or muon (one momentum instead of AdamW's two moments on the
    hidden matrices: K - 4 bytes on --muon-share of the parameters). Refused by the methods
    train refuses it for."""

    muon_share: float | None = None
    """With --optim.name muon: the share of the parameters in hidden 2-D matrices (Muon's).
    None: the built-in GPT's for --params tiny, else 1 - (V + T) d / N for a GPT of width d
    (the named size's, or the nearest named size's), V = 50257, T = 2048."""

    memory_model: Literal["acco", "lowcomm"] = "acco"
    """How memory is priced. acco: ACCO's convention (bf16 parameters and gradients, K bytes of
    optimizer state, 2 bytes per extra model copy; see above). lowcomm: what the largest rank of
    a lowcomm run holds at its peak (lowcomm_rank_memory): float32 parameters, gradients,
    AdamW moments and the method's model-sized buffers, twice (the final checkpoint copies
    them), FSDP's gathered block (--n-layer), the activations of a micro-batch (--n-layer,
    --n-embd, --micro-batch-tokens) and the process itself (--process-bytes)."""

    n_layer: int = 0
    """Transformer blocks of the model (--memory-model lowcomm: FSDP's gathered unit is one
    block, and the activations; 0: both left out)."""

    n_embd: int = 0
    """Width of the model (--memory-model lowcomm: activations; 0: left out)."""

    micro_batch_tokens: int = 0
    """Tokens of one rank's micro-batch (--memory-model lowcomm: activations; 0: left out)."""

    process_bytes: float = 0.35e9
    """--memory-model lowcomm: the resident memory of a worker process besides its model's
    states (interpreter, torch, transformers, lowcomm, its communicators and data); 0.32-0.40
    GB measured on Linux with CPU torch."""

    lose_workers: int = 0
    """Also price the run after losing this many of the M workers (an elastic resume on
    M - K, the global batch kept: each remaining worker computes M/(M-K) times more per step):
    time per step before and after."""

    fault_mtbf_s: float | None = None
    """Faults (generated trace, priced analytically): each worker's mean time between
    failures in seconds (None or inf: no crash). Any --fault-* option adds the method's expected
    goodput to the plan (docs/plan.md, "Faults and goodput")."""

    fault_replace_after_s: float | None = None
    """Faults: seconds from a crash until a replacement joins the slot (None or inf: never)."""

    fault_slow_fraction: float | None = None
    """Faults: the fraction of worker slots that are stragglers, in [0, 1] (None: none)."""

    fault_slow_factor: float | None = None
    """Faults: how many times longer a straggler's compute takes (>= 1; None: 1)."""

    fault_detection_s: float = TORCHFT_HEARTBEAT_TIMEOUT_S
    """Faults: seconds from a crash until the survivors learn of it (torchft's heartbeat
    timeout)."""

    fault_horizon_s: float | None = None
    """Faults: the run's modeled length T the faults are priced over (None: the planned run's
    fault-free wall clock)."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers: {self.workers} must be >= 1")
        if self.ranks_per_worker < 1:
            raise ValueError(
                f"--ranks-per-worker: {self.ranks_per_worker} must be >= 1 (1: flat workers)"
            )
        if self.worker_sharding not in ("replicate", "fsdp"):
            raise ValueError(
                f"--worker-sharding: {self.worker_sharding!r} is not one of replicate, fsdp"
            )
        if self.worker_sharding == "fsdp" and self.ranks_per_worker < 2:
            raise ValueError(
                f"--worker-sharding fsdp: --ranks-per-worker {self.ranks_per_worker} leaves "
                f"nothing to shard; pass --ranks-per-worker 2 or more"
            )
        check_link(self.network, self.bandwidth_gbps, self.latency_ms, OUTER_LINK)
        check_link(self.inner_network, self.inner_bandwidth_gbps, self.inner_latency_ms, INNER_LINK)
        for name in ("tokens", "tokens_per_step", "flops"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"--{name.replace('_', '-')}: {value} must be positive")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu: {self.mfu} must lie in (0, 1]; try 0.4")
        if self.seconds_per_step is not None and not self.seconds_per_step > 0:
            raise ValueError(f"--seconds-per-step: {self.seconds_per_step} must be positive")
        if self.solve_bandwidth is not None and not 0 < self.solve_bandwidth < 1:
            raise ValueError(
                f"--solve-bandwidth: {self.solve_bandwidth} is a target utilisation and must "
                f"lie in (0, 1), e.g. 0.9"
            )
        if not 0 <= self.lose_workers < self.workers:
            raise ValueError(
                f"--lose-workers: {self.lose_workers} must lie in [0, --workers={self.workers}); "
                f"at least one worker must remain"
            )
        if self.bytes_per_element is not None and not self.bytes_per_element > 0:
            raise ValueError(f"--bytes-per-element: {self.bytes_per_element} must be positive")
        if self.muon_share is not None and not 0.0 <= self.muon_share <= 1.0:
            raise ValueError(
                f"--muon-share: {self.muon_share} must lie in [0, 1]; it is the share of the "
                f"parameters in hidden matrices, e.g. 0.9"
            )
        _check_fault_options(self)

    def prices_faults(self) -> bool:
        """Whether any --fault-* option differs from its default (then the plan prices
        goodput)."""
        return any(getattr(self, name) != field.default for name, field in _FAULT_FIELDS.items())

    def element_bytes(self) -> float:
        """Bytes per communicated element: --bytes-per-element, else --comm-dtype's size."""
        if self.bytes_per_element is not None:
            return self.bytes_per_element
        return 4.0 if self.comm_dtype == "fp32" else 2.0


def _check_fault_options(config: PlanConfig) -> None:
    """Refuse a --fault-* value the model cannot price, in one line: the option, the value,
    the rule and the fix."""
    mtbf, replace = config.fault_mtbf_s, config.fault_replace_after_s
    fraction, factor = config.fault_slow_fraction, config.fault_slow_factor
    checks: list[tuple[str, float | None, bool, str]] = [
        ("mtbf_s", mtbf, mtbf is None or mtbf > 0,
         "a mean time between failures is > 0 seconds (inf: no crash); pass e.g. 86400"),
        ("replace_after_s", replace, replace is None or replace >= 0,
         "a replacement joins >= 0 seconds after the crash (inf: never); pass e.g. 600"),
        ("slow_fraction", fraction, fraction is None or 0 <= fraction <= 1,
         "a fraction of the workers lies in [0, 1]; pass e.g. 0.1"),
        ("slow_factor", factor, factor is None or (math.isfinite(factor) and factor >= 1),
         "a slowdown is a finite factor >= 1 (1: not slow); pass e.g. 3 for three times slower"),
        ("detection_s", config.fault_detection_s,
         math.isfinite(config.fault_detection_s) and config.fault_detection_s >= 0,
         f"detection takes a finite time >= 0 seconds; pass e.g. {TORCHFT_HEARTBEAT_TIMEOUT_S:g} "
         "(torchft's heartbeat timeout)"),
        ("horizon_s", config.fault_horizon_s,
         config.fault_horizon_s is None
         or (math.isfinite(config.fault_horizon_s) and config.fault_horizon_s > 0),
         "a run lasts a finite time > 0 seconds; pass e.g. 3600, or leave it out for the planned "
         "run's wall clock"),
    ]  # fmt: skip
    for name, value, ok, rule in checks:
        if not ok:
            flag = "--fault-" + name.replace("_", "-")
            raise ValueError(f"{flag}: {value} is refused: {rule}")


#: The --fault-* fields of :class:`PlanConfig` (their defaults mean: no fault).
_FAULT_FIELDS = {f.name: f for f in dataclasses.fields(PlanConfig) if f.name.startswith("fault_")}


def muon_share(config: PlanConfig) -> float:
    """The share of the parameters Muon updates (``--muon-share``, or its estimate)."""
    if config.muon_share is not None:
        return config.muon_share
    key = config.params.strip().lower()
    if key == "tiny":
        from lowcomm.data.config import DataConfig
        from lowcomm.models import ModelConfig, build_model
        from lowcomm.optim.muon import takes_muon

        model = build_model(ModelConfig(), DataConfig().vocab_size)
        sizes = [p.numel() for p in model.parameters()]
        chosen = takes_muon(model)
        return sum(n for n, muon in zip(sizes, chosen, strict=True) if muon) / sum(sizes)
    params = parse_params(config.params)
    if key not in _WIDTHS:
        key = min(_WIDTHS, key=lambda name: abs(math.log(MODEL_SIZES[name] / params)))
    return min(1.0, max(0.0, 1.0 - (_VOCAB + _CONTEXT) * _WIDTHS[key] / params))


def parse_params(text: str) -> float:
    """A parameter count from a number or a named size."""
    key = text.strip().lower()
    if key in MODEL_SIZES:
        return MODEL_SIZES[key]
    try:
        value = float(key)
    except ValueError:
        raise ValueError(
            f"--params: {text!r} is neither a number nor a named size; pass e.g. 7.5e9 or one "
            f"of {', '.join(MODEL_SIZES)}"
        ) from None
    if not value > 0:
        raise ValueError(f"--params: {text!r} must be positive")
    return value


@dataclass
class Plan:
    """The planner's answer. Times in seconds, sizes in bytes."""

    method: str
    params: float
    workers: int
    steps: float
    bandwidth_gbps: float
    latency_ms: float
    compute_s: float
    comm_total_s: float
    comm_exposed_s: float
    comm_hidden_s: float
    utilization: float
    wall_clock_s: float
    comm_bytes_per_worker_per_step: float
    comm_bytes_per_worker: float
    memory_per_worker_bytes: float
    ranks_per_worker: int = 1
    memory_per_rank_bytes: float = 0.0
    worker_sharding: str = "replicate"
    inner_comm_s: float = 0.0
    outer_bytes_per_rank_per_step: float = 0.0
    inner_bytes_per_rank_per_step: float = 0.0
    schedule: str = ""
    syncs_per_step: float = 0.0
    options: dict[str, Any] | None = None
    final_drain_s: float = 0.0
    """What the run waits after its last step for its exchanges still in flight (eager,
    diloco_delayed, co2, overlap_local_sgd); part of comm_exposed_s and wall_clock_s."""


def method_options(config: PlanConfig) -> tuple[type[Strategy], object | None]:
    """The strategy class of ``config.method`` and the options it would be built with (the
    group its declaration names, as ``train`` reads it).

    Raises:
        ValueError: for an unknown method, naming the known ones.
    """
    from lowcomm import strategies

    cls = strategies.strategy_class(config.method)
    return cls, strategies.method_options(cls, config)


def check_plan(config: PlanConfig) -> None:
    """Refuse what ``lowcomm train`` refuses for this method, options and worker layout:
    a method that cannot run hierarchically with ``--ranks-per-worker`` > 1, a
    ``--comm-dtype`` its collectives cannot travel in, and options the
    method's constructor rejects (built once, as ``train``'s validation does, on a recording
    communicator of ``--workers`` around ``train``'s default model).

    Raises:
        ValueError: the method's own message, naming the option and the fix.
    """
    from lowcomm.strategies import comm_dtype_problem

    cls, options = method_options(config)
    ranks = config.ranks_per_worker
    if ranks > 1 and cls.hierarchical_refusal is not None:
        raise ValueError(
            f"--ranks-per-worker: {ranks} with --method {config.method}: "
            f"{cls.hierarchical_refusal}; use --ranks-per-worker 1 with this method"
        )
    if config.worker_sharding == "fsdp" and cls.sharding_refusal is not None:
        raise ValueError(
            f"--worker-sharding fsdp: --method {config.method} does not run on sharded "
            f"workers: {cls.sharding_refusal}; use --worker-sharding replicate"
        )
    dtype_problem = comm_dtype_problem(config.method, config.comm_dtype)
    if dtype_problem is not None:
        raise ValueError(dtype_problem)
    if config.optim.name == "muon":
        from lowcomm.optim.muon import muon_refusal

        if cls.muon_refusal is not None:
            raise muon_refusal(config.method, cls.muon_refusal)
        if ranks > 1:
            raise ValueError(
                f"--optim.name: muon with --ranks-per-worker {ranks}: Muon's matrices are not "
                f"split over a worker's ranks; use --ranks-per-worker 1 or --optim.name adamw"
            )
    values = None if options is None else dataclasses.asdict(options)  # type: ignore[call-overload]
    key = (config.method, config.workers, json.dumps(values, default=str), config.optim.name)
    if key not in _CHECKED:
        _build_once(config.method, config.workers, options, config.optim.name)
        _CHECKED.add(key)


#: (method, workers, options, optimizer) combinations already built by :func:`check_plan`.
_CHECKED: set[tuple[str, int, str, str]] = set()


def _build_once(method: str, workers: int, options: object | None, optimizer: str) -> None:
    from lowcomm.comm.fake import RecordingComm
    from lowcomm.data.config import DataConfig
    from lowcomm.models import ModelConfig, build_model
    from lowcomm.strategies import StrategyContext, strategy_class

    cls = strategy_class(method)
    model = build_model(ModelConfig(), DataConfig().vocab_size)
    comm = RecordingComm(world_size=workers)
    context = StrategyContext(optim=AdamWConfig(name="muon" if optimizer == "muon" else "adamw"))
    if options is None:
        strategy = cls(model, comm, context)
    else:
        strategy = cls(model, comm, context, options=options)  # type: ignore[call-arg]
    strategy.finish()


def make_plan(config: PlanConfig, *, bandwidth_gbps: float | None = None) -> Plan:
    """Evaluate the method's declared cost model for ``config`` (optionally at another
    bandwidth), after :func:`check_plan`.

    Raises:
        ValueError: for an unknown method, or what ``train`` would refuse, naming the fix.
    """
    check_plan(config)
    return _evaluate(config, bandwidth_gbps)


@dataclass(frozen=True)
class _Pricing:
    """What one collective of a method costs on the outer link, per rank (each rank carries
    1/R of every outer payload over its own outer transfer).

    A quantized outer exchange (the options the method declares as its
    ``quantized_exchange``) travels in two steps at its encoded size (a reduce-scatter of
    encoded shards, an all-gather of the re-encoded mean shards), a compressed transfer
    (``Transfer.bytes_per_parameter``) an all-gather of that many bytes per parameter;
    everything else is an all-reduce."""

    profile: NetworkProfile
    workers: int
    ranks: int
    params: float
    model_bytes: float
    quantization: str = "none"
    row_size: int = 1

    def encoded_shard(self, fraction: float) -> float:
        """Bytes of one worker's encoded shard of ``fraction`` of the model (its chunk in
        either step of the two-step exchange, :mod:`lowcomm.strategies.two_step`)."""
        numel = max(1, round(fraction * self.params / self.ranks))
        fmt = typing.cast(QuantizationFormat, self.quantization)
        return float(shard_payload_bytes(numel, self.workers, fmt, self.row_size))

    def exchange_seconds(self, fraction: float) -> float:
        """Seconds of one outer exchange of ``fraction`` of the model (an all-reduce, or the
        quantized reduce-scatter and all-gather)."""
        m = self.workers
        if self.quantization != "none":
            full = m * self.encoded_shard(fraction)
            return self.profile.collective_time(
                CollectiveKind.REDUCE_SCATTER, full, m
            ) + self.profile.collective_time(CollectiveKind.ALL_GATHER, full, m)
        payload = fraction * self.model_bytes / self.ranks
        return self.profile.collective_time(CollectiveKind.ALL_REDUCE, payload, m)

    def exchange_bytes(self, fraction: float) -> float:
        """Bytes one rank sends for one outer exchange of ``fraction`` of the model."""
        m = self.workers
        if m <= 1:
            return 0.0
        if self.quantization != "none":
            return 2.0 * (m - 1) * self.encoded_shard(fraction)
        return 2.0 * (m - 1) / m * fraction * self.model_bytes / self.ranks

    def gathered(self, t: Transfer) -> float:
        """Bytes of one rank's encoded part of a compressed transfer (an all-gather)."""
        return (t.bytes_per_parameter or 0.0) * t.fraction * self.params / self.ranks

    def seconds(self, t: Transfer) -> float:
        if t.bytes_per_parameter is not None:
            m = self.workers
            return self.profile.collective_time(CollectiveKind.ALL_GATHER, m * self.gathered(t), m)
        return self.exchange_seconds(t.fraction)

    def sent(self, t: Transfer) -> float:
        """Bytes one rank sends for one ``t``."""
        if t.bytes_per_parameter is not None:
            return (self.workers - 1) * self.gathered(t) if self.workers > 1 else 0.0
        return self.exchange_bytes(t.fraction)

    def inner_payloads(self, t: Transfer) -> float:
        """What one transfer reassembles inside a worker, in model payloads."""
        if t.bytes_per_parameter is not None:
            return self.workers * self.gathered(t) * self.ranks / self.model_bytes
        return t.fraction


def _step_compute(config: PlanConfig, params: float) -> float:
    """Compute seconds of one optimizer step on one rank."""
    if config.seconds_per_step is not None:
        return config.seconds_per_step
    tokens_per_rank = config.tokens_per_step / (config.workers * config.ranks_per_worker)
    return 6.0 * params * tokens_per_rank / (config.flops * config.mfu)


def _pricing(
    config: PlanConfig, cls: type[Strategy], options: object | None, bandwidth_gbps: float | None
) -> _Pricing:
    params = parse_params(config.params)
    profile = NetworkProfile.from_preset(
        config.network,
        bandwidth_gbps=bandwidth_gbps if bandwidth_gbps is not None else config.bandwidth_gbps,
        latency_ms=config.latency_ms,
    )
    quantization, row_size = (
        ("none", 1) if cls.quantized_exchange is None else cls.quantized_exchange.of(options)
    )
    return _Pricing(
        profile, config.workers, config.ranks_per_worker, params,
        config.element_bytes() * params, quantization, row_size,
    )  # fmt: skip


def _inner_link(
    config: PlanConfig, pricing: _Pricing, payloads_per_step: float, replica_sharded: bool
) -> tuple[float, float]:
    """Seconds and bytes per rank per step on the inner link (R > 1), blocking: the gradient
    all-reduce of every step, and the all-gather that reassembles each outer payload inside
    the worker (``payloads_per_step`` model payloads); methods whose (inner) AdamW moments
    are sharded over the replicas add one all-gather of the parameters per step (ZeRO-1
    inside the worker)."""
    ranks, model_bytes = config.ranks_per_worker, pricing.model_bytes
    if ranks <= 1:
        return 0.0, 0.0
    inner = NetworkProfile.from_preset(
        config.inner_network,
        bandwidth_gbps=config.inner_bandwidth_gbps,
        latency_ms=config.inner_latency_ms,
        names=INNER_LINK,
    )
    if config.worker_sharding == "fsdp":
        return _fsdp_inner_link(inner, ranks, pricing.params, bf16=config.precision == "bf16-mixed")
    gathers = payloads_per_step + (1.0 if replica_sharded else 0.0)
    seconds = inner.collective_time(
        CollectiveKind.ALL_REDUCE, model_bytes, ranks
    ) + gathers * inner.collective_time(CollectiveKind.ALL_GATHER, model_bytes, ranks)
    sent = 2.0 * (ranks - 1) / ranks * model_bytes + gathers * (ranks - 1) / ranks * model_bytes
    return seconds, sent


def _fsdp_inner_link(
    inner: NetworkProfile, ranks: int, params: float, *, bf16: bool
) -> tuple[float, float]:
    """FSDP's inner traffic per step (one micro-batch): the parameters all-gathered for the
    forward and again for the backward (bfloat16 with ``bf16``: FSDP2's mixed-precision
    policy, else float32), the float32 gradients reduce-scattered (the root unit's second
    all-gather, which FSDP skips, is counted: an upper bound by the share of the
    embeddings). Each rank keeps its shards, so no outer payload is reassembled."""
    gathered, reduced = (2.0 if bf16 else 4.0) * params, 4.0 * params
    seconds = 2.0 * inner.collective_time(
        CollectiveKind.ALL_GATHER, gathered, ranks
    ) + inner.collective_time(CollectiveKind.REDUCE_SCATTER, reduced, ranks)
    return seconds, (ranks - 1) / ranks * (2.0 * gathered + reduced)


def _memory_per_worker(
    config: PlanConfig, model: CostModel, params: float, replica_sharded: bool
) -> float:
    """ACCO's convention: bf16 parameters and gradients, K bytes of optimizer states per
    parameter (divided by M when sharded over workers; 4 fewer on Muon's share with
    --optim.name muon), 2 bytes per extra model copy."""
    optimizer_bytes = config.optimizer_bytes / (config.workers if model.shards_over_workers else 1)
    if replica_sharded:
        # The two moments (2/3 of AdamW's fp32 bytes) are split over the R replicas.
        optimizer_bytes = config.optimizer_bytes * (1 / 3 + 2 / 3 / config.ranks_per_worker)
    if config.optim.name == "muon":
        # Muon keeps one fp32 momentum (4 bytes) where AdamW keeps two moments, on its share.
        optimizer_bytes -= 4.0 * muon_share(config)
    return (2 + 2 + 2 * model.extra_copies) * params + optimizer_bytes * params


def lowcomm_state_bytes(config: PlanConfig, model: CostModel) -> float:
    """--memory-model lowcomm: bytes per parameter of the states one rank holds, in float32
    as lowcomm keeps them (a run's ``state_bytes_per_rank``): parameters (4; they are AdamW's
    master), gradients (4), AdamW's two moments (8; divided by M for a method whose optimizer
    is sharded over the workers, by R for one whose moments are split over a replicated
    worker's ranks) and the method's model-sized buffers (4 each: anchors, outer momenta,
    in-flight copies); with --worker-sharding fsdp all of it divided by R."""
    ranks = config.ranks_per_worker
    fsdp = config.worker_sharding == "fsdp"
    moments = 8.0 / (config.workers if model.shards_over_workers else 1)
    if ranks > 1 and model.shards_over_replicas and not fsdp:
        moments /= ranks
    per_parameter = 4.0 + 4.0 + moments + 4.0 * model.extra_copies
    return per_parameter / ranks if fsdp else per_parameter


def lowcomm_rank_memory(config: PlanConfig, model: CostModel, params: float) -> float:
    """--memory-model lowcomm: bytes the largest rank of a lowcomm run holds at its peak (its
    peak resident memory on a CPU), which is its final checkpoint: the states
    (:func:`lowcomm_state_bytes`) and a copy of them, which the rank's state dict takes
    while it is written (every completed run writes one, to be extended with --resume),
    above the step's own temporaries (AdamW's denominator, FSDP's fresh gradient shard);
    plus FSDP's gathered block (its parameters in the compute dtype and float32 gradients,
    --n-layer), the activations of one micro-batch (about 34 values per token, block and
    unit of width, --micro-batch-tokens, --n-embd) and the process itself (--process-bytes).
    Measured by ``lowcomm bench fsdp`` (docs/results/fsdp.md)."""
    states = lowcomm_state_bytes(config, model) * params
    memory = config.process_bytes + 2.0 * states
    compute_bytes = 2.0 if config.precision == "bf16-mixed" else 4.0
    if config.worker_sharding == "fsdp" and config.n_layer > 0:
        memory += (compute_bytes + 4.0) * params / config.n_layer
    memory += 34.0 * compute_bytes * config.micro_batch_tokens * config.n_embd * config.n_layer
    return memory


def _evaluate(config: PlanConfig, bandwidth_gbps: float | None) -> Plan:
    cls, options = method_options(config)
    model, ranks = cls.cost, config.ranks_per_worker
    pricing = _pricing(config, cls, options, bandwidth_gbps)
    step_compute = _step_compute(config, pricing.params)
    transfers = model.traffic(
        options, Timing(step_seconds=step_compute, all_reduce_seconds=pricing.exchange_seconds)
    )
    # Communication time per step (averaged over the schedule) and the part exposed: each
    # collective overlaps its hidden_steps of compute; what does not fit is exposed (nothing
    # for a method that accumulates: its compute never idles).
    comm_per_step = sum(t.per_step * pricing.seconds(t) for t in transfers)
    exposed_per_step = sum(
        t.per_step * max(0.0, pricing.seconds(t) - t.hidden_steps * step_compute)
        for t in transfers
        if not model.accumulates
    )
    steps = config.tokens / config.tokens_per_step
    compute = steps * step_compute
    if model.accumulates:
        # ACCO: each committed step is two phases (estimate, update), each one RS+AG of the
        # model, and each phase's compute lasts until its communication is done (at least
        # half a step's batch). When communication is the slower side, each committed step
        # absorbs more tokens, so there are fewer of them; the compute never idles.
        steps /= max(1.0, pricing.exchange_seconds(1.0) / (step_compute / 2))
    fsdp = config.worker_sharding == "fsdp"
    # (fsdp: every state is sharded, not only the replicas' AdamW moments)
    replica_sharded = ranks > 1 and model.shards_over_replicas and not fsdp
    payloads_per_step = sum(pricing.inner_payloads(t) * t.per_step for t in transfers)
    inner_per_step, inner_bytes_per_step = _inner_link(
        config, pricing, payloads_per_step, replica_sharded
    )
    drain = 0.0 if model.accumulates else _final_drain(config, options, transfers, pricing, steps)
    exposed = steps * (exposed_per_step + inner_per_step) + drain
    total_comm = steps * (comm_per_step + inner_per_step)
    wall = compute + exposed
    outer_bytes_per_step = sum(t.per_step * pricing.sent(t) for t in transfers)
    bytes_per_step = ranks * (outer_bytes_per_step + inner_bytes_per_step)
    memory = _memory_per_worker(config, model, pricing.params, replica_sharded)
    rank_memory = memory / ranks if fsdp else memory
    if config.memory_model == "lowcomm":
        rank_memory = lowcomm_rank_memory(config, model, pricing.params)
        memory = rank_memory * ranks if fsdp else rank_memory
    return Plan(
        method=config.method, params=pricing.params, workers=config.workers, steps=steps,
        bandwidth_gbps=pricing.profile.bandwidth_gbps, latency_ms=pricing.profile.latency_ms,
        compute_s=compute, comm_total_s=total_comm, comm_exposed_s=exposed,
        comm_hidden_s=total_comm - exposed, utilization=compute / wall if wall > 0 else 1.0,
        wall_clock_s=wall, comm_bytes_per_worker_per_step=bytes_per_step,
        comm_bytes_per_worker=bytes_per_step * steps,
        memory_per_worker_bytes=memory, memory_per_rank_bytes=rank_memory,
        worker_sharding=config.worker_sharding, ranks_per_worker=ranks, inner_comm_s=steps * inner_per_step,
        outer_bytes_per_rank_per_step=outer_bytes_per_step,
        inner_bytes_per_rank_per_step=inner_bytes_per_step,
        schedule=model.schedule(options), syncs_per_step=sum(t.per_step for t in transfers),
        options=None if options is None else dataclasses.asdict(options),  # type: ignore[call-overload]
        final_drain_s=drain,
    )  # fmt: skip


def _delayed_launch_gaps(options: Any, steps: int) -> list[int]:
    """eager and diloco_delayed: per fragment, the steps from its last launch to the run's
    end (fragment p launches at the steps t >= o_p with t = o_p mod H, o_p its completion
    offset; a fragment that never launched is left out)."""
    from lowcomm.strategies.streaming import completion_offsets

    period = int(options.sync_every)
    fragments = int(options.fragments or 1)
    return [
        (steps - offset) % period
        for offset in completion_offsets(period, fragments)
        if steps >= offset
    ]


def _round_launch_gaps(options: Any, steps: int) -> list[int]:
    """overlap_local_sgd: the steps from its last launch (every tau steps) to the run's end."""
    period = int(options.sync_every)
    return [steps % period] if steps >= period else []


#: The methods whose run ends by waiting for its exchanges still in flight (their
#: ``finish()`` drains them): for a run of K steps, the steps each last exchange (one per
#: fragment) overlaps between its launch and the run's end. co2 turns a trailing partial
#: round into a round, so its last all-reduce is launched at the last step.
#: streaming_diloco and cocodc start no sync within tau steps of the end: theirs lands there.
_FINAL_EXCHANGES: dict[str, Callable[[Any, int], list[int]]] = {
    "eager": _delayed_launch_gaps,
    "diloco_delayed": _delayed_launch_gaps,
    "co2": lambda options, steps: [0] if steps >= 1 else [],
    "overlap_local_sgd": _round_launch_gaps,
}


def _final_drain(
    config: PlanConfig,
    options: object | None,
    transfers: typing.Sequence[Transfer],
    pricing: _Pricing,
    steps: float,
) -> float:
    """D_end, the seconds a run waits after its last step for its last exchange in flight,
    which the per-step pricing leaves out: an exchange of x seconds that overlaps y seconds of
    compute exposes max(0, x - y) where it lands, but the run's last one lands after the last
    step, with only the u steps since its launch to hide behind. Its wait past the last step,
    beyond the max(0, x - y) already priced, is max(0, min(x, y) - u c) (the link busy with
    the exchanges before it when x > y): D_end is the largest over the overlapped transfers
    and the fragments' last launches. 0 for the methods that end with nothing in flight."""
    gaps_of = _FINAL_EXCHANGES.get(config.method)
    if gaps_of is None:
        return 0.0
    step = _step_compute(config, pricing.params)
    gaps = gaps_of(options, math.floor(steps + 1e-9))
    waits = [
        max(0.0, min(pricing.seconds(t), t.hidden_steps * step) - gap * step)
        for t in transfers
        if t.hidden_steps > 0
        for gap in gaps
    ]
    return max(waits, default=0.0)


#: The analytic models of lowcomm.faults.goodput a method is priced with.
FaultFamily = Literal["synchronous", "local", "decoupled"]


@dataclass(frozen=True)
class _FaultModel:
    """How a method meets faults, for the planner.

    Attributes:
        family: the goodput model whose waiting it shares; None: not priced.
        period: H, the steps of a round (its sync period), from its options.
        heal_bytes: bytes per parameter a joining worker receives from a live member: what
            every worker holds alike (float32: parameters, outer optimizer state, replicated
            optimizer state); its per-worker state starts by the method's rule and is not sent.
        reason: why it is not priced (family None).
        in_flight: N, the rounds after its launch that a round's result lands (0: where it
            is launched); a crash fails the N in flight on every member.
        heal_tensors: the broadcasts healing takes (None: one per 4 bytes of heal_bytes).
        overlap: tau, the steps a sync flies when its failure only delays its tokens to the
            next completed sync (0: none); the run's last sync then loses them.
        fragments: F, the fragments whose syncs take turns (a sync completes every H / F
            steps).
        live_heal: the model-sized tensors of each exchange in flight that a healing sends
            only when the exchange is live (eager 2, diloco_delayed 1; already counted in
            heal_bytes): one that a crash failed since its launch is not sent.
        launch_phases: the steps of a round right after its overlapped collective's
            launches, one per launch (None: not known, a join's wait for it is priced as
            its expectation even given a run's healings).
        detect_phases: the steps of a round at whose end the survivors of a crash wait for
            its detection (None: the round's last, its sync).
    """

    family: FaultFamily | None
    period: Callable[[Any], int] = lambda options: 1
    heal_bytes: Callable[[PlanConfig], float] = lambda config: 4.0
    reason: str = ""
    in_flight: Callable[[Any], int] = lambda options: 0
    heal_tensors: int | None = None
    overlap: Callable[[Any], int] = lambda options: 0
    fragments: Callable[[Any], int] = lambda options: 1
    live_heal: int = 0
    launch_phases: Callable[[Any], tuple[int, ...]] | None = None
    detect_phases: Callable[[Any], tuple[int, ...]] | None = None


def _sync_every(options: Any) -> int:
    return int(options.sync_every)


def _outer_delay(options: Any) -> int:
    return int(options.outer_delay)


def _delayed_heal(config: PlanConfig, tensors_per_exchange: int) -> float:
    """phi, the outer momentum and N in-flight exchanges of ``tensors_per_exchange`` tensors."""
    return _OUTER + 4.0 * tensors_per_exchange * _outer_delay(method_options(config)[1])


def _overlap_steps(options: Any) -> int:
    return int(options.overlap_steps)


def _completions(options: Any, default_fragments: int = 1) -> list[int]:
    """The step counts (mod H) at which each fragment's sync completes (F from the options,
    or the method's default)."""
    from lowcomm.strategies.streaming import completion_offsets

    fragments = int(options.fragments or default_fragments)
    return completion_offsets(int(options.sync_every), fragments)


def _delayed_launches(options: Any) -> tuple[int, ...]:
    """eager and diloco_delayed launch fragment p's exchange after the step count o_p (its
    completion offset) of each round, so the step after it is o_p mod H."""
    return tuple(offset % int(options.sync_every) for offset in _completions(options))


def _streaming_detections(options: Any) -> tuple[int, ...]:
    """streaming_diloco waits for a pending detection at each launch (the end of step
    o_p - tau - 1 of the round) and at the completion of a sync in flight (the end of step
    o_p - 1)."""
    period, overlap = int(options.sync_every), int(options.overlap_steps)
    offsets = _completions(options, 4)
    ends = {(offset - overlap - 1) % period for offset in offsets}
    return tuple(sorted(ends | {(offset - 1) % period for offset in offsets}))


def _streaming_launches(options: Any) -> tuple[int, ...]:
    """streaming_diloco launches fragment p's sync tau steps before it completes, after the
    step count o_p: the step after the launch is o_p - tau mod H."""
    period, overlap = int(options.sync_every), int(options.overlap_steps)
    return tuple((offset - overlap) % period for offset in _completions(options, 4))


def _fragments_or(default: int) -> Callable[[Any], int]:
    """F from the options, or the method's default (a plan's options leave it unset)."""
    return lambda options: int(options.fragments or default)


def _param_period(options: Any) -> int:
    return int(options.param_period)


def _adamw_bytes(config: PlanConfig) -> float:
    # The float32 master copy and both moments (K bytes), which every worker holds alike.
    return config.optimizer_bytes


_OUTER = 8.0  # parameters (the anchor after a sync) and the outer momentum
_SHARDED_PIPELINE = (
    "its optimizer state is sharded over the workers and updated through an overlapped "
    "pipeline, so a crash loses a shard the next update needs; the goodput model covers "
    "methods that survive a crash"
)
_FAULT_MODELS: dict[str, _FaultModel] = {
    "ddp": _FaultModel("synchronous", heal_bytes=_adamw_bytes),
    # The parameters and the joiner's 1/M shard of the moments, re-sharded.
    "zero1": _FaultModel(
        "synchronous",
        heal_bytes=lambda config: 4.0 + (config.optimizer_bytes - 4.0) / config.workers,
    ),
    # Momentum and error feedback are per worker.
    "demo": _FaultModel("synchronous"),
    "acco": _FaultModel(None, reason=_SHARDED_PIPELINE),
    "dpu": _FaultModel(None, reason=_SHARDED_PIPELINE),
    "wp": _FaultModel(None, reason=_SHARDED_PIPELINE),
    "diloco": _FaultModel("local", _sync_every, lambda config: _OUTER),
    # A failed sync's tokens wait for the next completed one: only the last sync's are lost.
    "streaming_diloco": _FaultModel(
        "local",
        _sync_every,
        lambda config: _OUTER,
        overlap=_overlap_steps,
        fragments=_fragments_or(4),
        launch_phases=_streaming_launches,
        detect_phases=_streaming_detections,
    ),
    "cocodc": _FaultModel(
        "local",
        _sync_every,
        lambda config: _OUTER,
        overlap=_overlap_steps,
        fragments=_fragments_or(4),
    ),
    # phi, the outer momentum and the N exchanges in flight (eager: with the sender's own).
    "diloco_delayed": _FaultModel(
        "local",
        _sync_every,
        lambda config: _delayed_heal(config, 1),
        in_flight=_outer_delay,
        live_heal=1,
        launch_phases=_delayed_launches,
    ),
    "eager": _FaultModel(
        "local",
        _sync_every,
        lambda config: _delayed_heal(config, 2),
        in_flight=_outer_delay,
        live_heal=2,
        launch_phases=_delayed_launches,
    ),
    "sparta_diloco": _FaultModel("local", _sync_every, lambda config: _OUTER),
    # The anchor; the error-feedback buffer is per worker.
    "sparseloco": _FaultModel("local", _sync_every),
    "local_sgd": _FaultModel("local", _sync_every),
    "local_adamw": _FaultModel("local", _sync_every),
    "overlap_local_sgd": _FaultModel("local", _sync_every, launch_phases=lambda o: (0,)),
    "slowmo": _FaultModel("local", _sync_every, lambda config: _OUTER),
    # The anchor, m, the all-reduce in flight ([Delta | d]: twice the model) and d.
    "co2": _FaultModel(
        "local",
        _sync_every,
        lambda config: 20.0,
        in_flight=lambda o: 1,
        heal_tensors=4,
        launch_phases=lambda o: (0,),
    ),
    # Averages a fraction of the parameters every step: a round is one step.
    "sparta": _FaultModel("local"),
    # DES-LOC and Local Adam average the moments too, so a joiner receives them.
    "desloc": _FaultModel("local", _param_period, _adamw_bytes),
    "local_adam": _FaultModel("local", _param_period, _adamw_bytes),
    "favg_opt": _FaultModel("local", _param_period),
    "favg_reset": _FaultModel("local", _param_period),
    "decoupled_diloco": _FaultModel("decoupled", _sync_every, lambda config: _OUTER),
}


@dataclass
class FaultGoodput:
    """The method's expected goodput under the --fault-* options (lowcomm.faults.goodput's
    model, fed by the plan's own costs). Times in seconds, sizes in bytes.

    Attributes:
        family: the model used (synchronous, local, decoupled), or None when not priced.
        goodput: committed tokens over the fault-free tokens of the same time (None: not
            priced).
        reason: why the method is not priced.
        horizon_s: T, the modeled time the faults are priced over.
        fault_free_tokens_per_s: what the M workers commit per second without a fault.
        committed_tokens_per_s: goodput times that.
        worker_seconds: M T.
        worker_seconds_lost: M T (1 - goodput).
        wall_clock_s: the plan's tokens at this goodput (None when goodput is 0).
        compute_s: c, one worker's compute per step.
        sync_s: m, the communication a round exposes.
        sync_every: H, the steps of a round.
        heal_bytes: what a joining worker receives (per rank).
        heal_s: h, that transfer over the link.
        alive_fraction: a; crashes: n; joins: j; slowest_pace: S (the model's symbols).
    """

    family: str | None
    goodput: float | None
    reason: str
    horizon_s: float
    fault_free_tokens_per_s: float
    committed_tokens_per_s: float | None
    worker_seconds: float
    worker_seconds_lost: float | None
    wall_clock_s: float | None
    compute_s: float
    sync_s: float
    sync_every: int
    heal_bytes: float
    heal_s: float
    alive_fraction: float
    crashes: float
    joins: float
    slowest_pace: float


def fault_model(method: str) -> _FaultModel:
    """How ``method`` meets faults; a method without an entry is not priced (every method
    of the library has one)."""
    unknown = _FaultModel(
        None,
        reason=f"the planner has no fault model for {method}; name its family in "
        "lowcomm.plan._FAULT_MODELS",
    )
    return _FAULT_MODELS.get(method, unknown)


def price_faults(
    config: PlanConfig,
    plan: Plan,
    *,
    exposure: Exposure | None = None,
    dropped_rounds: float | None = None,
    last_sync_lost: float | None = None,
    steps_met: FaultSteps | None = None,
) -> FaultGoodput:
    """The expected goodput of ``plan``'s method under ``config``'s --fault-* options.

    The step costs are the plan's: c its compute per step, m its exposed communication per
    step times H, h the method's global state over the link (one hop, each rank its 1/R);
    T is --fault-horizon-s or the plan's fault-free wall clock. ``exposure``: the faults to
    price instead of the options' expected ones, ``dropped_rounds`` the exchanges that
    failed instead of their expected number, ``last_sync_lost`` the rounds of every
    survivor the run's failed last sync lost and ``steps_met`` the steps its crashes and
    healings fell on (a run's own, to check the model on it).
    """
    _, options = method_options(config)
    model = fault_model(config.method)
    horizon = plan.wall_clock_s if config.fault_horizon_s is None else config.fault_horizon_s
    expected = exposure is None
    if exposure is None:
        exposure = expected_exposure(_fault_options(config, horizon), workers=config.workers)
    period = model.period(options)
    costs, heal_bytes = _fault_step_costs(config, plan, model, period, exposure.crashes, steps_met)
    compute = costs.compute_s

    drained = _drained(plan, horizon)
    if drained is not None:
        exposure = dataclasses.replace(exposure, duration_s=horizon - plan.final_drain_s)
    if expected:
        exposure = _landed(config, model, costs, exposure)

    def goodput_of(faults: Exposure) -> float | None:
        given = (dropped_rounds, last_sync_lost)
        value = _family_goodput(model, faults, costs, options, plan.steps, given)
        return value if value is None or drained is None else min(1.0, value * drained)

    value = goodput_of(exposure)
    if expected and value is not None:
        # (A trace's crash count is drawn: the expectation is over it.)
        value = over_crash_counts(exposure, lambda faults: goodput_of(faults) or 0.0)
    fault_free_rate = config.tokens / plan.wall_clock_s
    return FaultGoodput(
        family=model.family, goodput=value, reason=model.reason, horizon_s=horizon,
        fault_free_tokens_per_s=fault_free_rate,
        committed_tokens_per_s=None if value is None else value * fault_free_rate,
        worker_seconds=config.workers * horizon,
        worker_seconds_lost=None if value is None else worker_seconds_lost(
            workers=config.workers, modeled_s=horizon, goodput=value
        ),
        wall_clock_s=None if not value else plan.wall_clock_s / value,
        compute_s=compute, sync_s=costs.exposed_s(), sync_every=period, heal_bytes=heal_bytes,
        heal_s=costs.heal_s, alive_fraction=exposure.alive_fraction, crashes=exposure.crashes,
        joins=exposure.joins, slowest_pace=exposure.slowest_pace,
    )  # fmt: skip


def _landed(
    config: PlanConfig, model: _FaultModel, costs: StepCosts, exposure: Exposure
) -> Exposure:
    """The expected crashes and joins that land on a step (``landed``): none in the run's
    last step, the slowest worker's compute and (but for decoupled_diloco, whose learners
    do not wait) the sync it exposes."""
    pace = exposure.slowest_pace
    last_step = costs.compute_s * pace
    if model.family != "decoupled":
        last_step += costs.exposed_s(pace)
    replace_after = config.fault_replace_after_s
    return landed(
        exposure, last_step_s=last_step,
        replace_after_s=math.inf if replace_after is None else replace_after,
    )  # fmt: skip


def _drained(plan: Plan, horizon: float) -> float | None:
    """The factor a run's final drain D puts on the goodput its steps keep (None: no
    drain). Both runs end by waiting D for their last exchange, computing nothing: the
    fault-free run commits its tokens in W - D of its wall clock W, and the run with faults
    computes for T - D of its T. So G is the family's G over the T - D the run computes,
    times (T - D) / T (the drain commits nothing) and W / (W - D) (the fault-free rate it is
    measured against is the slower for the drain too)::

        G = G_family(T - D) (T - D) / T * W / (W - D)
    """
    drain, wall = plan.final_drain_s, plan.wall_clock_s
    if drain <= 0.0 or not drain < min(horizon, wall):
        return None
    return (horizon - drain) / horizon * wall / (wall - drain)


def _fault_options(config: PlanConfig, horizon: float) -> FaultOptions:
    """The --fault-* options over a horizon of ``horizon`` seconds."""
    return FaultOptions.given(
        duration_s=horizon,
        detection_s=config.fault_detection_s,
        mtbf_s=config.fault_mtbf_s,
        replace_after_s=config.fault_replace_after_s,
        slow_fraction=config.fault_slow_fraction,
        slow_factor=config.fault_slow_factor,
    )


@dataclass(frozen=True)
class FaultSteps:
    """The steps a run's faults fell on, to price that run's own crashes and healings by
    where in the round they fall: a crash's partial round and its survivors' wait for its
    detection, a join's wait for the collectives in flight, and whether a healing sends an
    exchange in flight (not when a crash has failed it).

    Attributes:
        crashes: the steps of the run's crashes.
        healings: the steps at which it healed joiners (one per step however many join).
    """

    crashes: tuple[int, ...] = ()
    healings: tuple[int, ...] = ()


def _failed_at_healings(steps_met: FaultSteps, in_flight: int, period: int) -> float:
    """The mean exchanges in flight at the run's healings that a crash had failed: at a
    healing at step t of round r = t // H, the exchanges launched at the ends of rounds
    r - N .. r - 1 fly, and the one of round q failed when a crash fell at a step of rounds
    q + 1 .. (not before its launch: its quorum then left the dead worker out), up to t."""
    failed = [
        sum(
            any((q + 1) * period <= crash <= step for crash in steps_met.crashes)
            for q in range(max(0, step // period - in_flight), step // period)
        )
        for step in steps_met.healings
    ]
    return sum(failed) / len(failed)


def _fault_step_costs(
    config: PlanConfig,
    plan: Plan,
    model: _FaultModel,
    period: int,
    crashes: float,
    steps_met: FaultSteps | None = None,
) -> tuple[StepCosts, float]:
    """The step costs the fault model prices (c, m over a period of H steps, h) and the
    bytes of a healing with every exchange in flight live (each rank its 1/R of the global
    state); h is the expected healing, without the exchanges ``crashes`` failed, or, given
    ``steps_met``, the run's own healings."""
    # (The run's final drain is priced once, over the horizon: price_faults.)
    exposed_per_step = (
        (plan.comm_exposed_s - plan.final_drain_s) / plan.steps if plan.steps > 0 else 0.0
    )
    heal_bytes = model.heal_bytes(config) * plan.params / config.ranks_per_worker
    tensors = float(model.heal_tensors or round(model.heal_bytes(config) / 4.0))
    options = method_options(config)[1]
    if model.live_heal:
        in_flight = model.in_flight(options)
        failed = (
            _failed_at_healings(steps_met, in_flight, period)
            if steps_met is not None and steps_met.healings
            else _failed_in_flight(crashes, in_flight, period, plan.steps)
        )
        unsent = model.live_heal * failed
        heal_bytes_sent = heal_bytes * (1.0 - unsent / tensors)
        tensors -= unsent
    else:
        heal_bytes_sent = heal_bytes
    link = NetworkProfile(
        name="custom", bandwidth_gbps=plan.bandwidth_gbps, latency_ms=plan.latency_ms
    )
    overlapped = _overlapped(config, plan, period)
    hidden_exposed = sum(k * max(0.0, x - y) for k, x, y in overlapped)
    costs = StepCosts(
        compute_s=_step_compute(config, plan.params),
        sync_s=max(0.0, exposed_per_step * period - hidden_exposed),
        sync_every=period,
        overlapped=overlapped,
        heal_s=_heal_seconds(link, heal_bytes_sent, tensors, config.workers),
        join_phases=() if steps_met is None else tuple(t % period for t in steps_met.healings),
        launch_phases=() if model.launch_phases is None else model.launch_phases(options),
        detect_phases=() if model.detect_phases is None else model.detect_phases(options),
        crash_phases=() if steps_met is None else tuple(t % period for t in steps_met.crashes),
    )
    return costs, heal_bytes


def _failed_in_flight(crashes: float, in_flight: int, period: int, steps: float) -> float:
    """The expected exchanges in flight at a join that a crash has failed since their
    launch (crashes at n / K per step): the i-th newest was launched (i - 1) H steps and,
    the join falling at a uniform step of the round, (H + 1) / 2 more before it, so it is
    live with probability (1 - ((H + 1) / 2 + (i - 1) H) / K)^n (:func:`none_in`)."""
    if crashes == 0.0 or steps <= 0:
        return 0.0
    return sum(
        1.0 - none_in(crashes, ((period + 1) / 2.0 + i * period) / steps) for i in range(in_flight)
    )


def _overlapped(
    config: PlanConfig, plan: Plan, period: int
) -> tuple[tuple[float, float, float], ...]:
    """The method's collectives that overlap compute, per round of ``period`` steps, as the
    plan prices them: (how many, seconds each, compute seconds each overlaps). A straggler's
    slower compute hides more of them (``StepCosts.overlapped``)."""
    cls, options = method_options(config)
    if cls.cost.accumulates:
        return ()
    pricing = _pricing(config, cls, options, plan.bandwidth_gbps)
    step = _step_compute(config, pricing.params)
    transfers = cls.cost.traffic(
        options, Timing(step_seconds=step, all_reduce_seconds=pricing.exchange_seconds)
    )
    return tuple(
        (t.per_step * period, pricing.seconds(t), t.hidden_steps * step)
        for t in transfers
        if t.hidden_steps > 0
    )


def _heal_seconds(link: NetworkProfile, heal_bytes: float, tensors: float, workers: int) -> float:
    """h: the healing broadcasts from one member over the quorum's M workers, ``tensors`` of
    them (one per tensor of the global state; an expected count may be fractional): their
    transfer and, each, the (M - 1) hops of latency the link prices a broadcast with."""
    tensors = max(1.0, tensors)
    single = link.collective_time(CollectiveKind.BROADCAST, heal_bytes, workers)
    hops = link.collective_time(CollectiveKind.BROADCAST, 0.0, workers)
    return single + (tensors - 1) * hops


def _family_goodput(
    model: _FaultModel,
    exposure: Exposure,
    costs: StepCosts,
    options: object | None,
    steps: float,
    given: tuple[float | None, float | None] = (None, None),
) -> float | None:
    """G of the model's family; ``given``: the dropped rounds and the last sync's lost rounds
    to price instead of their expectations (None: expected)."""
    if model.family == "synchronous":
        return goodput_synchronous(exposure, costs, steps=steps)
    if model.family == "local":
        dropped_rounds, last_lost = given
        if dropped_rounds is None:
            late = model.in_flight(options)
            rounds = steps / costs.sync_every
            dropped_rounds = expected_dropped_rounds(exposure.crashes, late, rounds)
        if last_lost is None:
            overlap = model.overlap(options)
            last_lost = 0.0
            if overlap > 0:
                last_lost = expected_last_sync_lost(
                    exposure.crashes, overlap_steps=overlap,
                    fragments=model.fragments(options), steps=steps,
                )  # fmt: skip
        return goodput_local(
            exposure, costs, dropped_rounds=dropped_rounds, last_sync_lost=last_lost, steps=steps
        )
    if model.family == "decoupled":
        # Late fragments are merged by their token count, so the grace window does not
        # change what commits (lowcomm.faults.goodput.goodput_decoupled).
        quorum = int(getattr(options, "min_quorum", 1))
        return goodput_decoupled(exposure, costs, min_quorum=quorum, grace_s=0.0, steps=steps)
    return None


def solve_bandwidth(config: PlanConfig, target: float) -> float | None:
    """Smallest bandwidth (Gbit/s) reaching utilisation ``target``; None if latency forbids."""
    check_plan(config)
    if _evaluate(config, 1e12).utilization < target:
        return None
    low, high = 1e-6, 1e12
    for _ in range(200):
        middle = math.sqrt(low * high)
        if _evaluate(config, middle).utilization >= target:
            high = middle
        else:
            low = middle
        if high / low < 1 + 1e-9:
            break
    return high


def _human(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.2f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds:.2f} s"


def _gb(count: float) -> str:
    return f"{count / 1e9:.3f} GB"


def _after_losing(config: PlanConfig, plan: Plan) -> dict[str, float]:
    """Time per step on M workers and on M - K (same global batch and options)."""
    smaller = make_plan(
        dataclasses.replace(config, workers=config.workers - config.lose_workers, lose_workers=0)
    )
    before = plan.wall_clock_s / plan.steps
    after = smaller.wall_clock_s / smaller.steps
    return {
        "workers": smaller.workers,
        "step_s_before": before,
        "step_s_after": after,
        "slowdown": after / before if before > 0 else math.inf,
        "utilization": smaller.utilization,
        "wall_clock_s": smaller.wall_clock_s,
    }


def run_plan(config: PlanConfig) -> dict[str, object]:
    """Print the plan (table or JSON) and return it as a dictionary."""
    plan = make_plan(config)
    result: dict[str, object] = asdict(plan)
    if config.solve_bandwidth is not None:
        result["solved_bandwidth_gbps"] = solve_bandwidth(config, config.solve_bandwidth)
        result["solve_target_utilization"] = config.solve_bandwidth
    if config.lose_workers:
        result["after_losing"] = _after_losing(config, plan)
    if config.prices_faults():
        result["goodput"] = asdict(price_faults(config, plan))
    if config.json:
        print(json.dumps(result, indent=2))
        return result
    rows = _table(config, plan, result)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name.ljust(width)}  {value}")
    return result


def _rank_rows(plan: Plan) -> list[tuple[str, str]]:
    """The per-rank rows of a plan with several ranks per worker."""
    memory = (
        f"{_gb(plan.memory_per_rank_bytes)} (1/{plan.ranks_per_worker} of the worker's: "
        f"--worker-sharding fsdp)"
        if plan.worker_sharding == "fsdp"
        else "= memory per worker (states replicated inside a worker)"
    )
    return [
        ("outer sent per rank per step", _gb(plan.outer_bytes_per_rank_per_step)),
        ("inner sent per rank per step", _gb(plan.inner_bytes_per_rank_per_step)),
        ("memory per rank", memory),
    ]


def _table(config: PlanConfig, plan: Plan, result: dict[str, object]) -> list[tuple[str, str]]:
    """The plan's rows (name, value) as ``lowcomm plan`` prints them."""
    rows = [
        ("method", f"{plan.method} ({method_options(config)[0].cost.description})"),
        ("sync", f"{plan.schedule} ({plan.syncs_per_step:.3g} collectives per step)"),
        ("model", f"{plan.params / 1e9:.3f} B parameters"),
        (
            "workers",
            str(plan.workers)
            + (f" x {plan.ranks_per_worker} ranks" if plan.ranks_per_worker > 1 else ""),
        ),
        ("link", f"{plan.bandwidth_gbps} Gbit/s, {plan.latency_ms} ms"),
        ("optimizer steps", f"{plan.steps:,.0f}"),
        ("compute", _human(plan.compute_s)),
        (
            "communication",
            f"{_human(plan.comm_total_s)} ({_human(plan.comm_hidden_s)} hidden, {_human(plan.comm_exposed_s)} exposed"
            + (
                f", {_human(plan.final_drain_s)} of it the final drain)"
                if plan.final_drain_s
                else ")"
            ),
        ),
        ("utilisation", f"{plan.utilization:.1%}"),
        ("wall clock", _human(plan.wall_clock_s)),
        ("sent per worker per step", _gb(plan.comm_bytes_per_worker_per_step)),
        ("sent per worker, total", _gb(plan.comm_bytes_per_worker)),
        ("memory per worker", _gb(plan.memory_per_worker_bytes)),
    ]
    if "goodput" in result:
        priced = result["goodput"]
        assert isinstance(priced, dict)
        at = [name for name, _ in rows].index("utilisation") + 1
        rows[at:at] = _goodput_rows(plan, priced)
    if config.optim.name == "muon":
        rows.insert(
            3,
            ("optimizer", f"muon on {muon_share(config):.1%} of the parameters, adamw on the rest"),
        )
    if plan.ranks_per_worker > 1:
        rows[4:4] = [
            ("inner link", f"{config.inner_network}, {_human(plan.inner_comm_s)} (blocking)")
        ]
        rows += _rank_rows(plan)
    if config.lose_workers:
        rows.append(_losing_row(config, plan, result))
    if config.solve_bandwidth is not None:
        solved = result["solved_bandwidth_gbps"]
        rows.append(
            (
                f"bandwidth for {config.solve_bandwidth:.0%}",
                "unreachable (latency alone exceeds the budget)"
                if solved is None
                else f"{solved:.3f} Gbit/s",
            )
        )
    return rows


def _losing_row(config: PlanConfig, plan: Plan, result: dict[str, object]) -> tuple[str, str]:
    """The row of --lose-workers: the step time and utilisation on the workers left."""
    after = result["after_losing"]
    assert isinstance(after, dict)
    return (
        f"losing {config.lose_workers} of {plan.workers}",
        f"{_human(after['step_s_before'])} -> {_human(after['step_s_after'])} per step "
        f"on {after['workers']} workers ({after['slowdown']:.2f}x), utilisation "
        f"{after['utilization']:.1%}",
    )


def _goodput_rows(plan: Plan, priced: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows of the fault pricing (:func:`price_faults`), after utilisation."""
    if priced["goodput"] is None:
        return [("goodput", f"not priced for {plan.method}: {priced['reason']}")]
    wall = priced["wall_clock_s"]
    return [
        (
            "goodput",
            f"{priced['goodput']:.1%} under faults ({priced['family']} model), "
            f"{priced['committed_tokens_per_s']:,.0f} of {priced['fault_free_tokens_per_s']:,.0f}"
            f" tokens/s committed; wall clock {'never' if wall is None else _human(wall)}",
        ),
        (
            "worker-seconds lost",
            f"{priced['worker_seconds_lost']:.4g} of {priced['worker_seconds']:.4g} "
            f"(M x T, T = {_human(priced['horizon_s'])})",
        ),
        (
            "faults priced",
            f"{priced['crashes']:.4g} crashes, {priced['joins']:.4g} joins, alive "
            f"{priced['alive_fraction']:.2%}, slowest worker x{priced['slowest_pace']:.3g}; "
            f"c = {priced['compute_s']:.4g} s, m = {priced['sync_s']:.4g} s per H = "
            f"{priced['sync_every']}, heal {_gb(priced['heal_bytes'])} in {priced['heal_s']:.4g} s",
        ),
    ]


def plan_for_run(
    train: TrainConfig,
    *,
    params: str,
    tokens: float,
    steps: int,
    seconds_per_step: float,
    horizon_s: float,
) -> PlanConfig:
    """The planner's configuration of a training run: the settings ``train`` and ``plan``
    share (the method's options and the --fault-* options among them), and the run's size,
    tokens, steps, one worker's compute per step and its modeled time as the fault horizon.

    A fragmented method's unset fragment count is the one the run used: its default capped
    at the model's transformer blocks (a 1-block model trains with 1 fragment), where a plan
    alone takes the method's default (4), which the run's H and tau may not fit.

    ``seconds_per_step`` is one worker's compute for a step of ``--microbatches-per-step``
    micro-batches. ACCO, DPU and WP (the ``--acco.*`` family) compute another count: each
    phase takes micro-batches until its chain is done (at least one, or
    ``--acco.microbatches-per-phase``), two phases a step for ACCO, and the first step
    first computes a priming one (a run of K steps of one micro-batch a phase: 2 K + 1
    micro-batches for ACCO, K + 1 for DPU and WP). Their step's compute is therefore priced
    for the micro-batches the run's steps took (its tokens per step), at the same rate.
    """
    from lowcomm.config import option_names, option_value
    from lowcomm.strategies import strategy_class

    shared = {f.name for f in dataclasses.fields(PlanConfig)} & option_names()
    values = {name: option_value(train, name) for name in shared}
    cls = strategy_class(train.method)
    field = cls.options_field
    options = None if field is None else getattr(train, field, None)
    if getattr(options, "fragments", 0) is None and field in values:
        values[field] = dataclasses.replace(options, fragments=_run_fragments(train, cls))  # type: ignore[type-var]
    if field == "acco":
        baseline = (
            train.placement.workers
            * train.run.microbatches_per_step
            * train.tokens_per_microbatch()
        )
        seconds_per_step *= tokens / steps / baseline
    return PlanConfig(
        **values,
        params=params,
        tokens=tokens,
        tokens_per_step=tokens / steps,
        seconds_per_step=seconds_per_step,
        fault_horizon_s=horizon_s,
    )


def _run_fragments(train: TrainConfig, cls: type[Strategy]) -> int:
    """The fragment count a run of ``train`` uses when none is given (its model built on the
    meta device: only its parameter names and sizes are read)."""
    import torch

    from lowcomm.models import build_model
    from lowcomm.strategies.diloco import default_fragment_count

    preferred = int(getattr(cls, "default_fragments", 1))
    with torch.device("meta"):  # (the vocabulary does not change the blocks)
        model = build_model(train.model, 64)
    return default_fragment_count(model, preferred)
