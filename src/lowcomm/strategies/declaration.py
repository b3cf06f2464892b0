"""What a method declares about itself, besides its update rule, for the planner and the CLI.

Each strategy class carries, next to its ``name``:

* ``options_field``: the option group (``--<group>.*``) of its options class (the type of its
  constructor's ``options`` argument); ``train``, ``plan``, ``make_strategy``, ``config.json``
  and ``--help`` all take the group from here
  (:func:`lowcomm.strategies.option_groups.with_method_options`);
* ``hierarchical_refusal``: why it cannot run with several ranks per worker, or None;
* ``sharding_refusal``: why it cannot run on sharded workers (``--worker-sharding fsdp``), or
  None (by default a method is refused: it must take its buffers from
  ``sharded_flat.flat_buffers`` and sum its norms over the worker's shards first);
* ``cost``: a :class:`CostModel`, the closed-form traffic, hiding and memory ``lowcomm plan``
  evaluates, written against the same options object ``train`` hands the strategy;
* ``quantized_exchange``: a :class:`QuantizedExchange` naming the options that quantize its
  outer exchange (the planner prices the encoded all-gather from them), or None;
* ``comm_dtypes`` and ``comm_dtype_refusal``: the dtypes (``--comm-dtype``) its gradient and
  pseudo-gradient collectives can travel in, and why the others are refused;
* ``quick_options``: option values under which a few steps run its whole cycle (``lowcomm
  selftest`` runs every registered method so);
* ``takes_variable_microbatches(options)``: whether it takes a variable number of
  micro-batches per step (equal-token comparisons give it a token budget).
* ``membership``: a :class:`MembershipRule`, how it lives with workers that come and go
  (what a round is, what a joining worker is healed with, how its own state starts), or None
  when it does not run with declared faults yet.

The registry checks each declaration when it discovers the method
(:func:`lowcomm.strategies.check_declaration`).

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Transfer:
    """One kind of collective a method issues, as the planner prices it.

    Attributes:
        fraction: its payload, in full-model payloads (1/K for one of K fragments; 2 for a
            parameter payload sent with a same-sized companion; 3 for Local Adam's fused states).
        per_step: how many of it a worker issues per optimizer step, averaged over the method's
            schedule (1/H for once per round).
        hidden_steps: steps of compute it overlaps (0: blocking); what does not fit is exposed.
        bytes_per_parameter: None for an all-reduce of ``fraction`` model payloads at the
            run's element width; a number for a compressed exchange (SparseLoCo): each worker's
            encoded payload, this many bytes per parameter of ``fraction`` of the model, is
            all-gathered.
    """

    fraction: float
    per_step: float
    hidden_steps: float = 0.0
    bytes_per_parameter: float | None = None


@dataclass(frozen=True)
class MembershipRule:
    """How a method lives with workers that come and go (docs/ALGORITHMS.md, "Membership:
    quorum, commit and healing").

    Attributes:
        round: ``step`` when its workers talk every step (a crash inside a step drops that
            step on every member), ``sync`` when they talk at each outer sync (a worker lost
            during the inner steps is left out of the next sync's quorum).
        global_state: what a joining worker receives from a live member (healing).
        worker_state: how a joining worker's own state starts (``join``), and what a
            rejoining one keeps (``rejoin``).
    """

    round: str
    global_state: str
    worker_state: str

    def __post_init__(self) -> None:
        if self.round not in ("step", "sync"):
            raise ValueError(f"MembershipRule.round: {self.round!r}; choose step or sync")


#: Every value of ``--comm-dtype`` (:data:`lowcomm.comm.cast.COMM_DTYPES`, which
#: tests/test_declaration.py checks it equals; strategies do not import the cast module).
COMM_DTYPES: tuple[str, ...] = ("fp32", "bf16")


@dataclass(frozen=True)
class QuantizedExchange:
    """The options (fields of the method's options class) that quantize its outer exchange:
    with a format other than ``none`` each worker's encoded payload is all-gathered
    (:mod:`lowcomm.optim.quantize`), and ``lowcomm plan`` prices it so.

    Attributes:
        format_option: the field holding the format (none, bf16, fp8, int4).
        row_size_option: the field holding the elements per scale row.
    """

    format_option: str
    row_size_option: str

    def of(self, options: object) -> tuple[str, int]:
        """The (format, row size) ``options`` sets."""
        return str(getattr(options, self.format_option)), int(
            getattr(options, self.row_size_option)
        )

    def option_names(self) -> tuple[str, ...]:
        return (self.format_option, self.row_size_option)


@dataclass(frozen=True)
class Timing:
    """What a cost model may need to know of the run it is priced for.

    Attributes:
        step_seconds: compute seconds of one optimizer step on one worker (T_c).
        all_reduce_seconds: seconds of one exchange of ``fraction`` full-model payloads over
            the workers' link (T_s of a sync of that size): an all-reduce, or the all-gather
            of a quantized DiLoCo-family exchange.
    """

    step_seconds: float
    all_reduce_seconds: Callable[[float], float]


#: A cost model's traffic: the options object the method is built with, and the timing.
Traffic = Callable[[Any, Timing], Sequence[Transfer]]


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """How one method spends bytes, time and memory (read by ``lowcomm plan``).

    Attributes:
        description: one line for the plan's table.
        traffic: the collectives the method issues per step, from its options (the same
            object ``train`` gives the strategy) and the timing.
        schedule: the sync period(s) in words, from its options (printed by ``plan``).
        extra_copies: model-sized extra buffers (anchor, outer momentum, in-flight copies).
        shards_over_workers: the optimizer states are sharded over the M workers (ZeRO-1).
        shards_over_replicas: with several ranks per worker, the (inner) AdamW moments are
            sharded over the worker's ranks (``lowcomm.optim.adamw.make_adamw``).
        accumulates: the compute side never idles (ACCO): it keeps taking micro-batches until
            communication is done, so nothing is exposed and committed steps absorb more tokens
            when communication is the slower side.
    """

    description: str
    traffic: Traffic
    schedule: Callable[[Any], str] = lambda options: "every step"
    extra_copies: float = 0.0
    shards_over_workers: bool = False
    shards_over_replicas: bool = False
    accumulates: bool = False


def every_step(fraction: float = 1.0, hidden_steps: float = 0.0) -> Traffic:
    """Traffic of a method that sends ``fraction`` model payloads every optimizer step."""
    return lambda options, timing: [Transfer(fraction, 1.0, hidden_steps)]


def state_traffic(periods: dict[Any, int | None], fuse: bool) -> list[Transfer]:
    """Traffic of a method that averages several model-sized states, each every K_j steps
    (None: never); with ``fuse``, states sharing a period travel in one all-reduce."""
    if not fuse:
        return [Transfer(1.0, 1.0 / k) for k in periods.values() if k is not None]
    shared: dict[int, int] = {}
    for k in periods.values():
        if k is not None:
            shared[k] = shared.get(k, 0) + 1
    return [Transfer(float(count), 1.0 / k) for k, count in shared.items()]


def fragment_traffic(fragments: int, syncs_per_step: float, hidden_steps: float) -> list[Transfer]:
    """Traffic of a method that syncs one of ``fragments`` equal fragments ``syncs_per_step``
    times per step (K/H for once each per round), each overlapping ``hidden_steps`` steps."""
    return [Transfer(1.0 / fragments, syncs_per_step, hidden_steps)]
