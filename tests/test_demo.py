"""DeMo: the DCT and its inverse, the block layout, the per-block top-k, the update rule, the
reduction to data-parallel SGD, bytes against a hand count, the planner, multi-process, resume,
CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from _cli import lowcomm, small_flags
from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm import CollectiveKind, LocalComm, RecordingComm, Role
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.optim.dct import BlockDCT, block_side, dct, dct_matrix, idct
from lowcomm.plan import PlanConfig, make_plan
from lowcomm.strategies import StrategyContext
from lowcomm.strategies.demo import DeMo, DeMoCodec, DeMoOptions

CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=3e-3, weight_decay=0.1),
    schedule=ScheduleConfig(kind="constant", warmup_steps=0),
    total_steps=40,
    max_grad_norm=None,
)

# Small blocks, so the tiny GPT has many of them and the top-k really drops coefficients.
SMALL = {"chunk": 8, "topk": 4}
# Every coefficient kept, no sign: the reduction to SGD.
FULL = {"chunk": 8, "topk": 64, "sign": False}


# --- the DCT -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 5, 8])
def test_dct_and_its_inverse_follow_the_formula(size: int) -> None:
    torch.manual_seed(size)
    x = torch.randn(3, size, dtype=torch.float64)
    expected = torch.zeros_like(x)
    for k in range(size):
        c = math.sqrt(1 / size) if k == 0 else math.sqrt(2 / size)
        for n in range(size):
            expected[:, k] += c * x[:, n] * math.cos(math.pi * (2 * n + 1) * k / (2 * size))
    assert torch.allclose(dct(x), expected, atol=1e-12)
    back = torch.zeros_like(x)
    for n in range(size):
        for k in range(size):
            c = math.sqrt(1 / size) if k == 0 else math.sqrt(2 / size)
            back[:, n] += c * expected[:, k] * math.cos(math.pi * (2 * n + 1) * k / (2 * size))
    assert torch.allclose(idct(expected), back, atol=1e-12)
    assert torch.allclose(back, x, atol=1e-12)  # the formula's inverse is the inverse
    c = dct_matrix(size, dtype=torch.float64)
    assert torch.allclose(c @ c.T, torch.eye(size, dtype=torch.float64), atol=1e-12)
    assert dct_matrix(size) is dct_matrix(size)  # cached


@pytest.mark.parametrize("size", [3, 5, 29])
def test_odd_sides_store_the_exact_zeros_of_the_dct(size: int) -> None:
    """cos(pi (2n + 1) k / (2N)) is 0 where (2n + 1) k = N mod 2N; the matrix holds a true 0
    there (not float64 cos(pi / 2) = 6e-17), so a sign step on such a coefficient is 0."""
    c = dct_matrix(size)
    for k in range(size):
        for n in range(size):
            zero = (2 * n + 1) * k % (2 * size) == size
            assert (c[k, n].item() == 0.0) == zero, (size, k, n, c[k, n].item())
    # A lone odd-k coefficient of a 3-block: the middle entry is exactly 0, so no step there.
    if size == 3:
        assert torch.sign(idct(torch.tensor([0.0, 1.0, 0.0]))).tolist() == [1.0, 0.0, -1.0]


def test_block_sides_are_the_largest_divisors_up_to_the_chunk() -> None:
    assert [block_side(d, 64) for d in (32, 64, 96, 128, 97, 50257, 1)] == [
        32, 64, 48, 64, 1, 29, 1
    ]  # fmt: skip
    assert BlockDCT((96, 32), 64).sides == (48, 32)
    assert BlockDCT((4, 3, 5), 8).matrix_shape == (4, 15)  # more than 2-D: first x the rest
    assert BlockDCT((), 8).matrix_shape == (1,)


def test_block_dct_is_a_separable_dct_per_block() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    transform = BlockDCT((6, 8), chunk=4)  # sides 3 x 4: blocks (2, 2), 12 coefficients
    rows = transform.forward(x)
    assert rows.shape == (4, 12) and transform.blocks == 4 and transform.block == 12
    c3, c4 = dct_matrix(3), dct_matrix(4)
    for y in range(2):
        for b in range(2):
            tile = x[3 * y : 3 * y + 3, 4 * b : 4 * b + 4]
            assert torch.allclose(rows[2 * y + b].view(3, 4), c3 @ tile @ c4.T, atol=1e-6)
    assert torch.allclose(transform.inverse(rows), x, atol=1e-6)
    v = torch.randn(10)
    vector = BlockDCT((10,), chunk=4)  # side 2: five blocks of two
    assert torch.allclose(vector.forward(v), dct(v.view(5, 2)), atol=1e-6)
    assert torch.allclose(vector.inverse(vector.forward(v)), v, atol=1e-6)


# --- the wire format ---------------------------------------------------------------------------


def test_codec_keeps_the_top_k_coefficients_of_each_block() -> None:
    torch.manual_seed(1)
    x = torch.randn(8, 8)
    codec = DeMoCodec([(8, 8)], chunk=4, k=3)
    payload, sent = codec.encode(x.reshape(-1))
    rows = BlockDCT((8, 8), 4).forward(x)
    kept = torch.zeros_like(rows)
    for b in range(4):
        top = sorted(range(16), key=lambda i: -abs(float(rows[b, i])))[:3]
        kept[b, top] = rows[b, top]
    assert torch.allclose(sent, BlockDCT((8, 8), 4).inverse(kept).reshape(-1), atol=1e-6)
    # 4 blocks x 3 kept: 12 positions of 4 bits, 12 fp32 values.
    assert payload.numel() == 12 * 4 // 8 + 12 * 4 == codec.payload_bytes
    mean = torch.empty(64)
    codec.mean(payload.view(1, -1), mean)
    assert torch.equal(mean, sent)


def test_the_mean_of_a_coefficient_is_over_the_workers_that_sent_it() -> None:
    codec = DeMoCodec([(4,)], chunk=4, k=1)
    a = idct(torch.tensor([0.0, 2.0, 0.0, 0.0]))  # worker 0 sends coefficient 1
    b = idct(torch.tensor([0.0, 4.0, 0.0, -6.0]))  # worker 1 sends coefficient 3
    c = idct(torch.tensor([0.0, 8.0, 0.0, 0.0]))  # worker 2 sends coefficient 1
    rows = torch.stack([codec.encode(w)[0] for w in (a, b, c)])
    mean = torch.empty(4)
    codec.mean(rows, mean)
    assert torch.allclose(dct(mean), torch.tensor([0.0, 5.0, 0.0, -6.0]), atol=1e-6)


@pytest.mark.parametrize("group_bytes", [1, 10**9])
def test_mean_of_many_payloads_is_the_ordered_sum_per_coefficient(
    group_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """17 workers, a matrix, a vector and a 3-d tensor: the decoded mean equals, to the bit,
    each coefficient's senders summed in worker order and divided by their count, whether
    the payloads are decoded one worker at a time or all at once."""
    import lowcomm.optim.sparse as sparse

    monkeypatch.setattr(sparse, "DECODE_BYTES", group_bytes)
    shapes = [(12, 8), (6,), (2, 3, 4)]
    codec = DeMoCodec(shapes, chunk=4, k=3)
    generator = torch.Generator().manual_seed(5)
    size = sum(math.prod(shape) for shape in shapes)
    flats = [torch.randn(size, generator=generator) for _ in range(17)]
    rows = torch.stack([codec.encode(flat)[0] for flat in flats])
    mean = torch.empty(size + 3)  # with padding, which must come back zero
    codec.mean(rows, mean)
    expected, offset = [], 0
    for shape, transform in zip(shapes, codec.transforms, strict=True):
        sums = torch.zeros(transform.blocks, transform.block)
        counts = torch.zeros(transform.blocks, transform.block)
        for flat in flats:
            coefficients = transform.forward(flat[offset : offset + math.prod(shape)].view(shape))
            top = torch.topk(coefficients.abs(), min(3, transform.block), dim=1).indices
            for block in range(transform.blocks):
                for position in top[block].tolist():
                    sums[block, position] += coefficients[block, position]
                    counts[block, position] += 1
        expected.append(transform.inverse(sums / counts.clamp(min=1)).reshape(-1))
        offset += math.prod(shape)
    assert torch.equal(mean, torch.cat([*expected, torch.zeros(3)]))


# --- the update rule ---------------------------------------------------------------------------


def _run(strategy: Any, steps: int, start: int = 0, world: int = 1) -> None:
    batches = [global_batch(s, world) for s in range(start, start + steps)]
    closure = closure_for(strategy, batches)
    for _ in range(steps):
        strategy.step(closure)


def _gradient(model: torch.nn.Module, step: int, world: int = 1) -> torch.Tensor:
    model.zero_grad()
    inputs, targets = global_batch(step, world)
    _, loss = model(inputs, targets)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]


def _sparse_part(m: torch.Tensor, model: torch.nn.Module, chunk: int, k: int) -> torch.Tensor:
    """IDCT(TopK_block(DCT(m))), tensor by tensor, with torch.topk."""
    parts, offset = [], 0
    for p in model.parameters():
        transform = BlockDCT(tuple(p.shape), chunk)
        rows = transform.forward(m[offset : offset + p.numel()].view(p.shape))
        top = torch.topk(rows.abs(), min(k, transform.block), dim=1).indices
        kept = torch.zeros_like(rows).scatter_(1, top, rows.gather(1, top))
        parts.append(transform.inverse(kept).reshape(-1))
        offset += p.numel()
    return torch.cat(parts)


def test_steps_follow_the_equations() -> None:
    # Identical replicas (RecordingComm): the mean of the workers' q is q.
    comm = RecordingComm(world_size=3)
    options = DeMoOptions(momentum_decay=0.9, weight_decay=0.1, **SMALL)
    strategy = DeMo(tiny_gpt(), comm, CONTEXT, options)
    reference = tiny_gpt()
    theta = flat_params(reference)
    m = torch.zeros_like(theta)
    lr, wd = 3e-3, 0.1
    for step in range(3):
        _run(strategy, 1, start=step)
        g = _gradient(reference, step)
        m = 0.9 * m + g
        q = _sparse_part(m, reference, chunk=8, k=4)
        m = m - q
        theta = theta - lr * (torch.sign(q) + wd * theta)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(theta, reference.parameters())
        assert torch.allclose(flat_params(strategy.model), theta, atol=1e-6)
        assert torch.allclose(strategy.momentum, m, atol=1e-5)
    assert [(c.kind, c.role) for c in comm.calls] == [
        (CollectiveKind.ALL_GATHER, Role.PSEUDO_GRADIENT)
    ] * 3
    assert m.abs().sum() > 0  # the momentum kept what was not sent


def test_every_coefficient_kept_without_sign_is_sgd_on_the_mean_gradient() -> None:
    # k = block: q = m, so m is emptied every step and beta has no effect:
    # theta <- theta (1 - lr lambda) - lr g.
    options = DeMoOptions(momentum_decay=0.9, weight_decay=0.1, **FULL)
    demo = DeMo(tiny_gpt(), LocalComm(), CONTEXT, options)
    reference = tiny_gpt()
    theta = flat_params(reference)
    for step in range(4):
        _run(demo, 1, start=step)
        g = _gradient(reference, step)
        theta = theta * (1 - 3e-3 * 0.1) - 3e-3 * g
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(theta, reference.parameters())
    assert torch.allclose(flat_params(demo.model), theta, atol=1e-6)
    assert demo.momentum.abs().max() < 1e-5
    # With the defaults (top-k, sign) the two differ.
    default = DeMo(tiny_gpt(), LocalComm(), CONTEXT, DeMoOptions(**SMALL))
    _run(default, 4)
    assert not torch.allclose(flat_params(default.model), theta, atol=1e-4)


def test_default_weight_decay_is_the_references_zero_whatever_adamw_takes() -> None:
    """DeMo's lambda is its own (0, as in the reference code), not --optim.weight-decay: with
    every coefficient kept and no sign, the default run is theta - lr g, undecayed, although
    CONTEXT's AdamW takes 0.1."""
    assert DeMoOptions().weight_decay == 0.0 and CONTEXT.optim.weight_decay == 0.1
    demo = DeMo(tiny_gpt(), LocalComm(), CONTEXT, DeMoOptions(**FULL))
    reference = tiny_gpt()
    theta = flat_params(reference)
    for step in range(2):
        _run(demo, 1, start=step)
        theta = theta - 3e-3 * _gradient(reference, step)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(theta, reference.parameters())
    assert torch.allclose(flat_params(demo.model), theta, atol=1e-6)


