"""decoupled_diloco as a training method, every worker a thread of one process: its reductions
to diloco and streaming_diloco, a straggler past the grace window (late next and late drop),
the synchronizer's merge gate against the rule of docs/ALGORITHMS.md ("Decoupled DiLoCo"), a
run with a fault trace, and the one-line refusals (worker processes:
tests/test_decoupled_processes.py; learners of several ranks: tests/test_decoupled_ranks.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.launch.inprocess import train_in_process
from lowcomm.launch.run import preflight
from lowcomm.models import ModelConfig
from lowcomm.optim.outer import OuterNesterov
from lowcomm.optim.schedule import ScheduleConfig
from lowcomm.strategies import decoupled_diloco
from lowcomm.strategies.decoupled_diloco import DecoupledOptions, Synchronizer
from lowcomm.strategies.decoupled_sync import Contribution
from lowcomm.strategies.diloco import DiLoCoOptions

WORKERS = 3
STEPS = 12


def _config(method: str, out: Path, workers: int = WORKERS, **overrides: Any) -> TrainConfig:
    config = TrainConfig(
        method=method,
        model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
    )
    options: dict[str, Any] = dict(
        workers=workers, workers_per_process=workers, steps=STEPS, network="wan",
        clock="virtual", seconds_per_microbatch=1.0, eval_every=1000, log_every=1000,
        eval_batches=1, progress=False, plot=False, out=str(out),
    )  # fmt: skip
    return with_options(config, **{**options, **overrides})


def _run(config: TrainConfig) -> tuple[dict[str, Any], list[Any]]:
    """The run's summary and every worker's summary (parameters kept)."""
    config.validate()
    preflight(config)
    summaries = train_in_process(config, keep_parameters=True)
    summary = json.loads((Path(str(config.run.out)) / "summary.json").read_text())
    return summary, summaries


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[Synchronizer]:
    """Every synchronizer a run creates, to read its merge log afterwards."""
    found: list[Synchronizer] = []
    original = Synchronizer.__init__

    def record(self: Synchronizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        found.append(self)

    monkeypatch.setattr(Synchronizer, "__init__", record)
    return found


def _same_parameters(mine: list[Any], theirs: list[Any]) -> None:
    assert len(mine) == len(theirs) == WORKERS
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a.parameters, b.parameters)
        assert torch.equal(a.deployed_parameters, b.deployed_parameters)


def test_quorum_of_all_no_grace_one_fragment_tau_zero_equals_diloco(tmp_path: Path) -> None:
    shared: dict[str, Any] = {"sync_every": 4, "fragments": 1, "overlap_steps": 0, "mixing": 0.0}
    _, reference = _run(_config("diloco", tmp_path / "d", diloco=DiLoCoOptions(**shared)))
    options = DecoupledOptions(**shared, min_quorum=WORKERS, grace="none", weighting="paper")
    _, learners = _run(_config("decoupled_diloco", tmp_path / "x", decoupled=options))
    _same_parameters(learners, reference)


def test_fragments_with_replies_inside_the_overlap_equal_streaming_diloco(
    tmp_path: Path,
) -> None:
    shared: dict[str, Any] = {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "mixing": 0.5}
    _, reference = _run(_config("streaming_diloco", tmp_path / "s", diloco=DiLoCoOptions(**shared)))
    options = DecoupledOptions(**shared, min_quorum=WORKERS, grace="none")
    _, learners = _run(_config("decoupled_diloco", tmp_path / "x", decoupled=options))
    _same_parameters(learners, reference)


def _straggler(tmp_path: Path, late: str) -> TrainConfig:
    options = DecoupledOptions(sync_every=4, fragments=1, late=late)  # type: ignore[arg-type]
    return _config(
        "decoupled_diloco", tmp_path / late, workers=4, steps=24, log_every=1, eval_every=4,
        decoupled=options, speed_factors=[1.0, 1.0, 1.0, 3.0],
    )  # fmt: skip


def test_a_straggler_past_the_grace_window_is_left_out_and_merged_next(
    tmp_path: Path, made: list[Synchronizer]
) -> None:
    summary, _ = _run(_straggler(tmp_path, "next"))
    sync = made[-1]
    merges = [r for r in sync.log if r.fragment == 0]
    # The fast three send at their step 3 at one instant; the straggler (3x slower) reaches
    # its step 3 two merges later: the first merge goes without it, equal weights.
    first = merges[0]
    assert [m for m, _ in first.included] == [0, 1, 2]
    assert first.weights == pytest.approx([1 / 3] * 3)
    # Its fragment, on version 0, arrives late; it is merged into the next merge after its
    # arrival with its own token weight (3 steps of 64 tokens against the others' 4):
    # w = c_tok^2 / c_steps, so 4 : 4 : 4 : 3.
    carried = next(r for r in merges if (3, 0) in r.included)
    assert carried.version > 1 and [m for m, _ in carried.included] == [0, 1, 2, 3]
    assert carried.weights == pytest.approx([4 / 15, 4 / 15, 4 / 15, 3 / 15])
    # It counts toward no quorum: every merge has fresh fragments of the fast three.
    assert all({0, 1, 2} <= {m for m, b in r.included if b == r.version - 1} for r in merges)
    assert sync.dropped_tokens == 0
    # Only the versions a reply not yet taken can need are kept, not one per merge.
    assert len(merges) == 6 and len(sync.history[0]) <= 2
    # The straggler is never waited for: the run lasts the fast learners' 24 steps (within one
    # of the straggler's steps), and it took about a third of the ticks' steps.
    assert summary["modeled_time_s"] <= 24.0 + 3.0
    records = [json.loads(line) for line in (tmp_path / "next" / "metrics.jsonl").open()]
    assert len(records) == 24
    assert sum(len(r["microbatches_per_worker"]) == 4 for r in records) == 8
    assert all(math.isfinite(r["train_loss"]) for r in records)
    assert [r["step"] for r in records if r["val_loss"] is not None] == [3, 7, 11, 15, 19, 23]


def test_late_drop_discards_the_straggler_fragment(
    tmp_path: Path, made: list[Synchronizer]
) -> None:
    _run(_straggler(tmp_path, "drop"))
    sync = made[-1]
    assert all((3, 0) not in r.included for r in sync.log)
    assert any((3, 0) in r.dropped for r in sync.log)
    assert sync.dropped_tokens > 0


def _contribution(
    learner: int, delta: torch.Tensor, arrival: float, tokens: int = 64
) -> Contribution:
    return Contribution(
        learner=learner, outer_gradient=delta, tokens=tokens, steps=1, arrival=arrival,
        base_version=0,
    )  # fmt: skip


def test_a_merge_waits_for_a_learner_whose_clock_is_behind_its_time() -> None:
    """The rule: the merge of a quorum at t (t_q + the window) is applied once every live
    learner without a fresh fragment has a clock of at least t; then Theta <- OuterNesterov(
    Theta, sum w Delta / sum w)."""
    torch.manual_seed(0)
    theta = torch.randn(6)
    options = DecoupledOptions(min_quorum=1, grace="fixed", grace_seconds=0.5, weighting="tokens",
                               outer_lr=0.7, outer_momentum=0.9)  # fmt: skip
    sync = Synchronizer([theta], learners=3, options=options)
    deltas = [torch.randn(6) for _ in range(3)]
    sync.submit(0, _contribution(0, deltas[0], 1.0, tokens=64), 1.0)
    sync.submit(0, _contribution(1, deltas[1], 1.25, tokens=32), 1.0)
    # t = 1.0 + 0.5; learner 2 has sent nothing and its clock is 1.2 < 1.5: not yet.
    sync.advance(
        0, [(0, 1.0, False, 1.0, 0.0), (1, 1.25, False, 1.0, 0.0), (2, 1.2, False, 1.0, 0.0)]
    )
    assert sync.version == [0] and not sync.log
    # Its fragment arrives at 1.75, after t: left out; its clock now passes t.
    sync.submit(0, _contribution(2, deltas[2], 1.75), 1.0)
    sync.advance(
        1, [(0, 2.0, False, 1.0, 0.0), (1, 2.0, False, 1.0, 0.0), (2, 1.75, False, 1.0, 0.0)]
    )
    (record,) = sync.log
    assert record.merge_time == 1.5 and [m for m, _ in record.included] == [0, 1]
    expected = (64 * deltas[0] + 32 * deltas[1]) / 96
    reference = theta.clone()
    OuterNesterov(reference, lr=0.7, momentum=0.9, nesterov=True).step(expected)
    torch.testing.assert_close(sync.params[0], reference, rtol=1e-6, atol=1e-7)
    # The late one is answered at its arrival with the version then current (1).
    late = sync.pending[0][0]
    reply = sync.reply(0, late.ticket, late.contribution)
    assert reply is not None and (reply.leaves, reply.version) == (1.75, 1)


def test_a_run_with_a_fault_trace_replays_and_heals_the_joiner(
    tmp_path: Path, made: list[Synchronizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(
        "step=5 worker=1 crash\nstep=10 worker=1 join\nstep=2 worker=3 slow factor=3 for=100\n"
    )
    healed: list[tuple[bool, float, int]] = []
    heal = decoupled_diloco.DecoupledDiLoCo.heal

    def watched(
        self: decoupled_diloco.DecoupledDiLoCo, source: int, *, joining: bool, kept: bool = False
    ) -> None:
        before = self.comm.counters()["parameter"]  # type: ignore[attr-defined]
        heal(self, source, joining=joining, kept=kept)
        if joining:
            params, _, _ = self.sync.snapshot()
            same = all(
                torch.equal(self.local_fragment(p), values) for p, values in enumerate(params)
            )
            sent = self.comm.counters()["parameter"] - before  # type: ignore[attr-defined]
            healed.append((same, sent, self.inner.state_dict()["step_count"]))

    monkeypatch.setattr(decoupled_diloco.DecoupledDiLoCo, "heal", watched)
    runs = []
    for name in ("a", "b"):
        config = _config(
            "decoupled_diloco", tmp_path / name, workers=4, steps=24, log_every=1, eval_every=8,
            decoupled=DecoupledOptions(sync_every=4), faults=str(trace),
        )  # fmt: skip
        runs.append(_run(config))
    (first, learners), (second, again) = runs
    for a, b in zip(learners, again, strict=True):
        assert torch.equal(a.parameters, b.parameters)
    assert first["final_val_loss"] == second["final_val_loss"]
    faults = first["faults"]
    assert [c["step"] for c in faults["membership_changes"]] == [5, 10]
    assert faults["goodput"] is not None and 0 < faults["goodput"] < 1
    sync = made[-1]
    # The crashed learner contributes nothing from its crash until it joins.
    crashed = [r for r in sync.log if 5 <= r.tick < 10]
    assert crashed and all(m != 1 for r in crashed for m, _ in r.included)
    assert any(m == 1 for r in sync.log if r.tick >= 10 for m, _ in r.included)
    # The joiner (once per run) starts at the synchronizer's Theta with its inner AdamW
    # afresh, and the transfer is charged on its link.
    assert len(healed) == 2
    for same, sent, inner_steps in healed:
        assert same and sent > 0 and inner_steps == 0


def test_a_bf16_wire_is_refused_in_one_line(tmp_path: Path) -> None:
    config = _config("decoupled_diloco", tmp_path / "p", workers=4, comm_dtype="bf16")
    with pytest.raises(ConfigError, match=r"--comm-dtype: bf16 with --method decoupled") as e:
        config.validate()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("workers", [2, 4])
def test_an_elastic_resume_keeps_the_synchronizer_and_starts_every_learner_at_theta(
    workers: int, tmp_path: Path, made: list[Synchronizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 learners, one a straggler (so fragments wait at the synchronizer at the checkpoint),
    stopped after tick 8 and resumed on another --workers: the synchronizer keeps Theta_p,
    its outer momenta, versions and token counts; the fragments not yet merged are dropped,
    their tokens counted discarded; every learner starts by the join rule (at Theta, its base
    the current versions, nothing in flight, its inner AdamW afresh); the run goes on to the
    end on the new count."""
    from lowcomm.train.checkpoint import read_rank_state

    def config(out: Path, count: int, **overrides: Any) -> TrainConfig:
        return _config(
            "decoupled_diloco", out, workers=count, steps=24, log_every=1,
            decoupled=DecoupledOptions(sync_every=4), speed_factors=[1.0] * (count - 1) + [3.0],
            **overrides,
        )  # fmt: skip

    out = tmp_path / "run"
    stopped = config(out, 3, stop_after=9, checkpoint_every=9)
    stopped.validate()
    preflight(stopped)
    train_in_process(stopped)
    saved = read_rank_state(out / "checkpoints" / "step-000009", 0)["strategy"]["synchronizer"]
    pending = sum(int(c["tokens"]) for queue in saved["pending"] for _, c in queue)
    assert pending > 0  # (the straggler's fragments, not yet merged)

    started: list[tuple[bool, bool, int, int]] = []
    remapped = decoupled_diloco.DecoupledDiLoCo._load_remapped

    def watched(self: decoupled_diloco.DecoupledDiLoCo, state: dict[str, Any]) -> None:
        remapped(self, state)
        params, versions, _ = self.sync.snapshot()
        at_theta = all(torch.equal(self.local_fragment(p), v) for p, v in enumerate(params))
        nothing = self.base == versions and all(out is None for out in self.outstanding)
        started.append((at_theta, nothing, self.inner.state_dict()["step_count"], self.ticks))

    monkeypatch.setattr(decoupled_diloco.DecoupledDiLoCo, "_load_remapped", watched)
    resumed = config(out, workers, resume=str(out))
    summary, learners = _run(resumed)
    assert started == [(True, True, 0, 9)] * workers
    sync = made[-1]
    assert sync.learners == workers and sync.live == tuple(range(workers))
    assert sync.committed_tokens >= int(saved["tokens"][0])
    assert sync.discarded_tokens == int(saved["tokens"][2]) + pending
    # The merges after the resume go on from the checkpoint's versions, with the new learners.
    after = [r for r in sync.log if r.tick >= 9]
    assert after and all(r.version > saved["version"][r.fragment] for r in after)
    assert {m for r in after for m, _ in r.included} == set(range(workers))
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(24))
    change = records[9]["membership"]
    assert (change["old_workers"], change["new_workers"]) == (3, workers)
    assert math.isfinite(summary["final_val_loss"]) and len(learners) == workers


