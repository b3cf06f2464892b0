"""Outer-gradient quantization: round-trip error within each format's bound, byte counts."""

from __future__ import annotations

import pytest
import torch

from lowcomm.comm import RecordingComm
from lowcomm.optim.quantize import decode, encode, encoded_bytes, error_bound
from lowcomm.strategies.diloco import OuterExchange


@pytest.mark.parametrize("fmt", ["none", "bf16", "fp8", "int4"])
@pytest.mark.parametrize("numel", [1, 255, 1001])
def test_round_trip_error_within_the_bound(fmt: str, numel: int) -> None:
    generator = torch.Generator().manual_seed(numel)
    # Rows with very different magnitudes exercise the per-row scales.
    values = torch.randn(numel, generator=generator) * torch.logspace(-6, 1, numel)
    payload = encode(values, fmt, 64)  # type: ignore[arg-type]
    assert payload.dtype == torch.uint8
    assert payload.numel() == encoded_bytes(numel, fmt, 64)  # type: ignore[arg-type]
    restored = decode(payload, numel, fmt, 64)  # type: ignore[arg-type]
    error = (restored - values).abs()
    bound = error_bound(values, fmt, 64)  # type: ignore[arg-type]
    assert bool((error <= bound * (1 + 1e-5) + 1e-30).all()), float((error - bound).max())
    if fmt != "none" and numel > 1:  # a single value is its own row maximum: exact
        assert float(error.max()) > 0  # it really quantized


def test_byte_counts_are_the_quantized_sizes() -> None:
    numel = 1000
    assert encoded_bytes(numel, "none") == 4000
    assert encoded_bytes(numel, "bf16") == 2000
    assert encoded_bytes(numel, "fp8", 100) == 1000 + 4 * 10
    assert encoded_bytes(numel, "int4", 100) == 500 + 4 * 10
    assert encoded_bytes(numel, "int4", 256) == 4 * 256 // 2 + 4 * 4  # padded last row


def test_int4_bound_is_half_a_step() -> None:
    values = torch.tensor([7.0, -7.0, 3.4, 0.2])
    restored = decode(encode(values, "int4", 4), 4, "int4", 4)
    assert torch.equal(restored, torch.tensor([7.0, -7.0, 3.0, 0.0]))


def test_exchange_averages_dequantized_payloads_and_counts_quantized_bytes() -> None:
    from lowcomm.comm.base import CollectiveKind
    from lowcomm.strategies.two_step import shard_payload_bytes

    delta = torch.randn(300)
    # Values on a group of one (the recording fake tiles this rank's shard into every slot
    # of an all-gather, so it cannot play the other owners of a sharded exchange): the mean
    # is the dequantized own value, requantized once (within a float32 rounding of it).
    single = OuterExchange(RecordingComm(world_size=1), delta, torch.tensor([2.0, 3.0]), "fp8", 128)
    mean, extras, own = single.wait()
    assert torch.allclose(mean, own, rtol=1e-6, atol=0.0)
    assert torch.allclose(mean, delta, atol=float(error_bound(delta, "fp8", 128).max()))
    assert torch.equal(extras, torch.tensor([2.0, 3.0]))
    # Bytes on four workers: a reduce-scatter of the four encoded shards (each with the
    # extras' 8 bytes), then an all-gather of the four encoded mean shards.
    comm = RecordingComm(world_size=4)
    exchange = OuterExchange(comm, delta, torch.tensor([2.0, 3.0]), "fp8", 128)
    exchange.wait()
    shard = shard_payload_bytes(300, 4, "fp8", 128)
    assert shard == encoded_bytes(128, "fp8", 128)  # one row of 128 per shard
    assert [(c.kind, c.payload_bytes) for c in comm.calls] == [
        (CollectiveKind.REDUCE_SCATTER, 4 * (shard + 8)),
        (CollectiveKind.ALL_GATHER, 4 * shard),
    ]
    assert exchange.wire_bytes == 4 * (shard + 8)
