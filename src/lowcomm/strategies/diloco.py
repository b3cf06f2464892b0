"""DiLoCo family (docs/ALGORITHMS.md §4): DiLoCo here; Streaming DiLoCo in ``streaming.py``, the
naive delayed and eager outer steps in ``eager.py``, CoCoDC in ``cocodc.py``.

All of them share the machinery of this module: an inner optimizer stepping every worker's
own parameters (AdamW, state local and persistent, never averaged), outer parameters per
fragment with an outer Nesterov optimizer (``lowcomm.optim.outer``), and the exchange of outer
gradients ``Delta = anchor - local`` (§0.3 sign convention), optionally quantized.

Quantized exchange: a sum all-reduce of quantized values is not exact (every partial sum would
be re-rounded), so a quantized outer gradient travels in two steps (``two_step.py``): a
reduce-scatter of quantized shards (each worker encodes its M shards and sends shard j to
worker j, which decodes the M it received and takes their fp32 mean), then an all-gather of
each owner's requantized mean shard, which every worker decodes. Each worker sends
``2 (M-1)/M`` of its encoded outer gradient, as a ring all-reduce does at the quantized size
(an all-gather of whole payloads sent ``M-1`` times it: at M = 16, fp8 moved more than a
float32 all-reduce); the mean carries one more rounding than the all-gather's exact fp32 mean
of decoded payloads (the requantization of the mean, within the quantizer's error bound). The
outer step runs in fp32 and every worker sees bit-identical averages. Without quantization the
exchange is a float32 mean all-reduce.

Each ``step()`` is one inner step. Options live in :class:`DiLoCoOptions` (``--diloco.*``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from lowcomm.comm.base import Comm, Handle, Role, Settled
from lowcomm.comm.runtime import ClockReader, Runtime
from lowcomm.optim.outer import OuterNesterov
from lowcomm.optim.quantize import QuantizationFormat
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import (
    CostModel,
    MembershipRule,
    QuantizedExchange,
    Transfer,
)
from lowcomm.strategies.local_update import LocalUpdate, OptionsT, RoundOptions
from lowcomm.strategies.sharded_flat import flat_numel
from lowcomm.strategies.two_step import TwoStepQuantized, shard_payload_bytes


@dataclass(kw_only=True)
class DiLoCoOptions(RoundOptions):
    """Options of the DiLoCo family: diloco, streaming_diloco, diloco_delayed, eager, cocodc."""

    group: ClassVar[str] = "diloco"

    sync_every: int = 16
    """H: inner steps per outer round (every fragment is synchronized once per H steps)."""

    outer_lr: float | None = None
    """eta_out: outer learning rate (None: from H by --diloco.outer-defaults)."""

    outer_momentum: float | None = None
    """mu: outer momentum, 0 = plain outer SGD (None: from H by --diloco.outer-defaults)."""

    outer_nesterov: bool = True
    """Nesterov form of the outer momentum (False = heavy ball)."""

    outer_defaults: Literal["scaled", "paper"] = "scaled"
    """What an unset --diloco.outer-lr / --diloco.outer-momentum takes. scaled (lowcomm's):
    from H, t = min(1, log H / log 256), mu = 0.9 t^2, eta_out = 1 - 0.3 t: plain averaging
    (1, 0) at H = 1, (0.85, 0.225) at the default H = 16, the papers' (0.7, 0.9) from H = 256.
    paper: DiLoCo's eta_out 0.7, mu 0.9 at every H (tuned for H in the hundreds from a warm
    start; from scratch at H = 16 it overshoots and the loss rises again)."""

    fragments: int | None = None
    """K: number of strided fragments (None = the method's default: 4 for streaming_diloco and
    cocodc, capped at the model's number of transformer blocks; 1 for diloco, diloco_delayed
    and eager; diloco accepts only 1)."""

    overlap_steps: int = 1
    """tau: inner steps a fragment's all-reduce overlaps (streaming_diloco, cocodc)."""

    mixing: float = 0.5
    """alpha (streaming_diloco): weight of the LOCAL parameters in the merge
    theta <- alpha * local + (1 - alpha) * global (0 takes the global state)."""

    outer_delay: int = 1
    """N (diloco_delayed, eager): outer rounds an outer gradient's all-reduce may take."""

    quantization: QuantizationFormat = "none"
    """Outer-gradient wire format: none (fp32 all-reduce), bf16, fp8 (e4m3, per-row scale) or
    int4 (per-row scale); quantized payloads are all-gathered and averaged in fp32."""

    quantization_row_size: int = 256
    """Elements per row sharing one scale (fp8 and int4)."""

    compensation: float = 0.5
    """lambda (cocodc): weight of the delay-compensation term (0 = merge without it)."""

    compensation_sign: Literal["fixed", "literal"] = "fixed"
    """cocodc merge sign: fixed (docs/ALGORITHMS.md §4.5: new global - tau g_corr) or literal (the
    paper's printed Eq. 8, new global + tau g_corr; for ablation only)."""

    transmission_gamma: float = 0.4
    """gamma (cocodc): syncs per H are N = max(K, floor(gamma H T_c / T_s))."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for flag, value, choices in (
            ("--diloco.outer-defaults", self.outer_defaults, ("scaled", "paper")),
            ("--diloco.quantization", self.quantization, ("none", "bf16", "fp8", "int4")),
            ("--diloco.compensation-sign", self.compensation_sign, ("fixed", "literal")),
        ):
            if value not in choices:
                raise ValueError(
                    f"{flag}: {value!r} is unknown; choose {', '.join(choices[:-1])} or "
                    f"{choices[-1]}"
                )
        if self.fragments is not None and self.fragments < 1:
            raise ValueError(
                f"--diloco.fragments: {self.fragments} must be >= 1; pass e.g. 4, or None for "
                f"the method's default"
            )
        if self.overlap_steps < 0:
            raise ValueError(
                f"--diloco.overlap-steps: {self.overlap_steps} must be >= 0; pass e.g. 1"
            )
        if not 0.0 <= self.mixing <= 1.0:
            raise ValueError(
                f"--diloco.mixing: {self.mixing} must lie in [0, 1] (weight of the local "
                f"parameters); try 0.5"
            )
        if self.outer_delay < 1:
            raise ValueError(
                f"--diloco.outer-delay: {self.outer_delay} must be >= 1; pass 1 for the "
                f"1-outer-step form"
            )
        if self.quantization_row_size < 1:
            raise ValueError(
                f"--diloco.quantization-row-size: {self.quantization_row_size} must be >= 1; "
                f"try 256"
            )
        if not (self.compensation >= 0 and math.isfinite(self.compensation)):
            raise ValueError(
                f"--diloco.compensation: {self.compensation} must be a finite number >= 0; try 0.5"
            )
        if not (self.transmission_gamma > 0 and math.isfinite(self.transmission_gamma)):
            raise ValueError(
                f"--diloco.transmission-gamma: {self.transmission_gamma} must be a positive "
                f"number; try 0.4"
            )

    def outer(self) -> tuple[float, float]:
        """(eta_out, mu) of the outer step: the options given, the unset ones by
        ``outer_defaults`` (:func:`scaled_outer` of H, or the papers' 0.7 and 0.9)."""
        lr, momentum = (
            scaled_outer(self.sync_every) if self.outer_defaults == "scaled" else PAPER_OUTER
        )
        return (
            lr if self.outer_lr is None else self.outer_lr,
            momentum if self.outer_momentum is None else self.outer_momentum,
        )


#: DiLoCo's outer learning rate and Nesterov momentum (Douillard et al. 2023, H = 500).
PAPER_OUTER = (0.7, 0.9)
#: From this H on, the scaled defaults are the papers' values.
PAPER_H = 256


def scaled_outer(sync_every: int) -> tuple[float, float]:
    """lowcomm's default (eta_out, mu) for H = ``sync_every``: t = min(1, log H / log 256),
    mu = 0.9 t^2, eta_out = 1 - 0.3 t. From plain averaging (1, 0) at H = 1, where the
    pseudo-gradients of consecutive rounds point the same way and momentum would add them up
    (the steady-state step of heavy momentum is eta_out / (1 - mu) rounds of progress: 7 with
    the papers' values), to the papers' (0.7, 0.9) at H >= 256, where they were tuned."""
    t = min(1.0, math.log(max(sync_every, 1)) / math.log(PAPER_H))
    return 1.0 - (1.0 - PAPER_OUTER[0]) * t, PAPER_OUTER[1] * t * t


# --- fragments -------------------------------------------------------------------------------

_BLOCK = re.compile(r"^(?:.*\.)?blocks\.(\d+)\.")
_FIRST = ("token_embedding", "position_embedding", "lm_head")


def fragment_assignment(names: Sequence[str], sizes: Sequence[int], fragments: int) -> list[int]:
    """Fragment of each parameter (Streaming DiLoCo, docs/ALGORITHMS.md §4.2).

    Transformer block ``j`` (a parameter named ``blocks.j.*``) goes to fragment ``j mod K``
    (strided). Embeddings and the LM head (``token_embedding``, ``position_embedding``,
    ``lm_head``; GPT ties the head to the token embedding) go to fragment 0; the final norm and
    any other non-block tensor go to fragment K-1 [R-lo placement].

    Fallback for a model with no ``blocks.<j>.`` parameters: parameters, in model order, are
    split into K contiguous groups of about equal element count.
    """
    if fragments == 1:
        return [0] * len(names)
    blocks = [_BLOCK.match(name) for name in names]
    if any(match is not None for match in blocks):
        result = []
        for name, match in zip(names, blocks, strict=True):
            if match is not None:
                result.append(int(match.group(1)) % fragments)
            elif name.split(".")[0] in _FIRST:
                result.append(0)
            else:
                result.append(fragments - 1)
        return result
    total = sum(sizes)
    result, running = [], 0
    for size in sizes:
        # The group whose share of the elements this parameter's midpoint falls in.
        result.append(min(fragments - 1, int((running + size / 2) * fragments / total)))
        running += size
    return result


class Fragment:
    """A set of parameters as positions in the flat parameter buffer.

    Args:
        index: the fragment number p.
        names: the parameters it holds.
        ranges: (start, stop) ranges in the flat buffer, merged where contiguous.
    """

    def __init__(self, index: int, names: list[str], ranges: list[tuple[int, int]]) -> None:
        self.index = index
        self.names = names
        merged: list[tuple[int, int]] = []
        for start, stop in ranges:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        self.ranges = merged
        self.numel = sum(stop - start for start, stop in merged)

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """A fresh fp32 copy of this fragment's values in ``flat`` (never a view)."""
        return torch.cat([flat[start:stop].float() for start, stop in self.ranges]).clone()

    def scatter(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (this fragment's length) into ``flat``."""
        offset = 0
        for start, stop in self.ranges:
            flat[start:stop].copy_(values[offset : offset + stop - start])
            offset += stop - start


def default_fragment_count(model: nn.Module, preferred: int) -> int:
    """The fragment count used when none is given: ``preferred``, capped at the number of
    transformer blocks (``blocks.<j>.`` parameters) so no fragment is empty; for a model
    without such blocks (e.g. a transformers model), the largest count up to ``preferred``
    whose element-count split leaves no fragment empty."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    indices = {
        int(match.group(1)) for name, _ in named if (match := _BLOCK.match(name)) is not None
    }
    if indices:
        return min(preferred, len(indices))
    names, sizes = [name for name, _ in named], [p.numel() for _, p in named]
    for count in range(preferred, 1, -1):
        if len(set(fragment_assignment(names, sizes, count))) == count:
            return count
    return 1


def build_fragments(model: nn.Module, fragments: int) -> list[Fragment]:
    """Split ``model``'s trainable parameters into ``fragments`` fragments, in the order
    :class:`FlatBuffers` lays them out (``model.parameters()``, tied tensors once)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    names = [name for name, _ in named]
    sizes = [flat_numel(p) for _, p in named]  # a sharded worker: its local shards
    owners = fragment_assignment(names, sizes, fragments)
    groups: list[tuple[list[str], list[tuple[int, int]]]] = [([], []) for _ in range(fragments)]
    offset = 0
    for name, size, owner in zip(names, sizes, owners, strict=True):
        groups[owner][0].append(name)
        groups[owner][1].append((offset, offset + size))
        offset += size
    empty = [p for p, (group_names, _) in enumerate(groups) if not group_names]
    if empty:
        raise ValueError(
            f"--diloco.fragments: {fragments} leaves fragment {empty[0]} without parameters "
            f"(the model has too few blocks); pass at most the number of transformer blocks"
        )
    return [Fragment(p, group_names, ranges) for p, (group_names, ranges) in enumerate(groups)]


# --- the exchange of outer gradients --------------------------------------------------------


class OuterExchange:
    """One in-flight exchange of an outer gradient, with a few float32 side values.

    Unquantized: ``[Delta | extras]`` in one float32 mean all-reduce. Quantized: the two-step
    exchange of :class:`~lowcomm.strategies.two_step.TwoStepQuantized` (the extras ride along
    its first step as raw float32 bytes). Either way :meth:`wait` returns the same (mean Delta,
    mean extras, own Delta as it entered the mean) on every worker.

    The quantized exchange's second step needs the first's data: it is issued when the
    exchange is collected (its :meth:`wait`, or a checkpoint's :meth:`state_dict`), the same
    point on every worker, so the collectives' order agrees across workers. With ``rounds``
    (live membership: a group whose collectives are committed rounds, ``run_round`` of
    :class:`~lowcomm.membership.torchft_comm.TorchftComm`) both steps run at once as one
    round, which commits both or neither and is tried again whole on a new quorum, whose
    size may shard the exchange differently.
    """

    def __init__(
        self,
        comm: Comm,
        delta: torch.Tensor,
        extras: torch.Tensor,
        quantization: QuantizationFormat,
        row_size: int,
        *,
        clock: ClockReader | None = None,
        rounds: RoundRunner | None = None,
    ) -> None:
        self.comm = comm
        self.clock = clock
        self.numel = delta.numel()
        self.extras_numel = extras.numel()
        self.quantization = quantization
        self.row_size = row_size
        self.launch_time = _clock_now(clock)
        self._result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._two_step: TwoStepQuantized | None = None
        self._first: Handle | None = None  # the quantized exchange's first step, once collected
        # Everything handed to the collective lives on Delta's device (NCCL moves GPU tensors
        # only); the extras may come from the host.
        extras32 = extras.detach().float().reshape(-1).to(delta.device)
        if quantization == "none":
            self._own = delta.detach().float().clone()
            self._buffer = torch.cat([self._own, extras32])
            self.handle: Handle = comm.all_reduce(
                self._buffer, op="mean", role=Role.PSEUDO_GRADIENT
            )
        elif rounds is None:
            self._two_step = TwoStepQuantized(comm, delta, extras32, quantization, row_size)
            self._own = self._two_step.own  # what the others decode of this worker's Delta
            self.handle = self._two_step.first
        self.sync_seconds: float | None = None
        self.finish_time: float | None = None
        self._settled: Settled | None = None
        self._waited = False
        if quantization != "none" and rounds is not None:
            self._two_step, self._first, self.handle, self._settled = rounds(
                lambda: self._both_steps(delta, extras32)
            )
            self._own = self._two_step.own

    def _both_steps(
        self, delta: torch.Tensor, extras: torch.Tensor
    ) -> tuple[TwoStepQuantized, Handle, Handle, Settled]:
        """One try of the quantized exchange's round: both steps, their data moved (no time
        charged: :meth:`wait` charges it), sharded over the round's workers."""
        two_step = TwoStepQuantized(self.comm, delta, extras, self.quantization, self.row_size)
        two_step.first.settle()
        second = two_step.launch_second()
        return two_step, two_step.first, second, second.settle()

    @property
    def wire_bytes(self) -> int:
        """Bytes of this worker's payload per step of the exchange (the tensor handed to the
        all-reduce, or to each step of the quantized exchange)."""
        if self.quantization == "none":
            return 4 * (self.numel + self.extras_numel)
        return self.comm.world_size * (
            shard_payload_bytes(self.numel, self.comm.world_size, self.quantization, self.row_size)
            + 4 * self.extras_numel
        )

    def done(self) -> bool:
        """Whether :meth:`wait` would not block (a quantized exchange not yet collected has
        its second step still to run)."""
        if self._two_step is not None and self._result is None:
            return False
        return self.handle.done()

    def moved_result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean Delta, own Delta) of an unquantized exchange whose data has moved (its
        collective completed), read without settling its handle or charging the clock: what
        a live member sends a joiner from an engine's healing thread."""
        if self._result is not None:
            return self._result[0], self._result[2]
        # (With --comm-dtype bf16 the mean is in the cast copy the collective reduced: cast
        # back now, as waiting will, so a joiner takes the mean the members apply.)
        copy_back = getattr(self.handle, "copy_back_moved", None)
        if copy_back is not None:
            copy_back()
        return self._buffer[: self.numel], self._own

    def settle_moved(self) -> None:
        """Finish the data movement of an exchange whose collective between workers has
        completed (a live-membership round committed it), charging nothing (:meth:`wait`
        still charges it), so that :meth:`moved_result` reads the whole result. On a worker
        of several ranks each rank reduces the mean between workers in its own slice only;
        the mean is whole once the worker's ranks have gathered it, which a healing thread
        cannot run: a live member's ranks settle it together before they ask for a quorum
        that may heal a joiner with it."""
        if self._result is None and (self._two_step is None or self._settled is not None):
            self._collect()

    def _collect(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Finish the data movement (no time charged) and decode the result once."""
        if self._result is not None:
            return self._result
        if self._two_step is not None and self._first is None:
            self._first = self.handle
            self._two_step.first.settle()
            self.handle = self._two_step.launch_second()
        if self._settled is None:
            self._settled = self.handle.settle()
        self.finish_time = self._settled.completion
        if self._two_step is not None:
            mean, extras = self._two_step.result()
        else:
            mean = self._buffer[: self.numel]
            extras = self._buffer[self.numel :].float()
        self._result = (mean, extras, self._own)
        return self._result

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean Delta, mean extras, this worker's own Delta as it entered the mean)."""
        result = self._collect()
        if self._waited:
            return result
        if self._first is not None:
            self._first.wait()  # the quantized exchange's first step, charged in order
        self.handle.wait()  # charges the clock up to the modeled completion
        self._waited = True
        # The sync time on the run's clock: the modeled completion of the collective when
        # settling knew it (an emulated one-level comm), else the time this worker was
        # released by wait().
        now = _clock_now(self.clock)
        if self.launch_time is not None:
            end = self.finish_time if self.finish_time is not None else now
            if end is not None:
                self.sync_seconds = max(0.0, end - self.launch_time)
        return result

    def state_dict(self) -> dict[str, Any]:
        """The exchange's result, settled now, and its timing (for a checkpoint)."""
        mean, extras, own = self._collect()
        return {
            "mean": mean.clone(),
            "extras": extras.clone(),
            "own": own.clone(),
            "finish_time": self.finish_time,
            "settled": (self._settled or Settled()).state_dict(),
            "launch_time": self.launch_time,
            "waited": self._waited,
            "sync_seconds": self.sync_seconds,
        }

    @classmethod
    def restored(
        cls,
        comm: Comm,
        state: dict[str, Any],
        quantization: QuantizationFormat,
        row_size: int,
        *,
        runtime: Runtime,
    ) -> OuterExchange:
        """An exchange saved by :meth:`state_dict`: its result is known, its completion is
        still charged to the clock when waited for (``runtime`` restores its handle)."""
        exchange = cls.__new__(cls)
        exchange.comm = comm
        exchange.clock = runtime.clock
        exchange.numel = int(state["mean"].numel())
        exchange.extras_numel = int(state["extras"].numel())
        exchange.quantization = quantization
        exchange.row_size = row_size
        exchange.launch_time = state["launch_time"]
        exchange.finish_time = state["finish_time"]
        exchange._own = state["own"]
        exchange._result = (state["mean"], state["extras"], state["own"])
        exchange._waited = bool(state["waited"])
        exchange.sync_seconds = state["sync_seconds"]
        # A checkpoint without a ``settled`` entry holds only the one-level completion.
        settled = (
            Settled.from_state(state["settled"])
            if "settled" in state
            else Settled(exchange.finish_time)
        )
        exchange._settled = settled
        exchange._two_step = None
        exchange._first = None
        exchange.handle = runtime.restore(settled)
        return exchange


#: Runs an exchange of several collectives as one committed round, tried again whole
#: until one commits (live membership's ``TorchftComm.run_round``).
RoundRunner = Callable[[Callable[[], Any]], Any]


def _clock_now(clock: ClockReader | None) -> float | None:
    """The run's clock reading, or None without a clock."""
    return clock.now() if clock is not None else None


# --- the shared base ------------------------------------------------------------------------


class OuterLoopStrategy(LocalUpdate[OptionsT]):
    """Inner steps on local parameters plus per-fragment outer state (shared by the family).

    Holds, beyond :class:`~lowcomm.strategies.local_update.LocalUpdate`'s flat buffers, master
    and inner optimizer: per fragment p the global parameters ``globals_[p]`` (theta^g_p, an
    explicit clone) with its outer optimizer ``outer[p]``. Rounds are multiples of H in the
    global step count, so a resumed run finds them from ``step_index`` alone.

    Elastic resume (``--resume DIR --workers M2``): the global parameters, outer momentum and
    settled exchange results are replicated and kept exactly; each worker's local parameters and
    inner AdamW states are averaged over the old workers (the next outer step sees the same mean
    pseudo-gradient); with ``--ranks-per-worker`` the inner moments are re-split over the new
    ranks.
    """

    options_field: ClassVar[str | None] = "diloco"
    default_fragments: ClassVar[int] = 1
    quantized_exchange: ClassVar[QuantizedExchange | None] = QuantizedExchange(
        "quantization", "quantization_row_size"
    )
    quick_options: ClassVar[Mapping[str, object]] = {
        "sync_every": 2, "quantization": "int4", "quantization_row_size": 64,
    }  # fmt: skip

    def __init__(
        self, model: nn.Module, comm: Comm, context: StrategyContext, options: OptionsT
    ) -> None:
        super().__init__(model, comm, context, options)
        # Fragments and a quantized wire format are the DiLoCo options' own; the other
        # families synchronize the whole model in fp32.
        diloco = options if isinstance(options, DiLoCoOptions) else None
        self.quantization: QuantizationFormat = diloco.quantization if diloco else "none"
        self.row_size = diloco.quantization_row_size if diloco else 256
        # (A family of its own with fragments, decoupled_diloco's, names them too.)
        self.num_fragments = getattr(options, "fragments", None) or default_fragment_count(
            model, self.default_fragments
        )
        self.fragments = build_fragments(model, self.num_fragments)
        self.globals_ = [fragment.gather(self.master) for fragment in self.fragments]
        lr, momentum = options.outer()
        self.outer = [
            OuterNesterov(anchor, lr=lr, momentum=momentum, nesterov=options.outer_nesterov)
            for anchor in self.globals_
        ]
        self.outer_steps = 0

    # phases --------------------------------------------------------------------------------

    def launch_sync(self, p: int, extras: torch.Tensor | None = None) -> OuterExchange:
        """Launch the exchange of Delta_p = theta^g_p - theta_p (the §0.3 sign); its
        ``wait()`` finishes the sync."""
        delta = self.globals_[p] - self.local_fragment(p)
        return OuterExchange(
            self.comm,
            delta,
            extras if extras is not None else torch.zeros(0, device=delta.device),
            self.quantization,
            self.row_size,
            clock=self.runtime.clock,
            rounds=getattr(self.runtime.uncharged, "run_round", None),
        )

    def outer_step(self, p: int, delta: torch.Tensor) -> None:
        """Step fragment p's global parameters with the outer gradient ``delta``."""
        self.outer[p].step(delta)
        self.outer_steps += 1

    def local_fragment(self, p: int) -> torch.Tensor:
        return self.fragments[p].gather(self.master)

    def set_local_fragment(self, p: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            self.fragments[p].scatter(self.master, values)
            self.write_back()

    # membership (declared faults; a subclass declares its rule) ----------------------------

    def round_committed(self, stats: StepStats) -> bool:
        return "outer_step" in stats.extras

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        tensors = [(Role.PARAMETER, anchor) for anchor in self.globals_]
        tensors.extend((Role.FIRST_MOMENT, outer.momentum_buffer) for outer in self.outer)
        counters = {**self.round_counters(), "outer_steps": self.outer_steps}
        counters.update({f"outer{p}": outer.step_count for p, outer in enumerate(self.outer)})
        return tensors, counters

    def set_global_counters(self, counters: dict[str, int]) -> None:
        super().set_global_counters(counters)
        self.outer_steps = counters["outer_steps"]
        for p, outer in enumerate(self.outer):
            outer.step_count = counters[f"outer{p}"]

    def start_worker_state(self, *, kept: bool) -> None:
        if not kept:
            self.inner.reset()
        for p, anchor in enumerate(self.globals_):
            self.set_local_fragment(p, anchor)

    # Strategy API ---------------------------------------------------------------------------

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        """The model at the global (outer) parameters theta^g, which is what DiLoCo deploys;
        the worker's local parameters are restored afterwards. For the delayed and eager
        methods theta^g is this worker's own outer copy phi_m (no communication here)."""
        local = self.flat.params.clone()
        with torch.no_grad():
            for fragment, anchor in zip(self.fragments, self.globals_, strict=True):
                fragment.scatter(self.flat.params, anchor.to(self.flat.dtype))
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.flat.params.copy_(local)

    def state_bytes(self) -> int:
        outer = sum(
            g.numel() * 4 + o.state_bytes() for g, o in zip(self.globals_, self.outer, strict=True)
        )
        return self.base_state_bytes() + outer + self.extra_state_bytes()

    def extra_state_bytes(self) -> int:
        """Bytes of method-specific persistent buffers (overridden by subclasses)."""
        return 0

    def in_flight_state(self) -> list[Any]:
        """The exchanges in flight, settled and saved (overridden by the overlapping methods)."""
        return []

    def load_in_flight_state(self, saved: list[Any]) -> None:
        """Restore what :meth:`in_flight_state` saved."""
        if saved:
            raise ValueError(
                f"{self.name}: the checkpoint holds in-flight exchanges this method never has"
            )

    def restore_exchange(self, state: dict[str, Any]) -> OuterExchange:
        return OuterExchange.restored(
            self.comm, state, self.quantization, self.row_size, runtime=self.runtime
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "in_flight": self.in_flight_state(),
            "master": self.master.clone(),
            "globals": [g.clone() for g in self.globals_],
            "outer": [o.state_dict() for o in self.outer],
            "outer_steps": self.outer_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.master.copy_(state["master"])
            for anchor, saved in zip(self.globals_, state["globals"], strict=True):
                anchor.copy_(saved)
            for outer, saved in zip(self.outer, state["outer"], strict=True):
                outer.load_state_dict(saved)
            self.write_back()
        self.load_in_flight_state(state["in_flight"])
        self.outer_steps = int(state["outer_steps"])


class DiLoCo(OuterLoopStrategy[DiLoCoOptions]):
    """DiLoCo: H local AdamW steps, then a blocking all-reduce of Delta and outer Nesterov.
    With --optim.name muon (Muon inner steps on the hidden matrices) it is MuLoCo (Therien et
    al. 2025, arXiv 2505.23725).

    Paper: Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
    Models" (docs/ALGORITHMS.md §4.1). Symbols: H -> options.sync_every, eta_out ->
    options.outer_lr, mu -> options.outer_momentum, theta^(t-1) -> globals_[0] (the anchor),
    Delta_m = anchor - local.
    Reduces to: DDP with SGD when H=1, inner SGD, outer lr 1 and momentum 0
    (tests/test_diloco.py checks it). Evaluate at a multiple of H to see the synchronized model.
    """

    name: ClassVar[str] = "diloco"
    cost: ClassVar[CostModel] = CostModel(
        description="outer Nesterov every H steps",
        traffic=lambda o, t: [Transfer(1.0, 1 / o.sync_every)],
        schedule=lambda o: f"H = {o.sync_every} inner steps per outer round",
        extra_copies=2,
        shards_over_replicas=True,
    )

    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state=(
            "the global parameters theta^g, the outer momentum, the step, round and outer-step "
            "counters"
        ),
        worker_state=(
            "join: the local parameters start at theta^g and the inner AdamW afresh (zero "
            "moments, step count 0); rejoin: the local parameters start at theta^g and the "
            "inner AdamW keeps its state"
        ),
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: DiLoCoOptions | None = None,
    ) -> None:
        options = options or DiLoCoOptions()
        if options.fragments not in (None, 1):
            raise ValueError(
                f"--diloco.fragments: {options.fragments} is not allowed for diloco, which "
                f"synchronizes the whole model; use --method streaming_diloco for fragments"
            )
        super().__init__(model, comm, context, options)

    def step(self, closure: Closure) -> StepStats:
        stats = self.inner_step(closure)
        if self.step_index % self.options.sync_every == 0:
            self.runtime.enter_round()  # (a member lost since the last sync: its detection)
            sync = self.launch_sync(0)
            mean, _, _ = sync.wait()  # finish_sync: nothing overlaps DiLoCo's all-reduce
            self.outer_step(0, mean)
            self.set_local_fragment(0, self.globals_[0])  # every worker restarts from theta^g
            stats.extras["outer_step"] = 1.0
        return stats

    def unsynchronized_tail(self, steps: int) -> str | None:
        """The deployed model is the outer one (docs/ALGORITHMS.md §4.1 has no final round):
        the inner steps after the last multiple of H are not in it."""
        return outer_round_tail(steps, self.options.sync_every, "--diloco.sync-every")


def outer_round_tail(steps: int, h: int, flag: str) -> str | None:
    """The note on a run of ``steps`` whose deployed (outer) model leaves out the inner steps
    after the last multiple of H (``flag`` names H's option), or None when it ends on a round."""
    tail = steps % h
    if tail == 0:
        return None
    last = steps - tail
    model = f"the outer one of step {last}" if last else "the initial one (no round ends)"
    return (
        f"--steps {steps} is not a multiple of {flag} {h}: the final model is {model}, "
        f"without the last {tail} inner steps of every worker (--steps {last + h} ends on a "
        f"round)"
    )


METHODS: tuple[type[Strategy], ...] = (DiLoCo,)
