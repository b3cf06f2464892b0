"""SparseLoCo: building blocks (chunked top-k, 2-bit quantizer, bit packing), the update rule,
the reduction to DiLoCo, bytes against a hand count, the planner, multi-process, resume, CLI."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from _cli import lowcomm, small_flags
from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm import CollectiveKind, LocalComm, RecordingComm, Role
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.optim.sparse import (
    MAX_WIDTH,
    SparseCodec,
    chunked_topk,
    index_bits,
    pack_bits,
    quantize,
    unpack_bits,
)
from lowcomm.plan import PlanConfig, make_plan
from lowcomm.strategies import StrategyContext
from lowcomm.strategies.diloco import DiLoCo, DiLoCoOptions
from lowcomm.strategies.sparseloco import SparseLoCo, SparseLoCoOptions

CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=3e-3, weight_decay=0.1),
    schedule=ScheduleConfig(kind="constant", warmup_steps=0),
    total_steps=40,
    max_grad_norm=None,
)

# A small chunk, so the tiny GPT has many chunks and the top-k really drops entries.
SMALL_CHUNK = {"chunk": 64, "topk": 4}


# --- building blocks -------------------------------------------------------------------------


def test_pack_bits_matches_a_hand_packed_stream() -> None:
    # 12-bit values 0xABC and 0x123, least significant bit first: bytes BC, 3A, 12.
    packed = pack_bits(torch.tensor([0xABC, 0x123]), 12)
    assert packed.tolist() == [0xBC, 0x3A, 0x12]
    # 2-bit codes 1, 2, 3, 0, 1: byte 0 = 0b00111001, byte 1 = 0b01.
    assert pack_bits(torch.tensor([1, 2, 3, 0, 1]), 2).tolist() == [0b00111001, 0b01]
    values = torch.randint(0, 1 << 12, (1001,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_bits(pack_bits(values, 12), 1001, 12), values)
    assert index_bits(4096) == 12 and index_bits(64) == 6 and index_bits(100) == 7


@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 9, 12, 17, 24, 25, 26, 31, 32, 48, 56])
def test_unpack_bits_reads_back_every_width_one_stream_per_row(width: int) -> None:
    """unpack_bits reads back what pack_bits packed at every width up to MAX_WIDTH, for one
    stream and for a (rows, bytes) batch, with values that use every bit (the extremes 0
    and 2^width - 1 included); a wider width is refused by both."""
    generator = torch.Generator().manual_seed(width)
    rows = [torch.randint(0, 1 << width, (37,), generator=generator) for _ in range(3)]
    rows[0][:2] = torch.tensor([0, (1 << width) - 1])
    rows[2][:] = (1 << width) - 1  # (every shift 0-7 with every bit set: a word's top bit too)
    packed = torch.stack([pack_bits(row, width) for row in rows])
    assert torch.equal(unpack_bits(packed, 37, width), torch.stack(rows))
    assert torch.equal(unpack_bits(packed[1], 37, width), rows[1])
    assert unpack_bits(packed, 0, width).shape == (3, 0)
    with pytest.raises(ValueError, match=f"bit width {MAX_WIDTH + 1} is outside"):
        pack_bits(rows[0], MAX_WIDTH + 1)
    with pytest.raises(ValueError, match=f"bit width {MAX_WIDTH + 1} is outside"):
        unpack_bits(packed, 37, MAX_WIDTH + 1)


def test_chunked_topk_keeps_the_largest_magnitudes_of_each_chunk() -> None:
    torch.manual_seed(0)
    x = torch.randn(10)
    positions, values = chunked_topk(x, chunk=4, k=2)
    # Written out: chunks [0:4], [4:8], [8:10] + two zeros of padding.
    padded = torch.cat([x, torch.zeros(2)])
    for c in range(3):
        part = padded[4 * c : 4 * c + 4]
        expected = sorted(range(4), key=lambda i: -abs(float(part[i])))[:2]
        assert positions[c].tolist() == expected
        assert torch.equal(values[c], part[expected])


def test_quantizer_follows_the_statistical_two_bit_rule() -> None:
    torch.manual_seed(1)
    v = torch.randn(3, 64)
    codes, levels = quantize(v, bits=2, sigmas=6.0)
    for row in range(3):
        # Straight from the rule: centre by the mean, bins of 6 sigma / 4, offset 2.
        mu = v[row].mean()
        c = v[row] - mu
        sigma = c.norm() / math.sqrt(63)
        q = torch.clamp(torch.round(c / (6 * sigma / 4) + 2), 0, 3).long()
        assert torch.equal(codes[row], q)
        for j in range(4):
            members = v[row][q == j]
            if members.numel():
                assert levels[row, j] == pytest.approx(float(members.mean()), abs=1e-6)
            else:
                assert levels[row, j] == 0
    assert set(codes.unique().tolist()) <= {0, 1, 2, 3}


def test_codec_round_trip_and_its_bytes_by_hand() -> None:
    torch.manual_seed(2)
    x = torch.randn(10_000)
    codec = SparseCodec(numel=10_000, chunk=4096, k=64, bits=2)
    payload = codec.encode(x)
    # 3 chunks x 64 kept: 192 positions of 12 bits, 192 codes of 2 bits, 3 x 4 fp32 levels.
    assert payload.dtype == torch.uint8
    assert payload.numel() == 192 * 12 // 8 + 192 * 2 // 8 + 3 * 4 * 4 == codec.payload_bytes
    dense = codec.decode(payload)
    positions, values = chunked_topk(x, 4096, 64)
    codes, levels = quantize(values, 2, 6.0)
    expected = torch.zeros(3 * 4096)
    for c in range(3):
        expected[4096 * c + positions[c]] = levels[c][codes[c]]
    assert torch.equal(dense, expected[:10_000])
    # No quantization and every entry kept: the tensor itself, fp32 values on the wire.
    full = SparseCodec(numel=10_000, chunk=4096, k=4096, bits=None)
    assert torch.equal(full.decode(full.encode(x)), x)
    assert full.payload_bytes == 3 * 4096 * 12 // 8 + 4 * 3 * 4096


@pytest.mark.parametrize("bits", [2, None])
@pytest.mark.parametrize("group_bytes", [1, 10**9])
def test_decode_sum_adds_each_payload_in_worker_order(
    bits: int | None, group_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sum of 13 workers' payloads is, to the bit, their decode() added one after
    another in worker order, whether they are decoded one at a time or all at once."""
    import lowcomm.optim.sparse as sparse

    monkeypatch.setattr(sparse, "DECODE_BYTES", group_bytes)
    codec = SparseCodec(numel=1000, chunk=64, k=5, bits=bits)
    generator = torch.Generator().manual_seed(3)
    rows = torch.stack([codec.encode(torch.randn(1000, generator=generator)) for _ in range(13)])
    expected = torch.zeros(1000)
    for row in rows:
        expected += codec.decode(row)
    assert torch.equal(codec.decode_sum(rows), expected)


