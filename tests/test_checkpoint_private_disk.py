"""Checkpoints on nodes that share no disk: every rank writes and checksums its own file in its
own copy of the run directory, the checksums travel over the bookkeeping group, and a resume
verifies each rank's own file and agrees on the newest checkpoint intact on every rank.

On Gloo, each rank's "run directory" is a different path, so a rank that tried to read another
rank's file would not find it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowcomm.train import checkpoint

WORLD = 2
FINGERPRINT = {"method": "ddp", "ranks_per_worker": 1, "steps": 8}


def _own_disk(root: str) -> dict[str, object]:
    """One rank: two checkpoints written into a directory no other rank sees, then a resume;
    then this rank's newest file is damaged on rank 1 only, and both fall back together."""
    from lowcomm.comm.torch_comm import TorchComm
    from lowcomm.train.loop import bookkeeping_comm

    bookkeeping = bookkeeping_comm(TorchComm(timeout_s=60))
    rank = bookkeeping.rank
    run_dir = Path(root) / f"node{rank}"
    for step in (2, 4):
        state = {"weights": torch.full((3,), float(10 * rank + step))}
        path = checkpoint.write_rank_state(run_dir, step, rank, state)
        digests = checkpoint.gather_digests(bookkeeping, checkpoint.file_digest(path))
        checkpoint.commit_checkpoint(run_dir, step, WORLD, FINGERPRINT, digests=digests)
        bookkeeping.barrier().wait()
    agreed = checkpoint.agree_latest(run_dir, WORLD, FINGERPRINT, bookkeeping)
    if rank == 1:  # damage rank 1's newest file: rank 0's is still intact
        newest = checkpoint.step_directory(run_dir, 4) / "rank1.pt"
        newest.write_bytes(newest.read_bytes()[:-7])
    bookkeeping.barrier().wait()
    fallback = checkpoint.agree_latest(run_dir, WORLD, FINGERPRINT, bookkeeping)
    loaded = checkpoint.read_rank_state(fallback[1], rank)["weights"]
    return {
        "agreed": agreed[0],
        "fallback": fallback[0],
        "fallback_in_own_dir": fallback[1].parent.parent == run_dir,
        "loaded": loaded.tolist(),
    }


def test_each_rank_commits_and_resumes_from_its_own_disk(tmp_path: Path) -> None:
    from lowcomm.launch import spawn_workers

    results = spawn_workers(_own_disk, WORLD, (str(tmp_path),))
    assert [r["agreed"] for r in results] == [4, 4]
    # rank 1's step 4 is damaged: both ranks resume from step 2, each from its own disk
    assert [r["fallback"] for r in results] == [2, 2]
    assert all(r["fallback_in_own_dir"] for r in results)
    assert [r["loaded"] for r in results] == [[2.0] * 3, [12.0] * 3]
    for rank in range(WORLD):
        directory = checkpoint.step_directory(tmp_path / f"node{rank}", 2)
        # only this rank's file is on its disk, yet the manifest checksums every rank's
        assert sorted(p.name for p in directory.iterdir()) == ["manifest.json", f"rank{rank}.pt"]
        manifest = json.loads((directory / "manifest.json").read_text())
        assert sorted(manifest["sha256"]) == ["rank0.pt", "rank1.pt"]
        own = manifest["sha256"][f"rank{rank}.pt"]
        assert own == checkpoint.file_digest(directory / f"rank{rank}.pt")
        # the two nodes' manifests are the same bytes
        other = checkpoint.step_directory(tmp_path / f"node{1 - rank}", 2) / "manifest.json"
        assert manifest == json.loads(other.read_text())
        # (the newest one, step 4, is kept too: --keep-checkpoints 2)
        assert (tmp_path / f"node{rank}" / "checkpoints" / "latest").read_text() == "step-000004\n"


def test_a_rank_verifies_only_its_own_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "node1"
    path = checkpoint.write_rank_state(run_dir, 2, 1, {"weights": torch.zeros(2)})
    other = "0" * 64  # rank 0's checksum, of a file this disk does not hold
    checkpoint.commit_checkpoint(
        run_dir, 2, WORLD, FINGERPRINT, digests=[other, checkpoint.file_digest(path)]
    )
    assert checkpoint.find_latest(run_dir, WORLD, FINGERPRINT, ranks=(1,))[0] == 2
    # verifying every rank's file (one machine, or a shared disk) finds rank 0's missing
    with pytest.raises(checkpoint.CheckpointError, match=r"rank0\.pt is missing"):
        checkpoint.find_latest(run_dir, WORLD, FINGERPRINT)
    path.write_bytes(b"damaged")
    with pytest.raises(checkpoint.CheckpointError, match=r"rank1\.pt fails its checksum"):
        checkpoint.find_latest(run_dir, WORLD, FINGERPRINT, ranks=(1,))


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _two_nodes(root: Path, *flags: str) -> list[subprocess.CompletedProcess[str]]:
    """Run ``lowcomm train FLAGS`` as the two ranks of an env:// job, each in its own mount
    namespace where ``root/run`` is its own directory ``root/node<rank>`` (no shared disk)."""
    port = str(_free_port())
    processes = []
    for rank in range(WORLD):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        mount = f"mount --bind {root / f'node{rank}'} {root / 'run'}"
        command = f'{mount} && exec "$0" -m lowcomm train "$@"'
        processes.append(
            subprocess.Popen(
                ["unshare", "-m", "sh", "-c", command, sys.executable, *flags],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    done = []
    for process in processes:
        out, err = process.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -m (root or user namespaces)")
def test_two_nodes_without_a_shared_disk_train_stop_and_resume_exactly(tmp_path: Path) -> None:
    from _cli import TINY, lowcomm

    for name in ("node0", "node1", "run"):
        (tmp_path / name).mkdir()
    flags = (*TINY[2:], "--method", "diloco", "--diloco.sync-every", "2", "--steps", "4")
    run = str(tmp_path / "run")
    first = _two_nodes(
        tmp_path, *flags, "--out", run, "--checkpoint-every", "2", "--stop-after", "2"
    )
    assert all(p.returncode == 0 for p in first), [p.stderr[-2000:] for p in first]
    resumed = _two_nodes(tmp_path, *flags, "--out", run, "--resume", run)
    assert all(p.returncode == 0 for p in resumed), [p.stderr[-2000:] for p in resumed]
    for rank in range(WORLD):
        node = tmp_path / f"node{rank}"
        for step in (2, 4):  # each node holds only its own rank's files, and the manifests
            held = checkpoint.step_directory(node, step).iterdir()
            assert sorted(p.name for p in held) == ["manifest.json", f"rank{rank}.pt"]
    assert not any((tmp_path / "run").iterdir())  # nothing landed outside the namespaces
    # rank 0's node has the whole export; the result is the uninterrupted run's
    assert (tmp_path / "node0" / "model" / "model.safetensors").exists()
    reference = tmp_path / "reference"
    done = lowcomm("train", "--workers", "2", *flags, "--out", str(reference))
    assert done.returncode == 0, done.stderr
    want = json.loads((reference / "summary.json").read_text())["final_val_loss"]
    got = json.loads((tmp_path / "node0" / "summary.json").read_text())["final_val_loss"]
    assert got == want
