"""SPARTA (docs/ALGORITHMS.md, "SPARTA"): after every local AdamW step, average a random fraction
p of the parameters across the workers; and SPARTA-DiLoCo, the same plus a DiLoCo outer step
every H steps.

Paper: Beton, Baioumy, van der Ouderaa, Reed, Howes, Cheema, Vrabie 2025, "Improving the
Efficiency of Distributed Training using Sparse Parameter Averaging" (SPARTA,
openreview.net/forum?id=stFPf3gzq1); reference code: exogym (github.com/exo-explore/gym,
``exogym/strategy/sparta.py`` and ``sparta_diloco.py``). At every step t, on every worker::

    theta      <- AdamW(theta, g)                         (local, persistent moments)
    S_t        = each i independently with probability p, drawn from (seed, t)
    theta[S_t] <- mean_workers(theta[S_t])                (an all-reduce of |S_t| values)

Every worker draws the same S_t from the run's seed and the step (no mask is sent), so the
exchange is one mean all-reduce of the selected fp32 values: p n elements on average.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from lowcomm.comm.base import Comm, Role
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, MembershipRule, QuantizedExchange, Transfer
from lowcomm.strategies.diloco import OuterLoopStrategy, outer_round_tail
from lowcomm.strategies.flat import FlatBuffers
from lowcomm.strategies.local_update import LocalUpdate, RoundOptions
from lowcomm.strategies.sharded_flat import WholeRange, is_sharded, whole_ranges

#: Most Geometric gaps drawn at once when selecting indices (bounds the draw's memory).
_GAPS_PER_DRAW = 1 << 20
#: Mixed into every selection seed, so the draw is not the stream of another use of --seed.
_DOMAIN = 0x5BA27A


@dataclass(kw_only=True)
class SpartaOptions(RoundOptions):
    """Options of SPARTA and SPARTA-DiLoCo (--sparta.*); defaults as exogym's. The period and
    the outer step are sparta_diloco's only."""

    group: ClassVar[str] = "sparta"

    fraction: float = 0.005
    """p: probability that a parameter is averaged at a step (exogym's p_sparta = 0.005, in
    SPARTAStrategy and SPARTADiLoCoStrategy; the paper sweeps 0.05% to 0.5%). Each entry is
    drawn independently, so a step averages p n entries on average. 1 averages every
    parameter every step; 0 none."""

    sync_every: int = 100
    """H (sparta_diloco only): inner steps per DiLoCo outer round (exogym's
    SPARTADiLoCoStrategy H = 100)."""

    outer_lr: float = 0.7
    """eta_out (sparta_diloco only): outer learning rate (exogym's DiLoCo outer SGD lr 0.7)."""

    outer_momentum: float = 0.9
    """mu (sparta_diloco only): outer momentum (exogym's 0.9; 0 = plain outer SGD)."""

    outer_nesterov: bool = True
    """Nesterov form of the outer momentum (sparta_diloco only; exogym's nesterov=True)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(
                f"--sparta.fraction: {self.fraction} must lie in [0, 1] (the probability that "
                f"a parameter is averaged at a step); try 0.005"
            )


def selection_rng(seed: int, step: int) -> np.random.Generator:
    """The random stream of step ``step``'s draw: a function of (run seed, step) only, the same
    on every worker and on a resumed run (numpy's SeedSequence and PCG64, stable across
    versions); never the process-global RNG."""
    return np.random.default_rng(np.random.SeedSequence([seed, step, _DOMAIN]))


def selected_indices(
    numel: int, fraction: float, seed: int, step: int, device: torch.device
) -> torch.Tensor:
    """The sorted flat indices S averaged at step ``step``: every entry independently with
    probability ``fraction`` (exogym's Bernoulli mask), drawn as a Bernoulli process: the gaps
    between successive selected entries are Geometric(p) (trials up to a success), so the
    first is at G_1 - 1 and the next at the running sums. O(p n) work on the host, no read
    back from a GPU; the indices reach one by a pinned, non-blocking copy."""
    if fraction <= 0.0:
        return torch.zeros(0, dtype=torch.long, device=device)
    if fraction >= 1.0:
        return torch.arange(numel, device=device)
    rng = selection_rng(seed, step)
    parts = []
    last = -1  # the last position drawn so far
    while True:
        # Enough gaps to pass the end almost surely (mean + 6 sd), at most 2^20 at a time
        # (8 MiB); draw more until past the end.
        expected = (numel - 1 - last) * fraction
        count = min(int(expected + 6.0 * math.sqrt(expected) + 16), _GAPS_PER_DRAW)
        positions = last + np.cumsum(rng.geometric(fraction, size=count))
        inside = positions[positions < numel]
        parts.append(inside)
        if inside.size < count:
            break
        last = int(positions[-1])
    indices = torch.from_numpy(np.concatenate(parts).astype(np.int64))
    if device.type == "cuda":
        return indices.pin_memory().to(device, non_blocking=True)
    return indices.to(device)


def _sparse_traffic(options: SpartaOptions) -> list[Transfer]:
    """The sparse average's traffic: an all-reduce of p of the model every step (none at
    p = 0, where no step draws an index and none issues a collective)."""
    return [Transfer(options.fraction, 1.0)] if options.fraction > 0 else []


class SparseAverage:
    """SPARTA's exchange: the mean over the workers of the values of a flat fp32 tensor at the
    indices drawn for a step (one blocking all-reduce of those values; none when none)."""

    def __init__(
        self,
        comm: Comm,
        numel: int,
        fraction: float,
        seed: int,
        shards: list[WholeRange] | None = None,
    ) -> None:
        self.comm = comm
        self.numel = numel
        self.fraction = fraction
        self.seed = seed
        #: On a sharded worker, where this rank's elements sit among the whole model's
        #: ``numel`` (S is drawn over the whole model, each rank averages its own part of it).
        self.shards = shards

    def _local(self, indices: torch.Tensor) -> torch.Tensor:
        """The positions in this rank's shards of the whole-model ``indices`` it holds."""
        assert self.shards is not None
        edges = torch.tensor([[start, stop] for start, stop, _ in self.shards]).to(indices)
        bounds = torch.searchsorted(indices, edges).tolist()  # (one host read)
        parts = [
            indices[first:last] - start + local
            for (first, last), (start, _, local) in zip(bounds, self.shards, strict=True)
        ]
        return torch.cat(parts)

    def __call__(self, values: torch.Tensor, step: int) -> int:
        """Average ``values[S_step]`` over the workers in place; the number of entries (of the
        whole model's, on a sharded worker)."""
        indices = selected_indices(self.numel, self.fraction, self.seed, step, values.device)
        drawn = int(indices.numel())
        if self.shards is not None:
            indices = self._local(indices)
        if indices.numel() > 0:
            selected = values[indices]  # a gathered copy, handed to the collective
            self.comm.all_reduce(selected, op="mean", role=Role.PARAMETER).wait()
            values[indices] = selected
        return drawn