# --- the update rule ---------------------------------------------------------------------------


def _run(strategy: Any, steps: int, start: int = 0) -> None:
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(start, start + steps)])
    for _ in range(steps):
        strategy.step(closure)


def test_outer_round_follows_the_equations() -> None:
    # Identical replicas (RecordingComm): mean_r D_r = D. Two rounds, so e carries over.
    options = SparseLoCoOptions(sync_every=3, error_decay=0.9, outer_lr=0.8, **SMALL_CHUNK)
    comm = RecordingComm(world_size=3)
    strategy = SparseLoCo(tiny_gpt(), comm, CONTEXT, options)
    theta = flat_params(strategy.model)
    codec = SparseCodec(numel=theta.numel(), chunk=64, k=4, bits=2)
    # Reference: the inner AdamW steps replayed by a DiLoCo that never syncs.
    replay = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, DiLoCoOptions(sync_every=1000))
    error = torch.zeros_like(theta)
    for round_ in range(2):
        _run(strategy, 3, start=3 * round_)
        with torch.no_grad():
            replay.flat.params.copy_(theta)  # each round starts from the global parameters
        _run(replay, 3, start=3 * round_)
        delta = theta - flat_params(replay.model)
        error = 0.9 * error + delta
        sent = codec.decode(codec.encode(error))
        error = error - sent
        theta = theta - 0.8 * sent
        assert torch.allclose(strategy.globals_[0], theta, atol=1e-6)
        assert torch.allclose(flat_params(strategy.model), theta, atol=1e-6)
        assert torch.allclose(strategy.error, error, atol=1e-6)
    assert [(c.kind, c.role) for c in comm.calls] == [
        (CollectiveKind.ALL_GATHER, Role.PSEUDO_GRADIENT)
    ] * 2
    # The round sent a sparse update: at most 4 of every 64 entries changed theta.
    assert int((sent != 0).sum()) <= 4 * math.ceil(theta.numel() / 64)


