"""--membership torchft on a cluster: each worker is a process of its own that names a running
`torchft_lighthouse` (--membership.lighthouse, here on 127.0.0.1), with its run directory and
its checkpoints on its own disk.

- Workers stopped (--stop-after) and resumed, each from its own checkpoint (--resume of its own
  directory), follow the uninterrupted job's losses.
- A worker whose newest checkpoint is lost resumes from its older one, is healed at the first
  quorum from a worker that holds the newest, and ends on the others' parameters bit for bit;
  one whose older checkpoint holds the same committed rounds trains its own steps again.
- A worker SIGKILLed and started again with --resume while the other trains heals from it.
- A worker of two ranks started by torchrun joins a job already training, heals and holds the
  others' parameters bit for bit after its first sync.
- Workers of two ranks started by torchrun, stopped and resumed by the command each prints,
  follow the uninterrupted job's losses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.membership.options import MembershipOptions

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 2
STEPS = 12
#: Checkpoints every 3 steps, stopped after step 9: diloco's rounds commit after steps 4 and
#: 8 (H = 4), so the checkpoints of steps 6 and 9 hold different torchft steps.
EVERY, STOP = 3, 9
#: A guard against a hang, not a speed claim (2 loaded cores start the processes).
HANG_GUARD_S = 300.0

MODEL = (
    "--model.n-layer", "1", "--model.n-embd", "32", "--model.n-head", "2",
    "--model.block-size", "16", "--micro-batch-size", "2", "--eval-every", "1000",
    "--eval-batches", "2", "--progress", "False", "--plot", "False", "--log-every", "1",
    "--method", "diloco", "--diloco.sync-every", "4", "--membership", "torchft",
    "--membership.digests", "True",
)  # fmt: skip
#: The cluster jobs' own options (the virtual clock: the losses do not depend on timing).
JOB = (*MODEL, "--workers", str(WORKERS), "--clock", "virtual", "--seconds-per-microbatch", "0.01")


def _binary(name: str) -> str:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"{name} is not installed beside this Python")
    return found


def _env() -> dict[str, str]:
    from lowcomm.membership.local import loopback_interface

    return {
        **os.environ, "PYTHONPATH": str(ROOT / "src"), "GLOO_SOCKET_IFNAME": loopback_interface(),
        "RUST_LOG": "warn", "OMP_NUM_THREADS": "1",
    }  # fmt: skip


@contextlib.contextmanager
def _lighthouse(min_replicas: int = 1) -> Iterator[str]:
    """docs/membership.md's `torchft_lighthouse` on the loopback; its address."""
    binary = _binary("torchft_lighthouse")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas),
         "--heartbeat_timeout_ms", "2000", "--join_timeout_ms", "60000"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # (The workers refuse a lighthouse they cannot reach: start them once it listens.)
        _wait_for(lambda: _accepts(port), "the lighthouse to listen")
        yield f"127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def _cluster(address: str, args: list[list[str]]) -> list[str]:
    """One `lowcomm train` per worker K (``args[K]``, each naming its own directory), as a
    node starts it; each one's output, once all ended with 0."""
    command = [sys.executable, "-m", "lowcomm", "train", "--membership.lighthouse", address]
    workers = [
        subprocess.Popen(
            [*command, "--membership.worker", str(k), *extra],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k, extra in enumerate(args)
    ]
    outputs = [worker.communicate(timeout=HANG_GUARD_S)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0] * len(workers), outputs
    return outputs


def _losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {int(r["step"]): float(r["train_loss"]) for r in map(json.loads, lines)}


def _record(run: Path) -> dict[str, Any]:
    return dict(json.loads((run / "membership.json").read_text()))


def _digests(record: dict[str, Any]) -> dict[int, str]:
    return {int(entry["step"]): str(entry["sha256"]) for entry in record["digests"]}


def _healed(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [event for event in record["events"] if event["event"] == "healed"]


def _at(record: dict[str, Any], kind: str) -> list[int]:
    """The steps of the record's events of ``kind`` (commit, quorum, resumed, ...)."""
    return [int(event["step"]) for event in record["events"] if event["event"] == kind]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job (``whole/wK``) and the job stopped after step 9 with
    checkpoints every 3 steps (``stopped/wK``)."""
    root = tmp_path_factory.mktemp("cluster")
    with _lighthouse() as address:
        _cluster(address, [[*JOB, "--steps", str(STEPS), "--out", str(root / "whole" / f"w{k}")]
                           for k in range(WORKERS)])  # fmt: skip
        stop = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--stop-after", str(STOP)]
        outputs = _cluster(
            address,
            [[*JOB, *stop, "--out", str(root / "stopped" / f"w{k}")] for k in range(WORKERS)],
        )
    for k, output in enumerate(outputs):
        # Each worker says how to continue it, with its own directory and slot.
        assert f"--resume {root / 'stopped' / f'w{k}'} --membership.lighthouse" in output, output
    return root


def _resume(jobs: Path, name: str, address: str) -> list[str]:
    """Each worker continues its own copy of the stopped job's directory (``name/wK``)."""
    return _cluster(
        address, [["--resume", str(jobs / name / f"w{k}")] for k in range(WORKERS)]
    )  # fmt: skip


@pytest.mark.slow
def test_cluster_workers_resume_their_own_checkpoints_on_the_uninterrupted_trajectory(
    jobs: Path,
) -> None:
    for k in range(WORKERS):
        checkpoints = jobs / "stopped" / f"w{k}" / "checkpoints"
        assert (checkpoints / "latest").read_text().strip() == f"step-{STOP:06d}", k
        assert (checkpoints / f"step-{STOP:06d}" / "torchft.json").is_file(), k
        assert sorted(_losses(jobs / "stopped" / f"w{k}")) == list(range(STOP)), k
    shutil.copytree(jobs / "stopped", jobs / "resumed")
    with _lighthouse() as address:
        _resume(jobs, "resumed", address)  # (--resume alone: the options are the run's own)
    for k in range(WORKERS):
        whole, resumed = jobs / "whole" / f"w{k}", jobs / "resumed" / f"w{k}"
        want, got = _losses(whole), _losses(resumed)
        assert sorted(got) == list(range(STEPS)), k
        for step in range(STEPS):
            assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), (k, step)
        lines = (resumed / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(STEPS)), k  # (once)
        record, straight = _record(resumed), _record(whole)
        assert not _healed(record), record["events"]  # (every worker at one step: none heals)
        # Its membership.json goes on from the stopped process's: the rounds before the stop
        # and after it, the resume and its startup round at the stop's step, every round's
        # digest the uninterrupted job's, and the tokens of the whole run.
        assert _at(record, "resumed") == [STOP], record["events"]
        assert _at(record, "commit") == sorted([*_at(straight, "commit"), STOP]), k
        assert _digests(record) == _digests(straight), k
        assert record["commits"] == straight["commits"] + 1
        assert record["committed_tokens"] == straight["committed_tokens"] > 0
        assert record["dropped_rounds"] == straight["dropped_rounds"] == 0
        summary = json.loads((resumed / "summary.json").read_text())
        assert summary["committed_tokens"] == straight["committed_tokens"]
        # (The resumed job's first quorums assemble it: no quorum change, as in the straight job.)
        assert summary["faults"]["membership_changes"] == [], summary["faults"]


@pytest.mark.slow
def test_a_worker_that_lost_its_newest_checkpoint_is_healed_from_the_newest(jobs: Path) -> None:
    """Worker 1 resumes from step 6 (its step-9 checkpoint is gone, a round behind worker
    0's): the first quorum heals it from worker 0, both start at step 9, and after the next
    sync they hold the same parameters; worker 0 trains on as in the uninterrupted job."""
    shutil.copytree(jobs / "stopped", jobs / "skewed")
    older = jobs / "skewed" / "w1" / "checkpoints"
    shutil.rmtree(older / f"step-{STOP:06d}")
    (older / "latest").write_text("step-000006\n")
    with _lighthouse() as address:
        outputs = _resume(jobs, "skewed", address)
    assert "healed from one of them" in outputs[1], outputs[1]
    ahead, behind = _record(jobs / "skewed" / "w0"), _record(jobs / "skewed" / "w1")
    healed = _healed(behind)
    assert not _healed(ahead) and len(healed) == 1, behind["events"]
    assert healed[0]["step"] == STOP and healed[0]["bytes"] > 0
    # Both ran steps 9 to 11 (the shard where it would be: no sample twice) and the sync
    # after step 11 leaves them bit for bit equal.
    assert ahead["data_position"] == behind["data_position"] == STEPS
    assert _digests(ahead)[STEPS - 1] == _digests(behind)[STEPS - 1]
    # Each record goes on from its own checkpoint's: worker 1's keeps the round before step
    # 6 and drops the one at 7, which it did not train again but was healed past.
    assert sorted(_digests(ahead)) == [3, 7, STEPS - 1]
    assert sorted(_digests(behind)) == [3, STEPS - 1]
    assert _at(ahead, "resumed") == [STOP] and _at(behind, "resumed") == [6]
    # Worker 0's own steps up to that sync are the uninterrupted job's.
    want, got = _losses(jobs / "whole" / "w0"), _losses(jobs / "skewed" / "w0")
    for step in range(STEPS):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), step
    assert sorted(_losses(jobs / "skewed" / "w1"))[-3:] == [STOP, STOP + 1, STOP + 2]


