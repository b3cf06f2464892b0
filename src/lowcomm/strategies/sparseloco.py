"""SparseLoCo (docs/ALGORITHMS.md, "SparseLoCo"): DiLoCo's inner loop with a sparse, 2-bit
quantized outer exchange and local error feedback in place of the outer momentum.

Paper: Sarfi, Therien, Lidin, Belilovsky 2025, "Communication Efficient LLM Pre-training with
SparseLoCo" (arXiv 2508.15706); reference code: Templar (github.com/tplr-ai/templar,
``src/tplr/compress.py`` and ``hparams/hparams.json``). Per outer round r, on every worker::

    Delta   = theta^g - theta_local               (after H inner AdamW steps; §0.3 sign)
    e       <- beta e + Delta                      (error feedback, per worker)
    D       = Q(TopK_chunk(e))                     (k largest |e| per chunk, values at b bits)
    e       <- e - D                               (the decoded, transmitted value)
    theta^g <- theta^g - alpha mean_workers(D)     (outer SGD, no momentum)

The inner loop, the global parameters theta^g (the anchor), ``deployed`` and the inner
optimizer are the DiLoCo family's (:class:`lowcomm.strategies.diloco.OuterLoopStrategy`); the
exchange is an all-gather of every worker's encoded (positions, codes, levels) payload
(:class:`lowcomm.optim.sparse.SparseCodec`), bit-packed so the bytes counted are the bytes sent,
which every worker decodes and averages in fp32 in worker order (bit-identical everywhere).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role
from lowcomm.optim.sparse import SparseCodec, index_bits
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, MembershipRule, QuantizedExchange, Transfer
from lowcomm.strategies.diloco import OuterLoopStrategy, outer_round_tail
from lowcomm.strategies.local_update import RoundOptions


@dataclass(kw_only=True)
class SparseLoCoOptions(RoundOptions):
    """Options of SparseLoCo (--sparseloco.*); defaults as in the paper and Templar's code."""

    group: ClassVar[str] = "sparseloco"

    sync_every: int = 15
    """H: inner AdamW steps per outer round (the paper's main setting, H = 15, arXiv
    2508.15706 §4; Templar's production hparams.json runs 30)."""

    outer_lr: float = 1.0
    """alpha: outer learning rate, theta <- theta - alpha mean(D) (Templar's
    outer_learning_rate = 1.0)."""

    outer_momentum: float = 0.0
    """Outer momentum on mean(D): 0, the paper's outer SGD (the error feedback takes the
    momentum's place)."""

    outer_nesterov: bool = True
    """Nesterov form of an outer momentum (as DiLoCo's; no effect at momentum 0)."""

    chunk: int = 4096
    """Entries per top-k chunk (the paper's 64 x 64 = 4096-entry chunks; Templar's
    target_chunk = 64 per side). Here contiguous chunks of the flat parameter buffer."""

    topk: int = 64
    """k: entries kept per chunk (Templar's topk_compression = 64, i.e. 1.56% of 4096;
    the paper's 1-3% density). k = chunk keeps everything."""

    error_decay: float = 0.95
    """beta: decay of the error-feedback accumulator e <- beta e + Delta (Templar's
    momentum_decay = 0.95; 0 keeps only the current pseudo-gradient's residual)."""

    quantization_bits: int | None = 2
    """b: bits per transmitted value (the paper's 2-bit quantization; Templar's
    quantization_bins = 4); None sends fp32 values, no quantization."""

    quantization_range: float = 6.0
    """The quantizer's range in standard deviations of a chunk's kept values (Templar's
    quantization_range = 6): codes are round((v - mean) / (range sigma / 2^b) + 2^(b-1))."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk < 1:
            raise ValueError(f"--sparseloco.chunk: {self.chunk} must be >= 1; try 4096")
        if not 1 <= self.topk <= self.chunk:
            raise ValueError(
                f"--sparseloco.topk: {self.topk} must lie in [1, --sparseloco.chunk = "
                f"{self.chunk}]; try 64 (chunk 4096), or the chunk size to keep every entry"
            )
        if not 0.0 <= self.error_decay <= 1.0:
            raise ValueError(
                f"--sparseloco.error-decay: {self.error_decay} must lie in [0, 1]; try 0.95"
            )
        if self.quantization_bits is not None and not 1 <= self.quantization_bits <= 8:
            raise ValueError(
                f"--sparseloco.quantization-bits: {self.quantization_bits} must lie in [1, 8]; "
                f"try 2, or None for fp32 values"
            )
        if not (self.quantization_range > 0 and math.isfinite(self.quantization_range)):
            raise ValueError(
                f"--sparseloco.quantization-range: {self.quantization_range} must be a finite "
                f"number > 0; try 6"
            )

    def bytes_per_parameter(self) -> float:
        """Bytes one worker sends per model parameter per outer round (chunks whole, as
        :class:`lowcomm.optim.sparse.SparseCodec` packs them): k positions of ceil(log2 chunk)
        bits and k values of b bits plus 2^b fp32 levels per chunk (or k fp32 values)."""
        bits = self.topk * index_bits(self.chunk)
        if self.quantization_bits is None:
            bits += 32 * self.topk
        else:
            bits += self.topk * self.quantization_bits + 32 * (1 << self.quantization_bits)
        return bits / 8 / self.chunk


class SparseLoCo(OuterLoopStrategy[SparseLoCoOptions]):
    """SparseLoCo: H inner AdamW steps, then an all-gather of chunked top-k, 2-bit quantized
    error-feedback pseudo-gradients and an outer SGD step on their mean.

    Paper: Sarfi et al. 2025, "Communication Efficient LLM Pre-training with SparseLoCo"
    (arXiv 2508.15706; docs/ALGORITHMS.md "SparseLoCo"). Symbols: H -> options.sync_every,
    beta -> options.error_decay, k -> options.topk, chunk -> options.chunk, Q ->
    options.quantization_bits / quantization_range, alpha -> options.outer_lr, e_r -> error,
    theta -> globals_[0] (the anchor).
    Reduces to: DiLoCo with outer SGD at lr alpha and no momentum (--diloco.outer-momentum 0)
    when k = chunk, no quantization and beta = 0 (tests/test_sparseloco.py checks it).
    Evaluate at a multiple of H to see the synchronized model.
    """

    name: ClassVar[str] = "sparseloco"
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="sync",
        global_state="the global parameters theta^g, the outer momentum, the counters",
        worker_state=(
            "join: the local parameters start at theta^g, the inner AdamW and the error "
            "feedback e afresh (zero); rejoin: the inner AdamW and e kept"
        ),
    )
    options_field: ClassVar[str | None] = "sparseloco"
    # Its own compressed all-gather is priced from Transfer.bytes_per_parameter.
    quantized_exchange: ClassVar[QuantizedExchange | None] = None
    quick_options: ClassVar[Mapping[str, object]] = {"sync_every": 2, "chunk": 64, "topk": 4}
    sharding_refusal: ClassVar[str | None] = (
        "its top-k chunks are cut from the whole model's flat layout, which a rank's shards "
        "do not hold in order"
    )
    cost: ClassVar[CostModel] = CostModel(
        description="top-k + 2-bit error-feedback all-gather every H steps",
        traffic=lambda o, t: [
            Transfer(1.0, 1 / o.sync_every, bytes_per_parameter=o.bytes_per_parameter())
        ],
        schedule=lambda o: (
            f"H = {o.sync_every} inner steps per outer round, k = {o.topk} of {o.chunk} per chunk"
        ),
        extra_copies=2,  # the anchor theta^g and the error-feedback buffer e
        shards_over_replicas=True,
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: SparseLoCoOptions | None = None,
    ) -> None:
        # One fragment (its default count): theta^g <- theta^g - alpha mean(D).
        super().__init__(model, comm, context, options or SparseLoCoOptions())
        if self.options.outer_momentum == 0:
            # Outer SGD without momentum never reads its momentum buffer: keep it empty rather
            # than a model-sized tensor of zeros (state_bytes and checkpoints then skip it).
            self.outer[0].momentum_buffer = torch.zeros(0, device=self.master.device)
        self.error = torch.zeros_like(self.globals_[0])
        self.codec = SparseCodec(
            numel=self.error.numel(),
            chunk=self.options.chunk,
            k=self.options.topk,
            bits=self.options.quantization_bits,
            sigmas=self.options.quantization_range,
        )
        self.last_payload_bytes = 0

    def exchange(self) -> torch.Tensor:
        """Take this worker's decoded D out of its error buffer (e <- e - D), all-gather its
        encoded D and return the mean of every worker's decoded D. Blocking."""
        payload = self.codec.encode(self.error)
        own = self.codec.decode(payload)
        # e <- e - D before the gather: a worker healed in this round starts its e afresh
        # when the round commits (inside the wait), and sat the round out.
        self.error.sub_(own)
        world = self.comm.world_size
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
        self.comm.all_gather(gathered, payload, role=Role.PSEUDO_GRADIENT).wait()
        # (The workers that sent a payload: with live membership a round retried on a new
        # quorum gathers from that quorum's workers.)
        world = gathered.numel() // payload.numel()
        mean = self.runtime.once_per_gather(  # (workers of one process that gathered the
            gathered,  # same bytes decode them once)
            "sparseloco-sum",
            lambda: self.codec.decode_sum(gathered.view(world, -1)),
        )
        mean /= world
        self.last_payload_bytes = payload.numel()
        return mean

    def step(self, closure: Closure) -> StepStats:
        stats = self.inner_step(closure)
        if self.step_index % self.options.sync_every == 0:
            with torch.no_grad():
                delta = self.globals_[0] - self.local_fragment(0)
                self.error.mul_(self.options.error_decay).add_(delta)  # e <- beta e + Delta
                self.runtime.enter_round()  # (a member lost since the last sync: its detection)
                mean = self.exchange()  # e <- e - D, then a blocking all-gather of D
                self.outer_step(0, mean)
                self.set_local_fragment(0, self.globals_[0])
            stats.extras["outer_step"] = 1.0
            stats.extras["payload_bytes"] = float(self.last_payload_bytes)
        return stats

    def start_worker_state(self, *, kept: bool) -> None:
        super().start_worker_state(kept=kept)
        if not kept:
            self.error.zero_()

    def extra_state_bytes(self) -> int:
        return self.error.numel() * self.error.element_size()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "error": self.error.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.error.copy_(state["error"])

    def unsynchronized_tail(self, steps: int) -> str | None:
        """The deployed model is the outer one: the inner steps after the last multiple of H
        are not in it (as diloco)."""
        return outer_round_tail(steps, self.options.sync_every, self.options.flag("sync_every"))


METHODS: tuple[type[Strategy], ...] = (SparseLoCo,)