def test_all_kept_unquantized_without_decay_equals_diloco_outer_sgd() -> None:
    # k = chunk, no quantization, beta = 0: D = Delta, e = 0, theta <- theta - alpha mean Delta,
    # which is DiLoCo with outer SGD at lr alpha and no momentum.
    sparse = SparseLoCo(
        tiny_gpt(), LocalComm(), CONTEXT,
        SparseLoCoOptions(sync_every=2, chunk=256, topk=256, quantization_bits=None,
                          error_decay=0.0, outer_lr=0.6),
    )  # fmt: skip
    diloco = DiLoCo(
        tiny_gpt(), LocalComm(), CONTEXT,
        DiLoCoOptions(sync_every=2, outer_lr=0.6, outer_momentum=0.0),
    )  # fmt: skip
    _run(sparse, 6)
    _run(diloco, 6)
    assert torch.equal(flat_params(sparse.model), flat_params(diloco.model))
    assert torch.equal(sparse.globals_[0], diloco.globals_[0])
    assert not sparse.error.any()
    # With the defaults the two differ (sparse, quantized, error feedback).
    default = SparseLoCo(tiny_gpt(), LocalComm(), CONTEXT, SparseLoCoOptions(sync_every=2))
    _run(default, 6)
    assert not torch.allclose(flat_params(default.model), flat_params(diloco.model), atol=1e-4)


def test_bytes_counted_are_the_packed_payload_by_hand() -> None:
    comm = RecordingComm(world_size=4)
    strategy = SparseLoCo(tiny_gpt(), comm, CONTEXT, SparseLoCoOptions(sync_every=2))
    _run(strategy, 2)
    (call,) = comm.calls
    numel = strategy.flat.padded_numel
    chunks = math.ceil(numel / 4096)
    kept = 64 * chunks
    # Per worker: positions at 12 bits, values at 2 bits, 4 fp32 levels per chunk.
    per_worker = math.ceil(kept * 12 / 8) + math.ceil(kept * 2 / 8) + 16 * chunks
    assert call.dtype == torch.uint8
    assert call.payload_bytes == 4 * per_worker
    assert per_worker < 4 * numel / 100  # under 1% of the fp32 pseudo-gradient


def test_state_bytes_count_the_anchor_and_the_error_buffer_but_no_momentum() -> None:
    strategy = SparseLoCo(tiny_gpt(), LocalComm(), CONTEXT)
    psi = strategy.flat.padded_numel
    # params 4 + grads 4 + AdamW moments 8 + anchor 4 + error feedback 4 (fp32 bytes/param).
    assert strategy.state_bytes() == 24 * psi
    assert SparseLoCo.cost.extra_copies == 2