def test_help_names_demos_own_weight_decay(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tyro

    from lowcomm.config import TrainConfig

    monkeypatch.setenv("COLUMNS", "80")  # (one column: the entry's lines follow its flag)
    with pytest.raises(SystemExit):
        tyro.cli(TrainConfig, args=["--help"], config=(tyro.conf.FlagConversionOff,))
    text = capsys.readouterr().out
    lines = [line.strip("│ ") for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("--demo.weight-decay"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(("--", "─", "╰")))
    words = " ".join(" ".join(lines[start:end]).split())
    assert "0 as in the reference code" in words and "(default: 0.0)" in words, words


def test_bytes_counted_are_the_packed_payload_by_hand() -> None:
    comm = RecordingComm(world_size=4)
    strategy = DeMo(tiny_gpt(), comm, CONTEXT, DeMoOptions())  # chunk 64, k 32
    _run(strategy, 1)
    (call,) = comm.calls
    # Tiny GPT, by tensor: (blocks x block entries, index bits) -> ceil(kept bits / 8) + 4 kept
    per_worker = (
        math.ceil(32 * 11 / 8) + 4 * 32  # token embedding 64 x 32: 1 block of 2048
        + math.ceil(32 * 9 / 8) + 4 * 32  # position embedding 16 x 32: 1 block of 512
        + 3 * (math.ceil(32 * 5 / 8) + 4 * 32)  # 3 norms of 32: all 32 kept
        + math.ceil(64 * 11 / 8) + 4 * 64  # qkv 96 x 32: 2 blocks of 48 x 32
        + math.ceil(32 * 10 / 8) + 4 * 32  # attention proj 32 x 32: 1 block
        + 2 * (math.ceil(64 * 11 / 8) + 4 * 64)  # mlp 128 x 32 and 32 x 128: 2 blocks each
    )  # fmt: skip
    assert per_worker == 1980
    assert call.dtype == torch.uint8
    assert call.payload_bytes == 4 * per_worker
    assert per_worker < 4 * strategy.flat.numel / 25  # 30x less than the fp32 gradient


def test_state_bytes_count_the_momentum() -> None:
    strategy = DeMo(tiny_gpt(), LocalComm(), CONTEXT)
    psi = strategy.flat.padded_numel
    # params 4 + grads 4 + momentum 4 (fp32 bytes/param); no optimizer moments.
    assert strategy.state_bytes() == 12 * psi
    assert DeMo.cost.extra_copies == 1


def test_state_dict_round_trip_resumes_exactly() -> None:
    options = DeMoOptions(**SMALL)
    full = DeMo(tiny_gpt(), LocalComm(), CONTEXT, options)
    _run(full, 5)
    first = DeMo(tiny_gpt(), LocalComm(), CONTEXT, options)
    _run(first, 3)
    assert first.momentum.any()  # the resume must carry a non-zero momentum
    resumed = DeMo(tiny_gpt(seed=5), LocalComm(), CONTEXT, options)
    resumed.load_state_dict(first.state_dict())
    _run(resumed, 2, start=3)
    assert torch.equal(flat_params(full.model), flat_params(resumed.model))
    assert torch.equal(full.momentum, resumed.momentum)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"momentum_decay": 1.0}, "--demo.momentum-decay"),
        ({"momentum_decay": -0.1}, "--demo.momentum-decay"),
        ({"chunk": 0}, "--demo.chunk"),
        ({"topk": 0}, "--demo.topk"),
        ({"topk": 65, "chunk": 8}, "--demo.topk"),
    ],
)
def test_bad_options_name_the_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        DeMoOptions(**kwargs)


