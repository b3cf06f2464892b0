"""Declared faults for the methods whose sync's result lands a round after its launch (eager,
diloco_delayed, co2): the exchange in flight at a crash fails on every member, the next outer
step comes from the survivors' pseudo-gradients, a joiner is healed with what is in flight,
and the dropped round's tokens are not committed. Also: summary.json's rounds_dropped counts
the syncs that failed on every member."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm.inprocess import InProcessGroup
from lowcomm.comm.runtime import Quorum
from lowcomm.models import ModelConfig
from lowcomm.strategies.co2 import CO2, LocalOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.eager import DiLoCoDelayed, Eager
from test_faults_train import (
    CONTEXT,
    DETECTION_S,
    WORKERS,
    _config,
    _Members,
    _run,
    _Tap,
    _threads,
    _tokens_per_step,
    _trace,
)

LATE = ["diloco_delayed", "eager", "co2"]


def _strategies(
    make: Any, count: int
) -> tuple[InProcessGroup, list[_Tap], list[_Members], list[Any]]:
    group = InProcessGroup(count)
    taps = [_Tap(group.comm(k)) for k in range(count)]
    members = [_Members(count) for _ in range(count)]
    strategies = []
    for k in range(count):
        strategy = make(taps[k])
        strategy.runtime = replace(strategy.runtime, membership=members[k])
        strategies.append(strategy)
    return group, taps, members, strategies


def _crash_at_five(
    group: InProcessGroup, members: list[_Members], strategies: list[Any], keep: Any
) -> None:
    """Every worker steps t = 1..8 on its rows; worker 2 crashes at t = 5, inside round 2,
    while round 1's exchange (launched at t = 4 over all three) flies. ``keep(k, t)`` is
    called after each of a survivor's steps."""

    def work(k: int) -> None:
        strategy = strategies[k]
        rows = slice(k * 4, (k + 1) * 4)
        batches = [global_batch(s, WORKERS) for s in range(8)]
        closure = closure_for(strategy, [(x[rows], y[rows]) for x, y in batches])
        for t in range(1, 9):
            if t == 5:
                if k == 2:
                    return
                group.enter(k, 1, (0, 1))
                members[k].current = Quorum((0, 1), 1)
            keep(k, t, strategy.step(closure))

    _threads(work, WORKERS)