def _worker_config(out: Path | None, **overrides: Any) -> TrainConfig:
    options = MembershipOptions(lighthouse="127.0.0.1:29510", worker=0)
    config = with_options(
        TrainConfig(method="diloco"), workers=2, out=None if out is None else str(out),
        membership="torchft",
        membership_options=options,
    )  # fmt: skip
    return with_options(config, **overrides)


def test_a_cluster_worker_resume_is_checked_in_one_line(tmp_path: Path) -> None:
    from lowcomm.membership.local import check_resume
    from lowcomm.train import checkpoint

    # --resume auto names this worker's own directory.
    with pytest.raises(ConfigError, match=r"--resume auto: .*this worker's own run directory"):
        _worker_config(tmp_path, resume="auto").validate()
    # A directory without a checkpoint, and one whose checkpoint lacks torchft's step.
    run = tmp_path / "w0"
    config = _worker_config(None, resume=str(run))
    with pytest.raises(ConfigError, match=r"holds no checkpoint of this worker") as error:
        check_resume(config)
    assert "\n" not in str(error.value)
    path = checkpoint.write_rank_state(run, 4, 0, {"step": 4})
    worker = with_options(config, out=str(run))
    checkpoint.commit_checkpoint(
        run, 4, 1, checkpoint.fingerprint(worker), digests=[checkpoint.file_digest(path)]
    )
    with pytest.raises(ConfigError, match=r"torchft.json is missing") as error:
        check_resume(config)
    assert "\n" not in str(error.value)
    (checkpoint.step_directory(run, 4) / "torchft.json").write_text(
        json.dumps({"step": 2, "batches_committed": 4})
    )
    check_resume(config)
    # A resumed worker continues in its own directory.
    with pytest.raises(ConfigError, match=r"--out: .* differs from --resume"):
        check_resume(with_options(config, out=str(tmp_path / "elsewhere")))


