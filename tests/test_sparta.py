"""SPARTA and SPARTA-DiLoCo: the seeded index draw, the sparse average, the update rule, the
reductions (p = 1: averaging every step; p = 0: diloco), bytes against a hand count, the
planner, multi-process, resume, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from _cli import lowcomm, small_flags
from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm import CollectiveKind, CompletedHandle, LocalComm, RecordingComm, Role
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.plan import PlanConfig, make_plan
from lowcomm.strategies import StrategyContext
from lowcomm.strategies.co2 import LocalAdamW, LocalOptions
from lowcomm.strategies.diloco import DiLoCo, DiLoCoOptions
from lowcomm.strategies.sparta import (
    SparseAverage,
    Sparta,
    SpartaDiLoCo,
    SpartaOptions,
    selected_indices,
    selection_rng,
)

CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=3e-3, weight_decay=0.1),
    schedule=ScheduleConfig(kind="constant", warmup_steps=0),
    total_steps=40,
    max_grad_norm=None,
    seed=7,
)


def hand_drawn(numel: int, p: float, seed: int, step: int) -> torch.Tensor:
    """S_t written out as a Bernoulli process: from the step's stream, gaps G_j ~ Geometric(p)
    (trials up to a success); the selected entries are at G_1 - 1, G_1 + G_2 - 1, ... < n."""
    gaps = selection_rng(seed, step).geometric(p, size=numel)  # n trials hold <= n successes
    positions = np.cumsum(gaps) - 1
    return torch.from_numpy(positions[positions < numel].astype(np.int64))


def _run(strategy: Any, steps: int, start: int = 0) -> None:
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(start, start + steps)])
    for _ in range(steps):
        strategy.step(closure)


# --- the index draw and the sparse average -----------------------------------------------------


def test_indices_are_a_seeded_bernoulli_draw_shared_by_every_worker() -> None:
    before = torch.get_rng_state()
    drawn = selected_indices(10_000, 0.01, seed=3, step=5, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)  # the process-global RNG is untouched
    assert torch.equal(drawn, hand_drawn(10_000, 0.01, 3, 5))
    # A pure function of (seed, step): another call agrees, another step or seed does not.
    assert torch.equal(drawn, selected_indices(10_000, 0.01, 3, 5, torch.device("cpu")))
    assert not torch.equal(drawn[:50], selected_indices(10_000, 0.01, 3, 6, drawn.device)[:50])
    assert not torch.equal(drawn[:50], selected_indices(10_000, 0.01, 4, 5, drawn.device)[:50])
    assert 50 < drawn.numel() < 150  # about p n = 100
    assert selected_indices(10, 0.0, 0, 1, drawn.device).numel() == 0
    assert torch.equal(selected_indices(10, 1.0, 0, 1, drawn.device), torch.arange(10))


def test_every_entry_is_averaged_with_probability_p() -> None:
    # Bernoulli(p) per entry, as exogym's mask: over 400 steps each of 1000 entries is drawn
    # about 0.1 x 400 = 40 times (binomial sd 6), and the steps' counts average p n = 100.
    hits = torch.zeros(1000)
    sizes = []
    for step in range(1, 401):
        drawn = selected_indices(1000, 0.1, seed=0, step=step, device=torch.device("cpu"))
        assert torch.equal(drawn, drawn.unique())  # no entry twice
        hits[drawn] += 1
        sizes.append(drawn.numel())
    assert hits.min() > 15 and hits.max() < 65
    assert sum(sizes) / 400 == pytest.approx(100, rel=0.03)
    assert len(set(sizes)) > 10  # the count itself is random, not fixed at p n
    # More entries than one batch of gaps (2^20): the draw continues where it stopped.
    big = 3_000_000
    drawn = selected_indices(big, 0.5, seed=1, step=1, device=torch.device("cpu"))
    assert torch.equal(drawn, hand_drawn(big, 0.5, 1, 1))
    assert drawn.numel() == pytest.approx(0.5 * big, rel=0.01)
    assert (drawn >= 2_000_000).sum() == pytest.approx(500_000, rel=0.01)
    assert torch.equal(drawn, drawn.unique()) and int(drawn.max()) < big


class _PeerComm:
    """A unit-test fake: this worker and one peer whose values are ``peer[indices]``; a mean
    all-reduce returns their average (and is recorded)."""

    world_size = 2
    rank = 0

    def __init__(self, peer: torch.Tensor, indices: torch.Tensor) -> None:
        self.peer_values = peer[indices]
        self.sizes: list[int] = []

    def all_reduce(self, tensor: torch.Tensor, *, op: str, role: Role) -> CompletedHandle:
        assert op == "mean" and role is Role.PARAMETER
        self.sizes.append(tensor.numel())
        tensor.copy_((tensor + self.peer_values) / 2)
        return CompletedHandle()


def test_sparse_average_follows_the_equation() -> None:
    torch.manual_seed(0)
    mine, peer = torch.randn(5000), torch.randn(5000)
    s = hand_drawn(5000, 0.02, 11, 3)
    comm = _PeerComm(peer, s)
    theta = mine.clone()
    count = SparseAverage(comm, 5000, 0.02, seed=11)(theta, step=3)  # type: ignore[arg-type]
    expected = mine.clone()
    expected[s] = (mine[s] + peer[s]) / 2
    assert torch.equal(theta, expected)
    assert count == s.numel() and comm.sizes == [s.numel()]
    outside = torch.ones(5000, dtype=torch.bool)
    outside[s] = False
    assert torch.equal(theta[outside], mine[outside])


# --- the update rule ---------------------------------------------------------------------------


def test_each_step_is_a_local_adamw_step_then_one_sparse_all_reduce() -> None:
    # Identical replicas (RecordingComm): the average changes nothing, so theta follows AdamW
    # exactly (replayed by local_adamw that never syncs); the collectives are the hand draws.
    comm = RecordingComm(world_size=3)
    strategy = Sparta(tiny_gpt(), comm, CONTEXT, SpartaOptions(fraction=0.05))
    replay = LocalAdamW(tiny_gpt(), LocalComm(), CONTEXT, LocalOptions(sync_every=1000))
    _run(strategy, 4)
    _run(replay, 4)
    assert torch.equal(flat_params(strategy.model), flat_params(replay.model))
    n = strategy.flat.numel
    sizes = [hand_drawn(n, 0.05, 7, t).numel() for t in range(1, 5)]
    assert [(c.kind, c.role, c.dtype, c.numel) for c in comm.calls] == [
        (CollectiveKind.ALL_REDUCE, Role.PARAMETER, torch.float32, size) for size in sizes
    ]
    assert all(0.03 * n < size < 0.07 * n for size in sizes)


def test_bytes_per_step_by_hand() -> None:
    # p n fp32 values per step on average: |S_t| x 4 bytes exactly.
    comm = RecordingComm(world_size=4)
    strategy = Sparta(tiny_gpt(), comm, CONTEXT, SpartaOptions())
    _run(strategy, 3)
    n = strategy.flat.numel
    assert [c.payload_bytes for c in comm.calls] == [
        4 * hand_drawn(n, 0.005, 7, t).numel() for t in (1, 2, 3)
    ]
    assert sum(c.payload_bytes for c in comm.calls) == pytest.approx(3 * 0.005 * n * 4, rel=0.15)


def test_state_bytes_are_local_adamw_s() -> None:
    strategy = Sparta(tiny_gpt(), LocalComm(), CONTEXT)
    # params 4 + grads 4 + AdamW moments 8 (fp32 bytes per parameter); no extra copy.
    assert strategy.state_bytes() == 16 * strategy.flat.padded_numel
    assert Sparta.cost.extra_copies == 0


def test_state_dict_round_trip_resumes_exactly() -> None:
    for cls, options in (
        (Sparta, SpartaOptions(fraction=0.1)),
        (SpartaDiLoCo, SpartaOptions(fraction=0.1, sync_every=2)),
    ):
        full = cls(tiny_gpt(), RecordingComm(world_size=2), CONTEXT, options)
        _run(full, 5)
        first = cls(tiny_gpt(), RecordingComm(world_size=2), CONTEXT, options)
        _run(first, 3)
        resumed = cls(tiny_gpt(seed=5), RecordingComm(world_size=2), CONTEXT, options)
        resumed.load_state_dict(first.state_dict())
        _run(resumed, 2, start=3)
        assert torch.equal(flat_params(full.model), flat_params(resumed.model)), cls.name
        saved, straight = resumed.inner.state_dict(), full.inner.state_dict()
        assert torch.equal(saved["exp_avg_sq"], straight["exp_avg_sq"]), cls.name


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"fraction": 1.5}, "--sparta.fraction"),
        ({"fraction": -0.1}, "--sparta.fraction"),
        ({"sync_every": 0}, "--sparta.sync-every"),
        ({"outer_lr": float("inf")}, "--sparta.outer-lr"),
        ({"outer_momentum": 1.0}, "--sparta.outer-momentum"),
    ],
)
def test_bad_options_name_the_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        SpartaOptions(**kwargs)


# --- the planner -------------------------------------------------------------------------------


def test_plan_prices_a_sparse_all_reduce_every_step_by_hand() -> None:
    # 8 Gbit/s = 1e9 bytes/s, 1 ms latency, 4 workers, 1e9 parameters, p = 0.005.
    config = dict(
        params="1e9", workers=4, tokens=10 * 4096.0, tokens_per_step=4096.0,
        seconds_per_step=1.0, network="wan", bandwidth_gbps=8.0, latency_ms=1.0,
    )  # fmt: skip
    result = make_plan(PlanConfig(method="sparta", **config))  # type: ignore[arg-type]
    payload = 0.005 * 1e9 * 4  # p n fp32 values
    assert result.comm_bytes_per_worker_per_step == pytest.approx(2 * 3 / 4 * payload)
    ring = 2 * 3 / 4 * payload / 1e9 + 2 * 3 * 1e-3  # ring all-reduce of the selected values
    assert result.comm_total_s == pytest.approx(10 * ring)
    assert result.comm_exposed_s == pytest.approx(10 * ring)  # blocking
    both = make_plan(
        PlanConfig(method="sparta_diloco", sparta=SpartaOptions(sync_every=10), **config)  # type: ignore[arg-type]
    )
    full = 2 * 3 / 4 * 4e9
    assert both.comm_bytes_per_worker_per_step == pytest.approx(2 * 3 / 4 * payload + full / 10)
    # p = 0: no step issues a collective, so nothing is priced (not even latency).
    none = make_plan(PlanConfig(method="sparta", sparta=SpartaOptions(fraction=0.0), **config))  # type: ignore[arg-type]
    assert none.comm_total_s == 0.0 and none.comm_bytes_per_worker_per_step == 0.0


# --- multi-process -----------------------------------------------------------------------------


def _gloo_worker(steps: int) -> dict[str, torch.Tensor]:
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    rank, world = comm.rank, comm.world_size

    def shard(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = global_batch(step, world)
        return x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]

    mine = [shard(s) for s in range(steps)]
    diloco = DiLoCoOptions(sync_every=3, outer_lr=0.7, outer_momentum=0.9)
    runs: list[tuple[str, Any]] = [
        ("sparta", Sparta(tiny_gpt(), comm, CONTEXT, SpartaOptions(fraction=0.05))),
        ("all", Sparta(tiny_gpt(), comm, CONTEXT, SpartaOptions(fraction=1.0))),
        ("local", LocalAdamW(tiny_gpt(), comm, CONTEXT, LocalOptions(sync_every=1))),
        ("none", Sparta(tiny_gpt(), comm, CONTEXT, SpartaOptions(fraction=0.0))),
        ("sparta_diloco", SpartaDiLoCo(tiny_gpt(), comm, CONTEXT,
                                       SpartaOptions(fraction=0.05, sync_every=3))),
        ("sparta_diloco_0", SpartaDiLoCo(tiny_gpt(), comm, CONTEXT,
                                         SpartaOptions(fraction=0.0, sync_every=3))),
        ("diloco", DiLoCo(tiny_gpt(), comm, CONTEXT, diloco)),
    ]  # fmt: skip
    results: dict[str, torch.Tensor] = {}
    # Exact resume where the averages matter: half the steps, a checkpoint, a fresh strategy.
    first = Sparta(tiny_gpt(), comm, CONTEXT, SpartaOptions(fraction=0.05))
    closure = closure_for(first, mine)
    for _ in range(steps // 2):
        first.step(closure)
    resumed = Sparta(tiny_gpt(seed=3), comm, CONTEXT, SpartaOptions(fraction=0.05))
    resumed.load_state_dict(first.state_dict())
    closure = closure_for(resumed, mine[steps // 2 :])
    for _ in range(steps - steps // 2):
        resumed.step(closure)
    results["resumed"] = flat_params(resumed.model)
    for key, strategy in runs:
        closure = closure_for(strategy, mine)
        for _ in range(steps):
            strategy.step(closure)
        strategy.finish()
        results[key] = flat_params(strategy.model)
        if isinstance(strategy, SpartaDiLoCo | DiLoCo):
            results[f"{key}_global"] = strategy.globals_[0].clone()
        if key == "sparta":
            with strategy.deployed() as model:
                results["sparta_deployed"] = flat_params(model)
    return results


def test_two_gloo_ranks_average_the_drawn_entries_and_reduce() -> None:
    from lowcomm.launch import spawn_workers

    steps = 4
    zero, one = spawn_workers(_gloo_worker, 2, (steps,))
    n = zero["sparta"].numel()
    last = hand_drawn(n, 0.05, 7, steps)  # S_T, averaged after the last step
    assert torch.equal(zero["sparta"][last], one["sparta"][last])
    rest = torch.ones(n, dtype=torch.bool)
    rest[last] = False
    # Elsewhere the workers differ (their own data since the entry was last averaged) ...
    assert (zero["sparta"][rest] != one["sparta"][rest]).float().mean() > 0.5
    # ... but far less than without any averaging (p = 0: each worker alone).
    apart = (zero["sparta"] - one["sparta"]).norm()
    assert apart < (zero["none"] - one["none"]).norm()
    assert torch.allclose(zero["sparta_deployed"], (zero["sparta"] + one["sparta"]) / 2)
    assert torch.equal(zero["sparta_deployed"], one["sparta_deployed"])
    for result in (zero, one):
        assert torch.equal(result["resumed"], result["sparta"])
        # p = 1: every parameter averaged after every local step, i.e. local_adamw with tau 1.
        assert torch.equal(result["all"], result["local"])
        # p = 0: no sparse exchange, so sparta_diloco is diloco.
        assert torch.equal(result["sparta_diloco_0"], result["diloco"])
        assert torch.equal(result["sparta_diloco_0_global"], result["diloco_global"])
    assert torch.equal(zero["all"], one["all"])
    # SPARTA-DiLoCo: the same global parameters everywhere, moved by the sparse averages too.
    assert torch.equal(zero["sparta_diloco_global"], one["sparta_diloco_global"])
    assert not torch.equal(zero["sparta_diloco_global"], zero["diloco_global"])


# --- command line ------------------------------------------------------------------------------


def test_cli_trains_and_counts_the_sparse_bytes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = lowcomm("train", "--method", "sparta", "--steps", "3", "--sparta.fraction", "0.02",
                     "--seed", "4", "--out", str(out), *small_flags())  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "sparta" and summary["steps"] == 3
    assert summary["bytes_by_role"]["gradient"] == 0
    n = summary["num_params"]
    # Two workers: a ring all-reduce sends 2 (M - 1) / M = 1 payload of |S_t| fp32 values.
    sent = sum(4 * hand_drawn(n, 0.02, 4, t).numel() for t in (1, 2, 3))
    assert summary["bytes_by_role"]["parameter"] == sent
    assert sent == pytest.approx(3 * 0.02 * n * 4, rel=0.1)


def test_cli_refuses_a_bad_fraction_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from lowcomm.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["train", "--method", "sparta", "--sparta.fraction", "2", "--steps", "1"])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--sparta.fraction: 2" in line and "[0, 1]" in line and "try 0.005" in line


def test_sparta_diloco_says_when_the_last_round_is_cut() -> None:
    strategy = SpartaDiLoCo(tiny_gpt(), LocalComm(), CONTEXT, SpartaOptions(sync_every=4))
    assert strategy.unsynchronized_tail(8) is None
    tail = strategy.unsynchronized_tail(10)
    assert tail is not None and "--sparta.sync-every 4" in tail and "--steps 12" in tail
    assert math.isclose(SpartaOptions().fraction, 0.005)


def test_exported_and_built_by_make_strategy_with_the_run_seed() -> None:
    import lowcomm

    strategy = lowcomm.make_strategy(
        "sparta_diloco", tiny_gpt(), lowcomm.connect(),
        options=lowcomm.SpartaOptions(fraction=0.1, sync_every=8), seed=9,
    )  # fmt: skip
    assert isinstance(strategy, SpartaDiLoCo)
    assert (strategy.average.seed, strategy.average.fraction) == (9, 0.1)
    assert strategy.options.sync_every == 8 and strategy.options.outer_lr == 0.7


def test_both_take_muon_as_their_local_optimizer() -> None:
    from lowcomm.optim.muon import FlatMuon

    muon = StrategyContext(
        optim=AdamWConfig(name="muon", lr=3e-3, weight_decay=0.1),
        schedule=ScheduleConfig(kind="constant", warmup_steps=0),
        total_steps=40, max_grad_norm=None, seed=7,
    )  # fmt: skip
    for cls in (Sparta, SpartaDiLoCo):
        comm = RecordingComm(world_size=2)
        strategy = cls(tiny_gpt(), comm, muon, SpartaOptions(fraction=0.05, sync_every=2))
        assert isinstance(strategy.inner, FlatMuon), cls.name
        _run(strategy, 2)
        assert torch.isfinite(flat_params(strategy.model)).all()
        n = strategy.flat.numel
        assert comm.calls[0].numel == hand_drawn(n, 0.05, 7, 1).numel(), cls.name