def test_bad_options_name_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--decoupled\.min-quorum"):
        DecoupledOptions(min_quorum=0)
    with pytest.raises(ValueError, match=r"--decoupled\.grace-seconds"):
        DecoupledOptions(grace="fixed")
    with pytest.raises(ValueError, match=r"--decoupled\.late"):
        DecoupledOptions(late="keep")  # type: ignore[arg-type]


def test_a_stop_and_resume_continues_exactly(tmp_path: Path) -> None:
    """Stopped mid-run with a straggler's fragment late and replies in flight, then resumed:
    every learner's parameters, the deployed model, the clocks and the bytes equal the
    straight run's."""

    def config(out: Path, **overrides: Any) -> TrainConfig:
        return _config(
            "decoupled_diloco", out, workers=4, steps=24, decoupled=DecoupledOptions(sync_every=4),
            speed_factors=[1.0, 1.0, 1.0, 3.0], **overrides,
        )  # fmt: skip

    _, straight = _run(config(tmp_path / "straight"))
    stopped = config(tmp_path / "resumed", stop_after=11, checkpoint_every=11)
    stopped.validate()
    preflight(stopped)
    train_in_process(stopped)
    _, resumed = _run(config(tmp_path / "resumed", resume=str(tmp_path / "resumed")))
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a.parameters, b.parameters)
        assert torch.equal(a.deployed_parameters, b.deployed_parameters)
        assert a.clock_s == b.clock_s and a.bytes_sent == b.bytes_sent