def _wait_for(condition: Any, what: str, timeout_s: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


@pytest.mark.slow
def test_a_torchrun_group_joins_a_running_job_and_heals_bit_for_bit(tmp_path: Path) -> None:
    """Workers 0 and 1 (2 ranks each, the local launcher's processes) train against the
    job's lighthouse; once they are past their first rounds, worker 2 is started as a node
    starts it, `torchrun --standalone --nproc-per-node 2 ... --membership.lighthouse ADDR
    --membership.worker 2`: it joins at their next round, each of its ranks healed from the
    same rank of a live worker, sits that sync out, and then holds their parameters bit for
    bit. The emulated 200 ms link paces the running workers' rounds while it starts."""
    torchrun = _binary("torchrun")
    from lowcomm.membership.local import LocalJob
    from test_membership_torchft import _config

    steps, ranks = 600, 2
    options = MembershipOptions(detect_s=2.0, quorum_s=5.0, digests=True)
    config = _config("diloco", tmp_path, steps, ranks_per_worker=ranks, membership_options=options)
    joiner = tmp_path / "joiner"
    with LocalJob(config) as job:
        job.start(0)
        job.start(1)  # (the two start together once --membership.quorum-s has passed)
        _wait_for(lambda: _lines(job.worker_dir(0, 0) / "metrics.jsonl") >= 10, "10 steps")
        command = [
            torchrun, "--standalone", "--nproc-per-node", str(ranks), "-m", "lowcomm", "train",
            *MODEL, "--workers", "3", "--ranks-per-worker", str(ranks), "--steps", str(steps),
            "--clock", "real", "--network", "wan", "--latency-ms", "200",
            "--membership.detect-s", "2", "--membership.quorum-s", "5",
            "--membership.lighthouse", job.address, "--membership.worker", "2",
            "--out", str(joiner),
        ]  # fmt: skip
        group = subprocess.Popen(
            command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        output = group.communicate(timeout=HANG_GUARD_S)[0]
        codes = job.wait(HANG_GUARD_S)
    assert group.returncode == 0, output
    assert codes == {0: [0], 1: [0]}, codes
    survivor = tmp_path / "worker0"
    for name in ("membership.json", "membership.rank1.json"):
        record = json.loads((joiner / name).read_text())
        healed = _healed(record)
        assert len(healed) == 1 and healed[0]["bytes"] > 0, record["events"]
        first_quorum = next(e for e in record["events"] if e["event"] == "quorum")
        assert first_quorum["participants"] == 2, first_quorum  # (it sits that sync out)
        mine = _digests(record)
        theirs = _digests(json.loads((survivor / name).read_text()))
        first_sync = min(mine)
        assert first_sync == healed[0]["step"] > 0
        assert mine[first_sync] == theirs[first_sync]
        assert mine[steps - 1] == theirs[steps - 1]
    assert _record(joiner)["data_position"] == _record(survivor)["data_position"] == steps


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
        return True
    return False


@pytest.mark.slow
def test_a_worker_behind_inside_the_same_round_retrains_its_own_steps(
    jobs: Path, tmp_path: Path
) -> None:
    """Stopped after step 6 with checkpoints every 2 steps: worker 1's step-6 checkpoint is
    gone, so it resumes from step 4, which holds the same committed rounds (diloco's next
    commits after step 8) and torchft step as worker 0's step 6. Neither is healed: worker 1
    trains steps 4 and 5 again from its own checkpoint, worker 0 waits for it at the round,
    and both follow the uninterrupted job."""
    with _lighthouse() as address:
        stop = ["--steps", str(STEPS), "--checkpoint-every", "2", "--stop-after", "6"]
        _cluster(address, [[*JOB, *stop, "--out", str(tmp_path / f"w{k}")] for k in range(WORKERS)])
        behind = tmp_path / "w1" / "checkpoints"
        shutil.rmtree(behind / "step-000006")
        (behind / "latest").write_text("step-000004\n")
        _cluster(address, [["--resume", str(tmp_path / f"w{k}")] for k in range(WORKERS)])
    for k in range(WORKERS):
        record = _record(tmp_path / f"w{k}")
        assert not _healed(record), record["events"]
        want, got = _losses(jobs / "whole" / f"w{k}"), _losses(tmp_path / f"w{k}")
        assert sorted(got) == list(range(STEPS)), k
        for step in range(STEPS):
            assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), (k, step)
        assert _digests(record)[STEPS - 1] == _digests(_record(jobs / "whole" / f"w{k}"))[STEPS - 1]


@pytest.mark.slow
def test_a_worker_restarted_with_resume_into_the_running_job_heals_from_it(
    tmp_path: Path,
) -> None:
    """Worker 1 is SIGKILLed after its step-40 checkpoint while worker 0 trains on, and started
    again with --resume of its own directory: the live worker is past that checkpoint, so its
    torchft step is ahead and the restarted worker is healed from it at its next round (the
    lighthouse and the workers need 2 for a round, so worker 0 waits for it), then holds its
    parameters bit for bit."""
    steps = 400
    need_two = ["--membership.min-workers", "2", "--membership.quorum-s", "240"]
    args = [*JOB, "--steps", str(steps), "--checkpoint-every", "10", *need_two]
    runs = [tmp_path / f"w{k}" for k in range(WORKERS)]
    with _lighthouse(min_replicas=2) as address:
        command = [sys.executable, "-m", "lowcomm", "train", "--membership.lighthouse", address]
        started = [
            subprocess.Popen(
                [*command, "--membership.worker", str(k), *args, "--out", str(runs[k])],
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for k in range(WORKERS)
        ]
        _wait_for(lambda: _lines(runs[1] / "metrics.jsonl") >= 45, "45 steps")
        started[1].kill()
        started[1].communicate()
        latest = (runs[1] / "checkpoints" / "latest").read_text().strip()
        again = subprocess.Popen(
            [*command, "--membership.worker", "1", "--resume", str(runs[1])],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        outputs = [process.communicate(timeout=HANG_GUARD_S)[0] for process in (started[0], again)]
        assert [started[0].returncode, again.returncode] == [0, 0], outputs
    resumed_from = int(latest.removeprefix("step-"))
    assert f"resumed {runs[1]} from step {resumed_from}" in outputs[1], outputs[1]
    live, restarted = _record(runs[0]), _record(runs[1])
    healed = _healed(restarted)
    assert not _healed(live) and len(healed) == 1, restarted["events"]
    assert healed[0]["step"] > resumed_from and healed[0]["bytes"] > 0
    mine, theirs = _digests(restarted), _digests(live)
    # Its record goes on from its checkpoint's: the killed process's rounds before it, then
    # its first sync, the round it healed in.
    assert _at(restarted, "resumed") == [resumed_from]
    before = {step: digest for step, digest in theirs.items() if step < resumed_from}
    assert before and {step: mine[step] for step in mine if step < resumed_from} == before
    assert min(s for s in mine if s >= resumed_from) == healed[0]["step"]
    assert all(mine[step] == theirs[step] for step in mine)
    assert mine[steps - 1] == theirs[steps - 1]
    assert live["data_position"] == restarted["data_position"] == steps


def _torchrun_groups(torchrun: str, commands: list[list[str]]) -> list[str]:
    """Each worker as a node starts it, ``commands[K]``: a torchrun of its ranks (``torchrun``
    the binary beside this Python); each one's output, once all ended with 0."""
    groups = [
        subprocess.Popen(
            [torchrun, *command],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command in commands
    ]
    outputs = [group.communicate(timeout=HANG_GUARD_S)[0] for group in groups]
    assert [group.returncode for group in groups] == [0] * len(groups), outputs
    return outputs


@pytest.mark.slow
def test_torchrun_groups_stopped_inside_a_round_resume_by_the_command_they_print(
    tmp_path: Path,
) -> None:
    """Two workers of 2 ranks, each one `torchrun --standalone --nproc-per-node 2` on
    `torchft_lighthouse`, checkpoint every 3 steps and stop after step 9 (inside diloco's
    round of steps 8 to 11). Each prints how to continue it: a torchrun of its 2 ranks again
    (a plain `lowcomm train` is one process, which a worker of 2 ranks refuses). Run as
    printed, the job gives the uninterrupted job's losses, and each rank the same parameters
    at the end."""
    torchrun = _binary("torchrun")
    ranks = ["--ranks-per-worker", "2"]
    group = ["--standalone", "--nproc-per-node", "2", "-m", "lowcomm", "train"]
    stop = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--stop-after", str(STOP)]
    with _lighthouse() as address:

        def worker(k: int, *args: str) -> list[str]:
            at = ["--membership.lighthouse", address, "--membership.worker", str(k)]
            return [*group, *JOB, *ranks, *at, *args]

        straight = [worker(k, "--steps", str(STEPS), "--out", str(tmp_path / f"whole{k}"))
                    for k in range(WORKERS)]  # fmt: skip
        _torchrun_groups(torchrun, straight)
        outputs = _torchrun_groups(
            torchrun, [worker(k, *stop, "--out", str(tmp_path / f"w{k}")) for k in range(WORKERS)]
        )
        printed = []
        for k, output in enumerate(outputs):
            line = next(line for line in output.splitlines() if "continue every worker" in line)
            command = line.split("with its own: ", 1)[1].split()
            assert command[:5] == ["torchrun", *group[:4]], line
            assert command[5:] == [
                "lowcomm", "train", "--resume", str(tmp_path / f"w{k}"),
                "--membership.lighthouse", address, "--membership.worker", str(k),
            ], line  # fmt: skip
            printed.append(command[1:])
        _torchrun_groups(torchrun, printed)
    for k in range(WORKERS):
        whole, resumed = _losses(tmp_path / f"whole{k}"), _losses(tmp_path / f"w{k}")
        assert sorted(resumed) == sorted(whole) == list(range(STEPS)), k
        assert all(resumed[s] == pytest.approx(whole[s], rel=1e-6, abs=1e-6) for s in whole)
        for name in ("membership.json", "membership.rank1.json"):
            mine = _digests(json.loads((tmp_path / f"w{k}" / name).read_text()))
            theirs = _digests(json.loads((tmp_path / f"whole{k}" / name).read_text()))
            assert mine[STEPS - 1] == theirs[STEPS - 1], (k, name)