def sparse_average(comm: Comm, flat: FlatBuffers, fraction: float, seed: int) -> SparseAverage:
    """SPARTA's exchange of ``flat``'s parameters: over the flat buffer, or on a sharded worker
    over the whole model's layout, each rank averaging the drawn entries it holds."""
    if not is_sharded(flat):
        return SparseAverage(comm, flat.numel, fraction, seed)
    whole = sum(p.numel() for p in flat.parameters)  # a sharded parameter's global numel
    return SparseAverage(comm, whole, fraction, seed, whole_ranges(flat))


class Sparta(LocalUpdate[SpartaOptions]):
    """SPARTA: a local AdamW step, then the mean over the workers of a random fraction p of the
    parameters (the same indices on every worker, drawn from the run's seed and the step).

    Paper: Beton et al. 2025, "Improving the Efficiency of Distributed Training using Sparse
    Parameter Averaging" (docs/ALGORITHMS.md "SPARTA"); exogym's SPARTAStrategy. Symbols: p ->
    options.fraction, S_t -> ``selected_indices(..., step=t)``, inner optimizer -> --optim.*.
    Inner AdamW state local and persistent, never averaged (Muon on the hidden matrices with
    --optim.name muon).
    Deploys: the mean of the workers' models (an uncharged all-reduce, for evaluation only).
    Reduces to: averaging the parameters after every local step (local_adamw with
    --local.sync-every 1) when p = 1 (tests/test_sparta.py checks it).
    """

    name: ClassVar[str] = "sparta"
    options_field: ClassVar[str | None] = "sparta"
    quick_options: ClassVar[Mapping[str, object]] = {"fraction": 0.1}
    muon_refusal: ClassVar[str | None] = None  # its local optimizer is AdamW
    sharding_refusal: ClassVar[str | None] = None
    cost: ClassVar[CostModel] = CostModel(
        description="average a random fraction p of the parameters every step",
        traffic=lambda o, t: _sparse_traffic(o),
        schedule=lambda o: f"every step, p = {o.fraction:g} of the parameters",
        shards_over_replicas=True,
    )
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="step",
        global_state="the step counters and the sending member's parameters",
        worker_state=(
            "join: the parameters start as the sending member's and the inner AdamW afresh; "
            "rejoin: the same, the inner AdamW kept"
        ),
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: SpartaOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context, options or SpartaOptions())
        self.average = sparse_average(comm, self.flat, self.options.fraction, context.seed)

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        counters = self.round_counters()
        return [(Role.PARAMETER, self.master)], counters

    def start_worker_state(self, *, kept: bool) -> None:
        if not kept:
            self.inner.reset()
        with torch.no_grad():
            self.write_back()

    def step(self, closure: Closure) -> StepStats:
        stats = self.inner_step(closure)
        with torch.no_grad():
            stats.extras["averaged"] = float(self.average(self.master, self.step_index))
            self.write_back()
        return stats

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        """The mean of the workers' current models (an uncharged all-reduce, for evaluation
        only); every worker's own parameters are restored afterwards."""
        with self.worker_average() as model:
            yield model

    def state_bytes(self) -> int:
        return self.base_state_bytes()

    def state_dict(self) -> dict[str, Any]:
        # No generator state: step t's indices are a function of (seed, t).
        return {**super().state_dict(), "master": self.master.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.master.copy_(state["master"])
            self.write_back()


class SpartaDiLoCo(OuterLoopStrategy[SpartaOptions]):
    """SPARTA-DiLoCo: SPARTA's sparse average after every inner AdamW step, plus DiLoCo's outer
    Nesterov step on the averaged pseudo-gradient every H steps.

    Paper: Beton et al. 2025 (SPARTA §"SPARTA + DiLoCo"; docs/ALGORITHMS.md "SPARTA"); exogym's
    SPARTADiLoCoStrategy (the sparse average, then the DiLoCo communicator, each step). Symbols:
    p -> options.fraction, H -> options.sync_every, eta_out -> options.outer_lr, mu ->
    options.outer_momentum; the rest is diloco's (the anchor, Delta = anchor - local).
    Reduces to: diloco with the same H and outer optimizer when p = 0 (tests/test_sparta.py
    checks it). Evaluate at a multiple of H to see the synchronized model.
    """

    name: ClassVar[str] = "sparta_diloco"
    options_field: ClassVar[str | None] = "sparta"
    # Its outer exchange is DiLoCo's, never quantized (SpartaOptions has no such option).
    quantized_exchange: ClassVar[QuantizedExchange | None] = None
    quick_options: ClassVar[Mapping[str, object]] = {"sync_every": 2, "fraction": 0.1}
    cost: ClassVar[CostModel] = CostModel(
        description="random fraction p every step + outer Nesterov every H steps",
        traffic=lambda o, t: [*_sparse_traffic(o), Transfer(1.0, 1 / o.sync_every)],
        schedule=lambda o: (
            f"every step, p = {o.fraction:g} of the parameters; H = {o.sync_every} inner steps "
            f"per outer round"
        ),
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
            "as diloco: join: the local parameters start at theta^g and the inner AdamW "
            "afresh; rejoin: the same, the inner AdamW kept"
        ),
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: SpartaOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context, options or SpartaOptions())
        self.average = sparse_average(comm, self.flat, self.options.fraction, context.seed)

    def step(self, closure: Closure) -> StepStats:
        stats = self.inner_step(closure)
        # (The step's first collective: a member lost at this step is detected here, and the
        # sparse average and the round's sync run over the survivors.)
        self.runtime.enter_round()
        # The sparse average comes before the outer step of a round's last step, as exogym
        # orders its communication modules.
        with torch.no_grad():
            stats.extras["averaged"] = float(self.average(self.master, self.step_index))
            self.write_back()
        if self.step_index % self.options.sync_every == 0:
            sync = self.launch_sync(0)
            mean, _, _ = sync.wait()  # finish_sync: blocking, as diloco's
            self.outer_step(0, mean)
            self.set_local_fragment(0, self.globals_[0])
            stats.extras["outer_step"] = 1.0
        return stats

    def unsynchronized_tail(self, steps: int) -> str | None:
        """The deployed model is the outer one: the inner steps after the last multiple of H
        are not in it (as diloco)."""
        return outer_round_tail(steps, self.options.sync_every, self.options.flag("sync_every"))


METHODS: tuple[type[Strategy], ...] = (Sparta, SpartaDiLoCo)