# --- the planner -------------------------------------------------------------------------------


def test_plan_prices_an_all_gather_of_the_packed_payload_by_hand() -> None:
    # 8 Gbit/s = 1e9 bytes/s, 1 ms latency, 4 workers, 1e9 parameters, every step.
    result = make_plan(
        PlanConfig(
            method="demo", params="1e9", workers=4, tokens=10 * 4096.0,
            tokens_per_step=4096.0, seconds_per_step=1.0, network="wan", bandwidth_gbps=8.0,
            latency_ms=1.0, demo=DeMoOptions(),
        )
    )  # fmt: skip
    # Per 64 x 64 block: 32 x 12 index bits + 32 fp32 values = 176 B.
    encoded = 1e9 / 4096 * 176
    assert result.comm_bytes_per_worker_per_step == pytest.approx(3 * encoded)
    gather = 3 / 4 * (4 * encoded) / 1e9 + 3 * 1e-3  # ring all-gather of the 4 payloads
    assert result.comm_total_s == pytest.approx(10 * gather)
    assert result.comm_exposed_s == pytest.approx(10 * gather)


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
    for key, options in (("demo", DeMoOptions(**SMALL)), ("full", DeMoOptions(**FULL))):
        strategy = DeMo(tiny_gpt(), comm, CONTEXT, options)
        closure = closure_for(strategy, mine)
        for _ in range(steps):
            strategy.step(closure)
        strategy.finish()
        results[key] = flat_params(strategy.model)
        results[f"{key}_momentum"] = strategy.momentum.clone()
    # Data-parallel SGD by hand: the mean of the two workers' gradients, then SGD.
    model = tiny_gpt()
    for inputs, targets in mine:
        model.zero_grad()
        _, loss = model(inputs, targets)
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
        comm.all_reduce(g, op="mean", role=Role.GRADIENT).wait()
        theta = flat_params(model) - 3e-3 * g  # (DeMo's default weight decay: 0)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(theta, model.parameters())
    results["sgd"] = flat_params(model)
    return results


