"""decoupled_diloco with learners of several ranks (--ranks-per-worker 2, replicated, as
threads): each rank holds the learner's replica and a replica of the synchronizer, sends its
slice of each fragment on its own outer link and reassembles each reply over the learner's
ranks. With a crash, a join and a straggler in the trace it gives the losses of one rank per
learner with the union micro-batch, and the ranks of a learner stay bit-equal."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.launch.inprocess import train_in_process
from lowcomm.launch.run import preflight, run_training
from lowcomm.models import ModelConfig
from lowcomm.strategies.decoupled_diloco import DecoupledOptions

WORKERS = 3
STEPS = 12

#: Worker 2 crashes while its first fragment is in flight and joins again (healed from a
#: live learner's synchronizer), and worker 0 runs 3x slower for a while, so merges go
#: without it and its fragments come late.
TRACE = """\
step=3    worker=2  crash
step=7    worker=2  join
step=1    worker=0  slow factor=3 for=5
"""


#: The per-step fields two placements of the same run must give alike.
EVENTS = ("quorum", "membership_events", "bytes_sent_per_worker")


def _config(out: Path, trace: Path, *, ranks: int, **overrides: Any) -> TrainConfig:
    """R ranks per learner, each with micro-batches of 4 / R samples: a learner computes the
    same union micro-batch of 4 whatever R. The inner link is free (``none``), so both
    layouts charge the same modeled time to a step and the learners' pace, merges and
    replies follow the same schedule."""
    options: dict[str, Any] = dict(
        workers=WORKERS, workers_per_process=WORKERS, ranks_per_worker=ranks, steps=STEPS,
        network="wan", inner_network="none", clock="virtual", seconds_per_microbatch=0.01,
        eval_every=4, eval_batches=2, log_every=1, progress=False, plot=False, out=str(out),
        decoupled=DecoupledOptions(sync_every=4, fragments=2), faults=str(trace),
        fault_detection_s=2.5,
    )  # fmt: skip
    return with_options(
        TrainConfig(
            method="decoupled_diloco",
            model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=4 // ranks),
        ),
        **{**options, **overrides},
    )


def _run(config: TrainConfig) -> tuple[list[dict[str, Any]], dict[str, Any], list[Any]]:
    """metrics.jsonl, summary.json and every rank's summary (parameters kept)."""
    config.validate()
    preflight(config)
    ranks = train_in_process(config, keep_parameters=True)
    out = Path(str(config.run.out))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((out / "summary.json").read_text()), ranks


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-6) or (math.isnan(a) and math.isnan(b))


