"""--membership torchft with --worker-sharding fsdp: each worker is one torchft replica group
of R processes whose model FSDP2 shards over the group's own ranks (a mesh of that group
alone); rank r's shard is exchanged between workers through rank r's own torchft Manager, and
a joining group's rank r is healed with its own shard's declared state from rank r of a live
group.

Each job is workers of 2 ranks of a tiny GPT on a local lighthouse, on the loopback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import TrainConfig
from test_membership_ranks import (
    ON_THE_CLOCK,
    _follow_the_static_losses,
    _healed_once,
    _kill_and_restart_worker_2,
    _needs_torchft,
    _ranks_config,
    _static_losses,
)
from test_membership_torchft import _digests, _record

RANK_FILES = ("membership.json", "membership.rank1.json")


def _fsdp_config(method: str, out: Path, steps: int, **overrides: Any) -> TrainConfig:
    return _ranks_config(method, out, steps, **{"worker_sharding": "fsdp", **overrides})


def _rank_digests(directory: Path) -> list[dict[int, str]]:
    """Each rank's digests of its own shards after every committed round."""
    return [_digests(json.loads((directory / name).read_text())) for name in RANK_FILES]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "ddp"])
def test_sharded_groups_follow_the_static_fsdp_trajectory(tmp_path: Path, method: str) -> None:
    """diloco's outer sync and ddp's per-step mean of each rank's gradient shard."""
    _needs_torchft()
    from lowcomm.launch.run import run_training

    expected = _static_losses(_fsdp_config, method, tmp_path / "static")
    live = tmp_path / "torchft"
    run_training(_fsdp_config(method, live, **ON_THE_CLOCK), report=None)
    assert len(expected) == 8
    _follow_the_static_losses(expected, live)
    # Rank r of each worker holds the same shard after each committed round; the two ranks
    # of a worker hold different shards.
    digests = [_rank_digests(live / f"worker{k}") for k in range(2)]
    assert digests[0] == digests[1]
    rounds = [3, 7] if method == "diloco" else list(range(8))
    assert sorted(digests[0][0]) == sorted(digests[0][1]) == rounds
    assert all(digests[0][0][s] != digests[0][1][s] for s in rounds)


@pytest.mark.slow
def test_a_killed_sharded_group_restarted_heals_each_rank_its_own_shard(tmp_path: Path) -> None:
    """3 workers of 2 ranks, diloco; worker 2's group is SIGKILLed and started again: each of
    its ranks takes its own shard's global state from the same rank of a live group, sits out
    the sync it healed in, and then holds the survivors' shard bit for bit."""
    _needs_torchft()
    _kill_and_restart_worker_2(_fsdp_config("diloco", tmp_path, steps=160, workers=3))
    survivor, joiner = tmp_path / "worker0", tmp_path / "worker2.1"
    healed_bytes = []
    for name in RANK_FILES:
        healed = _healed_once(joiner / name, survivor / name)
        # (its shard's state whole from its peer: nothing to gather among the worker's ranks)
        assert healed["bytes"] == healed["state_bytes"], healed
        assert healed["gathered_bytes"] == 0, healed
        healed_bytes.append(healed["bytes"])
    # Each rank received its own shard's state, not the whole model's: FSDP cuts every
    # parameter into R chunks, so the ranks' shards are of one size but hold other values, and
    # a rank's declared state is a part of what the rank holds.
    mine = _rank_digests(joiner)
    assert mine[0][159] != mine[1][159]
    assert healed_bytes[0] == healed_bytes[1], healed_bytes
    summary = json.loads((survivor / "summary.json").read_text())
    assert healed_bytes[0] < summary["state_bytes_per_rank"]
    assert _record(joiner)["data_position"] == _record(survivor)["data_position"] == 160


@pytest.mark.slow
def test_a_traces_link_events_slow_each_sharded_ranks_link_between_workers(
    tmp_path: Path,
) -> None:
    """A replayed trace's link event is the link between workers, which a sharded rank's own
    communicator is (its inner link, FSDP's, is the worker's own and keeps its pace)."""
    _needs_torchft()
    from lowcomm.launch.run import run_training

    trace = tmp_path / "trace.txt"
    trace.write_text("step=4 link factor=0.25 for=4\n")
    config = _fsdp_config(
        "diloco", tmp_path / "run", 8, clock="virtual", seconds_per_microbatch=0.01,
        faults=str(trace),
    )  # fmt: skip
    assert run_training(config, report=None) is not None
    for slot in range(2):
        lines = (tmp_path / "run" / f"worker{slot}" / "metrics.jsonl").read_text().splitlines()
        comm = [json.loads(line)["exposed_comm_s"] for line in lines]
        # (The virtual clock: a step's inner exposure is the same each step; a sync step's
        # outer exposure is the link's model, exact.)
        inner, synced = comm[2], comm[3] - comm[2]
        assert synced > 0 and comm[6] == pytest.approx(inner, rel=1e-6)
        # The sync at step 7 ran on the link degraded to 1/4 (steps 4 to 7).
        assert comm[7] - comm[6] == pytest.approx(4 * synced, rel=1e-6), slot