def _nesterov(
    anchor: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DiLoCo's outer Nesterov step, written from its equation: b <- mu b + Delta,
    theta <- theta - lr (Delta + mu b)."""
    b = mu * momentum + delta
    return anchor - lr * (delta + mu * b), b


@pytest.mark.parametrize("eager", [False, True])
def test_a_delayed_outer_step_after_a_crash_drops_the_round_in_flight_and_takes_the_survivors(
    eager: bool,
) -> None:
    lr, mu = 0.7, 0.9
    options = DiLoCoOptions(sync_every=2, outer_lr=lr, outer_momentum=mu, outer_nesterov=True)
    cls = Eager if eager else DiLoCoDelayed
    group, taps, members, strategies = _strategies(
        lambda comm: cls(tiny_gpt(), comm, CONTEXT, options), WORKERS
    )
    seen: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, dict[str, float]]] = {}

    def keep(k: int, t: int, stats: Any) -> None:
        strategy = strategies[k]
        state = (strategy.globals_[0].clone(), strategy.outer[0].momentum_buffer.clone())
        seen[k, t] = (*state, dict(stats.extras))

    _crash_at_five(group, members, strategies, keep)
    assert len(taps[2].sent) == 2  # (t = 2 and 4: the crashed worker's exchanges)
    # Each survivor's Delta_m of round 2 (launched t = 6) and round 3 (t = 8).
    fresh = {k: (taps[k].sent[2], taps[k].sent[3]) for k in (0, 1)}
    mean2 = (fresh[0][0] + fresh[1][0]) / 2  # Delta^(2), over the survivors
    for k in (0, 1):
        anchor4, momentum4, _ = seen[k, 4]
        anchor6, momentum6, extras6 = seen[k, 6]
        anchor8, momentum8, extras8 = seen[k, 8]
        assert extras6["syncs_dropped"] == 1 and "syncs_dropped" not in extras8
        if eager:
            # t = 6: round 1's others' part is lost; the own fresh part over |Q| = 2.
            expected6, b6 = _nesterov(anchor4, momentum4, fresh[k][0] / 2, lr, mu)
            # t = 8: Delta^(2) - Delta_m^(2)/2 + Delta_m^(3)/2.
            update8 = mean2 - fresh[k][0] / 2 + fresh[k][1] / 2
        else:
            # t = 6: no outer step; t = 8: the survivors' Delta^(2).
            expected6, b6 = anchor4, momentum4
            update8 = mean2
        assert torch.allclose(anchor6, expected6, atol=1e-6)
        assert torch.allclose(momentum6, b6, atol=1e-6)
        expected8, b8 = _nesterov(anchor6, momentum6, update8, lr, mu)
        assert torch.allclose(anchor8, expected8, atol=1e-6)
        assert torch.allclose(momentum8, b8, atol=1e-6)
        assert torch.equal(flat_params(strategies[k].model), strategies[k].globals_[0])
    if not eager:  # (the naive delay keeps every worker's phi alike)
        assert torch.equal(seen[0, 8][0], seen[1, 8][0])


def test_co2_after_a_crash_drops_the_round_in_flight_and_steps_from_the_survivors_mean() -> None:
    alpha, beta, phi = 1.0, 0.5, 1.0
    options = LocalOptions(sync_every=2, outer_lr=alpha, outer_momentum=beta, clip_threshold=phi)
    group, taps, members, strategies = _strategies(
        lambda comm: CO2(tiny_gpt(), comm, CONTEXT, options), WORKERS
    )
    seen: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, dict[str, float]]] = {}

    def keep(k: int, t: int, stats: Any) -> None:
        strategy = strategies[k]
        seen[k, t] = (strategy.anchor.clone(), strategy.momentum.clone(), dict(stats.extras))

    _crash_at_five(group, members, strategies, keep)
    numel = strategies[0].flat.params.numel()
    # Round 2's [Delta | d] of each survivor, launched at t = 6.
    mean2 = (taps[0].sent[2] + taps[1].sent[2]) / 2
    for k in (0, 1):
        anchor4, momentum4, _ = seen[k, 4]
        anchor6, momentum6, extras6 = seen[k, 6]
        anchor8, momentum8, extras8 = seen[k, 8]
        assert bool(momentum4.abs().sum() > 0)  # (round 0 moved the anchor at t = 4)
        # t = 6: round 1's all-reduce failed: no outer step, m and the anchor unchanged.
        assert extras6["syncs_dropped"] == 1 and "outer_step" not in extras6
        assert torch.equal(anchor6, anchor4) and torch.equal(momentum6, momentum4)
        # t = 8: x_{t,0} = x_{t-1,0}, so Lambda = 0 / (tau |d| + eps) + 1 = 1 and
        # m = beta m + mean Delta over the survivors; x <- x - alpha clip(m, phi).
        assert extras8["mean_penalty"] == 1.0
        expected_m = beta * momentum6 + mean2[:numel]
        assert torch.allclose(momentum8, expected_m, atol=1e-7)
        expected = anchor6 - alpha * expected_m.clamp(-phi, phi)
        assert torch.allclose(anchor8, expected, atol=1e-7)
    assert torch.equal(seen[0, 8][0], seen[1, 8][0])


def test_eager_heals_a_joiner_with_the_senders_outer_state_and_its_exchange_in_flight() -> None:
    lr, mu = 0.7, 0.9
    options = DiLoCoOptions(sync_every=2, outer_lr=lr, outer_momentum=mu, outer_nesterov=True)
    group, taps, members, strategies = _strategies(
        lambda comm: Eager(tiny_gpt(), comm, CONTEXT, options), 2
    )
    healed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    pending: dict[int, tuple[int, tuple[int, ...], torch.Tensor, torch.Tensor]] = {}

    def work(k: int) -> None:
        strategy = strategies[k]
        batches = [global_batch(s, 2) for s in range(8)]
        closure = closure_for(strategy, [(x[k * 4 : k * 4 + 4], y[k * 4 : k * 4 + 4]) for x, y in batches])  # fmt: skip
        for _ in range(2):  # t = 1, 2: both launch round 0
            strategy.step(closure)
        if k == 0:  # worker 1 crashes at t = 3; worker 0 goes on alone to t = 5
            group.enter(0, 1, (0,))
            members[0].current = Quorum((0,), 1)
            for _ in range(3):
                strategy.step(closure)
        group.enter(k, 2, (0, 1))
        members[k].current = Quorum((0, 1), 2, joined=k == 1)
        strategy.heal(0, joining=k == 1)
        (sync,) = strategy.pending[0]
        mean, _, own = sync.exchange.wait()
        pending[k] = (sync.launched_at, sync.members, mean.clone(), own.clone())
        outer = strategy.outer[0]
        healed[k] = (
            strategy.globals_[0].clone(),
            outer.momentum_buffer.clone(),
            flat_params(strategy.model),
        )
        strategy.step(closure)  # t = 6: both apply round 1, launched at t = 4 over worker 0

    _threads(work, 2)
    source, joiner = healed[0], healed[1]
    assert torch.equal(joiner[0], source[0]) and torch.equal(joiner[1], source[1])
    assert torch.equal(joiner[2], joiner[0])  # the joiner's local parameters start at phi
    assert pending[1][:2] == pending[0][:2] == (4, (0,))
    assert torch.equal(pending[1][2], pending[0][2]) and torch.equal(pending[1][3], pending[0][3])
    assert strategies[1].step_index == strategies[0].step_index == 6
    # t = 6: Delta~ = Delta^(1) - Delta_0^(1)/1 + Delta_1^(2)/2 for the joiner.
    _, _, mean1, own1 = pending[1]
    expected, _ = _nesterov(joiner[0], joiner[1], mean1 - own1 + taps[1].sent[-1] / 2, lr, mu)
    assert torch.allclose(strategies[1].globals_[0], expected, atol=1e-6)


# --- whole runs --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", LATE)
def test_an_empty_trace_gives_the_late_methods_run_without_faults_exactly(
    method: str, tmp_path: Path
) -> None:
    plain = _run(_config(method, tmp_path / "plain", None))
    empty = _run(_config(method, tmp_path / "empty", _trace(tmp_path, "# no event\n")))
    for with_faults, without in zip(empty[0], plain[0], strict=True):
        assert with_faults.pop("quorum") == WORKERS
        assert with_faults == without
    for a, b in zip(empty[2], plain[2], strict=True):
        assert torch.equal(a, b)
    assert empty[1]["faults"]["rounds_dropped"] == 0
    assert empty[1]["final_val_loss"] == plain[1]["final_val_loss"]
    assert empty[1]["modeled_time_s"] == plain[1]["modeled_time_s"]
    assert empty[1]["committed_tokens"] == plain[1]["committed_tokens"]


@pytest.mark.parametrize("method", LATE)
def test_a_crash_in_flight_drops_that_round_and_a_joiner_is_healed_bit_for_bit(
    method: str, tmp_path: Path
) -> None:
    # Rounds of 2 steps; round r launches its exchange at loop step 2r + 1 and it lands at
    # 2r + 3. Worker 2 crashes at loop step 3, while round 0's exchange flies: round 0 is
    # dropped on every member. A replacement joins at loop step 5, mid round 2.
    trace = _trace(tmp_path, "step=3 worker=2 crash\nstep=5 worker=2 join\n")
    first = _run(_config(method, tmp_path / "a", trace), deployed=True)
    second = _run(_config(method, tmp_path / "b", trace), deployed=True)
    records, summary, parameters = first
    assert records == second[0] and summary["faults"] == second[1]["faults"]
    for a, b in zip(parameters, second[2], strict=True):
        assert torch.equal(a, b)
    assert [r["quorum"] for r in records] == [3, 3, 3, 2, 2, 3, 3, 3]
    assert records[3]["extras"]["syncs_dropped"] == 1
    assert records[3]["clock_s"] >= records[2]["clock_s"] + DETECTION_S
    assert summary["faults"]["rounds_dropped"] == 1
    # Committed: round 1 (steps 2, 3: workers 0 and 1), round 2 (steps 4, 5: 0 and 1, and the
    # joiner's step 5) and round 3 (steps 6, 7: all three, settled by the final drain); not
    # round 0 (steps 0, 1), nor the crashed worker's step 2.
    assert summary["committed_tokens"] == (2 * 2 + 2 * 2 + 1 + 3 * 2) * _tokens_per_step()
    if method != "eager":  # (eager's workers each keep their own phi_m)
        assert len(parameters) == WORKERS
        assert all(torch.equal(parameters[0], p) for p in parameters[1:])


@pytest.mark.parametrize("method", LATE)
def test_a_leave_while_an_exchange_flies_drops_it_without_a_detection_wait(
    method: str, tmp_path: Path
) -> None:
    trace = _trace(tmp_path, "step=3 worker=2 leave\nstep=5 worker=2 rejoin\n")
    records, summary, parameters = _run(_config(method, tmp_path / "out", trace), deployed=True)
    assert records[3]["extras"]["syncs_dropped"] == 1
    assert records[3]["clock_s"] - records[2]["clock_s"] < DETECTION_S
    assert summary["faults"]["rounds_dropped"] == 1
    if method != "eager":  # (the rejoined worker, healed, deploys the others' model)
        assert len(parameters) == WORKERS
        assert all(torch.equal(parameters[0], p) for p in parameters[1:])


# --- rounds_dropped counts the syncs that failed ----------------------------------------------


@pytest.mark.parametrize(
    ("method", "text"),
    [
        # (streaming_diloco: fragment 0's sync launched at loop step 4 completes at step 5.)
        ("streaming_diloco", "step=5 worker=2 crash\n"),
        # (overlap_local_sgd: the average launched at loop step 1 settles at step 3.)
        ("overlap_local_sgd", "step=2 worker=2 crash\n"),
        # (cocodc: a sync every 2 steps from t = 2, each completing a step later.)
        ("cocodc", "step=4 worker=2 crash\n"),
        ("diloco", "step=2 worker=2 crash\n"),
    ],
)
def test_rounds_dropped_counts_the_syncs_that_failed_on_every_member(
    method: str, text: str, tmp_path: Path
) -> None:
    records, summary, _ = _run(_config(method, tmp_path / "out", _trace(tmp_path, text)))
    failed = sum(int(r["extras"].get("syncs_dropped", 0)) for r in records)
    # (diloco's sync at a crash runs over the survivors: no round fails.)
    assert failed == (0 if method == "diloco" else 1)
    assert summary["faults"]["rounds_dropped"] == failed


def test_rounds_dropped_counts_a_failed_sync_the_writing_worker_was_away_for(
    tmp_path: Path,
) -> None:
    # Worker 0 (which writes the summary) crashes at loop step 3, failing round 0's exchange
    # on the members 1 and 2, and rejoins at step 5.
    trace = _trace(tmp_path, "step=3 worker=0 crash\nstep=5 worker=0 join\n")
    records, summary, _ = _run(_config("diloco_delayed", tmp_path / "out", trace))
    assert "syncs_dropped" not in records[3]["extras"]  # (worker 0's own extras: it was away)
    assert summary["faults"]["rounds_dropped"] == 1


@pytest.mark.parametrize("method", ["diloco_delayed", "eager"])
def test_with_fragments_and_two_rounds_in_flight_a_crash_drops_every_exchange_it_was_in(
    method: str, tmp_path: Path
) -> None:
    # H = 4, K = 2: fragment 0 launches at t = 2, 6, 10, 14 and fragment 1 at t = 4, 8, 12,
    # 16, each landing N = 2 of its periods (8 steps) later. Worker 2 crashes at loop step 6
    # (t = 7), when the exchanges of t = 2, 4 and 6 fly: all three fail; a replacement joins
    # at loop step 9 (t = 10) and is healed with the two exchanges of each fragment in flight.
    options = DiLoCoOptions(sync_every=4, fragments=2, outer_delay=2)
    model = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    trace = _trace(tmp_path, "step=6 worker=2 crash\nstep=9 worker=2 join\n")
    runs = [
        _run(_config(method, tmp_path / out, trace, steps=16, diloco=options, model=model))
        for out in ("a", "b")
    ]
    (records, summary, parameters), (again, summary_again, parameters_again) = runs
    assert records == again and summary["faults"] == summary_again["faults"]
    assert all(torch.equal(a, b) for a, b in zip(parameters, parameters_again, strict=True))
    dropped = [r["step"] for r in records if "syncs_dropped" in r["extras"]]
    assert dropped == [9, 11, 13] and summary["faults"]["rounds_dropped"] == 3
    # Each launch closes the steps since the previous one (2 steps): those of t = 8 (the two
    # survivors' loop steps 6, 7) commit at t = 16, the rest at the final drain; the joiner's
    # first step is loop step 9.
    assert summary["committed_tokens"] == (2 * 2 + (2 + 3) + 3 * 2 * 3) * _tokens_per_step()


@pytest.mark.parametrize("method", LATE)
def test_a_join_into_a_quorum_smaller_than_the_run_heals_the_exchanges_in_flight(
    method: str, tmp_path: Path
) -> None:
    # Worker 0 crashes at loop step 1 and worker 1 at step 3, so the exchange launched at
    # step 3 flies over worker 2 alone; worker 1 joins at step 5, into a quorum of 2 of 3.
    trace = _trace(tmp_path, "step=1 worker=0 crash\nstep=3 worker=1 crash\nstep=5 worker=1 join\n")
    records, summary, parameters = _run(_config(method, tmp_path / "out", trace), deployed=True)
    assert [r["quorum"] for r in records] == [3, 2, 2, 1, 1, 2, 2, 2]
    assert len(parameters) == 2
    if method != "eager":
        assert torch.equal(parameters[0], parameters[1])
    # The round launched at loop step 1 over workers 1 and 2 lost worker 1 at step 3:
    # dropped. The one launched at step 3 over worker 2 alone, which the joiner is healed
    # with, lands at step 5 on both.
    assert summary["faults"]["rounds_dropped"] == 1


@pytest.mark.parametrize("method", ["streaming_diloco", "cocodc"])
def test_a_sync_the_members_finish_early_at_a_join_commits_its_tokens(
    method: str, tmp_path: Path
) -> None:
    # streaming_diloco: the sync launched at loop step 6 flies when worker 2 joins at step 7:
    # the members finish it before healing, and the steps it covers commit then (no later
    # sync would commit them). cocodc: none flies at step 7, and the join commits nothing
    # early.
    trace = _trace(tmp_path, "step=1 worker=2 crash\nstep=7 worker=2 join\n")
    summary = _run(_config(method, tmp_path / "out", trace, steps=8))[1]
    plain = _run(_config(method, tmp_path / "plain", _trace(tmp_path, "step=1 worker=2 crash\n")))
    # Without the join, the last sync completes at its step: both runs commit the same
    # tokens of workers 0 and 1 (the joiner's one step, after the sync, commits nothing).
    assert summary["committed_tokens"] == plain[1]["committed_tokens"]
    assert summary["committed_tokens"] > 0


@pytest.mark.parametrize("method", LATE)
def test_rounds_dropped_counts_an_exchange_that_fails_in_the_final_drain(
    method: str, tmp_path: Path
) -> None:
    # 7 steps: the last exchange is launched at loop step 5, and worker 2 leaves at step 6,
    # the trailing partial round: the final drain discards that exchange on the members.
    trace = _trace(tmp_path, "step=6 worker=2 leave\n")
    records, summary, _ = _run(_config(method, tmp_path / "out", trace, steps=7))
    assert not any("syncs_dropped" in r["extras"] for r in records)
    assert summary["faults"]["rounds_dropped"] == 1
    # Rounds 0 and 1 (loop steps 0-3, three workers) commit; round 2 (steps 4, 5) is lost.
    # The trailing step 6 of the two members: co2 makes it a round of its own, applied in
    # the drain; the delayed methods' deployed phi leaves it out.
    trailing = 2 if method == "co2" else 0
    assert summary["committed_tokens"] == (3 * 4 + trailing) * _tokens_per_step()