def _same_numbers(
    tmp_path: Path, configs: dict[str, TrainConfig], fields: tuple[str, ...]
) -> list[list[dict[str, Any]]]:
    """Run each config and assert the second's metrics equal the first's step by step: the
    losses to 1e-6, the modeled time to 1e-9 s and ``fields`` exactly; the records."""
    for config in configs.values():
        assert run_training(config, report=None) is not None
    read = [
        [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in configs
    ]
    assert len(read[1]) == len(read[0]) == STEPS
    for got, want in zip(read[1], read[0], strict=True):
        for name in ("train_loss", "val_loss"):
            assert _close(got[name], want[name]), (name, got, want)
        assert abs(got["clock_s"] - want["clock_s"]) <= 1e-9
        for name in fields:
            assert got.get(name) == want.get(name), (name, got, want)
    return read


def test_two_ranks_per_learner_give_the_losses_of_one(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(TRACE)
    one, one_summary, learners = _run(_config(tmp_path / "one", trace, ranks=1))
    two, two_summary, ranks = _run(_config(tmp_path / "two", trace, ranks=2))
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(STEPS))
    for got, want in zip(two, one, strict=True):
        for name in ("train_loss", "val_loss"):
            assert _close(got[name], want[name]), (name, got, want)
        for name in ("quorum", "membership_events", "committed_steps"):
            assert got.get(name) == want.get(name), (name, got, want)
    assert _close(two_summary["final_val_loss"], one_summary["final_val_loss"])
    assert two_summary["committed_tokens"] == one_summary["committed_tokens"]
    assert (
        two_summary["faults"]["membership_changes"] == one_summary["faults"]["membership_changes"]
    )
    # The ranks of a learner hold the same replica, bit for bit, and the same deployed
    # model; each equals the one-rank learner's to float rounding.
    assert len(ranks) == 2 * WORKERS
    for worker, learner in enumerate(learners):
        first, second = ranks[2 * worker], ranks[2 * worker + 1]
        assert torch.equal(first.parameters, second.parameters)
        assert torch.equal(first.deployed_parameters, second.deployed_parameters)
        torch.testing.assert_close(first.parameters, learner.parameters, rtol=1e-5, atol=1e-6)
    # Each rank sent its half of every fragment and reply on its own outer link: a learner's
    # two ranks together sent what the one-rank learner did (the fragments' lengths are even).
    outer = two_summary["levels"]["outer"]["bytes_sent_per_rank"]
    assert outer > 0
    assert 2 * outer == pytest.approx(one_summary["bytes_sent_per_worker"], rel=1e-9)


def test_the_inner_link_carries_the_reassembled_replies_and_keeps_the_ranks_equal(
    tmp_path: Path,
) -> None:
    """On a priced inner link the per-step gradient average and each reply's reassembly are
    charged to it; the ranks of a learner still agree bit for bit."""
    trace = tmp_path / "trace.txt"
    trace.write_text(TRACE)
    config = _config(tmp_path / "two", trace, ranks=2, inner_network="datacenter")
    records, summary, ranks = _run(config)
    assert len(records) == STEPS and all(math.isfinite(r["train_loss"]) for r in records)
    assert summary["levels"]["inner"]["bytes_sent_per_rank"] > 0
    for worker in range(WORKERS):
        assert torch.equal(ranks[2 * worker].parameters, ranks[2 * worker + 1].parameters)


@pytest.mark.slow
def test_learners_of_two_ranks_in_two_processes_give_the_numbers_of_one_process(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text(TRACE.replace("worker=2", "worker=3"))
    placement: dict[str, Any] = {"workers": 4, "ranks_per_worker": 2}
    one = _config(tmp_path / "one", trace, ranks=2, workers_per_process=4, **placement)
    two = _config(tmp_path / "two", trace, ranks=2, workers_per_process=2, **placement)
    _same_numbers(tmp_path, {"one": one, "two": two}, EVENTS)


@pytest.mark.slow
def test_a_process_per_rank_without_faults_gives_the_numbers_of_rank_threads(
    tmp_path: Path,
) -> None:
    """Without faults a learner's ranks may be processes of their own (every rank a replica
    of the synchronizer, fed over the uncharged group), with a straggler among the learners."""
    placement: dict[str, Any] = {"workers": 2, "faults": None, "speed_factors": [1.0, 3.0]}
    threads = _config(tmp_path / "threads", tmp_path, ranks=2, workers_per_process=2, **placement)
    processes = _config(tmp_path / "processes", tmp_path, ranks=2, workers_per_process=1,
                        inner_network="datacenter", **placement)  # fmt: skip
    threads.comm.inner_network = "datacenter"
    _same_numbers(tmp_path, {"threads": threads, "processes": processes}, EVENTS[2:])


@pytest.mark.slow
def test_a_process_per_rank_replays_the_trace_of_rank_threads(tmp_path: Path) -> None:
    """With faults too a learner's ranks may be processes of their own: the crashed learner's
    two processes are killed and two standbys take its join, and every number equals the
    threads' (each process keeps a replica of the synchronizer, fed the same contributions)."""
    trace = tmp_path / "trace.txt"
    trace.write_text(TRACE)
    link: dict[str, Any] = {"inner_network": "datacenter"}
    threads = _config(tmp_path / "threads", trace, ranks=2, workers_per_process=WORKERS, **link)
    processes = _config(tmp_path / "processes", trace, ranks=2, workers_per_process=1, **link)
    read = _same_numbers(tmp_path, {"threads": threads, "processes": processes}, EVENTS)
    assert any(record.get("membership_events") for record in read[0])


def test_on_the_real_clock_the_ranks_of_a_learner_take_each_reply_together(
    tmp_path: Path,
) -> None:
    """On the real clock each rank reads its own clock, so a reply arrives at a different
    moment on each; the ranks take it at the same step boundary (once it is in on all of
    them) and send what their slices agree on, so a learner's ranks stay bit-equal through a
    crash, a join and a straggler."""
    trace = tmp_path / "trace.txt"
    trace.write_text(TRACE)
    config = _config(
        tmp_path / "out", trace, ranks=2, clock="real", seconds_per_microbatch=None,
        inner_network="datacenter", fault_detection_s=0.05,
    )  # fmt: skip
    records, summary, ranks = _run(config)
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["quorum"] for r in records][2:8] == [3, 2, 2, 2, 2, 3]
    assert summary["committed_tokens"] > 0
    for worker in range(WORKERS):
        assert torch.equal(ranks[2 * worker].parameters, ranks[2 * worker + 1].parameters)
        assert torch.equal(
            ranks[2 * worker].deployed_parameters, ranks[2 * worker + 1].deployed_parameters
        )


def test_a_sharded_learner_is_refused_in_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path / "out", tmp_path / "t", ranks=2, faults=None, worker_sharding="fsdp")
    with pytest.raises(ConfigError, match=r"decoupled_diloco.*whole fragments") as caught:
        config.validate()
    assert "\n" not in str(caught.value)


