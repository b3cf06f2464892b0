"""--membership torchft with decoupled_diloco on a cluster: each worker a process of its own
that names a running `torchft_lighthouse` (on 127.0.0.1), with its run directory and its
checkpoints, which hold its replica of the synchronizer, on its own disk.

- Workers stopped (--stop-after) and resumed, each from its own checkpoint (--resume of its own
  directory), follow the uninterrupted job's losses and end with its replicas, bit for bit.
- A worker whose newest checkpoint is lost resumes from its older one and is healed at the
  first quorum from the worker that holds the newest: it takes that worker's replica and
  starts by the join rule, and the replicas end equal bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from test_membership_cluster import _cluster, _healed, _lighthouse, _losses, _record
from test_membership_decoupled import _same_replicas, _synchronizer

WORKERS = 2
STEPS = 12
#: Checkpoints every 3 steps, stopped after step 9: every tick is a round, so the
#: checkpoints of steps 6 and 9 hold different torchft steps.
EVERY, STOP = 3, 9

#: The jobs' options: the virtual clock, a 5 ms link (replies come back within a few ticks).
JOB = (
    "--model.n-layer", "1", "--model.n-embd", "32", "--model.n-head", "2",
    "--model.block-size", "16", "--micro-batch-size", "2", "--eval-every", "1000",
    "--eval-batches", "2", "--progress", "False", "--plot", "False", "--log-every", "1",
    "--method", "decoupled_diloco", "--decoupled.sync-every", "4", "--decoupled.fragments", "2",
    "--network", "wan", "--latency-ms", "5", "--membership", "torchft",
    "--workers", str(WORKERS), "--clock", "virtual", "--seconds-per-microbatch", "0.01",
)  # fmt: skip


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job (``whole/wK``, with its last step's checkpoint) and the job
    stopped after step 9 with checkpoints every 3 steps (``stopped/wK``)."""
    root = tmp_path_factory.mktemp("decoupled_cluster")
    every = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
    with _lighthouse() as address:
        _cluster(address, [[*JOB, *every, "--out", str(root / "whole" / f"w{k}")]
                           for k in range(WORKERS)])  # fmt: skip
        stop = [*every, "--stop-after", str(STOP)]
        _cluster(
            address,
            [[*JOB, *stop, "--out", str(root / "stopped" / f"w{k}")] for k in range(WORKERS)],
        )
    return root


def _resume(jobs: Path, name: str) -> list[str]:
    """Each worker continues its own copy of the stopped job's directory (``name/wK``)."""
    with _lighthouse() as address:
        return _cluster(
            address, [["--resume", str(jobs / name / f"w{k}")] for k in range(WORKERS)]
        )  # fmt: skip


@pytest.mark.slow
def test_cluster_workers_resume_their_own_replicas_on_the_uninterrupted_trajectory(
    jobs: Path,
) -> None:
    shutil.copytree(jobs / "stopped", jobs / "resumed")
    _resume(jobs, "resumed")
    for k in range(WORKERS):
        whole, resumed = jobs / "whole" / f"w{k}", jobs / "resumed" / f"w{k}"
        want, got = _losses(whole), _losses(resumed)
        assert sorted(got) == list(range(STEPS)), k
        for step in range(STEPS):
            assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), (k, step)
        assert not _healed(_record(resumed))  # (every worker at one step: none heals)
    replicas = [_synchronizer(jobs / name / f"w{k}", STEPS)
                for name in ("whole", "resumed") for k in range(WORKERS)]  # fmt: skip
    _same_replicas(replicas)
    assert min(replicas[0]["version"]) >= 2, replicas[0]["version"]  # (it merged)


@pytest.mark.slow
def test_a_worker_that_lost_its_newest_checkpoint_heals_the_replica_from_the_newest(
    jobs: Path,
) -> None:
    """Worker 1 resumes from step 6 (its step-9 checkpoint is gone, three rounds behind
    worker 0's): the first quorum heals it from worker 0 with its replica, both train steps
    9 to 11, and the replicas end equal bit for bit."""
    shutil.copytree(jobs / "stopped", jobs / "skewed")
    older = jobs / "skewed" / "w1" / "checkpoints"
    shutil.rmtree(older / f"step-{STOP:06d}")
    (older / "latest").write_text("step-000006\n")
    outputs = _resume(jobs, "skewed")
    assert "healed from one of them" in outputs[1], outputs[1]
    ahead, behind = _record(jobs / "skewed" / "w0"), _record(jobs / "skewed" / "w1")
    healed = _healed(behind)
    assert not _healed(ahead) and len(healed) == 1, behind["events"]
    assert healed[0]["step"] == STOP and healed[0]["bytes"] > 0
    assert sorted(_losses(jobs / "skewed" / "w1"))[-3:] == [STOP, STOP + 1, STOP + 2]
    # Worker 0's first step after the stop is the uninterrupted job's (its replica and its
    # own state are its checkpoint's).
    want, got = _losses(jobs / "whole" / "w0"), _losses(jobs / "skewed" / "w0")
    assert got[STOP] == pytest.approx(want[STOP], rel=1e-6, abs=1e-6)
    _same_replicas([_synchronizer(jobs / "skewed" / f"w{k}", STEPS) for k in range(WORKERS)])