def test_a_finished_run_extended_with_more_steps_merges_to_its_new_end(
    tmp_path: Path, made: list[Synchronizer]
) -> None:
    """A finished run of 12 steps resumed with --steps 24 (its final checkpoint holds the
    synchronizer after its end's drain): the extension's learners keep sending, and its
    synchronizer keeps merging to the new end. With a constant learning rate (a cosine one
    is stretched to the new total) and a drain at step 12 that had nothing left to merge, the
    two parts make the straight 24-step run's merges and end on its parameters bit for bit."""

    def config(out: Path, steps: int, **overrides: Any) -> TrainConfig:
        return _config(
            "decoupled_diloco", out, steps=steps, decoupled=DecoupledOptions(sync_every=4),
            schedule=ScheduleConfig(kind="constant", warmup_steps=0), **overrides,
        )  # fmt: skip

    def merges(sync: Synchronizer) -> list[tuple[int, int, int, Any]]:
        return [(r.fragment, r.version, r.tick, r.included) for r in sync.log]

    _, straight = _run(config(tmp_path / "straight", 24))
    whole = merges(made[-1])
    _run(config(tmp_path / "extended", 12))
    first = merges(made[-1])
    _, extended = _run(config(tmp_path / "extended", 24, resume=str(tmp_path / "extended")))
    later = merges(made[-1])
    assert later and max(tick for _, _, tick, _ in later) >= 22, later  # (the last merge's)
    assert first + later == whole
    for a, b in zip(straight, extended, strict=True):
        assert torch.equal(a.parameters, b.parameters)
        assert torch.equal(a.deployed_parameters, b.deployed_parameters)
        assert a.clock_s == b.clock_s


