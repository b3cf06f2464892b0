"""The two-step quantized mean of an outer gradient: a reduce-scatter of quantized shards, a
dequantize-sum-requantize on each shard's owner, an all-gather.

A sum of quantized payloads cannot be taken on the wire, so the first step is an all-to-all
(``Comm.all_to_all``, moved, counted and priced as the reduce-scatter it is): worker ``i``
encodes each of its M shards of ``Delta`` and sends shard ``j`` to worker ``j``. The owner of
shard ``j`` decodes the M encodings it received, takes their float32 mean (summed in worker
order, as the all-gather exchange did) and encodes that mean again; the second step
all-gathers the M encoded mean shards, which every worker decodes. Each worker sends
``(M-1)/M`` of its encoded ``Delta`` in each step, ``2 (M-1)/M`` in all, against ``M-1``
times for an all-gather of whole payloads.

Shards are whole rows of the quantizer (``row_size`` elements; one element for bf16), so the
first step encodes each row exactly as encoding the whole ``Delta`` would: the owner sums the
same decoded values the all-gather exchange summed. The result differs from that exchange's
exact mean by one more rounding, the requantization of the mean: within the quantizer's
error bound of the mean (:func:`lowcomm.optim.quantize.error_bound`).

A few float32 side values (``extras``) ride along every chunk of the first step as raw bytes,
so every worker has all workers' extras after it and takes their mean itself.
"""

from __future__ import annotations

import torch

from lowcomm.comm.base import Comm, Handle, Role
from lowcomm.optim.quantize import QuantizationFormat, decode, encode, encoded_bytes


def shard_numel(numel: int, shards: int, fmt: QuantizationFormat, row_size: int) -> int:
    """Elements of each of ``shards`` shards of a ``numel``-element tensor (whole quantizer
    rows, the last shard padded with zeros; at least one row)."""
    unit = 1 if fmt in ("none", "bf16") else row_size
    return max(1, -(-numel // (shards * unit))) * unit


def shard_payload_bytes(numel: int, shards: int, fmt: QuantizationFormat, row_size: int) -> int:
    """Bytes of one encoded shard (each worker's chunk in either step)."""
    return encoded_bytes(shard_numel(numel, shards, fmt, row_size), fmt, row_size)


class TwoStepQuantized:
    """One worker's side of the two-step quantized mean of ``delta`` (see the module
    docstring). The first step is issued here; :meth:`launch_second` issues the second once
    the first's data is in (every worker at the same point of its collective order);
    :meth:`result` decodes the mean once the second's data is in.

    Args:
        comm: the group (every worker calls with the same shapes).
        delta: this worker's outer gradient (any shape; float32 values).
        extras: float32 side values, on ``delta``'s device.
        fmt: the quantizer (not ``none``).
        row_size: its row size.
    """

    def __init__(
        self,
        comm: Comm,
        delta: torch.Tensor,
        extras: torch.Tensor,
        fmt: QuantizationFormat,
        row_size: int,
    ) -> None:
        self.comm = comm
        self.fmt = fmt
        self.row_size = row_size
        self.numel = delta.numel()
        self.extras_numel = extras.numel()
        workers = comm.world_size
        self.shard = shard_numel(self.numel, workers, fmt, row_size)
        padded = torch.zeros(workers * self.shard, dtype=torch.float32, device=delta.device)
        padded[: self.numel] = delta.detach().reshape(-1)
        shards = padded.view(workers, self.shard)
        payloads = [encode(shards[j], fmt, row_size) for j in range(workers)]
        self.payload_bytes = payloads[0].numel()
        #: What the others decode of this worker's Delta (the eager rule removes it).
        self.own = torch.cat([decode(p, self.shard, fmt, row_size) for p in payloads])[: self.numel]
        side = extras.detach().float().reshape(-1).contiguous().view(torch.uint8)
        send = torch.cat([torch.cat([payload, side]) for payload in payloads])
        self._received = torch.empty_like(send)
        self.first: Handle = comm.all_to_all(self._received, send, role=Role.PSEUDO_GRADIENT)
        self._gathered: torch.Tensor | None = None
        self._extras: torch.Tensor | None = None

    def launch_second(self) -> Handle:
        """The owner's step: decode the M encodings of this worker's shard, take their
        float32 mean, encode it, and all-gather the encoded means. The first step's data must
        be in (its handle waited for or settled)."""
        workers = self.comm.world_size
        chunks = self._received.view(workers, -1)
        mean = torch.zeros(self.shard, dtype=torch.float32, device=chunks.device)
        extras = torch.zeros(self.extras_numel, dtype=torch.float32, device=chunks.device)
        for worker in range(workers):
            mean += decode(
                chunks[worker, : self.payload_bytes], self.shard, self.fmt, self.row_size
            )
            if self.extras_numel:
                extras += chunks[worker, self.payload_bytes :].clone().view(torch.float32)
        mean /= workers
        self._extras = extras / workers
        encoded = encode(mean, self.fmt, self.row_size)
        self._gathered = torch.empty(
            workers * encoded.numel(), dtype=torch.uint8, device=encoded.device
        )
        return self.comm.all_gather(self._gathered, encoded, role=Role.PSEUDO_GRADIENT)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean Delta, mean extras), float32; the second step's data must be in."""
        assert self._gathered is not None and self._extras is not None, "launch_second first"
        rows = self._gathered.view(self.comm.world_size, -1)
        mean = torch.cat([decode(row, self.shard, self.fmt, self.row_size) for row in rows])
        return mean[: self.numel], self._extras