def test_two_gloo_ranks_agree_and_reduce_to_sgd() -> None:
    from lowcomm.launch import spawn_workers

    results = spawn_workers(_gloo_worker, 2, (3,))
    # Every worker holds the same parameters ...
    assert torch.equal(results[0]["demo"], results[1]["demo"])
    assert not torch.equal(results[0]["demo"], flat_params(tiny_gpt()))
    # ... but its own momentum (its own data's slow components).
    assert not torch.equal(results[0]["demo_momentum"], results[1]["demo_momentum"])
    for rank_result in results:
        assert torch.allclose(rank_result["full"], rank_result["sgd"], atol=1e-6)


# --- command line ------------------------------------------------------------------------------


def test_cli_trains_and_counts_the_packed_bytes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = lowcomm("train", "--method", "demo", "--steps", "2", "--demo.chunk", "16",
                     "--demo.topk", "8", "--out", str(out), *small_flags())  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "demo" and summary["steps"] == 2
    assert summary["bytes_by_role"]["gradient"] == 0
    # Two steps; each worker sends its payload to the other one: at most 8 of every 256
    # coefficients of a 16 x 16 block (more for vectors), 8 index bits and 32 value bits.
    sent = summary["bytes_by_role"]["pseudo_gradient"]
    assert 2 * 8 * 5 * summary["num_params"] / 256 <= sent < 2 * 4 * summary["num_params"] / 10


def test_options_are_exported_from_lowcomm() -> None:
    import lowcomm

    assert "DeMoOptions" in lowcomm.__all__
    assert lowcomm.DeMoOptions is DeMoOptions


def test_a_step_is_charged_the_same_whether_or_not_the_dct_matrices_were_built() -> None:
    # The DCT matrices are process-wide constants: in one process of many workers only the
    # first to encode builds them, a worker process builds its own. The calibrated clock's
    # count must not depend on which (it did: step 0 of DeMo was charged differently in one
    # process than in four).
    from lowcomm.comm.calibration import ElementCounter
    from lowcomm.optim import dct

    codec = DeMoCodec([(8, 8), (12,), (6, 10)], chunk=4, k=3)
    flat = torch.randn(64 + 12 + 60, generator=torch.Generator().manual_seed(0))
    counts = []
    for _ in range(2):
        dct._DEVICE_CACHE.clear()
        dct._dct_matrix_cpu.cache_clear()
        with ElementCounter() as cold:
            codec.encode(flat)
        with ElementCounter() as warm:
            codec.encode(flat)
        counts.append((cold.elements, warm.elements))
    assert counts[0][0] == counts[0][1] > 0
    assert counts[0] == counts[1]
