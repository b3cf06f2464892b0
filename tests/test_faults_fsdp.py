"""Declared faults on sharded workers (``--ranks-per-worker R --worker-sharding fsdp``, a
process per rank): each worker's model is ``fully_shard``-ed over its own ranks' replica group,
rank r's shard goes between workers over rank r's outer group, which follows the quorum; a
crash kills the worker's R processes, and the R standing by for its join take over, each
healed with its own shard's declared state from rank r of a live member (locally or under
torchrun, on either clock). The same trace gives
the numbers of replicated workers (losses to 1e-6; modeled times to 1e-9 s on a free inner
link, where neither placement is charged inside a worker: on a priced one FSDP's all-gathers
and reduce-scatters cost other than a replicated worker's gradient all-reduce)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _faults import STEPS, Run, close, generated_faults, trace_file, trained, under_torchrun
from lowcomm.config import TrainConfig
from lowcomm.train.checkpoint import read_rank_state, step_directory
from test_faults_rank_processes import TRACE, _config


def _sharded(out: Path, trace: Path, **extra: Any) -> TrainConfig:
    return _config("diloco", out, trace, processes=True, worker_sharding="fsdp", **extra)


def _same_losses(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(STEPS))
    for g, w in zip(got, want, strict=True):
        for name in ("train_loss", "val_loss"):
            assert close(g[name], w[name]), (name, g, w)


def _same_numbers(run: Run, reference: Run) -> None:
    """Losses, modeled times, quorums, events and the faults block of the replicated run
    (bytes differ: a sharded worker's ranks send FSDP's collectives, and their shards)."""
    (got, summary), (want, expected) = run, reference
    _same_losses(got, want)
    for g, w in zip(got, want, strict=True):
        assert abs(g["clock_s"] - w["clock_s"]) <= 1e-9, (g, w)
        for name in ("quorum", "membership_events", "dropped"):
            assert g.get(name) == w.get(name), (name, g, w)
    assert summary["faults"].keys() == expected["faults"].keys()
    for key, value in expected["faults"].items():
        if isinstance(value, float):
            assert summary["faults"][key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
        else:
            assert summary["faults"][key] == value, key
    for name in ("modeled_time_s", "compute_s", "exposed_comm_s"):
        assert abs(summary[name] - expected[name]) <= 1e-9, name
    assert summary["committed_tokens"] == expected["committed_tokens"]


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    """The trace (a crash and a join of worker 1, worker 0 straggling over the crash) and
    its run with replicated workers, every rank a thread of one process, on a free inner
    link."""
    folder = tmp_path_factory.mktemp("replicated")
    trace = trace_file(folder, TRACE)
    config = _config("diloco", folder / "out", trace, processes=False, inner_network="none")
    return trace, trained(config)


def test_static_sharded_workers_give_the_replicated_losses_with_an_evaluation_between_syncs(
    tmp_path: Path,
) -> None:
    """No faults. The evaluation after step 2 deploys diloco's global parameters, not the
    training ones, which the next step trains on again."""
    options: dict[str, Any] = {"faults": None, "eval_every": 3}
    want = trained(_config("diloco", tmp_path / "r", tmp_path / "x", processes=False, **options))
    got = trained(_sharded(tmp_path / "s", tmp_path / "x", **options))
    _same_losses(got[0], want[0])
    assert got[0][2]["val_loss"] is not None


def test_a_crash_a_join_and_a_straggler_give_sharded_workers_the_replicated_numbers(
    tmp_path: Path, replicated: tuple[Path, Run], capfd: pytest.CaptureFixture[str]
) -> None:
    trace, reference = replicated
    config = _sharded(tmp_path / "out", trace, inner_network="none")
    run = trained(config)
    _same_numbers(run, reference)
    assert [r["quorum"] for r in run[0]] == [2, 2, 1, 1, 1, 2, 2, 2]
    printed = capfd.readouterr().out
    for rank in (0, 1):  # (worker 1's two processes were killed, as planned)
        assert f"declared crash of worker 1 (rank {rank}) at step 2" in printed
    # The run's last step ends a round: each rank of the joiner (rank slots 2 and 3, written
    # by the processes that took over) holds its own shard, the survivor's rank's bit for bit.
    final = step_directory(Path(str(config.run.out)), STEPS)
    states = [read_rank_state(final, slot) for slot in range(4)]
    assert all(state["fsdp_layout"] is not None for state in states)
    models = [state["model"] for state in states]
    for survivor, joiner in ((0, 2), (1, 3)):
        assert models[joiner].keys() == models[survivor].keys()
        for name, tensor in models[survivor].items():
            assert torch.equal(models[joiner][name], tensor), (survivor, joiner, name)
    assert not torch.equal(models[0]["lm_head.weight"], models[1]["lm_head.weight"])
    # (it took no step while it was out)
    assert states[2]["tokens"] == states[3]["tokens"] < states[0]["tokens"]


def test_the_same_trace_under_torchrun_gives_sharded_workers_the_replicated_numbers(
    tmp_path: Path, replicated: tuple[Path, Run]
) -> None:
    """torchrun's processes are not killed: each rank of the crashed worker loses its shard
    in place and waits outside the quorum until the join heals it."""
    trace, reference = replicated
    flags = ("--inner-network", "none", "--ranks-per-worker", "2", "--worker-sharding", "fsdp")
    _same_numbers(under_torchrun(tmp_path, trace, *flags, processes=4), reference)


def test_a_generated_trace_gives_sharded_workers_the_replicated_numbers(tmp_path: Path) -> None:
    """No process is killed: a crashed worker's R processes keep their shards outside the
    quorum, and at its replacement's join each rank's shard is healed in place (its last
    forward was an evaluation's)."""
    runs = []
    for sharding in ("replicate", "fsdp"):
        config = _config(
            "diloco", tmp_path / sharding, tmp_path / "x", processes=sharding == "fsdp",
            workers=3, worker_sharding=sharding, inner_network="none",
        )  # fmt: skip
        runs.append(trained(generated_faults(config)))
    _same_numbers(runs[1], runs[0])
    changes = runs[1][1]["faults"]["membership_changes"]
    assert [change["step"] for change in changes] == [2, 4, 6]  # (crashes and joins landed)


def test_a_crash_and_join_on_the_real_clock_give_sharded_workers_the_replicated_losses(
    tmp_path: Path, replicated: tuple[Path, Run], capfd: pytest.CaptureFixture[str]
) -> None:
    """The events land on the same steps on either clock, and the losses follow the steps."""
    trace, (want, _) = replicated
    config = _sharded(tmp_path / "out", trace, clock="real", seconds_per_microbatch=None)
    got, summary = trained(config)
    _same_losses(got, want)
    assert [r["quorum"] for r in got] == [2, 2, 1, 1, 1, 2, 2, 2]
    assert summary["faults"]["membership_changes"][0]["quorum"] == 1
    printed = capfd.readouterr().out
    for rank in (0, 1):
        assert f"declared crash of worker 1 (rank {rank}) at step 2" in printed
