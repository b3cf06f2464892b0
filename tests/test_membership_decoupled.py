"""--membership torchft with decoupled_diloco on the virtual clock: each tick is one torchft
round (quorum, an all-gather of the tick's posted clocks and sent fragments, commit), and every
live worker's replica of the synchronizer merges the same contributions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.membership.options import membership_refusal
from lowcomm.strategies.decoupled_diloco import DecoupledOptions
from test_membership_torchft import _config, _follows_static, _needs_torchft, _record

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


def _synchronizer(directory: Path, step: int) -> dict[str, Any]:
    """The synchronizer replica in the worker's checkpoint of ``step``."""
    from lowcomm.train.checkpoint import read_rank_state, step_directory

    state = read_rank_state(step_directory(directory, step), 0)
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


#: Worker 2 is SIGKILLed at step 10 and a new process started in its slot once the others
#: reach step 20; worker 0 sleeps 3 times each step's wall time, so that the survivors
#: still train while the new process starts (the virtual clock does not pace them).
TRACE = """\
step=10  worker=2  crash
step=20  worker=2  join
step=0   worker=0  slow factor=4
"""


@pytest.mark.slow
def test_decoupled_diloco_survives_a_kill_and_the_restarted_worker_heals(tmp_path: Path) -> None:
    _needs_torchft()
    from lowcomm.launch.run import run_training

    steps = 160
    trace = tmp_path / "trace.txt"
    trace.write_text(TRACE)
    out = tmp_path / "job"
    config = _config(
        "decoupled_diloco", out, steps, clock="virtual", seconds_per_microbatch=0.01,
        checkpoint_every=1000, faults=str(trace), **DECOUPLED,
    )  # fmt: skip
    run_training(config, report=None)
    job = json.loads((out / "membership.json").read_text())
    codes = {slot: [w["exit_code"] for w in workers] for slot, workers in job["workers"].items()}
    assert codes == {"0": [0], "1": [0], "2": [-9, 0]}, codes
    dirs = [out / "worker0", out / "worker1", out / "worker2.1"]
    survivors, joiner = [_record(d) for d in dirs[:2]], _record(dirs[2])
    for record in survivors:
        quorums = [e["members"] for e in record["events"] if e["event"] == "quorum"]
        # (the dead one out at a quorum, and the joiner in at a later one)
        out_at = quorums.index([0, 1])
        assert [0, 1, 2] in quorums[out_at:] and quorums[-1] == [0, 1, 2], quorums
    healed = [e for e in joiner["events"] if e["event"] == "healed"]
    assert len(healed) == 1 and healed[0]["bytes"] > 0, joiner["events"]
    first_quorum = next(e for e in joiner["events"] if e["event"] == "quorum")
    assert first_quorum["participants"] == 2, first_quorum  # (it sat out the round it healed in)
    # At the end every replica of the synchronizer holds the same global state, bit for bit
    # (the replies each keeps for its own learner aside), and so deploys the same model.
    replicas = [_synchronizer(d, steps) for d in dirs]
    shared = ("params", "outer", "version", "pending", "tickets", "tick", "live", "tokens")
    for replica in replicas[1:]:
        for name in shared:
            assert _same_bits(replica[name], replicas[0][name]), name
    assert replicas[0]["live"] == [0, 1, 2]
    # (and the synchronizer merged all along: each fragment about every H steps)
    assert min(replicas[0]["version"]) > steps // 8, replicas[0]["version"]


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"clock": "real"}, "--clock real: each worker process reads its own clock"),
        ({"ranks_per_worker": 2}, "--ranks-per-worker 2 is not yet supported"),
        ({"resume": "somewhere"}, "--resume is not yet supported"),
    ],
)
def test_decoupled_diloco_refusals(options: dict[str, Any], reason: str) -> None:
    config = with_options(TrainConfig(method="decoupled_diloco"), membership="torchft", **options)
    with pytest.raises(ConfigError, match=reason) as error:
        config.validate()
    assert "\n" not in str(error.value)


def test_decoupled_diloco_runs_on_the_virtual_clock() -> None:
    config = with_options(TrainConfig(method="decoupled_diloco"), membership="torchft")
    assert config.comm.clock == "virtual" and membership_refusal(config) is None
