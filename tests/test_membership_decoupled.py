"""--membership torchft with decoupled_diloco: each tick is one torchft round (quorum, an
all-gather of the tick's posted clocks and sent fragments, commit), and every live worker's
replica of the synchronizer (every rank's, with several ranks per worker) merges the same
contributions; through a kill and a restart (one rank and two, the virtual clock and the
real one), and stopped and resumed (cluster workers: test_membership_decoupled_cluster.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import TrainConfig, with_options
from lowcomm.membership.options import membership_refusal
from lowcomm.strategies.decoupled_diloco import DecoupledOptions
from test_membership_torchft import (
    _config,
    _follows_static,
    _lines,
    _needs_torchft,
    _quorum_without_2,
    _record,
    _wait_for,
)

#: A 5 ms link: a fragment's reply comes back within a few steps, so merges happen often.
DECOUPLED = {"decoupled": DecoupledOptions(sync_every=4, fragments=2), "latency_ms": 5.0}


@pytest.mark.slow
def test_no_fault_decoupled_diloco_follows_the_static_trajectory(tmp_path: Path) -> None:
    _needs_torchft()
    records = _follows_static("decoupled_diloco", tmp_path, steps=12, **DECOUPLED)
    for record in records:
        assert record["dropped_rounds"] == 0
        # (one round per tick and one at the end, besides the startup round)
        assert record["commits"] == 1 + 12 + 1, record["commits"]
    # The replies came back and were taken: the learners trained on merged fragments.
    rows = [
        json.loads(line) for line in (tmp_path / "torchft" / "worker0" / "metrics.jsonl").open()
    ]
    assert sum(r["extras"]["syncs_completed"] for r in rows) >= 2


def _synchronizer(directory: Path, step: int, rank: int = 0) -> dict[str, Any]:
    """The synchronizer replica in the worker's checkpoint of ``step`` (its rank ``rank``'s)."""
    from lowcomm.train.checkpoint import read_rank_state, step_directory

    state = read_rank_state(step_directory(directory, step), rank)
    found = [
        v["synchronizer"] for v in state.values() if isinstance(v, dict) and "synchronizer" in v
    ]
    assert len(found) == 1, sorted(state)
    return dict(found[0])


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


#: Worker 0 sleeps 3 times each step's wall time (a replayed slowdown), so that the survivors
#: still train while a restarted process starts: the virtual clock does not pace them. With 2
#: ranks, 1.5: at 4 the group's measured step times were seen to grow threefold from step to
#: step (each holding the sleep of the one before), which stalls the job within 10 steps.
PACE = {1: "step=0  worker=0  slow factor=4\n", 2: "step=0  worker=0  slow factor=1.5\n"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "clock"),
    [(1, "virtual"), (2, "virtual"), (1, "real"), pytest.param(2, "real", marks=pytest.mark.long)],
)
def test_decoupled_diloco_survives_a_kill_and_the_restarted_worker_heals(
    tmp_path: Path, ranks: int, clock: str
) -> None:
    """With 2 ranks per worker the kill takes the whole group, and each rank of the restarted
    one is healed from the same rank of a live worker (its slice of the replica's bytes,
    completed among its ranks). On the real clock the restarted process's clock, read from
    its own start, takes the job's time the replica names when it heals."""
    _needs_torchft()
    from lowcomm.membership.local import LocalJob

    steps = 160 * ranks
    trace = tmp_path / "pace.txt"
    trace.write_text(PACE[ranks])
    timing = {"seconds_per_microbatch": 0.01} if clock == "virtual" else {}
    config = _config(
        "decoupled_diloco", tmp_path / "job", steps, clock=clock, checkpoint_every=1000,
        faults=str(trace), ranks_per_worker=ranks, **timing, **DECOUPLED,
    )  # fmt: skip
    with LocalJob(config) as job:
        job.start_all()
        _wait_for(lambda: _lines(job.worker_dir(2, 0) / "metrics.jsonl") >= 10, "10 steps")
        killed = job.kill(2)  # (anywhere in its tick: its round may be cut mid-gather)
        _wait_for(lambda: _quorum_without_2(job.worker_dir(0, 0), killed), "a new quorum")
        job.start(2)
        codes = job.wait(300)
        dirs = [job.worker_dir(0, 0), job.worker_dir(1, 0), job.worker_dir(2, 1)]
    assert codes[0] == [0] and codes[1] == [0], codes  # the survivors finish
    assert codes[2][0] == -9 and codes[2][1] == 0, codes  # killed, then the joiner finishes
    survivors = [_record(d) for d in dirs[:2]]
    for record in survivors:
        after = [e for e in record["events"] if e["event"] == "quorum" and e["time"] > killed]
        # The dead one is out at the quorum formed once its heartbeat timed out (a round
        # whose quorum still held it could not commit: dropped, and tried again), and the
        # joiner in at a later one.
        out = next(i for i, e in enumerate(after) if e["members"] == [0, 1])
        assert all(e["members"] == [0, 1, 2] for e in after[:out]), after
        assert record["dropped_rounds"] >= out
        assert after[-1]["members"] == [0, 1, 2], after
    for name in ["membership.json"] + [f"membership.rank{r}.json" for r in range(1, ranks)]:
        record = json.loads((dirs[2] / name).read_text())
        healed = [e for e in record["events"] if e["event"] == "healed"]
        assert len(healed) == 1 and healed[0]["bytes"] > 0, record["events"]
        first_quorum = next(e for e in record["events"] if e["event"] == "quorum")
        assert first_quorum["participants"] == 2, first_quorum  # (it sat its round out)
        if ranks > 1:  # (its slice of the replica's bytes, completed among its ranks)
            assert 0 < healed[0]["bytes"] < healed[0]["state_bytes"], healed[0]
        if clock == "real":  # (its own clock was behind the job's, which it took)
            assert healed[0]["clock_to"] > healed[0]["clock_from"], healed[0]
        else:  # (the join rule's modeled wait moves a virtual clock)
            assert "clock_to" not in healed[0], healed[0]
    if clock == "real":
        # Its clock ends with the survivors' (which it would have trailed by the jump had it
        # kept its own), so the synchronizer's merges never waited for it to catch up.
        jump = healed[0]["clock_to"] - healed[0]["clock_from"]
        ends = [json.loads((d / "summary.json").read_text())["modeled_time_s"] for d in dirs]
        assert ends[2] > min(ends[:2]) - jump / 2, (ends, jump)
    # At the end every replica of the synchronizer (every rank's) holds the same global
    # state, bit for bit (the replies each keeps for its own learner aside), and so deploys
    # the same model.
    replicas = [_synchronizer(d, steps, rank) for d in dirs for rank in range(ranks)]
    _same_replicas(replicas)
    assert replicas[0]["live"] == [0, 1, 2]
    # (and the synchronizer merged all along: each fragment about every H steps)
    assert min(replicas[0]["version"]) > steps // 8, replicas[0]["version"]


