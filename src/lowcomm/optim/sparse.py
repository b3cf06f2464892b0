"""Chunked top-k sparsification, the statistical 2-bit quantizer and bit packing (SparseLoCo).

The wire format of a SparseLoCo outer exchange (docs/ALGORITHMS.md, "SparseLoCo"). A flat fp32
tensor of ``numel`` entries is cut into ``ceil(numel / chunk)`` contiguous chunks of ``chunk``
entries (the last one zero-padded); in each chunk the ``k`` entries of largest magnitude are
kept. Each kept entry travels as its position in the chunk, ``ceil(log2(chunk))`` bits, and its
value: either fp32 (``bits=None``) or a ``bits``-bit code of the statistical quantizer of
Templar's ``TopKCompressor`` (``src/tplr/compress.py``, github.com/tplr-ai/templar), here per
chunk:

    mu = mean(v),  c = v - mu,  sigma = ||c|| / sqrt(k - 1),  s = range * sigma / B  (B = 2**bits)
    q = clamp(round(c / s + B / 2), 0, B - 1)
    level_j = mean(v_i : q_i = j)   (0 for an empty bin)          decoded v_i = level_{q_i}

so a chunk also carries its B levels in fp32 (Templar sends the shift and the B bin means of
the centred values, the same information). Codes and indices are bit-packed, so the payload's
size is its real size on the wire::

    bytes = ceil(n k idx_bits / 8) + ceil(n k bits / 8) + 4 n B      (quantized)
    bytes = ceil(n k idx_bits / 8) + 4 n k                            (bits=None)

with n chunks. :func:`encode` and :func:`decode` are exact inverses on the kept entries:
``decode(encode(x))`` is the dense tensor the receiver adds, and the sender's error feedback
subtracts that same tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def index_bits(chunk: int) -> int:
    """Bits of a position inside a chunk of ``chunk`` entries: ceil(log2(chunk))."""
    return max(0, math.ceil(math.log2(chunk)))


#: The widest value :func:`pack_bits` packs and :func:`unpack_bits` reads (a value, and the up
#: to 7 bits before it in its first byte, fit an int64 word).
MAX_WIDTH = 56


def _check_width(width: int) -> None:
    if not 0 <= width <= MAX_WIDTH:
        raise ValueError(f"bit width {width} is outside [0, {MAX_WIDTH}]")


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """The non-negative integers ``values`` (each < 2**width), ``width`` bits each, least
    significant bit first, as ``ceil(len * width / 8)`` bytes (``uint8``)."""
    _check_width(width)
    n = values.numel()
    size = (n * width + 7) // 8
    if size == 0:
        return torch.zeros(0, dtype=torch.uint8, device=values.device)
    shifts = torch.arange(width, device=values.device, dtype=torch.int64)
    bits = (values.reshape(-1, 1).to(torch.int64) >> shifts) & 1
    stream = torch.zeros(size * 8, dtype=torch.int32, device=values.device)
    stream[: n * width] = bits.reshape(-1)
    # Made on the device (a tensor of host values would be a blocking pageable copy per call).
    weights = torch.ones(8, dtype=torch.int32, device=values.device) << torch.arange(
        8, dtype=torch.int32, device=values.device
    )
    return (stream.view(size, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The ``count`` integers :func:`pack_bits` packed at ``width`` bits (``int64``); a
    ``(rows, bytes)`` ``packed`` gives ``(rows, count)``, one packed stream per row.

    The stream is one little-endian integer, value ``i`` its bits ``i w`` to ``i w + w - 1``:
    each value is read from the few bytes it touches (``ceil((w + 7) / 8)``), shifted and
    masked, not through a tensor of every bit (about 6x faster at 12 bits, where DeMo at 256
    workers decodes 256 payloads per worker and step)."""
    _check_width(width)
    lead = packed.shape[:-1]
    if count == 0 or width == 0:
        return torch.zeros(*lead, count, dtype=torch.int64, device=packed.device)
    span = (width + 7 + 7) // 8  # bytes a value can touch (it starts at any of 8 bits)
    # 4 bytes hold a value of up to 25 bits and its shift (0-7): int32 words, half the scratch.
    kind = torch.int32 if span <= 4 else torch.int64
    offsets = torch.arange(count, dtype=torch.int64, device=packed.device) * width
    first, shift = offsets // 8, (offsets % 8).to(kind)
    padded = torch.nn.functional.pad(packed, (0, span))  # (the last value's bytes may run over)
    word = padded[..., first].to(kind)
    for byte in range(1, span):
        word.bitwise_or_(padded[..., first + byte].to(kind).bitwise_left_shift_(8 * byte))
    return word.bitwise_right_shift_(shift).bitwise_and_((1 << width) - 1).to(torch.int64)


def block_positions(packed: torch.Tensor, blocks: int, kept: int, block: int) -> torch.Tensor:
    """The positions of ``kept`` entries in each of ``blocks`` blocks of ``block`` entries,
    packed (block by block, :func:`index_bits` of ``block`` bits each) in every row of the
    ``(rows, bytes)`` ``packed``, as indices into the blocks laid end to end:
    ``(rows, blocks * kept)``, ``int64``."""
    local = unpack_bits(packed, blocks * kept, index_bits(block))
    starts = torch.arange(blocks, dtype=torch.int64, device=packed.device)
    return local + starts.repeat_interleave(kept) * block


