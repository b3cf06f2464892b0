"""Reliability: a hung collective times out with a clear error; a worker killed under torchrun
with elastic restarts costs only the steps since the last checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _cli import torchrun
from lowcomm.launch import WorkerFailed, spawn_workers

pytestmark = pytest.mark.slow


def _rank_one_never_joins(hierarchical: bool) -> None:
    """Rank 1 stays alive but never joins an all-reduce (on the world's group, or on the
    replica group of one worker of 2 ranks); rank 0 waits for it."""
    import torch

    from lowcomm.comm.base import Role
    from lowcomm.comm.torch_comm import TorchComm
    from lowcomm.launch.groups import level_comms

    comm = level_comms(2, timeout_s=1.5)[0] if hierarchical else TorchComm(timeout_s=1.5)
    if comm.rank == 1:
        time.sleep(30)  # alive but hung: the launcher cannot tell, only the timeout can
        return
    comm.all_reduce(torch.ones(8), role=Role.GRADIENT).wait()


@pytest.mark.parametrize("hierarchical", [False, True])
def test_a_hung_collective_raises_naming_rank_operation_and_time(hierarchical: bool) -> None:
    """Also inside a hierarchical worker: the replica and outer groups of --ranks-per-worker
    take --collective-timeout-s like the world's (they waited without a limit)."""
    begin = time.perf_counter()
    with pytest.raises(WorkerFailed) as failure:
        spawn_workers(_rank_one_never_joins, 2, (hierarchical,), timeout_s=60)
    message = str(failure.value)
    assert "worker 0 failed:" in message
    assert "CollectiveTimeout: rank 0: all_reduce (gradient) of 32 bytes" in message
    assert "did not complete within 1." in message and "--collective-timeout-s 1.5" in message
    assert time.perf_counter() - begin < 25  # the timeout ended it, not the sleeping peer


def _workers_of(parent: int) -> list[int]:
    """Live child processes of ``parent`` running lowcomm (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"lowcomm" in command:
            found.append(int(entry.name))
    return found


def _steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    steps = []
    for line in metrics.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            steps.append(json.loads(line)["step"])
    return steps


def test_torchrun_restarts_a_killed_worker_from_the_latest_checkpoint(tmp_path: Path) -> None:
    steps, kill_after = 40, 12
    common = [
        "train", "--method", "ddp", "--steps", str(steps), "--checkpoint-every", "5",
        "--model.n-layer", "1", "--model.n-embd", "32", "--model.n-head", "2",
        "--model.block-size", "16", "--micro-batch-size", "2", "--eval-every", "100",
        "--eval-batches", "2", "--progress", "False", "--plot", "False", "--clock", "real", "--network", "wan",
    ]  # fmt: skip
    out = tmp_path / "elastic"
    job = subprocess.Popen(
        [*torchrun(tmp_path), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "-m", "lowcomm", *common, "--resume", "auto", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(_steps(out / "metrics.jsonl")) < kill_after:
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job never reached the kill step"
            time.sleep(0.02)
        workers = _workers_of(job.pid)
        assert len(workers) == 2, workers
        killed_at = len(_steps(out / "metrics.jsonl"))
        os.kill(workers[1], signal.SIGKILL)
        _, stderr = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert killed_at < steps, "the kill came after the run had finished"
    # Each step once, in order: the restarted job truncated what the dead one wrote after its
    # last checkpoint and continued from there.
    assert _steps(out / "metrics.jsonl") == list(range(steps))
    elastic = json.loads((out / "summary.json").read_text())

    # The restarted run ends exactly where an uninterrupted one does (DDP's numbers do not
    # depend on timing, so the real clock does not matter here).
    straight_dir = tmp_path / "straight"
    straight = subprocess.run(
        [sys.executable, "-m", "lowcomm", *common, "--workers", "2", "--out", str(straight_dir)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = json.loads((straight_dir / "summary.json").read_text())
    assert elastic["final_train_loss"] == pytest.approx(expected["final_train_loss"], abs=1e-6)
    assert elastic["final_val_loss"] == pytest.approx(expected["final_val_loss"], abs=1e-6)


def _listening_addresses() -> list[str]:
    """Local addresses of the TCP sockets this process listens on (from /proc)."""
    import torch

    from lowcomm.comm.base import Role
    from lowcomm.comm.torch_comm import TorchComm

    TorchComm().all_reduce(torch.ones(4), role=Role.OTHER).wait()  # the group is connected
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode in inodes and state == "0A":  # LISTEN
                found.append(local.split(":")[0])
    return found


def test_local_workers_listen_on_loopback_only() -> None:
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1
    for rank, addresses in enumerate(spawn_workers(_listening_addresses, 2, timeout_s=60)):
        assert addresses, f"worker {rank}: no listening socket found (Gloo listens on one)"
        assert set(addresses) <= loopback, f"worker {rank} listens on {addresses}"