def test_decoupled_diloco_runs_on_either_clock_with_ranks_and_resume() -> None:
    config = with_options(TrainConfig(method="decoupled_diloco"), membership="torchft")
    assert membership_refusal(config) is None
    assert membership_refusal(with_options(config, resume="somewhere")) is None
    assert membership_refusal(with_options(config, ranks_per_worker=2)) is None
    assert membership_refusal(with_options(config, clock="real")) is None


class _HealingSource:
    """A torchft Manager that is a joiner's healing source: its quorum thread completes the
    quorum only once it has read the state, which waits for the state-dict lock."""

    def __init__(self) -> None:
        import threading
        from concurrent.futures import Future

        self._quorum_future: Future[None] = Future()
        self.readable = threading.Event()

        def quorum_thread() -> None:
            if self.readable.wait(timeout=30.0):
                self._quorum_future.set_result(None)

        threading.Thread(target=quorum_thread, daemon=True).start()

    def allow_state_dict_read(self) -> None:
        self.readable.set()

    def num_participants(self) -> int:
        self._quorum_future.result(timeout=30.0)
        return 2


def test_a_step_that_needs_its_quorum_before_its_round_lets_the_joiner_heal() -> None:
    """decoupled_diloco prices a fragment's send by the round's participants before it
    reaches the round: a worker that opened that round early, holding the state-dict lock,
    lets its quorum thread read the state for a joiner instead of waiting for it."""
    _needs_torchft()
    from lowcomm.membership.torchft_comm import Replica, TorchftComm, _EarlyRound

    replica = object.__new__(Replica)
    replica.manager = _HealingSource()
    replica._early = _EarlyRound(holding=True)  # (the round opened early)
    replica._round_open, replica._last_quorum = True, -1
    comm = TorchftComm(replica)
    comm.start()
    assert comm.world_size == 2
    assert not replica._early.holding


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): float(r["train_loss"]) for r in rows}


#: The synchronizer's state every replica holds alike (the replies each keeps for its own
#: learner aside).
SHARED = ("params", "outer", "version", "pending", "tickets", "tick", "live", "tokens")