def chunked_topk(x: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk of ``chunk`` entries of the flat ``x`` (the last zero-padded), the positions
    (``int64``, shape ``(n, k)``, in the chunk) and values of its ``k`` largest-magnitude
    entries. Ties go to the lower position, so every worker picks the same entries."""
    n = -(-x.numel() // chunk)
    padded = torch.zeros(n * chunk, dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x.reshape(-1)
    rows = padded.view(n, chunk)
    # A stable descending sort of |x| breaks ties by position (torch.topk does not promise to).
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    return order, torch.gather(rows, 1, order)


def quantize(values: torch.Tensor, bits: int, sigmas: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (``int64``, values' shape ``(n, k)``) and per-row levels (``(n, 2**bits)`` fp32)
    of the statistical quantizer (module docstring), one row per chunk."""
    bins = 1 << bits
    v = values.float()
    k = v.shape[1]
    shift = v.mean(dim=1, keepdim=True)
    centred = v - shift
    sigma = centred.norm(dim=1, keepdim=True) / math.sqrt(max(k - 1, 1))
    scale = sigmas * sigma / bins
    scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    codes = (centred / scale + bins // 2).round().clamp(0, bins - 1).to(torch.int64)
    sums = torch.zeros(v.shape[0], bins, dtype=torch.float32, device=v.device)
    counts = torch.zeros_like(sums)
    sums.scatter_add_(1, codes, centred)
    counts.scatter_add_(1, codes, torch.ones_like(centred))
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    levels = torch.where(counts > 0, means + shift, torch.zeros_like(sums))
    return codes, levels


@dataclass(frozen=True)
class SparseCodec:
    """The wire format of one flat tensor of ``numel`` entries (module docstring).

    Attributes:
        numel: entries of the dense tensor.
        chunk: entries per chunk.
        k: entries kept per chunk (<= chunk).
        bits: bits per kept value (None: fp32 values, no quantization).
        sigmas: the quantizer's range, in standard deviations of a chunk's kept values.
    """

    numel: int
    chunk: int
    k: int
    bits: int | None
    sigmas: float = 6.0

    @property
    def chunks(self) -> int:
        return -(-self.numel // self.chunk)

    @property
    def kept(self) -> int:
        return self.chunks * self.k

    @property
    def index_bytes(self) -> int:
        return (self.kept * index_bits(self.chunk) + 7) // 8

    @property
    def value_bytes(self) -> int:
        if self.bits is None:
            return 4 * self.kept
        return (self.kept * self.bits + 7) // 8 + 4 * self.chunks * (1 << self.bits)

    @property
    def payload_bytes(self) -> int:
        """Bytes of one encoded tensor: what a worker hands to the all-gather."""
        return self.index_bytes + self.value_bytes

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The ``uint8`` payload of the top-k entries of ``x``: packed positions, then the
        packed codes and the fp32 levels (or the fp32 values)."""
        positions, values = chunked_topk(x.detach().float().reshape(-1), self.chunk, self.k)
        parts = [pack_bits(positions.reshape(-1), index_bits(self.chunk))]
        if self.bits is None:
            parts.append(values.contiguous().reshape(-1).view(torch.uint8))
        else:
            codes, levels = quantize(values, self.bits, self.sigmas)
            parts.append(pack_bits(codes.reshape(-1), self.bits))
            parts.append(levels.contiguous().reshape(-1).view(torch.uint8))
        return torch.cat(parts)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The dense fp32 tensor (``numel`` entries) a payload of :meth:`encode` stands for:
        the decoded kept entries at their positions, zero elsewhere."""
        positions, values = self._entries(payload.view(1, -1))
        dense = torch.zeros(self.chunks * self.chunk, dtype=torch.float32, device=payload.device)
        dense.scatter_(0, positions[0], values[0])
        return dense[: self.numel]

    def decode_sum(self, payloads: torch.Tensor) -> torch.Tensor:
        """The sum of what the rows of ``(workers, payload_bytes)`` ``payloads`` stand for,
        added in row order: the bits of adding their :meth:`decode` one after another. A
        group of rows is decoded at once (at most :data:`DECODE_BYTES` of scratch), and each
        row is added with one ``scatter_add_`` (a row holds a position at most once)."""
        total = torch.zeros(self.chunks * self.chunk, dtype=torch.float32, device=payloads.device)
        for rows in torch.split(payloads, decode_group(self.payload_bytes)):
            positions, values = self._entries(rows)
            for row in range(rows.shape[0]):
                total.scatter_add_(0, positions[row], values[row])
        return total[: self.numel]

    def _entries(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept entries of each of the ``(workers, payload_bytes)`` ``rows``: positions
        in the chunk-padded flat tensor and their decoded values, each ``(workers, kept)``."""
        n, kept = self.chunks, self.kept
        cut = self.index_bytes
        positions = block_positions(rows[:, :cut], n, self.k, self.chunk)
        rest = rows[:, cut:]
        if self.bits is None:
            values = fresh(rest[:, : 4 * kept]).view(torch.float32)
        else:
            code_bytes = (kept * self.bits + 7) // 8
            codes = unpack_bits(rest[:, :code_bytes], kept, self.bits).view(-1, n, self.k)
            levels = fresh(rest[:, code_bytes:]).view(torch.float32).view(-1, n, 1 << self.bits)
            values = torch.gather(levels, 2, codes).view(-1, kept)
        return positions, values


#: Bytes of the bit-level scratch that decoding a group of payloads may take at once (about 32
#: bytes per payload byte): the bound on the memory of :meth:`SparseCodec.decode_sum` and
#: DeMo's decode, whatever the number of workers.
DECODE_BYTES = 16 * 2**20


def decode_group(payload_bytes: int) -> int:
    """Payloads of ``payload_bytes`` decoded at once within :data:`DECODE_BYTES`."""
    return max(1, DECODE_BYTES // max(1, 32 * payload_bytes))


def fresh(raw: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the ``uint8`` ``raw`` in storage of its own (so its start is aligned
    and it can be viewed as fp32)."""
    return raw.clone(memory_format=torch.contiguous_format)
