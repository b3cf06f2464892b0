"""What a user of ``--membership torchft`` meets at its edges: a ``--membership.host`` the
machine cannot bind, a new job into a job's directory, the line an interrupted job ends with,
which processes a resume continues, and a launcher stopped by a signal (or killed) leaving no
worker behind.

The unit tests build configurations and directories by hand; the two process tests start a
real local job (a tiny GPT, two workers on a local lighthouse) and signal its launcher alone,
as a process manager does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _cli import TINY
from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.membership.local import check_job_dir, interrupted_message, killed_by_trace
from lowcomm.membership.worker import check_host

STOP_BOUND_S = 90  # generous: seconds on an idle machine, more under load


def _job(out: Path, **options: object) -> TrainConfig:
    return with_options(
        TrainConfig(), **{"membership": "torchft", "workers": 2, "out": str(out), **options}
    )


def _checkpoint(run: Path, step: int) -> None:
    """A committed checkpoint directory as the message reads it (its manifest)."""
    directory = run / "checkpoints" / f"step-{step:06d}"
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text("{}\n")


# --- --membership.host ---------------------------------------------------------------------


def test_a_host_this_machine_cannot_bind_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        check_host("192.0.2.1")  # (TEST-NET-1: documentation only, never a local address)
    message = str(refused.value)
    assert message.startswith("--membership.host: 192.0.2.1 cannot be bound")
    assert "\n" not in message and "omit it" in message
    check_host("127.0.0.1")  # (the loopback binds)


def test_a_local_job_refuses_a_host_it_would_not_use() -> None:
    from lowcomm.membership.options import MembershipOptions, membership_refusal

    local = _job(Path("live"), membership_options=MembershipOptions(host="10.0.0.5"))
    assert membership_refusal(local) == (
        "--membership.host: 10.0.0.5 is a cluster worker's address (with "
        "--membership.lighthouse); a local job's workers bind 127.0.0.1: drop it"
    )
    loopback = MembershipOptions(host="127.0.0.1")
    assert membership_refusal(_job(Path("live"), membership_options=loopback)) is None
    worker = MembershipOptions(host="10.0.0.5", lighthouse="10.0.0.1:29510", worker=0)
    assert membership_refusal(_job(Path("w0"), membership_options=worker)) is None


# --- a new job into a job's directory ------------------------------------------------------


def test_a_new_job_into_a_jobs_directory_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "live"
    check_job_dir(_job(out))  # (nothing there yet)
    (out / "worker0").mkdir(parents=True)
    (out / "membership.json").write_text("{}\n")
    with pytest.raises(ConfigError) as refused:
        check_job_dir(_job(out))
    message = str(refused.value)
    assert message.startswith(f"--out: {out} already holds a --membership torchft job")
    assert "membership.json, worker0" in message and "--overwrite" in message
    assert "--resume" not in message  # (no checkpoint: nothing to continue)
    _checkpoint(out / "worker0", 4)
    with pytest.raises(ConfigError, match=f"--resume {out} to continue it"):
        check_job_dir(_job(out))
    check_job_dir(_job(out, overwrite=True))  # (replacing it is asked for)
    check_job_dir(_job(out, resume=str(out)))  # (continuing it is check_resume's)


def test_a_directory_of_other_files_is_not_a_job(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    check_job_dir(_job(tmp_path))


def test_a_file_where_a_worker_writes_its_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "worker1").write_text("not a directory\n")
    for config in (_job(tmp_path), _job(tmp_path, overwrite=True)):
        with pytest.raises(ConfigError, match=r"worker1 is a file, where worker 1 writes its run"):
            check_job_dir(config)


# --- a resume of a local job -----------------------------------------------------------------


def test_a_resume_of_a_missing_directory_or_a_file_is_refused(tmp_path: Path) -> None:
    from lowcomm.membership.local import resume_point

    (tmp_path / "file").write_text("x\n")
    for name, what in (("missing", "does not exist"), ("file", "is a file")):
        with pytest.raises(ConfigError) as refused:
            resume_point(_job(tmp_path / name, resume=str(tmp_path / name)))
        assert str(refused.value).startswith(f"--resume: {tmp_path / name} {what}; give the --out")


def test_a_resume_with_another_worker_count_is_refused(tmp_path: Path) -> None:
    from lowcomm.membership.local import resume_point

    job = tmp_path / "live"
    job.mkdir()
    (job / "config.json").write_text(_job(job).to_json())
    for workers in (1, 3):
        with pytest.raises(ConfigError) as refused:
            resume_point(_job(job, resume=str(job), workers=workers))
        message = str(refused.value)
        assert message.startswith(f"--workers: {workers} differs from the job's 2")
        assert "drop --workers" in message


def test_a_cluster_worker_resumes_only_in_its_own_slot_and_worker_count(tmp_path: Path) -> None:
    from lowcomm.membership.local import check_resume

    run = tmp_path / "w0"
    run.mkdir()
    (run / "config.json").write_text(_job(run, membership_options=_cluster(worker=0)).to_json())
    for slot, workers, expected in (
        (1, 2, f"--membership.worker: 1 differs from {run}'s 0 (its config.json)"),
        (0, 3, f"--workers: 3 differs from {run}'s 2 (its config.json)"),
    ):
        config = _job(run, resume=str(run), workers=workers, membership_options=_cluster(slot))
        with pytest.raises(ConfigError) as refused:
            check_resume(config)
        assert str(refused.value).startswith(expected)
    # Its own slot and count: on to its checkpoint (none here).
    own = _job(run, resume=str(run), membership_options=_cluster(worker=0))
    with pytest.raises(ConfigError, match="holds no checkpoint of this worker"):
        check_resume(own)


def _worker_checkpoint(job: TrainConfig, run: Path, step: int, torchft: str) -> None:
    """A committed checkpoint of ``job``'s worker in ``run``, with ``torchft`` as its
    torchft.json."""
    from lowcomm.train import checkpoint

    path = checkpoint.write_rank_state(run, step, 0, {"step": step})
    worker = with_options(job, out=str(run), resume=str(run))
    checkpoint.commit_checkpoint(
        run, step, 1, checkpoint.fingerprint(worker), digests=[checkpoint.file_digest(path)]
    )
    (checkpoint.step_directory(run, step) / "torchft.json").write_text(torchft)


def test_a_local_jobs_unreadable_torchft_step_names_the_checkpoint_to_remove(
    tmp_path: Path,
) -> None:
    from lowcomm.membership.local import resume_point

    out = tmp_path / "live"
    job = _job(out, resume=str(out))
    good = json.dumps({"step": 2, "batches_committed": 4})
    for step in (4, 8):
        _worker_checkpoint(job, out / "worker0", step, good)
    _worker_checkpoint(job, out / "worker1", 4, good)
    _worker_checkpoint(job, out / "worker1", 8, "{garbage")
    with pytest.raises(ConfigError) as refused:
        resume_point(job)
    newest = out / "worker1" / "checkpoints" / "step-000008"
    assert str(refused.value) == (
        f"--resume: {newest / 'torchft.json'} is unreadable (torchft's step at that "
        f"checkpoint, which its workers' first quorum compares); remove {newest} to resume "
        "from the step before (the resume then names any other worker's newer checkpoints "
        "to remove)"
    )
    shutil.rmtree(newest)
    with pytest.raises(ConfigError) as refused:
        resume_point(job)
    assert str(refused.value).endswith(
        f"remove {out / 'worker0' / 'checkpoints' / 'step-000008'} to resume every worker "
        "from step 4"
    )
    shutil.rmtree(out / "worker0" / "checkpoints" / "step-000008")
    assert resume_point(job).step == 4


def test_workers_at_different_steps_are_told_which_checkpoints_to_remove(tmp_path: Path) -> None:
    from lowcomm.membership.local import _common_step_fix

    for step in (4, 8, 12):
        _checkpoint(tmp_path / "worker0", step)
    for step in (4, 8):
        _checkpoint(tmp_path / "worker1", step)
    names, steps = {0: "worker0", 1: "worker1"}, {0: 12, 1: 8}
    assert _common_step_fix(tmp_path, names, steps) == (
        f"remove {tmp_path / 'worker0' / 'checkpoints' / 'step-000012'} to resume every worker "
        "from step 8"
    )
    # (worker0 kept no step 8: no common step to name)
    (tmp_path / "worker0" / "checkpoints" / "step-000008" / "manifest.json").unlink()
    assert _common_step_fix(tmp_path, names, steps).startswith("remove the newer checkpoints")


def test_a_failed_local_job_names_each_workers_directory(tmp_path: Path) -> None:
    from lowcomm.launch.run import kept_state

    out = tmp_path / "live"
    _checkpoint(out / "worker0", 6)
    _checkpoint(out / "worker1", 6)
    state = kept_state(_job(out))
    assert state == (
        f"each worker's run is in {out}/workerK, newest checkpoints: worker0 step-000006, "
        f"worker1 step-000006; continue with: lowcomm train --resume {out}"
    )


# --- the line an interrupted job ends with -------------------------------------------------


def test_an_interrupted_local_job_names_each_workers_checkpoint_and_the_resume(
    tmp_path: Path,
) -> None:
    out = tmp_path / "live"
    config = _job(out)
    interrupt = RuntimeError("interrupted by SIGTERM")
    line = interrupted_message(config, interrupt)
    assert "no checkpoint was written (--checkpoint-every N writes them)" in line
    assert line.endswith("run it again with --overwrite")
    early = interrupted_message(_job(out, checkpoint_every=50), interrupt)
    assert "no checkpoint was written yet (--checkpoint-every 50: the first at step 50)" in early
    # Slot 1's last process is its restart (OUT/membership.json names it).
    record = {"workers": {"0": [{"run": str(out / "worker0")}],
                          "1": [{"run": str(out / "worker1")}, {"run": str(out / "worker1.1")}]}}  # fmt: skip
    out.mkdir()
    (out / "membership.json").write_text(json.dumps(record))
    _checkpoint(out / "worker0", 8)
    _checkpoint(out / "worker0", 12)
    _checkpoint(out / "worker1", 4)
    _checkpoint(out / "worker1.1", 12)
    line = interrupted_message(config, interrupt)
    assert line.startswith("lowcomm: interrupted by SIGTERM: every worker and the lighthouse")
    assert "worker0 step-000012, worker1.1 step-000012" in line
    assert line.endswith(f"continue with: lowcomm train --resume {out}")


def test_an_interrupted_cluster_worker_names_its_own_resume(tmp_path: Path) -> None:
    out = tmp_path / "w1"
    config = _job(out, membership_options=_cluster(worker=1))
    interrupt = RuntimeError("interrupted by SIGINT")
    assert "heals from a live worker" in interrupted_message(config, interrupt)
    _checkpoint(out, 20)
    line = interrupted_message(config, interrupt)
    assert line.startswith("lowcomm: worker 1 interrupted by SIGINT: stopped")
    assert line.endswith(
        f"lowcomm train --resume {out} --membership.lighthouse 10.0.0.5:29510 --membership.worker 1"
    )


def _cluster(worker: int) -> object:
    from lowcomm.membership.options import MembershipOptions

    return MembershipOptions(lighthouse="10.0.0.5:29510", worker=worker)


# --- which processes a resume continues ----------------------------------------------------


def test_a_resume_continues_processes_stopped_with_the_job_not_those_the_trace_killed() -> None:
    assert killed_by_trace({"exit_code": -int(signal.SIGKILL)})  # (the trace's crash)
    assert not killed_by_trace({"exit_code": 0})  # (--stop-after)
    # Stopped by the launcher at a signal: alive at the stop, whatever its exit code.
    assert not killed_by_trace({"exit_code": 143, "stopped": True})
    assert not killed_by_trace({"exit_code": -int(signal.SIGKILL), "stopped": True})


# --- a signal to the launcher alone --------------------------------------------------------


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid``, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0]


def _workers(launcher: int) -> list[int]:
    """The launcher's children that run a lowcomm worker (multiprocessing's spawned ones)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (_stat(int(entry.name)) or (0, ""))[0] == launcher:
            with contextlib.suppress(OSError):
                if b"spawn_main" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def _running(pids: list[int]) -> list[int]:
    return [pid for pid in pids if (_stat(pid) or (0, "Z"))[1] != "Z"]