def test_a_resume_with_other_ranks_per_learner_keeps_each_learners_own_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpointed with one rank per learner (one a straggler, so the learners' states
    differ), resumed with two: each learner's two ranks take that learner's own state (its
    parameters, base versions, counters and fragments in flight) and stay bit-equal."""
    from lowcomm.strategies import decoupled_diloco
    from lowcomm.train.checkpoint import read_rank_state

    def config(ranks: int, **overrides: Any) -> TrainConfig:
        return _config(
            tmp_path / "run", tmp_path / "none", ranks=ranks, workers=2, workers_per_process=2,
            faults=None,
            speed_factors=[1.0, 3.0], data=DataConfig(micro_batch_size=2), **overrides,
        )  # fmt: skip

    stopped = config(1, stop_after=6, checkpoint_every=6)
    stopped.validate()
    preflight(stopped)
    train_in_process(stopped)
    old = [read_rank_state(tmp_path / "run" / "checkpoints" / "step-000006", w) for w in (0, 1)]
    loaded: list[tuple[int, Any, torch.Tensor]] = []
    load = decoupled_diloco.DecoupledDiLoCo.load_state_dict

    def watched(self: decoupled_diloco.DecoupledDiLoCo, state: dict[str, Any]) -> None:
        load(self, state)
        mine = self.state_dict()["learner"]
        del mine["posted"]  # (read from the clock, restored after the strategy)
        loaded.append((self.learner, mine, self.master.clone()))

    monkeypatch.setattr(decoupled_diloco.DecoupledDiLoCo, "load_state_dict", watched)
    _, _, ranks = _run(config(2, resume=str(tmp_path / "run")))
    assert sorted(learner for learner, _, _ in loaded) == [0, 0, 1, 1]
    for learner, mine, master in loaded:
        saved = old[learner]["strategy"]
        expected = dict(saved["learner"])
        del expected["posted"]
        assert repr(mine) == repr(expected)
        assert torch.equal(master, saved["master"])
    assert old[0]["strategy"]["step_index"] != old[1]["strategy"]["step_index"]
    for worker in (0, 1):
        assert torch.equal(ranks[2 * worker].parameters, ranks[2 * worker + 1].parameters)