def test_no_merge_without_the_minimum_quorum_and_a_stall_at_tau_zero_ends_in_one_line(
    tmp_path: Path, made: list[Synchronizer]
) -> None:
    """K_q = 3 of 3 learners: after a crash no fragment merges until the replacement joins
    (tau = 1, the learners go on alone); at tau = 0 the two survivors both wait for a merge
    that cannot form, and the run ends saying so."""
    trace = tmp_path / "trace.txt"
    trace.write_text("step=2 worker=2 crash\nstep=8 worker=2 join\n")
    options = DecoupledOptions(sync_every=4, fragments=1, min_quorum=3)
    _run(_config("decoupled_diloco", tmp_path / "a", steps=16, decoupled=options,
                 faults=str(trace)))  # fmt: skip
    ticks = [r.tick for r in made[-1].log]
    assert ticks and not [t for t in ticks if 2 <= t < 8]
    assert all(len(r.included) == 3 for r in made[-1].log)
    trace.write_text("step=2 worker=2 crash\n")
    stalled = DecoupledOptions(sync_every=4, fragments=1, overlap_steps=0, min_quorum=3)
    with pytest.raises(Exception, match=r"--decoupled\.overlap-steps: 0 with") as e:
        _run(_config("decoupled_diloco", tmp_path / "b", decoupled=stalled, faults=str(trace)))
    assert "\n" not in str(e.value).strip()


