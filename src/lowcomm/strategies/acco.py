"""ACCO, DPU and weight prediction: sharded AdamW that accumulates while it communicates.

Paper: Nabli et al., *ACCO: Accumulate While You Communicate for Communication-Overlapped
Sharded LLM Training* (../shared/seeds/000_c21372be6ab2c5c4.txt). Specification:
docs/ALGORITHMS.md §2 (2.1 DPU, 2.2 WP, 2.3 ACCO's executable loop, 2.4 Table 1 memory), built on
ZeRO-1 (§1.2, ``strategies/zero1.py``).

All three methods keep ZeRO-1's layout (full working parameters and gradients, the fp32
master and AdamW moments only for this worker's shard S_i) plus one model-sized communication
buffer B, and run the chain

    C <- AR_sum(c_B);  g_hat <- RS_sum(B)[S_i] / C;  sharded optimizer step;  B <- AG(shard)

on a communication thread (:class:`lowcomm.comm.overlap.CommThread`, plus a side CUDA stream
on GPU; the workers of one process share their group's one
:class:`~lowcomm.comm.overlap.ChainScheduler` instead) while the main thread keeps running the
closure, accumulating micro-batch gradients
into G (the flat gradient buffer) and counting them in n, until the chain is done (at least
one micro-batch; "done" by the run's clock when the communicator is emulated). Then
the *join*: theta <- B, B <- G, c_B <- n. Every reduction is normalised by C, the summed
micro-batch counts of all workers, so workers may contribute different counts.

Symbols -> code: theta -> ``flat.params``; G, n -> ``flat.grads``, ``self.accumulated``;
B, c_B -> ``self.buffer``, ``self.buffer_count``; Theta_i, m_i, v_i, s -> ``self.optimizer``
(``master``, ``exp_avg``, ``exp_avg_sq``, ``step_count``); C -> the chain's return value;
W -> ``options.dpu_warmup_steps``; the forced per-phase count -> ``options.microbatches_per_phase``.

Thread safety (docs/ARCHITECTURE.md hazards): while a chain is in flight, every collective of
the strategy is issued by the chain (on its runner's thread), on the runtime's *uncharged* channel
(``self.uncharged``); the main thread issues none and only does the accounting through the
runtime's ``offload`` (``offload`` / ``record``: bytes by role, modeled cost, completion time)
and reads its own clock. Every
``step()`` waits for its last chain before returning, so no collective of ours is in flight
when the training loop talks to other workers between steps.

Learning-rate schedule: indexed by committed samples, as ACCO's reference code advances its
scheduler by the micro-batch gradients each committed step consumed. Schedule step =
floor(committed gradients summed over workers / (phases x M x ``--microbatches-per-step``)),
phases = 2 for ACCO (its two halves) and 1 for DPU and WP: the number of steps of the
synchronous baseline that would have consumed the same samples (after an elastic resume,
counted from the step reached, at the new M). With a token budget
(``--token-budget``) the schedule is laid out over the budget instead: schedule step =
floor(committed gradients x total steps / budgeted micro-batches).
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from lowcomm.comm.base import CollectiveKind, Comm, Handle, Role, payload_bytes
from lowcomm.comm.overlap import (
    Chain,
    ChainRunner,
    FutureHandle,
    HelperMeter,
    Steps,
    chain_runner,
)
from lowcomm.comm.runtime import ClockReader, Offload
from lowcomm.optim.adamw import FlatAdamW
from lowcomm.optim.flat import FlatOptimizer, tensor_bytes
from lowcomm.optim.sgd import FlatSGD
from lowcomm.strategies.base import (
    Closure,
    Loss,
    MicroBatchResult,
    StepStats,
    Strategy,
    StrategyContext,
    add_loss,
    clip_,
)
from lowcomm.strategies.declaration import CostModel, every_step
from lowcomm.strategies.flat import FlatBuffers
from lowcomm.strategies.gradient_step import average_and_clip


@dataclass(kw_only=True)
class AccoOptions:
    """Options of acco, dpu and wp (ACCO paper; docs/ALGORITHMS.md §2). ACCO itself has no new
    hyperparameter: every field here is for the baselines or for tests."""

    microbatches_per_phase: int | None = None
    """Micro-batches each worker computes per communication phase. None (the papers'
    behaviour): accumulate until the communication chain is done, at least one, so counts vary
    by worker and step. An integer forces exactly that many (the compute side then waits for
    the chain if it is slower): a fixed schedule, for equal-token comparisons and tests."""

    dpu_warmup_steps: int = 0
    """W: dpu only. Plain (sequential) ZeRO-1 steps before the delayed updates start. 0 is
    the plain DPU rule; ZeRO-Offload recommends 40 and ACCO also tests 500."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    """Sharded optimizer: adamw (the papers') or sgd (theta <- theta (1 - lr wd) - lr g, the
    setting of ACCO's Prop. 3.2 analysis; used by the equation tests)."""

    def __post_init__(self) -> None:
        if self.microbatches_per_phase is not None and self.microbatches_per_phase < 1:
            raise ValueError(
                f"--acco.microbatches-per-phase: {self.microbatches_per_phase} must be >= 1; "
                f"pass a positive count, or None to accumulate until communication is done"
            )
        if self.dpu_warmup_steps < 0:
            raise ValueError(
                f"--acco.dpu-warmup-steps: {self.dpu_warmup_steps} must be >= 0; pass 0 for "
                f"plain DPU or the number of sequential ZeRO-1 steps to run first (e.g. 40)"
            )
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(
                f"--acco.optimizer: unknown optimizer {self.optimizer!r}; choose adamw or sgd"
            )


class _Mode(enum.Enum):
    """What the sharded optimizer does with the reduced gradient in one chain."""

    COMMIT = "commit"  # AdamW step (DPU, ACCO's update phase, ZeRO-1 warm-up)
    LOOKAHEAD = "lookahead"  # AdamW lookahead, nothing committed (ACCO's estimate phase)
    COMMIT_THEN_LOOKAHEAD = "commit_then_lookahead"  # WP: commit, then predict with the same g


@dataclass
class _Tally:
    """Micro-batches one worker ran during one step (or one phase)."""

    loss_sum: Loss = 0.0
    microbatches: int = 0
    samples: int = 0
    tokens: int = 0

    def add(self, result: MicroBatchResult) -> None:
        self.loss_sum = add_loss(self.loss_sum, result.loss)
        self.microbatches += 1
        self.samples += result.samples
        self.tokens += result.tokens

    def merge(self, other: _Tally) -> None:
        self.loss_sum = add_loss(self.loss_sum, other.loss_sum)
        self.microbatches += other.microbatches
        self.samples += other.samples
        self.tokens += other.tokens


#: Bytes of one float64 scalar: the micro-batch count and the squared gradient norm.
_SCALAR_BYTES = 8

#: An overlapped phase of at least this many micro-batches and this many seconds of wall time
#: makes rank 0 say, once, why the run seems to hang: compute declared (or measured) far
#: cheaper than the link's time.
LONG_PHASE_MICROBATCHES = 100
LONG_PHASE_SECONDS = 30.0


@dataclass(frozen=True)
class _Link:
    """One collective of the chain, declared once: the chain issues it from this declaration
    (:meth:`issue`) and the main thread accounts for it from the same one
    (``NetworkComm.record``), so the two cannot drift apart.

    Attributes:
        kind: the collective (reductions are sums).
        role: what the payload is.
        payload_bytes: the full (unsharded) payload, as the issuing methods count it;
            :meth:`issue` refuses a tensor of another size.
        stage: the chain's steps around the collective (prepare its tensors, :meth:`issue`
            it, consume the result).
    """

    kind: CollectiveKind
    role: Role
    payload_bytes: int
    stage: Callable[[Comm, _Link], Steps[None]]

    def issue(
        self, comm: Comm, output: torch.Tensor, input: torch.Tensor | None = None
    ) -> Steps[None]:
        """Issue this collective on ``comm``, yield its handle, then wait for it (the
        chain's runner resumes it once the collective is done: the wait returns at once)."""
        full = input if self.kind is CollectiveKind.REDUCE_SCATTER else output
        assert full is not None and payload_bytes(full) == self.payload_bytes, (
            f"ACCO chain: {self.kind.value} declared with {self.payload_bytes} bytes, issued with "
            f"{None if full is None else payload_bytes(full)}"
        )
        if self.kind is CollectiveKind.ALL_REDUCE:
            handle = comm.all_reduce(output, op="sum", role=self.role)
        elif self.kind is CollectiveKind.REDUCE_SCATTER:
            assert input is not None
            handle = comm.reduce_scatter(output, input, op="sum", role=self.role)
        else:
            assert self.kind is CollectiveKind.ALL_GATHER and input is not None
            handle = comm.all_gather(output, input, role=self.role)
        yield handle
        handle.wait()


class _ChainRun:
    """One chain, ``C <- AR_sum(c_B); g_hat <- RS_sum(source)[S_i] / C; [AR_sum(|g_hat|^2),
    clip]; optimizer; target <- AG(shard)``, built on the main thread and run by the
    worker's chain runner (its communication thread, or its group's scheduler).

    :attr:`links` declares its collectives in issue order; :meth:`steps` issues exactly these,
    and :meth:`_ShardedOverlap._launch` accounts for exactly these.
    """

    def __init__(
        self,
        strategy: _ShardedOverlap,
        source: torch.Tensor,
        target: torch.Tensor,
        local_count: int,
        mode: _Mode,
        lr: float,
        committed_before: int,
    ) -> None:
        self.strategy = strategy
        self.source = source
        self.target = target
        self.local_count = local_count
        self.mode = mode
        self.lr = lr
        self.committed_before = committed_before
        self.total = 0
        self.grad: torch.Tensor | None = None
        clipped = strategy.context.max_grad_norm is not None
        self.links: list[_Link] = [
            _Link(CollectiveKind.ALL_REDUCE, Role.OTHER, _SCALAR_BYTES, self._sum_counts),
            _Link(CollectiveKind.REDUCE_SCATTER, Role.GRADIENT, payload_bytes(source), self._reduce_gradient),
            *([_Link(CollectiveKind.ALL_REDUCE, Role.OTHER, _SCALAR_BYTES, self._clip)] if clipped else []),
            _Link(CollectiveKind.ALL_GATHER, Role.PARAMETER, payload_bytes(target), self._step_and_gather),
        ]  # fmt: skip

    def steps(self, comm: Comm) -> Steps[int]:
        """Issue every link on ``comm`` in order; returns C."""
        for link in self.links:
            yield from link.stage(comm, link)
        return self.total

    def _sum_counts(self, comm: Comm, link: _Link) -> Steps[None]:
        """C <- AR_sum(c_B)."""
        count = torch.full(
            (1,), float(self.local_count), dtype=torch.float64, device=self.source.device
        )
        yield from link.issue(comm, count)
        self.total = round(float(count.item()))

    def _reduce_gradient(self, comm: Comm, link: _Link) -> Steps[None]:
        """g_hat <- RS_sum(source)[S_i] / C."""
        shard_grad = self.strategy.shard_grad
        yield from link.issue(comm, shard_grad, self.source)
        self.grad = average_and_clip(shard_grad, count=self.total, max_grad_norm=None)

    def _clip(self, comm: Comm, link: _Link) -> Steps[None]:
        """Clip g_hat to the global norm: one scalar all-reduce of the shards' squared norms
        (``average_and_clip`` of a float32 gradient with count 1, its collective yielded)."""
        assert self.grad is not None
        squared = self.grad.square().sum().reshape(1).double()
        yield from link.issue(comm, squared)
        clip_(self.grad, squared, self.strategy.context.max_grad_norm)

    def _step_and_gather(self, comm: Comm, link: _Link) -> Steps[None]:
        """The sharded optimizer (commit, lookahead or both), then target <- AG(shard)."""
        assert self.grad is not None
        out = self.strategy._optimize(
            self.grad, self.mode, self.lr, self.committed_before + self.total
        )
        yield from link.issue(comm, self.target, out.to(self.strategy.flat.dtype))


@dataclass
class _Chain:
    """One chain in flight: the runner's future, the modeled handles of its collectives, and
    the meter of the compute the chain does (the sharded optimizer step, the averaging)."""

    future: FutureHandle[int]
    handles: list[Handle]
    meter: HelperMeter
    clock: ClockReader | None

    def done(self) -> bool:
        # The link serves the chain's collectives in order: the last one done = all done.
        return self.handles[-1].done()

    def wait(self) -> int:
        for handle in self.handles:
            handle.wait()  # on the main thread: exposed time is charged here, and only here
        total = self.future.result()
        if self.clock is not None:
            # The thread's compute shared the worker's device: it takes the worker's time.
            self.clock.fold(self.meter)
        return total


class _ShardedOverlap(Strategy):
    """Shared machinery of ACCO, DPU and WP (see the module docstring).

    Args:
        model: the model; its parameters are rebound into flat buffers.
        comm: the communicator; an emulated one is accounted for on its clock (the
            runtime's ``offload``) while the chain's real collectives run on the runtime's
            uncharged channel.
        context: optimizer, schedule and step settings.
        options: the family's options (``--acco.*``).

    Elastic resume (``--resume DIR --workers M2``): the optimizer shards are re-sharded exactly
    and theta kept; the accumulated sums G, B and their counts n, c_B are pooled onto the new
    worker 0 (every reduction divides by the summed count C); the schedule continues by
    committed samples: the schedule step reached stays, and later commits advance it by the
    new worker count's samples per step.
    """

    muon_refusal: ClassVar[str | None] = (
        "ACCO, DPU and WP step a flat optimizer shard per worker, cut across the weight "
        "matrices Muon orthogonalises whole"
    )
    sharding_refusal: ClassVar[str | None] = (
        "ACCO, DPU and WP take as many micro-batches as each rank's clock allows and run "
        "their chain on a communication thread, while FSDP needs every rank of a worker in "
        "the same forward and backward passes"
    )
    hierarchical_refusal: ClassVar[str | None] = (
        "ACCO, DPU and WP run their reduce-scatter/step/all-gather chain on a communication "
        "thread beside the main thread's backward passes, and (unless "
        "--acco.microbatches-per-phase is set) take as many micro-batches as each rank's own "
        "clock allows; with R ranks per worker the inner group would get collectives from two "
        "threads and the replicas of a worker would diverge"
    )

    options_field: ClassVar[str | None] = "acco"
    # DPU and WP too: the thread issues the chain on the uncharged channel, which moves the
    # float32 buffers as they are.
    comm_dtypes: ClassVar[tuple[str, ...]] = ("fp32",)
    comm_dtype_refusal: ClassVar[str | None] = (
        "its gradient collectives are issued on a communication thread that does not cast "
        "them, so they would travel in float32 while being priced in bfloat16"
    )

    @classmethod
    def takes_variable_microbatches(cls, options: Any) -> bool:
        """Unless --acco.microbatches-per-phase fixes the count, each phase computes for as
        long as its communication lasts."""
        return options is None or options.microbatches_per_phase is None

    #: Elastic resume: G, B and their counts n, c_B are sums every reduction divides by the
    #: total count C, so they are pooled onto the new worker 0 (the optimizer shards are
    #: re-sharded exactly, theta is replicated).
    reshard_pooled: ClassVar[tuple[str, ...]] = ("grads", "buffer", "buffer_count", "accumulated")
    #: Communication phases per committed optimizer step (the schedule's unit).
    phases_per_commit: ClassVar[int] = 1
    #: Whether the chain ever computes a lookahead (needs an extra fp32 shard).
    uses_lookahead: ClassVar[bool] = False

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: AccoOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context)
        self.options = options if options is not None else AccoOptions()
        # The comm thread issues the real collectives on the uncharged channel; accounting
        # (when the comm is emulated) happens on the main thread, through the runtime.
        self.network: Offload | None = self.runtime.offload
        self.uncharged: Comm = self.runtime.uncharged
        world_size = comm.world_size
        self.flat = FlatBuffers(model, pad_to=world_size)
        self.shard_numel = self.flat.padded_numel // world_size
        begin = comm.rank * self.shard_numel
        self.shard = slice(begin, begin + self.shard_numel)
        # clone(): on CPU .float() of a float32 tensor is the same storage (ZeRO-1's hazard).
        master = self.flat.params[self.shard].float().clone()
        self.optimizer: FlatOptimizer = (
            FlatAdamW(master, context.optim)
            if self.options.optimizer == "adamw"
            else FlatSGD(master, weight_decay=context.optim.weight_decay)
        )
        self.shard_grad = torch.zeros(
            self.shard_numel, dtype=self.flat.dtype, device=self.flat.device
        )
        self.estimate: torch.Tensor | None = (
            torch.zeros(self.shard_numel, dtype=torch.float32, device=self.flat.device)
            if self.uses_lookahead
            else None
        )
        # B and c_B: the communication buffer (gradients going out, parameters coming back).
        self.buffer = torch.zeros_like(self.flat.params)
        self.buffer_count = 0
        # n: micro-batch gradients accumulated in G (= self.flat.grads) since its last reset.
        self.accumulated = 0
        self.primed = False
        # Micro-batch gradients (summed over workers) consumed by committed steps so far.
        self.committed_gradients = 0
        # (schedule step, committed gradients) where this worker count took over: an elastic
        # resume continues the schedule from there, at the new count's samples per step.
        self.schedule_base = (0, 0)
        # Micro-batches this worker has computed (for a token budget's per-worker share).
        self.computed = 0
        self._said_long_phase = False
        # The worker's runner of chains: a communication thread of its own, or (workers in one
        # process) a lane of its group's one scheduler; made at the first chain.
        self.runner: ChainRunner | None = None
        self.stream: Any = (
            torch.cuda.Stream(device=self.flat.device)  # type: ignore[no-untyped-call]
            if self.flat.device.type == "cuda"
            else None
        )
        #: The CUDA stream the last chain ran on (None on CPU); for the GPU test.
        self.last_chain_stream: Any = None

    # --- schedule ------------------------------------------------------------------------

    def schedule_step(self, committed_gradients: int | None = None) -> int:
        """The LR schedule's step after ``committed_gradients`` committed micro-batch
        gradients (default: the current count); see the module docstring."""
        count = self.committed_gradients if committed_gradients is None else committed_gradients
        budget = self.context.microbatch_budget
        if budget is not None:
            # A token budget: the schedule's last step lands where the budget is spent.
            return count * self.context.total_steps // budget
        return self._step_reached(count, self.comm.world_size)

    def _step_reached(self, count: int, workers: int) -> int:
        """The schedule step after ``count`` committed gradients, counted from
        ``schedule_base`` at ``workers`` workers' samples per step."""
        base_step, base_gradients = self.schedule_base
        unit = self.phases_per_commit * workers * self.context.microbatches_per_step
        return base_step + max(0, count - base_gradients) // unit

    # --- the chain (run by the chain runner) ---------------------------------------------

    def _chain_steps(self, chain: _ChainRun) -> Steps[int]:
        """``chain``'s declared links, in order, on the uncharged channel; returns C.

        Runs on the runner's thread; touches only the inner communicator, the optimizer
        shard and the buffers handed to it (never the clock, never ``flat.params`` during an
        overlapped phase); the runner measures its compute with the meter the main thread
        folds into the clock."""
        self.last_chain_stream = (
            torch.cuda.current_stream(self.flat.device) if self.stream is not None else None
        )
        total = yield from chain.steps(self.uncharged)
        if self.stream is not None:
            self.stream.synchronize()
        return total

    @contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        """Where the chain's kernels go: the worker's side stream on a GPU (entered at every
        resumption: a shared scheduler runs other workers' chains in between)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.flat.device), torch.cuda.stream(self.stream):
            yield

    def _optimize(
        self, grad: torch.Tensor, mode: _Mode, lr: float, committed_after: int
    ) -> torch.Tensor:
        """The sharded optimizer's part of a chain: the shard to all-gather."""
        if mode is _Mode.COMMIT:
            self.optimizer.step(grad, lr=lr)
            return self.optimizer.master
        if mode is _Mode.LOOKAHEAD:
            return self._lookahead(grad, lr)
        self.optimizer.step(grad, lr=lr)
        # WP predicts the next committed step: its LR is the schedule's after this commit.
        return self._lookahead(grad, self.lr_at(self.schedule_step(committed_after)))

    def _lookahead(self, grad: torch.Tensor, lr: float) -> torch.Tensor:
        assert self.estimate is not None
        return self.optimizer.lookahead(grad, lr=lr, out=self.estimate)

    # --- main thread ---------------------------------------------------------------------

    def _launch(
        self, source: torch.Tensor, target: torch.Tensor, local_count: int, mode: _Mode, lr: float
    ) -> _Chain:
        """Start a chain on the chain runner and account for its collectives."""
        if self.runner is None:
            self.runner = chain_runner(self.uncharged, device=self.flat.device)
        if self.stream is not None:
            # B was written on the main stream: the side stream must see it.
            self.stream.wait_stream(torch.cuda.current_stream(self.flat.device))
        agreement = self.network.offload(source.device) if self.network is not None else None
        chain = _ChainRun(
            self, source, target, local_count, mode, lr, committed_before=self.committed_gradients
        )
        clock = self.runtime.clock
        meter = clock.helper_meter() if clock is not None else HelperMeter()
        future = self.runner.submit_chain(
            Chain(
                self._chain_steps(chain),
                meter,
                prelude=None if agreement is None else agreement.agree(self.uncharged),
                scope=self._on_side_stream,
            )
        )
        if self.network is None or agreement is None:
            return _Chain(future, [future], meter, clock)
        # Accounting from the chain's own declaration, in the order the thread issues it.
        handles = [
            self.network.record(
                link.kind,
                role=link.role,
                payload_bytes=link.payload_bytes,
                completion=future,
                agreement=agreement,
            )
            for link in chain.links
        ]
        return _Chain(future, handles, meter, clock)

    def _compute(self, closure: Closure, count: int) -> _Tally:
        """Run exactly ``count`` micro-batches into G (no communication in flight)."""
        tally = _Tally()
        for _ in range(count):
            tally.add(closure())
            self.accumulated += 1
            self.computed += 1
        self.flat.sync_grads()
        return tally

    def _overlapped_phase(self, closure: Closure, chain: _Chain) -> tuple[_Tally, int]:
        """Accumulate micro-batches into G while ``chain`` runs; return them and C.

        "Done" is checked after each micro-batch (so at least one runs, unless a token
        budget's share of this worker is already computed: then none does, and the phase
        only waits, so the run commits no more than its budget): by the run's clock when the
        communicator is emulated (virtual: the virtual clock alone; real: the thread finished
        and the modeled time passed), else when the thread finished. With
        ``microbatches_per_phase`` set, exactly that many run, then the chain is waited for."""
        forced = self.options.microbatches_per_phase
        tally = _Tally()
        begin = time.monotonic()
        while forced is not None or not self._share_spent():
            tally.add(closure())
            self.accumulated += 1
            self.computed += 1
            if forced is not None:
                if tally.microbatches >= forced:
                    break
            elif chain.done() or self._share_spent():
                break
            elif not self._said_long_phase and tally.microbatches >= LONG_PHASE_MICROBATCHES:
                self._say_long_phase(tally.microbatches, time.monotonic() - begin)
        total = chain.wait()
        self.flat.sync_grads()
        return tally, total

    def _say_long_phase(self, microbatches: int, seconds: float) -> None:
        """Once per run, after LONG_PHASE_SECONDS of one phase: why it seems to hang."""
        if seconds < LONG_PHASE_SECONDS:
            return
        self._said_long_phase = True
        if self.comm.rank == 0:
            print(
                f"lowcomm: {self.name}: {microbatches} micro-batches ({seconds:.0f} s) in one "
                "phase and its communication is still running (a micro-batch costs far less "
                "than the link's time); the phase goes on until it is done. Bound it with "
                "--acco.microbatches-per-phase N or --token-budget TOKENS",
                file=sys.stderr,
                flush=True,
            )

    def _share_spent(self) -> bool:
        """With a token budget: this worker has computed its share of the budgeted
        micro-batches (its phases then compute none until the run ends). The shares are in
        proportion to the workers' speeds (``--speed-factors``), so a fast worker contributes
        more, as ACCO means it to, and all finish theirs at about the same time."""
        budget = self.context.microbatch_budget
        if budget is None:
            return False
        shares = self.context.microbatch_shares
        if shares is not None and len(shares) == self.comm.world_size:
            return self.computed >= shares[self.comm.rank]
        return self.computed >= -(-budget // self.comm.world_size)

    def _sequential_step(self, closure: Closure) -> tuple[_Tally, int]:
        """One plain ZeRO-1 step (§1.2) through the same chain: compute, then communicate."""
        self.flat.zero_grads()
        self.accumulated = 0
        tally = self._compute(closure, self.context.microbatches_per_step)
        lr = self.lr_at(self.schedule_step())
        chain = self._launch(self.flat.grads, self.flat.params, self.accumulated, _Mode.COMMIT, lr)
        total = chain.wait()
        self.accumulated = 0
        return tally, total

    def _prime(self, closure: Closure) -> _Tally:
        """Compute the first gradient at theta_0 (no communication to overlap yet); B <- G."""
        self.flat.zero_grads()
        self.accumulated = 0
        tally = self._compute(closure, self.options.microbatches_per_phase or 1)
        self._send_gradients()
        self.primed = True
        return tally

    def _send_gradients(self) -> None:
        """B <- G; c_B <- n."""
        with torch.no_grad():
            self.buffer.copy_(self.flat.grads)
        self.buffer_count = self.accumulated

    def _receive_parameters(self) -> None:
        """theta <- B."""
        with torch.no_grad():
            self.flat.params.copy_(self.buffer)

    def _reset_accumulator(self) -> None:
        """G <- 0; n <- 0."""
        self.flat.zero_grads()
        self.accumulated = 0

    def _stats(self, tally: _Tally, lr: float, extras: dict[str, float]) -> StepStats:
        return StepStats(
            loss=tally.loss_sum / max(1, tally.microbatches),
            microbatches=tally.microbatches,
            samples=tally.samples,
            tokens=tally.tokens,
            lr=lr,
            committed_steps=1,
            extras=extras,
        )

    # --- Strategy API --------------------------------------------------------------------

    def finish(self) -> None:
        """Nothing is in flight after ``step()``; stop the chain runner (a communication
        thread of the worker's own)."""
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    def state_bytes(self) -> int:
        """Measured: params + G (flat buffers) + B + optimizer shard + the reduced-gradient
        shard (+ the lookahead shard for ACCO and WP)."""
        extra = self.shard_grad.numel() * self.shard_grad.element_size()
        if self.estimate is not None:
            extra += self.estimate.numel() * self.estimate.element_size()
        buffer = self.buffer.numel() * self.buffer.element_size()
        optimizer = tensor_bytes(self.optimizer.master) + self.optimizer.state_bytes()
        return self.flat.bytes + buffer + optimizer + extra

    def formula_state_bytes(self) -> int:
        """ACCO Table 1: (2 + 2 + 2 + K/M) Psi in the precision actually used, i.e.
        (3 p + K/M) Psi with p the working dtype's bytes per parameter (params, G, B), K the
        sharded optimizer's fp32 bytes per parameter (12 for AdamW: master, m, v; 4 for SGD),
        M the world size and Psi the unpadded parameter count."""
        optimizer_bytes = 4 * (1 + len(self.optimizer.states()))  # master + its states
        element = self.flat.params.element_size()
        psi = self.flat.numel
        return round((3 * element + optimizer_bytes / self.comm.world_size) * psi)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "params": self.flat.params.clone(),
            "grads": self.flat.grads.clone(),
            "buffer": self.buffer.clone(),
            "buffer_count": self.buffer_count,
            "accumulated": self.accumulated,
            "primed": self.primed,
            "committed_gradients": self.committed_gradients,
            "computed": self.computed,
            "schedule_workers": self.comm.world_size,
            "schedule_base_step": self.schedule_base[0],
            "schedule_base_gradients": self.schedule_base[1],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            self.flat.params.copy_(state["params"])
            self.flat.grads.copy_(state["grads"])
            self.buffer.copy_(state["buffer"])
        self.buffer_count = int(state["buffer_count"])
        self.accumulated = int(state["accumulated"])
        self.primed = bool(state["primed"])
        self.committed_gradients = int(state["committed_gradients"])
        self.computed = int(state.get("computed", 0))
        self.schedule_base = (
            int(state.get("schedule_base_step", 0)),
            int(state.get("schedule_base_gradients", 0)),
        )
        workers = int(state.get("schedule_workers", self.comm.world_size))
        if workers != self.comm.world_size and self.context.microbatch_budget is None:
            # An elastic resume: the schedule step reached so far stays, and later committed
            # samples advance it at the new count's rate (not re-read at the new rate from 0).
            reached = self._step_reached(self.committed_gradients, workers)
            self.schedule_base = (reached, self.committed_gradients)


class ACCO(_ShardedOverlap):
    """ACCO: two overlapped half-steps per optimizer step, estimate then update (§2.3).

    Paper: Nabli et al., ACCO, §3.2, Alg. 1, App. B.2 (docs/ALGORITHMS.md §2.3, executable loop).
    One ``step()`` = one committed optimizer step = an estimate (EST) phase and an update
    (UPD) phase. Symbols: theta~(t+1) = AdamW_lookahead(theta(t), sum G~ / sum N~) is the EST
    chain's output (never commits m, v, s); theta(t+1) = AdamW_step(theta(t), sum(G + G~) /
    sum(N + N~)) is the UPD chain's. With SGD and one micro-batch per phase:
    theta(t+1) = theta(t) - lr/2 (g_t + g~_t), theta~(t+1) = theta(t) - lr g~_t (Prop. 3.2).
    First step: g~(0) is a gradient at theta(0) (no warm-up). Last step: the run stops after
    an UPD phase; gradients accumulated during it are never committed. Per committed step it
    moves twice ZeRO-1's bytes (two RS + AG pairs), hidden rather than reduced.
    Reduces to: the equations of Prop. 3.2 (tests/test_acco.py).
    Memory: (2 + 2 + 2 + K/M) Psi.
    """

    name: ClassVar[str] = "acco"
    cost: ClassVar[CostModel] = CostModel(
        description="two-stage delay compensation, accumulates",
        traffic=every_step(2.0),  # two RS+AG phases per committed step
        extra_copies=1,
        shards_over_workers=True,
        accumulates=True,
    )
    phases_per_commit: ClassVar[int] = 2
    uses_lookahead: ClassVar[bool] = True

    def step(self, closure: Closure) -> StepStats:
        self.flat.check_params()
        tally = _Tally()
        if not self.primed:
            # init: g0 at theta0 goes out as g~(0) AND stays in G (it is also part of the
            # first full batch, as in the reference loop).
            tally.merge(self._prime(closure))
        lr = self.lr_at(self.schedule_step())
        # EST: the chain predicts theta~(t+1) from g~(t); compute takes g(t) at theta(t).
        chain = self._launch(self.buffer, self.buffer, self.buffer_count, _Mode.LOOKAHEAD, lr)
        estimate, estimate_count = self._overlapped_phase(closure, chain)
        self._receive_parameters()  # theta <- theta~(t+1)
        self._send_gradients()  # B <- g~(t) + g(t): the full batch
        self._reset_accumulator()
        # UPD: the chain commits theta(t+1); compute takes g~(t+1) at theta~(t+1).
        chain = self._launch(self.buffer, self.buffer, self.buffer_count, _Mode.COMMIT, lr)
        update, committed = self._overlapped_phase(closure, chain)
        self._receive_parameters()  # theta <- theta(t+1)
        self._send_gradients()  # B <- g~(t+1); G and n are NOT reset: the next EST adds g on top
        self.committed_gradients += committed
        self.step_index += 1
        tally.merge(estimate)
        tally.merge(update)
        return self._stats(
            tally,
            lr,
            {
                "microbatches_estimate": float(estimate.microbatches),
                "microbatches_update": float(update.microbatches),
                "global_microbatches_estimate": float(estimate_count),
                "global_microbatches_committed": float(committed),
                "schedule_step": float(self.schedule_step()),
            },
        )


class DPU(_ShardedOverlap):
    """Delayed parameter update: theta(t+1) = Opt(theta(t), g(theta(t-1))) (§2.1).

    Paper: ACCO eq. DPU (after ZeRO-Offload). One ``step()`` = one overlapped phase: the chain
    commits an AdamW step with the gradients of the previous phase while compute accumulates
    new ones at the current parameters. First step: theta(1) = Opt(theta(0), g(theta(0))),
    the only undelayed one. Symbols: W -> ``options.dpu_warmup_steps`` (plain ZeRO-1 steps
    first). Reduces to: ZeRO-1 when W >= the number of steps (tests/test_acco.py).
    Memory: (2 + 2 + 2 + K/M) Psi.
    """

    name: ClassVar[str] = "dpu"
    cost: ClassVar[CostModel] = CostModel(
        description="one-step-delayed ZeRO-1 update",
        traffic=every_step(hidden_steps=1),
        extra_copies=1,
        shards_over_workers=True,
    )

    def step(self, closure: Closure) -> StepStats:
        self.flat.check_params()
        if self.step_index < self.options.dpu_warmup_steps:
            lr = self.lr_at(self.schedule_step())
            tally, committed = self._sequential_step(closure)
            self.committed_gradients += committed
            self.step_index += 1
            return self._stats(
                tally, lr, {"warmup": 1.0, "global_microbatches_committed": float(committed)}
            )
        tally = _Tally()
        if not self.primed:
            tally.merge(self._prime(closure))
            self._reset_accumulator()
        lr = self.lr_at(self.schedule_step())
        chain = self._launch(self.buffer, self.buffer, self.buffer_count, _Mode.COMMIT, lr)
        phase, committed = self._overlapped_phase(closure, chain)
        self._receive_parameters()
        self._send_gradients()
        self._reset_accumulator()
        self.committed_gradients += committed
        self.step_index += 1
        tally.merge(phase)
        return self._stats(
            tally,
            lr,
            {
                "warmup": 0.0,
                "microbatches_phase": float(phase.microbatches),
                "global_microbatches_committed": float(committed),
                "schedule_step": float(self.schedule_step()),
            },
        )


class WP(_ShardedOverlap):
    """Weight prediction: commit, then a non-committing lookahead with the same gradient (§2.2).

    Paper: ACCO eq. WP. theta(t+1) = Opt(theta(t), g(t)) is committed on the master shard;
    theta~(t+1) = Opt_lookahead(theta(t+1), g(t)) is all-gathered into the compute copy, and
    the next gradients are taken there. The lookahead never commits m, v, s ([R-med] in the
    spec: otherwise Adam would count every gradient twice). First step: g(0) at theta(0).
    ``deployed()`` all-gathers the committed master shards (validation uses theta, not the
    prediction). Memory: (2 + 2 + 2 + K/M) Psi.
    """

    name: ClassVar[str] = "wp"
    cost: ClassVar[CostModel] = CostModel(
        description="delayed update with weight prediction",
        traffic=every_step(hidden_steps=1),
        extra_copies=1,
        shards_over_workers=True,
    )
    uses_lookahead: ClassVar[bool] = True

    def step(self, closure: Closure) -> StepStats:
        self.flat.check_params()
        tally = _Tally()
        if not self.primed:
            tally.merge(self._prime(closure))
            self._reset_accumulator()
        lr = self.lr_at(self.schedule_step())
        chain = self._launch(
            self.buffer, self.buffer, self.buffer_count, _Mode.COMMIT_THEN_LOOKAHEAD, lr
        )
        phase, committed = self._overlapped_phase(closure, chain)
        self._receive_parameters()  # theta <- theta~(t+1), the prediction
        self._send_gradients()
        self._reset_accumulator()
        self.committed_gradients += committed
        self.step_index += 1
        tally.merge(phase)
        return self._stats(
            tally,
            lr,
            {
                "microbatches_phase": float(phase.microbatches),
                "global_microbatches_committed": float(committed),
                "schedule_step": float(self.schedule_step()),
            },
        )

    @contextmanager
    def deployed(self) -> Iterator[nn.Module]:
        """The model at the committed theta: the master shards all-gathered (on the inner
        communicator, uncharged: it is evaluation, not training traffic; no chain is in
        flight between steps), swapped in, and the prediction restored afterwards."""
        if self.runner is not None and self.runner.busy:
            raise RuntimeError("wp.deployed() while a chain is in flight; call it between steps")
        committed = torch.empty_like(self.flat.params)
        master = self.optimizer.master.to(self.flat.dtype)
        self.uncharged.all_gather(committed, master, role=Role.PARAMETER).wait()
        prediction = self.flat.params.clone()
        with torch.no_grad():
            self.flat.params.copy_(committed)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.flat.params.copy_(prediction)


METHODS = (ACCO, DPU, WP)