def _start_job(out: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    with open(log, "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "lowcomm", "train", *TINY, "--membership", "torchft",
             "--method", "diloco", "--diloco.sync-every", "2", "--steps", "5000",
             "--checkpoint-every", "2", "--membership.quorum-s", "600", "--out", str(out), *extra],
            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
            env={**os.environ, "TMPDIR": str(out.parent)},  # (a killed launcher's scratch)
        )  # fmt: skip


def _wait_for(condition: object, launcher: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 240
    while not condition():  # type: ignore[operator]
        assert launcher.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the job never got there"
        time.sleep(0.1)


def _wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + STOP_BOUND_S
    while _running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _running(pids)


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="scans /proc")
def test_sigterm_to_a_local_jobs_launcher_stops_every_worker_and_says_how_to_resume(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed")
    out, log = tmp_path / "live", tmp_path / "stderr"
    # (A replayed trace whose one event comes long after the stop: the job records how far
    # its run time got, from which a resume replays.)
    trace = tmp_path / "trace.txt"
    trace.write_text("t=100000 worker=1 slow factor=2\n")
    # (Progress bars on: their lock must leave no semaphore for the resource tracker.)
    launcher = _start_job(out, log, "--faults", str(trace), "--progress", "True")
    workers: list[int] = []
    try:
        _wait_for(lambda: all(_lines(out / f"worker{k}" / "metrics.jsonl") >= 4 for k in (0, 1)),
                  launcher, log)  # fmt: skip
        workers = _workers(launcher.pid)
        assert len(workers) == 2, workers
        os.kill(launcher.pid, signal.SIGTERM)  # the launcher alone
        code = launcher.wait(timeout=STOP_BOUND_S)
        assert _wait_gone(workers) == [], "workers left behind"
    finally:
        if launcher.poll() is None or _running(workers):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    stderr = log.read_text()
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr and "leaked semaphore" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("lowcomm: interrupted by SIGTERM: every worker and the lighthouse"), last
    assert last.endswith(f"lowcomm train --resume {out}"), last
    record = json.loads((out / "membership.json").read_text())
    assert record["replayed"]["run_s"] > 0  # (the workers had trained: time had passed)
    for slot in ("0", "1"):
        (process,) = record["workers"][slot]
        assert process["stopped"] is True
        # The worker unwound (its SIGTERM raised, its Manager shut down) rather than died.
        assert process["exit_code"] == 128 + signal.SIGTERM
        steps = [json.loads(line)["step"] for line in (Path(process["run"]) / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
        assert steps == list(range(len(steps)))  # (whole lines only)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux parent-death signal")
def test_workers_of_a_killed_launcher_end_by_themselves(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed")
    out, log = tmp_path / "live", tmp_path / "stderr"
    launcher = _start_job(out, log)
    workers: list[int] = []
    try:
        # (Each worker writes its membership.json once its Manager started.)
        _wait_for(lambda: all((out / f"worker{k}" / "membership.json").exists() for k in (0, 1)),
                  launcher, log)  # fmt: skip
        workers = _workers(launcher.pid)
        assert len(workers) == 2, workers
        launcher.kill()  # SIGKILL: the launcher cannot stop them itself
        launcher.wait()
        assert _wait_gone(workers) == [], "workers outlived their launcher"
    finally:
        for pid in _running(workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# --- a joiner started with other options than the job's -----------------------------------


def _healed_from(options: dict[str, object] | None, slot: int = 1) -> object:
    """A replica whose torchft Manager holds the state a live worker healed it with."""
    from types import SimpleNamespace

    from lowcomm.membership.worker import OPTIONS_KEY

    pending = None if options is None else {"user": {OPTIONS_KEY: options}}
    return SimpleNamespace(slot=slot, manager=SimpleNamespace(_pending_state_dict=pending))


def test_a_joiner_healed_from_a_job_of_other_options_is_refused_naming_the_option() -> None:
    from lowcomm.membership.worker import _check_same_options, job_options

    job = with_options(TrainConfig(), method="diloco", workers=2, membership="torchft")
    mine = job_options(dataclasses.replace(job, optim=dataclasses.replace(job.optim, lr=0.01)))
    assert mine["diloco"]["sync_every"] == job.diloco.sync_every  # (named as its flags are)
    with pytest.raises(ConfigError) as refused:
        _check_same_options(_healed_from(job_options(job)), mine)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message.startswith(f"optim.lr: 0.01 is this worker's, and {job.optim.lr!r} the live")
    assert "lowcomm train --config DIR" in message
    with pytest.raises(ConfigError, match=r"^workers: 3 is this worker's, and 2 the live"):
        _check_same_options(_healed_from(job_options(job)), job_options(with_options(job, workers=3)))  # type: ignore[arg-type]  # fmt: skip
    # The same options, a slot and an --out of its own: it joins; not healed: nothing to check.
    joiner = with_options(job, out="runs/w1b")
    _check_same_options(_healed_from(job_options(job)), job_options(joiner))  # type: ignore[arg-type]
    _check_same_options(_healed_from(None), mine)  # type: ignore[arg-type]


def test_a_cluster_worker_that_gives_up_on_a_round_fails_in_one_line() -> None:
    pytest.importorskip("torchft", reason="torchft is not installed")
    from lowcomm.launch.spawn import WorkerFailed
    from lowcomm.membership.local import _say_round_failed
    from lowcomm.membership.torchft_comm import RoundFailed

    config = _job(Path("w1"), membership_options=_cluster(worker=1))
    with pytest.raises(WorkerFailed) as failed:
        _say_round_failed(config, RoundFailed("worker 1: not admitted: no quorum"))
    assert str(failed.value) == "worker 1 failed: not admitted: no quorum"
    _say_round_failed(config, RuntimeError("another failure"))  # (raised as it is, by its caller)
