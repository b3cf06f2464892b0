"""DeMo (docs/ALGORITHMS.md, "DeMo"): decoupled momentum, of which only the fast DCT
components are exchanged, and a sign step on their mean.

Paper: Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization" (arXiv
2411.19870, Algorithm 1); reference code: github.com/bloc97/DeMo (as vendored by exogym,
``exogym/strategy/demo_impl/demo.py``). Every step, on every worker::

    m  <- beta m + g                        (g: this worker's gradient; m never averaged)
    q  = IDCT(TopK_chunk(DCT(m)))           (k largest |coefficient| per DCT block)
    m  <- m - q                             (what was sent leaves the momentum)
    Q  = IDCT(mean_workers(TopK_chunk(DCT(m_r))))    (all-gather of (positions, values))
    theta <- theta - lr (sign(Q) + lambda theta)

The DCT blocks are the reference code's (:class:`lowcomm.optim.dct.BlockDCT`): per parameter
tensor, blocks of (up to) ``chunk`` x ``chunk`` entries for matrices, ``chunk`` for vectors. A
worker's payload is every tensor's kept positions, bit-packed at ``ceil(log2(block))`` bits,
then their fp32 values (:class:`DeMoCodec`), so the bytes counted are the bytes sent. As in the
reference, a coefficient of the mean is the mean over the workers that sent it (0 if none did).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.comm.base import Comm, Role
from lowcomm.optim.dct import BlockDCT
from lowcomm.optim.sparse import block_positions, decode_group, fresh, index_bits, pack_bits
from lowcomm.strategies.base import Closure, StepStats, Strategy, StrategyContext
from lowcomm.strategies.declaration import CostModel, MembershipRule, Transfer
from lowcomm.strategies.flat import FlatBuffers
from lowcomm.strategies.gradient_step import accumulate, average_and_clip


@dataclass(kw_only=True)
class DeMoOptions:
    """Options of DeMo (--demo.*); defaults as in the reference code (bloc97/DeMo)."""

    momentum_decay: float = 0.999
    """beta: m <- beta m + g (the reference's compression_decay = 0.999)."""

    chunk: int = 64
    """s: target DCT block side (the reference's compression_chunk = 64): along each
    dimension the largest divisor of it that is at most s, so matrices get blocks of up to
    s x s entries and vectors blocks of up to s."""

    topk: int = 32
    """k: DCT coefficients kept per block (the reference's compression_topk = 32; a block of
    fewer entries keeps all of them). k = chunk^2 keeps everything."""

    sign: bool = True
    """Step along sign(Q) (the paper's signum variant, the reference's only form); false
    steps along Q itself (theta <- theta - lr (Q + lambda theta))."""

    weight_decay: float = 0.0
    """lambda: DeMo's own decoupled weight decay, theta <- theta (1 - lr lambda) before the
    step. 0 as in the reference code (weight_decay = 0.0) and the paper's configurations;
    DeMo does not read --optim.weight-decay (0.1, the AdamW's)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum_decay < 1.0:
            raise ValueError(
                f"--demo.momentum-decay: {self.momentum_decay} must lie in [0, 1); try 0.999"
            )
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(
                f"--demo.weight-decay: {self.weight_decay} must be a finite number >= 0; try 0 "
                f"(the reference's)"
            )
        if self.chunk < 1:
            raise ValueError(f"--demo.chunk: {self.chunk} must be >= 1; try 64")
        if not 1 <= self.topk <= self.chunk * self.chunk:
            raise ValueError(
                f"--demo.topk: {self.topk} must lie in [1, --demo.chunk^2 = "
                f"{self.chunk * self.chunk}]; try 32 (chunk 64), or chunk^2 to keep everything"
            )

    def bytes_per_parameter(self) -> float:
        """Bytes one worker sends per parameter per step, for matrices whose sides are
        multiples of the chunk (full chunk x chunk blocks): k positions of
        ceil(log2(chunk^2)) bits and k fp32 values per block. Vectors and smaller blocks send
        more per parameter (the payload itself is counted exactly when training)."""
        block = self.chunk * self.chunk
        return self.topk * (index_bits(block) + 32) / 8 / block


class DeMoCodec:
    """The wire format of a DeMo exchange for a list of tensor shapes (module docstring).

    Args:
        shapes: the parameter tensors' shapes, in flat-buffer order.
        chunk: the target DCT block side.
        k: coefficients kept per block (at most the block's entries).
    """

    def __init__(self, shapes: list[tuple[int, ...]], chunk: int, k: int) -> None:
        self.transforms = [BlockDCT(shape, chunk) for shape in shapes]
        self.kept = [min(k, t.block) for t in self.transforms]
        self.sizes = [math.prod(shape) for shape in shapes]
        self.parts: list[tuple[int, int]] = []  # (index bytes, value bytes) per tensor
        for transform, kept in zip(self.transforms, self.kept, strict=True):
            count = transform.blocks * kept
            self.parts.append(((count * index_bits(transform.block) + 7) // 8, 4 * count))

    @property
    def payload_bytes(self) -> int:
        """Bytes of one worker's encoded payload."""
        return sum(i + v for i, v in self.parts)

    def _tensors(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], 0
        for transform, size in zip(self.transforms, self.sizes, strict=True):
            out.append(flat[offset : offset + size].view(transform.shape))
            offset += size
        return out

    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``uint8`` payload of the top-k DCT coefficients of every tensor in ``flat``
        (fp32, flat-buffer order, padding ignored), and the dense tensor it stands for (the
        kept coefficients taken back to parameter space; zero in the padding)."""
        pieces: list[torch.Tensor] = []
        sent = torch.empty_like(flat)
        offset = 0
        for transform, kept, x in zip(self.transforms, self.kept, self._tensors(flat), strict=True):
            rows = transform.forward(x)
            # torch.topk, not sparse.chunked_topk's stable sort (5x slower): only the
            # receivers must agree, and they read the positions from the payload.
            positions = torch.topk(rows.abs(), kept, dim=1, sorted=False).indices
            values = torch.gather(rows, 1, positions)
            pieces.append(pack_bits(positions.reshape(-1), index_bits(transform.block)))
            pieces.append(values.contiguous().reshape(-1).view(torch.uint8))
            kept_rows = rows.zero_().scatter_(1, positions, values)
            sent[offset : offset + x.numel()] = transform.inverse(kept_rows).reshape(-1)
            offset += x.numel()
        sent[offset:].zero_()
        return torch.cat(pieces), sent

    def mean(self, payloads: torch.Tensor, out: torch.Tensor) -> None:
        """Decode the ``(workers, payload_bytes)`` gathered payloads into ``out`` (fp32, flat):
        per coefficient the mean over the workers that sent it (0 if none did), summed in
        worker order so every worker gets the same bits; then the inverse DCT.

        The payloads are decoded a group of workers at a time, every tensor of a group at
        once (:meth:`_decode`), and each worker's coefficients are added with one
        ``scatter_add_``: a worker sends a coefficient at most once, so within an add no two
        values meet, and across adds they meet in worker order. At 256 workers in one
        process, decoding payload by payload and tensor by tensor took minutes per step."""
        total = sum(t.blocks * t.block for t in self.transforms)
        sums = torch.zeros(total, dtype=torch.float32, device=out.device)
        counts = torch.zeros(total, dtype=torch.int64, device=out.device)
        for rows in torch.split(payloads, decode_group(self.payload_bytes)):
            positions, values = self._decode(rows)
            for worker in range(rows.shape[0]):
                sums.scatter_add_(0, positions[worker], values[worker])
            flat = positions.reshape(-1)  # (not bincount: on a GPU it reads its length back)
            counts.scatter_add_(0, flat, torch.ones_like(flat))
        sums.div_(counts.clamp_(min=1))  # a coefficient nobody sent stays 0
        cut, offset = 0, 0
        for transform in self.transforms:
            size = transform.blocks * transform.block
            coefficients = sums[cut : cut + size].view(transform.blocks, transform.block)
            out[offset : offset + size] = transform.inverse(coefficients).reshape(-1)
            cut += size
            offset += size
        out[offset:].zero_()

    def _decode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(workers, payload_bytes)`` ``rows`` as (positions, values), each
        ``(workers, sent)``: a position indexes every tensor's DCT blocks laid end to end."""
        positions, values = [], []
        cut, base = 0, 0
        for transform, kept, (index_bytes, value_bytes) in zip(
            self.transforms, self.kept, self.parts, strict=True
        ):
            n = transform.blocks
            packed = rows[:, cut : cut + index_bytes]
            positions.append(block_positions(packed, n, kept, transform.block) + base)
            raw = rows[:, cut + index_bytes : cut + index_bytes + value_bytes]
            values.append(fresh(raw).view(torch.float32))
            cut += index_bytes + value_bytes
            base += n * transform.block
        return torch.cat(positions, dim=1), torch.cat(values, dim=1)


class DeMo(Strategy):
    """DeMo: local momentum; the top-k DCT components of it are all-gathered every step and
    every worker takes a sign step on their mean.

    Paper: Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization" (arXiv
    2411.19870; docs/ALGORITHMS.md "DeMo"). Symbols: beta -> options.momentum_decay, s ->
    options.chunk, k -> options.topk, sign -> options.sign, eta -> --optim.lr (with its
    schedule), lambda -> options.weight_decay (--demo.weight-decay, 0 as in the reference;
    not --optim.weight-decay), m -> momentum.
    Reduces to: data-parallel SGD without momentum on the mean gradient, for any beta, when
    every coefficient is kept and sign is off (the momentum is then sent whole and emptied
    every step; tests/test_demo.py checks it).
    """

    name: ClassVar[str] = "demo"
    options_field: ClassVar[str | None] = "demo"
    muon_refusal: ClassVar[str | None] = (
        "DeMo's optimizer is its own (decoupled momentum, sign update), not an AdamW"
    )
    sharding_refusal: ClassVar[str | None] = (
        "DeMo's DCT blocks tile each whole parameter tensor, and a rank holds only some rows of it"
    )
    cost: ClassVar[CostModel] = CostModel(
        description="top-k DCT momentum components all-gathered every step, sign step",
        traffic=lambda o, t: [Transfer(1.0, 1.0, bytes_per_parameter=o.bytes_per_parameter())],
        schedule=lambda o: f"every step, k = {o.topk} of {o.chunk}x{o.chunk} per DCT block",
        extra_copies=1,  # the momentum m
    )
    membership: ClassVar[MembershipRule | None] = MembershipRule(
        round="step",
        global_state="the parameters and the step counter",
        worker_state="join: the momentum m starts at zero; rejoin: m kept",
    )

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        context: StrategyContext,
        options: DeMoOptions | None = None,
    ) -> None:
        super().__init__(model, comm, context)
        self.options = options or DeMoOptions()
        self.flat = FlatBuffers(model)
        # In fp32 the parameters are their own master copy (updated in place, no copy).
        self.master = (
            self.flat.params if self.flat.dtype == torch.float32 else self.flat.params.float()
        )
        self.momentum = torch.zeros_like(self.master)
        self.update = torch.zeros_like(self.master)  # scratch: the decoded mean Q
        self.codec = DeMoCodec(
            [tuple(p.shape) for p in self.flat.parameters], self.options.chunk, self.options.topk
        )
        self.last_payload_bytes = 0

    def exchange(self) -> None:
        """Encode the momentum's fast components, take them out of the momentum, all-gather
        every worker's payload and decode their mean into ``self.update``. Blocking."""
        payload, sent = self.codec.encode(self.momentum)
        self.momentum.sub_(sent)
        world = self.comm.world_size
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
        self.comm.all_gather(gathered, payload, role=Role.PSEUDO_GRADIENT).wait()
        # (The workers that sent a payload: with live membership a round retried on a new
        # quorum gathers from that quorum's workers.)
        world = gathered.numel() // payload.numel()

        def mean() -> torch.Tensor:
            self.codec.mean(gathered.view(world, -1), self.update)
            return self.update

        # (Workers of one process that gathered the same bytes decode them once.)
        self.runtime.once_per_gather(gathered, "demo-mean", mean, out=self.update)
        self.last_payload_bytes = payload.numel()

    def step(self, closure: Closure) -> StepStats:
        count = self.context.microbatches_per_step
        loss, samples, tokens = accumulate(self.flat, closure, count, self.runtime.replica_group)
        lr = self.lr_at(self.step_index)
        with torch.no_grad():
            grad = average_and_clip(
                self.flat.grads, count=count, max_grad_norm=self.context.max_grad_norm
            )
            self.momentum.mul_(self.options.momentum_decay).add_(grad)
            self.exchange()
            if self.options.sign:
                self.update.sign_()
            weight_decay = self.options.weight_decay
            if weight_decay:
                self.master.mul_(1.0 - lr * weight_decay)
            self.master.add_(self.update, alpha=-lr)
            if self.master is not self.flat.params:
                self.flat.params.copy_(self.master)
        self.step_index += 1
        return StepStats(
            loss=loss,
            microbatches=count,
            samples=samples,
            tokens=tokens,
            lr=lr,
            extras={"payload_bytes": float(self.last_payload_bytes)},
        )

    def global_state(self) -> tuple[list[tuple[Role, torch.Tensor]], dict[str, int]]:
        return [(Role.PARAMETER, self.master)], {"step_index": self.step_index}

    def set_global_counters(self, counters: dict[str, int]) -> None:
        self.step_index = counters["step_index"]

    def start_worker_state(self, *, kept: bool) -> None:
        with torch.no_grad():
            if not kept:
                self.momentum.zero_()
            if self.master is not self.flat.params:
                self.flat.params.copy_(self.master)

    def state_bytes(self) -> int:
        extra_master = 0 if self.master is self.flat.params else self.master.numel() * 4
        return self.flat.bytes + extra_master + self.momentum.numel() * 4

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "master": self.master.clone(),
            "momentum": self.momentum.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.master.copy_(state["master"])
            self.momentum.copy_(state["momentum"])
            if self.master is not self.flat.params:
                self.flat.params.copy_(self.master)


METHODS: tuple[type[Strategy], ...] = (DeMo,)