def test_the_pace_follows_the_live_learners(tmp_path: Path) -> None:
    """The fast learner of two crashes: the straggler, ahead of its last clock, steps at the
    next tick rather than every learner idling (which would leave the step without a row)."""
    trace = tmp_path / "trace.txt"
    trace.write_text("step=4 worker=0 crash\n")
    config = _config(
        "decoupled_diloco", tmp_path / "a", workers=2, steps=8, log_every=1,
        decoupled=DecoupledOptions(sync_every=4, fragments=1), faults=str(trace),
        speed_factors=[1.0, 3.0],
    )  # fmt: skip
    _run(config)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    assert [len(r["microbatches_per_worker"]) for r in records] == [2, 1, 1, 2, 1, 1, 1, 1]
    assert all(math.isfinite(r["train_loss"]) for r in records)


def test_replicas_fed_the_same_contributions_merge_alike_and_keep_their_own_replies() -> None:
    """Two replicas of the synchronizer (one per learner, as in worker processes), each fed
    every learner's contributions at each tick's end: the same tickets, merges and Theta, bit
    for bit; each answers its own learner only, so the versions kept stay bounded although
    the other learner's replies are never taken from it."""
    torch.manual_seed(0)
    theta = torch.randn(6)
    options = DecoupledOptions(min_quorum=2, grace="none", outer_lr=0.7, outer_momentum=0.9)
    replicas = [Synchronizer([theta], learners=2, options=options, owners=(m,)) for m in (0, 1)]
    tickets: list[list[int]] = [[], []]
    for tick in range(6):
        sent = [
            (0, _contribution(m, torch.randn(6), float(tick), tokens=32 * (m + 1)), 1.0)
            for m in (0, 1)
        ]
        sent = [(p, replace(c, base_version=tick), s) for p, c, s in sent]
        rows = [(m, tick + 0.5, False, 1.0, 0.0) for m in (0, 1)]
        for m, sync in enumerate(replicas):
            sync.advance(tick, rows, sent)
            ticket = sync.issued[(m, 0)]
            reply = sync.reply(0, ticket, sent[m][1])
            assert reply is not None and reply.version == tick + 1
            tickets[m].append(ticket)
    a, b = replicas
    assert torch.equal(a.params[0], b.params[0]) and a.version == b.version == [6]
    assert [(r.included, r.weights) for r in a.log] == [(r.included, r.weights) for r in b.log]
    assert tickets[0] == [2 * t for t in range(6)] and tickets[1] == [2 * t + 1 for t in range(6)]
    for sync in replicas:
        assert not sync.unreplied and not sync.merged and len(sync.history[0]) <= 2