def test_state_dict_round_trip_resumes_exactly() -> None:
    options = SparseLoCoOptions(sync_every=2, **SMALL_CHUNK)
    full = SparseLoCo(tiny_gpt(), LocalComm(), CONTEXT, options)
    _run(full, 6)
    first = SparseLoCo(tiny_gpt(), LocalComm(), CONTEXT, options)
    _run(first, 4)
    assert first.error.any()  # the resume must carry a non-zero error buffer
    resumed = SparseLoCo(tiny_gpt(seed=5), LocalComm(), CONTEXT, options)
    resumed.load_state_dict(first.state_dict())
    _run(resumed, 2, start=4)
    assert torch.equal(flat_params(full.model), flat_params(resumed.model))
    assert torch.equal(full.error, resumed.error)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"sync_every": 0}, "--sparseloco.sync-every"),
        ({"chunk": 0}, "--sparseloco.chunk"),
        ({"topk": 65, "chunk": 64}, "--sparseloco.topk"),
        ({"error_decay": 1.5}, "--sparseloco.error-decay"),
        ({"outer_lr": -1.0}, "--sparseloco.outer-lr"),
        ({"quantization_bits": 0}, "--sparseloco.quantization-bits"),
        ({"quantization_range": 0.0}, "--sparseloco.quantization-range"),
    ],
)
def test_bad_options_name_the_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        SparseLoCoOptions(**kwargs)


# --- the planner -------------------------------------------------------------------------------


def test_plan_prices_an_all_gather_of_the_packed_payload_by_hand() -> None:
    # 8 Gbit/s = 1e9 bytes/s, 1 ms latency, 4 workers, 1e9 parameters, H = 10.
    result = make_plan(
        PlanConfig(
            method="sparseloco", params="1e9", workers=4, tokens=10 * 4096.0,
            tokens_per_step=4096.0, seconds_per_step=1.0, network="wan", bandwidth_gbps=8.0,
            latency_ms=1.0, sparseloco=SparseLoCoOptions(sync_every=10),
        )
    )  # fmt: skip
    # Per 4096-entry chunk: 64 x 12 index bits + 64 x 2 value bits + 4 fp32 levels = 128 B.
    encoded = 1e9 / 4096 * 128
    assert result.comm_bytes_per_worker_per_step == pytest.approx(3 * encoded / 10)
    gather = 3 / 4 * (4 * encoded) / 1e9 + 3 * 1e-3  # ring all-gather of the 4 payloads
    assert result.comm_total_s == pytest.approx(gather)  # one round in the 10 steps
    assert result.comm_exposed_s == pytest.approx(gather)
    assert result.memory_per_worker_bytes == pytest.approx((4 + 2 * 2) * 1e9 + 12 * 1e9)


# --- multi-process -----------------------------------------------------------------------------


def _gloo_worker(steps: int) -> dict[str, torch.Tensor]:
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    rank, world = comm.rank, comm.world_size

    def shard(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = global_batch(step, world)
        return x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]

    mine = [shard(s) for s in range(steps)]
    results: dict[str, torch.Tensor] = {}
    runs: list[tuple[str, Any]] = [
        ("sparseloco", SparseLoCo(tiny_gpt(), comm, CONTEXT,
                                  SparseLoCoOptions(sync_every=3, **SMALL_CHUNK))),
        ("full", SparseLoCo(tiny_gpt(), comm, CONTEXT,
                            SparseLoCoOptions(sync_every=3, chunk=128, topk=128,
                                              quantization_bits=None, error_decay=0.0,
                                              outer_lr=0.7))),
        ("diloco", DiLoCo(tiny_gpt(), comm, CONTEXT,
                          DiLoCoOptions(sync_every=3, outer_lr=0.7, outer_momentum=0.0))),
    ]  # fmt: skip
    for key, strategy in runs:
        closure = closure_for(strategy, mine)
        for _ in range(steps):
            strategy.step(closure)
        strategy.finish()
        results[key] = flat_params(strategy.model)
        if isinstance(strategy, SparseLoCo):
            results[f"{key}_error"] = strategy.error.clone()
    return results


