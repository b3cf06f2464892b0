"""A ``--membership torchft`` job: one worker in this process (``--membership.lighthouse``
given, on a cluster), or a local job of ``--workers`` worker processes and a lighthouse.

A local job (:class:`LocalJob`) starts torchft's lighthouse in this process, bound to
127.0.0.1 on a port the system picks, and every worker as a process of its own on the loopback
(``GLOO_SOCKET_IFNAME`` set to its interface): nothing listens beyond 127.0.0.1. Worker K
writes ``OUT/workerK`` (a worker started again in slot K writes ``OUT/workerK.N``): nodes share
no disk. The job ends when every worker has; a worker that dies does not end it. It can kill a
worker (SIGKILL) and start one again, which joins the others at their next round.

With ``--ranks-per-worker R > 1`` a worker is R processes, one torchft replica group: its
ranks meet in a file store of their own (a fresh one each time the slot starts: no listener),
a kill ends all R, and a start starts R again.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from lowcomm.atomic import atomic_write_text
from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.membership.options import parse_address, require_torchft
from lowcomm.membership.replay import Channel, Replay, WorkerReplay, check_replay, job_goodput
from lowcomm.train.task import Task

__all__ = ["LocalJob", "loopback_interface", "run_membership"]


def loopback_interface() -> str:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((name for name in names if name.startswith("lo")), "lo")


def _worker_main(
    config: TrainConfig, task: Task | None, replay: WorkerReplay | None, group: Any = None
) -> None:
    """A local worker process (``group``: its rank of the worker's replica group, a
    :class:`lowcomm.membership.worker.GroupRank`; None: the worker's only process): train, and
    say a failure in one line."""
    import torch

    torch.set_num_threads(1)
    from lowcomm.membership.worker import train_replica

    who = f"worker {config.placement.membership_options.worker}"
    if group is not None:
        who += f" rank {group.rank}"
    try:
        train_replica(config, task, replay, group)
    except KeyboardInterrupt:
        os._exit(130)
    except ValueError as error:
        print(f"lowcomm: {who}: error: {error}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    except BaseException as error:  # (a traceback for the log, then this worker ends)
        import traceback

        traceback.print_exception(error, file=sys.stderr)
        print(f"lowcomm: {who}: error: {error}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


class LocalJob:
    """A lighthouse on 127.0.0.1 and the job's worker processes.

    Args:
        config: the job (``--membership torchft`` without a lighthouse); its ``--out`` (or
            run directory) holds one directory per worker.
        task: the model, data and loss (None: ``lowcomm train``'s).
    """

    def __init__(self, config: TrainConfig, task: Task | None = None) -> None:
        require_torchft()
        from torchft.coordination import LighthouseServer

        from lowcomm.train.rundir import run_directory

        options = config.placement.membership_options
        self.config = config
        self.task = task
        self.run_dir = run_directory(config)
        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=options.min_workers,
            join_timeout_ms=int(options.quorum_s * 1000),
            heartbeat_timeout_ms=int(options.detect_s * 1000),
        )
        # (Its address names the host name; the workers reach it on the loopback.)
        _, port = parse_address(self.lighthouse.address(), "lighthouse")
        self.address = f"127.0.0.1:{port}"
        #: Each slot's processes, one per start (with R ranks per worker: each group's rank 0).
        self.processes: dict[int, list[BaseProcess]] = {}
        #: Each slot's replica groups, one per start: its R processes in rank order.
        self.groups: dict[int, list[list[BaseProcess]]] = {}
        # (The groups' file stores: a fresh file per start, removed with the job.)
        self._stores = tempfile.mkdtemp(prefix="lowcomm-ft-groups-")
        self._context = multiprocessing.get_context("spawn")
        #: The fault trace replayed on the workers (--faults, --fault-*), or None.
        #: (With R ranks per worker, a crash kills the slot's whole group; a join starts R.)
        self.trace = check_replay(config)
        #: With --resume: where the stopped job stood (each slot's directory to continue).
        self.resumed = None if config.run.resume is None else resume_point(config)
        self.channel = Channel.make(self._context, config.placement.workers)
        self.replay = None
        if self.trace is not None:
            since = (0, 0.0) if self.resumed is None else self.resumed.replayed
            self.replay = Replay(
                self.trace, self.channel, config.placement.workers, since=since,
                first=[slot for slot in range(config.placement.workers) if self.starts(slot)],
            )  # fmt: skip

    def starts(self, slot: int) -> bool:
        """Whether slot ``slot`` has a worker at the job's start (a resumed job's slot whose
        worker was dead at the stop waits for the trace's join)."""
        return self.resumed is None or self.resumed.dirs.get(slot) is not None

    def worker_dir(self, slot: int, start: int) -> Path:
        """Where slot ``slot``'s ``start``-th process (0: the first) writes its run. A
        resumed job's first process continues its slot's last directory; one started later
        takes the next name."""
        index = start if self.resumed is None else self.resumed.first_index[slot] + start
        return self.run_dir / (f"worker{slot}" if index == 0 else f"worker{slot}.{index}")

    def start(self, slot: int, since_step: int = 0) -> BaseProcess:
        """Start a worker in ``slot`` (again, if one ran there: it joins the live ones, which
        are at ``since_step``): its process, or with ``--ranks-per-worker R`` its R processes
        (rank 0's is returned)."""
        started = len(self.processes.get(slot, []))
        options = replace(
            self.config.placement.membership_options,
            lighthouse=self.address,
            worker=slot,
            host="127.0.0.1",
        )
        # A resumed job's first worker in each slot continues its own checkpoint; one started
        # again heals from the live ones instead.
        resume = None
        if self.resumed is not None and started == 0:
            resume = self.resumed.dirs.get(slot)
            since_step = self.resumed.step
        config = with_options(
            self.config,
            out=str(self.worker_dir(slot, started)),
            membership_options=options,
            resume=None if resume is None else str(resume),
        )
        saved = {key: os.environ.get(key) for key in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")}
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        try:
            replay = None
            if self.trace is not None:
                if started > 0 and self._met_crash(slot, since_step):
                    since_step += 1  # (that step's crash was its predecessor's)
                replay = WorkerReplay(self.channel, self.trace, slot, since_step)
                if self.resumed is not None and started == 0:
                    replay.assembling = sum(map(self.starts, range(self.config.placement.workers)))
            group: list[BaseProcess] = [
                self._context.Process(target=_worker_main, args=(config, self.task, replay, place))
                for place in self._places(slot, started)
            ]
            for process in group:
                process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.processes.setdefault(slot, []).append(group[0])
        self.groups.setdefault(slot, []).append(group)
        return group[0]

    def _met_crash(self, slot: int, step: int) -> bool:
        """Whether the launcher has met a crash or leave of slot ``slot`` placed at ``step``
        (a trace that starts the slot again at the step of its crash: the new worker, which
        starts at that step, is not the one it kills)."""
        if self.replay is None or self.trace is None:
            return False
        pending = self.replay.pending
        return any(
            event.kind in ("crash", "leave") and event.worker == slot and event.at_step == step
            and all(event is not waiting for waiting in pending)
            for event in self.trace.membership_events()
        )  # fmt: skip

    def _places(self, slot: int, start: int) -> list[Any]:
        """Each process's place in the replica group of slot ``slot``'s ``start``-th start
        (``[None]``: one rank), its ranks meeting in a file store of their own."""
        from lowcomm.membership.worker import GroupRank

        ranks = self.config.placement.ranks_per_worker
        if ranks == 1:
            return [None]
        path = os.path.join(self._stores, f"worker{slot}.{start}")
        return [GroupRank(rank, ranks, path) for rank in range(ranks)]

    def start_all(self) -> None:
        for slot in range(self.config.placement.workers):
            if self.starts(slot):
                self.start(slot)

    def alive(self, slot: int) -> bool:
        """Whether a process of slot ``slot``'s latest worker is running."""
        groups = self.groups.get(slot)
        return bool(groups) and any(process.is_alive() for process in (groups or [[]])[-1])

    def any_alive(self) -> bool:
        return any(self.alive(slot) for slot in self.processes)

    def kill(self, slot: int) -> float:
        """SIGKILL slot ``slot``'s live worker (every process of its replica group); the wall
        time of the kill."""
        group = self.groups[slot][-1]
        killed = time.time()
        for process in group:
            if process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        for process in group:
            process.join()
        return killed

    def wait(self, timeout_s: float | None = None) -> dict[int, list[int | None]]:
        """Wait for every worker process to end; the exit codes of each slot's processes
        (None: still running at the timeout)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for process in self._every_process():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            process.join(left)
        return {
            slot: [_group_exit(group) for group in groups] for slot, groups in self.groups.items()
        }

    def _every_process(self) -> list[BaseProcess]:
        return [process for groups in self.groups.values() for group in groups for process in group]

    def stop(self) -> None:
        """Stop every live worker (SIGTERM, then SIGKILL) and the lighthouse."""
        for process in self._every_process():
            if process.is_alive():
                process.terminate()
        for process in self._every_process():
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()
        with contextlib.suppress(Exception):
            self.lighthouse.shutdown()
        shutil.rmtree(self._stores, ignore_errors=True)

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _processes(config: TrainConfig) -> str:
    ranks = config.placement.ranks_per_worker
    return "processes" if ranks == 1 else f"replica groups of {ranks} processes"


def _group_exit(group: list[BaseProcess]) -> int | None:
    """A worker's exit code: its first rank's that did not end with 0 (None: one still runs),
    else 0."""
    codes = [process.exitcode for process in group]
    if None in codes:
        return None
    return next((code for code in codes if code != 0), 0)


def run_membership(config: TrainConfig, task: Task | None = None) -> dict[str, Any] | None:
    """Run a ``--membership torchft`` job; return worker 0's summary (or the first that
    finished).

    With ``--membership.lighthouse`` this process is that one worker. Without, a local job:
    a lighthouse on 127.0.0.1 and ``--workers`` worker processes; it ends when they all have,
    and fails when none finished."""
    from lowcomm.launch.spawn import WorkerFailed
    from lowcomm.train.rundir import read_summary, run_directory

    options = config.placement.membership_options
    if options.lighthouse is not None:
        from lowcomm.membership.worker import train_replica

        check_replay(config)  # (a trace is refused here: the local launcher replays one)
        record = train_replica(config, task)
        if record.get("stopped") is not None:
            _say_stopped(config)
            return None
        return read_summary(run_directory(config))
    with LocalJob(config, task) as job:
        print(
            f"lowcomm: torchft lighthouse on {job.address}; starting {config.placement.workers} "
            f"worker {_processes(config)} (each its own run in {job.run_dir}/workerK)",
            flush=True,
        )
        run = config.run
        if run.checkpoint_every is not None or run.stop_after is not None:
            # The job's options, so that `lowcomm train --resume OUT` alone continues it.
            job.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(job.run_dir / "config.json", config.to_json() + "\n")
        job.start_all()
        if job.replay is not None:
            job.replay.run(job)
        codes = job.wait()
    if config.run.stop_after is not None and _stopped(job, codes):
        _write_job(job, codes)
        print(
            f"lowcomm: stopped after step {config.run.stop_after} with each worker's checkpoint "
            f"in {job.run_dir}/workerK; continue with: lowcomm train --resume {job.run_dir}",
            flush=True,
        )
        return None
    finished = [slot for slot, exits in sorted(codes.items()) if exits and exits[-1] == 0]
    _write_job(job, codes)
    if not finished:
        slot, exits = min(codes.items())
        raise WorkerFailed(slot, f"every worker failed (worker {slot} exited with {exits[-1]})")
    summary = read_summary(job.worker_dir(finished[0], len(codes[finished[0]]) - 1))
    if summary is not None and job.replay is not None:
        summary["faults"] = json.loads((job.run_dir / "membership.json").read_text())["faults"]
    return summary


@dataclass(frozen=True)
class ResumePoint:
    """Where a stopped local job stood, which its resumed job continues.

    Attributes:
        step: the step every live worker's newest checkpoint names.
        dirs: each slot's directory to continue (its last process's); None for a slot whose
            worker was dead at the stop (killed by the replayed trace, which starts it again
            at its next join).
        first_index: the number of the slot's first process in the resumed job (its
            directory ``workerK`` or ``workerK.N``).
        replayed: the replayed trace's position at the stop (step, run seconds): the events
            before it have happened.
    """

    step: int
    dirs: dict[int, Path | None]
    first_index: dict[int, int]
    replayed: tuple[int, float]


def resume_point(config: TrainConfig) -> ResumePoint:
    """``--resume OUT`` of a local job: each slot's last process's directory (from
    ``OUT/membership.json``; ``OUT/workerK`` without one) holds an intact checkpoint of this
    configuration, and all name the same step (the workers start the resumed job together,
    from one step). A slot whose last process was killed is left out only when a replayed
    trace is there to start it again.

    Raises:
        ConfigError: in one line naming the worker, its directory and the fix.
    """
    from lowcomm.membership.replay import read_record, trace_of, without_faults
    from lowcomm.membership.worker import torchft_step
    from lowcomm.train.checkpoint import CheckpointError, find_latest, fingerprint

    assert config.run.resume is not None
    job = Path(config.run.resume)
    record = read_record(job / "membership.json") or {}
    processes = record.get("workers") or {}
    traced = trace_of(config) is not None
    ranks = config.placement.ranks_per_worker  # (one checkpoint file per rank of a worker)
    steps: dict[int, int] = {}
    dirs: dict[int, Path | None] = {}
    first: dict[int, int] = {}
    names: dict[int, str] = {}
    for slot in range(config.placement.workers):
        runs = processes.get(str(slot)) or [{"run": f"worker{slot}", "exit_code": 0}]
        directory = job / Path(str(runs[-1]["run"])).name  # (the job's directory may move)
        index = _process_index(directory.name)
        if runs[-1]["exit_code"] != 0 and traced:  # (dead at the stop: the trace kills it)
            dirs[slot], first[slot] = None, index + 1
            continue
        worker = without_faults(with_options(config, out=str(directory), resume=str(directory)))
        try:
            steps[slot], found = find_latest(directory, ranks, fingerprint(worker))
        except CheckpointError as error:
            raise ConfigError(f"--resume: worker {slot}: {error}") from None
        torchft_step(found)
        dirs[slot], first[slot], names[slot] = directory, index, directory.name
    if len(set(steps.values())) > 1:
        named = ", ".join(f"{names[slot]} at step {step}" for slot, step in steps.items())
        raise ConfigError(
            f"--resume: {job}: the workers' checkpoints name different steps ({named}); a "
            "job resumes every worker from one step: remove the newer checkpoints (or give "
            "a job whose workers stopped together)"
        )
    if not steps:
        raise ConfigError(
            f"--resume: {job}: no worker was alive at the job's stop; give a job with a live one"
        )
    step = next(iter(steps.values()))
    replayed = record.get("replayed") or {}
    return ResumePoint(step, dirs, first, (step, float(replayed.get("run_s") or 0.0)))


def _say_stopped(config: TrainConfig) -> None:
    """A cluster worker stopped at --stop-after (its group's rank 0 says how to continue)."""
    from lowcomm.launch.spawn import under_torchrun

    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        return
    from lowcomm.train.rundir import run_directory

    options = config.placement.membership_options
    run_dir = run_directory(config)
    ranks = config.placement.ranks_per_worker
    # (A worker of R ranks is one torchrun of R processes, its resume too.)
    train = f"torchrun --standalone --nproc-per-node {ranks} -m " if ranks > 1 else ""
    print(
        f"lowcomm: worker {options.worker} stopped after step {config.run.stop_after} with its "
        f"checkpoint in {run_dir}; continue every worker with its own: {train}lowcomm train "
        f"--resume {run_dir} --membership.lighthouse {options.lighthouse} --membership.worker "
        f"{options.worker}",
        flush=True,
    )


def _process_index(name: str) -> int:
    """The number of a worker's process from its directory's name (workerK: 0, workerK.N: N)."""
    _, dot, number = name.partition(".")
    return int(number) if dot and number.isdigit() else 0


def check_resume(config: TrainConfig) -> None:
    """``--resume OUT`` can continue, or ConfigError in one line: a local job's workers each
    from its own checkpoint, all at one step (:func:`resume_point`); a cluster worker
    (``--membership.lighthouse``) from its own run directory's newest intact checkpoint
    (:func:`check_worker_resume`)."""
    if config.placement.membership_options.lighthouse is not None:
        check_worker_resume(config)
    else:
        resume_point(config)


def check_worker_resume(config: TrainConfig) -> int:
    """``--resume OUT`` of one cluster worker: OUT is its own run directory (its ``--out``),
    holding an intact checkpoint of this configuration with torchft's step beside it; the
    step it resumes from. Nodes share no disk, so no other worker's checkpoint is read
    here: the workers' first quorum compares them (a worker behind the newest is healed,
    lowcomm.membership.worker's ``_admit``).

    Raises:
        ConfigError: in one line naming the directory and the fix.
    """
    from lowcomm.membership.replay import without_faults
    from lowcomm.membership.worker import torchft_step
    from lowcomm.train.checkpoint import CheckpointError, find_latest, fingerprint, has_checkpoint

    assert config.run.resume is not None
    resume = Path(config.run.resume)
    if config.run.out is not None and Path(config.run.out).resolve() != resume.resolve():
        raise ConfigError(
            f"--out: {config.run.out!r} differs from --resume {config.run.resume!r}; a resumed "
            "worker continues in its own run directory, so omit --out"
        )
    if not has_checkpoint(resume):
        raise ConfigError(
            f"--resume: {resume} holds no checkpoint of this worker; give its own --out "
            "directory of a run with --checkpoint-every or --stop-after, or start it without "
            "--resume (it heals from a live worker)"
        )
    worker = without_faults(with_options(config, out=str(resume)))
    ranks = config.placement.ranks_per_worker
    try:
        step, directory = find_latest(resume, ranks, fingerprint(worker))
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    torchft_step(directory)
    return step


def _stopped(job: LocalJob, codes: dict[int, list[int | None]]) -> bool:
    """Whether the job stopped at --stop-after: every slot's last process ended there, or
    (a replayed trace) was killed by it."""
    ends = [exits[-1] for exits in codes.values()]
    killed = -int(signal.SIGKILL)
    return 0 in ends and all(end == 0 or (job.replay is not None and end == killed) for end in ends)


def job_faults(job: LocalJob, codes: dict[int, list[int | None]]) -> dict[str, Any] | None:
    """The replayed trace's record of the job (None: no trace): what the launcher did, the
    job's goodput (lowcomm.membership.replay.job_goodput), and every worker's rounds dropped
    and membership changes. Also written into each finished worker's summary.json ``faults``
    (its goodput is the job's)."""
    if job.replay is None or job.trace is None:
        return None
    from lowcomm.membership.replay import read_record

    records = []
    for slot, exits in sorted(codes.items()):
        for n in range(len(exits)):
            record = read_record(job.worker_dir(slot, n) / "membership.json")
            if record is not None:
                records.append(record)
    started = float(job.channel.started.value) or None
    figures = job_goodput(job.config, records, started)
    return {
        "source": job.trace.source,
        "replayed": "torchft",
        "detection_s": job.config.placement.membership_options.detect_s,
        **figures,
        "rounds_dropped": max((int(r.get("dropped_rounds") or 0) for r in records), default=0),
        "launcher": job.replay.log,
    }


def _patch_summaries(
    job: LocalJob, codes: dict[int, list[int | None]], faults: dict[str, Any]
) -> None:
    for slot, exits in codes.items():
        path = job.worker_dir(slot, len(exits) - 1) / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        own = summary.get("faults") or {}
        for key in ("committed_tokens", "goodput", "worker_seconds_lost", "fault_free_step_s"):
            own[key] = faults[key]
        own["scope"] = "job"
        summary["faults"] = own
        atomic_write_text(path, json.dumps(summary, indent=1) + "\n")


def _write_job(job: LocalJob, codes: dict[int, list[int | None]]) -> None:
    """OUT/membership.json: where each worker's run is and how its processes ended (a
    resumed job's: its own part's, with the stopped parts' records in ``parts``)."""
    faults = job_faults(job, codes)
    if faults is not None:
        _patch_summaries(job, codes, faults)
    record: dict[str, Any] = {
        "engine": "torchft",
        "lighthouse": job.address,
        "workers": {
            str(slot): [
                {"run": str(job.worker_dir(slot, n)), "exit_code": code}
                for n, code in enumerate(exits)
            ]
            for slot, exits in sorted(codes.items())
        },
        "faults": faults,
    }
    if job.replay is not None:
        # Where the trace stood: a resumed job replays the events after it.
        before = job.replay.since[1]
        run_s = None if faults is None else faults.get("run_s")
        record["replayed"] = {
            "step": job.config.run.stop_after or job.config.run.steps,
            "run_s": before + float(run_s or 0.0),
        }
    path = job.run_dir / "membership.json"
    if job.resumed is not None:
        # The stopped parts' records, oldest first: a resume continues them, never loses them.
        from lowcomm.membership.replay import read_record

        stopped = read_record(path)
        if stopped is not None:
            record["parts"] = [*stopped.pop("parts", []), stopped]
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