def test_a_checkpoint_of_replicas_gives_one_shared_synchronizer_every_learners_replies() -> None:
    """Two replicas (worker processes) merge both learners' fragments (learner 1's in before
    the merge time), and neither learner has taken its reply yet; each replica holds its own
    learner's reply and the versions it needs only. Resumed in one
    process, the shared synchronizer loads the first learner's state and adds the second's
    reply from the second's: both learners are answered with the merge, as by the replicas."""
    torch.manual_seed(0)
    theta = torch.randn(6)
    options = DecoupledOptions(min_quorum=2, grace="none", outer_lr=0.7, outer_momentum=0.9)
    replicas = [Synchronizer([theta], learners=2, options=options, owners=(m,)) for m in (0, 1)]
    sent = [(0, _contribution(m, torch.randn(6), 2.0 - m), 1.0) for m in (0, 1)]
    rows = [(m, 2.5, False, 1.0, 0.0) for m in (0, 1)]
    for sync in replicas:
        sync.advance(0, rows, sent)
    assert [len(sync.merged) for sync in replicas] == [1, 1]
    saved = [sync.state_dict() for sync in replicas]
    shared = Synchronizer([theta], learners=2, options=options)
    for state in saved:
        shared.load_state_dict(state, once=True)
    for m, sync in enumerate(replicas):
        ticket = sync.issued[(m, 0)]
        want = sync.reply(0, ticket, sent[m][1])
        got = shared.reply(0, ticket, sent[m][1])
        assert want is not None and got is not None
        assert (got.leaves, got.version, got.merged) == (want.leaves, want.version, want.merged)
        assert torch.equal(got.values, want.values)