def _same_replicas(replicas: list[dict[str, Any]]) -> None:
    for replica in replicas[1:]:
        for name in SHARED:
            assert _same_bits(replica[name], replicas[0][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_stopped_and_resumed_job_follows_the_uninterrupted_one(
    tmp_path: Path, ranks: int
) -> None:
    """A local job stopped after step 7 (fragments in flight) and resumed (--resume OUT),
    each worker from its own checkpoint, which holds its replica of the synchronizer (each
    rank's file its own): every worker's losses are the uninterrupted job's, and every
    replica ends equal to the uninterrupted job's, bit for bit."""
    _needs_torchft()
    from lowcomm.launch.run import run_training

    steps, stop = 12, 7
    common = {"clock": "virtual", "seconds_per_microbatch": 0.01, "checkpoint_every": 2,
              "ranks_per_worker": ranks, **DECOUPLED}  # fmt: skip
    run_training(_config("decoupled_diloco", tmp_path / "whole", steps, **common), report=None)
    job = tmp_path / "job"
    stopped = _config("decoupled_diloco", job, steps, stop_after=stop, **common)
    run_training(stopped, report=None)
    for slot in range(3):
        assert sorted(_losses(job / f"worker{slot}")) == list(range(stop)), slot
        # (Each worker's checkpoint holds its replica: they agree.)
    _same_replicas([_synchronizer(job / f"worker{k}", stop, r) for k in range(3)
                    for r in range(ranks)])  # fmt: skip
    resumed = _config("decoupled_diloco", job, steps, resume=str(job), **common)
    resumed.run.out = None
    run_training(resumed, report=None)
    replicas = []
    for slot in range(3):
        whole, again = tmp_path / "whole" / f"worker{slot}", job / f"worker{slot}"
        want, got = _losses(whole), _losses(again)
        assert sorted(got) == list(range(steps)), slot
        for step in range(steps):
            assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), (slot, step)
        assert not [e for e in _record(again)["events"] if e["event"] == "healed"]
        replicas += [_synchronizer(again, steps, r) for r in range(ranks)]
    _same_replicas([_synchronizer(tmp_path / "whole" / "worker0", steps), *replicas])
    assert min(replicas[0]["version"]) >= 2, replicas[0]["version"]  # (it merged)


def test_a_replica_read_for_healing_after_its_ticks_exchange_is_refused() -> None:
    """torchft reads a live learner's replica inside a round's quorum, which may be mid-tick
    (after the send's pricing released the lock): the tick's exchange waits for that quorum,
    so the replica read is the last tick's. One read after the exchange, which would hand a
    joiner the round's merges to apply again, is refused."""
    import torch

    from lowcomm.strategies.decoupled_diloco import DecoupledDiLoCo, Synchronizer

    learner = object.__new__(DecoupledDiLoCo)
    learner.learner, learner.step_index = 0, 5
    learner.sync = Synchronizer(
        [torch.zeros(4)], learners=2, options=DecoupledOptions(sync_every=4), owners=(0,)
    )
    learner.sync.advance(3, [(0, 1.0, False, 0.1, 0.0), (1, 1.0, False, 0.1, 0.0)])
    learner.ticks, learner.stepping = 4, False  # (between ticks 3 and 4)
    tensors, counters = learner.healing_payload()
    assert len(tensors) == 1 and counters == {"step_index": 5}
    learner.ticks, learner.stepping = 5, True  # (inside tick 4, before its exchange)
    learner.healing_payload()
    learner.sync.advance(4, [(0, 2.0, False, 0.1, 0.0), (1, 2.0, False, 0.1, 0.0)])
    with pytest.raises(RuntimeError, match="a quorum must form before the tick's exchange"):
        learner.healing_payload()  # (inside tick 4, after its exchange)


@pytest.mark.slow
def test_no_fault_learners_of_two_ranks_follow_the_static_trajectory(tmp_path: Path) -> None:
    """Each worker is 2 processes: rank r of a learner moves its slice of each tick's round
    to rank r of the others, and charges its slice of each fragment on its outer link, as
    the static run's learners of 2 ranks do."""
    _needs_torchft()
    steps = 12
    common = {"ranks_per_worker": 2, "checkpoint_every": 1000, **DECOUPLED}
    records = _follows_static("decoupled_diloco", tmp_path, steps=steps, **common)
    assert all(record["dropped_rounds"] == 0 for record in records)
    live = tmp_path / "torchft"
    # Every rank of every learner holds the same replica, which merged.
    replicas = [_synchronizer(live / f"worker{k}", steps, rank) for k in range(3)
                for rank in range(2)]  # fmt: skip
    _same_replicas(replicas)
    assert min(replicas[0]["version"]) >= 2, replicas[0]["version"]