def test_two_gloo_ranks_agree_and_reduce_to_diloco() -> None:
    from lowcomm.launch import spawn_workers

    results = spawn_workers(_gloo_worker, 2, (6,))
    # After two rounds every worker holds the same global parameters ...
    assert torch.equal(results[0]["sparseloco"], results[1]["sparseloco"])
    assert not torch.equal(results[0]["sparseloco"], flat_params(tiny_gpt()))
    # ... but its own error buffer (its own data's residual).
    assert not torch.equal(results[0]["sparseloco_error"], results[1]["sparseloco_error"])
    for rank_result in results:
        assert torch.allclose(rank_result["full"], rank_result["diloco"], atol=1e-6)
        assert not rank_result["full_error"].any()


# --- command line ------------------------------------------------------------------------------


#: The short CLI run's options (H = 2 over 4 steps: two rounds), for train and plan alike.
CLI_OPTIONS = ("--sparseloco.sync-every", "2", "--sparseloco.chunk", "256",
               "--sparseloco.topk", "8")  # fmt: skip


@pytest.fixture(scope="module")
def cli_summary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One short `lowcomm train` run of sparseloco, shared by the CLI tests below."""
    out = tmp_path_factory.mktemp("sparseloco_cli") / "run"
    result = lowcomm("train", "--method", "sparseloco", "--steps", "4", *CLI_OPTIONS,
                     "--out", str(out), *small_flags())  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def test_cli_trains_and_counts_the_packed_bytes(cli_summary: dict[str, Any]) -> None:
    summary = cli_summary
    assert summary["method"] == "sparseloco" and summary["steps"] == 4
    assert summary["bytes_by_role"]["gradient"] == 0
    chunks = math.ceil(summary["num_params"] / 256)
    payload = math.ceil(8 * chunks * 8 / 8) + math.ceil(8 * chunks * 2 / 8) + 16 * chunks
    # Two rounds; each worker sends its payload to the other one.
    assert summary["bytes_by_role"]["pseudo_gradient"] == pytest.approx(2 * payload, rel=0.02)


def test_plan_predicts_the_bytes_a_cli_run_sends(cli_summary: dict[str, Any]) -> None:
    # `lowcomm plan` for the same model size, workers, steps and options as the run above.
    n = cli_summary["num_params"]
    result = lowcomm("plan", "--method", "sparseloco", "--params", str(n), "--workers", "2",
                     "--tokens", "4", "--tokens-per-step", "1", *CLI_OPTIONS,
                     "--json", "True")  # fmt: skip
    assert result.returncode == 0, result.stderr
    planned = json.loads(result.stdout)["comm_bytes_per_worker"]
    sent = cli_summary["bytes_sent_per_worker"]
    assert sent == cli_summary["bytes_by_role"]["pseudo_gradient"] > 0
    # The plan prices n / 256 chunks, the run sends whole chunks (the last one padded) and
    # whole bytes: per round at most one chunk's 26 bytes (8 x 8 + 8 x 2 bits, 4 fp32
    # levels) and 2 bytes of rounding apart.
    assert abs(planned - sent) <= 2 * (26 + 2)
    assert planned == pytest.approx(sent, rel=0.01)


def test_pack_bits_copies_nothing_from_the_host() -> None:
    """pack_bits runs per tensor per step (DeMo) and twice per sync (SparseLoCo): on a GPU a
    tensor built from host values is a blocking copy from pageable memory each time. Values
    on ``meta`` stand in for the GPU's; the packed bytes are those of a host computation."""
    from _host import HostTraffic
    from lowcomm.optim.sparse import pack_bits, unpack_bits

    with HostTraffic() as traffic:
        pack_bits(torch.zeros(10, dtype=torch.int64, device="meta"), 5)
    assert traffic.copies == [] and traffic.reads == []
    values = torch.tensor([0, 31, 7, 16, 1, 30])
    packed = pack_bits(values, 5)
    assert packed.dtype == torch.uint8 and packed.numel() == 4
    assert unpack_bits(packed, 6, 5).tolist() == values.tolist()
