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
import threading
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
    _stop_with_launcher()
    _thread_lock_for_progress()
    from lowcomm.membership.worker import train_replica

    who = f"worker {config.placement.membership_options.worker}"
    if group is not None:
        who += f" rank {group.rank}"
    try:
        train_replica(config, task, replay, group)
    except KeyboardInterrupt as stop:
        sys.stderr.flush()
        os._exit(128 + (stop.signum if isinstance(stop, _Stopped) else int(signal.SIGINT)))
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


def _thread_lock_for_progress() -> None:
    """tqdm's default lock holds a multiprocessing semaphore, which a worker ending with
    ``os._exit`` never releases, so the resource tracker warned of 'leaked semaphore objects'
    at every job's end. A worker's progress bars are its own process's: a thread lock serves."""
    import threading

    with contextlib.suppress(ImportError):
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())


class _Stopped(KeyboardInterrupt):
    """A local worker's SIGTERM (its launcher stopping the job): it unwinds as from Ctrl-C, so
    its torchft Manager shuts down and what it writes is closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def _stop_with_launcher() -> None:
    """In a local worker: SIGTERM unwinds like Ctrl-C, and the launcher's death (even by
    SIGKILL, which it cannot pass on) sends this worker SIGTERM (Linux), so no worker outlives
    its job waiting for a lighthouse that is gone."""
    signal.signal(signal.SIGTERM, _raise_stopped)
    with contextlib.suppress(Exception):  # (not Linux: no parent-death signal)
        import torch.multiprocessing as torch_mp

        torch_mp._prctl_pr_set_pdeathsig(signal.SIGTERM)  # type: ignore[attr-defined]
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # (it died before the line above)
        raise SystemExit(128 + int(signal.SIGTERM))


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
    and fails when none finished. SIGINT or SIGTERM stops the job (every worker, then the
    lighthouse) and raises :class:`lowcomm.launch.spawn.Interrupted`."""
    if config.placement.membership_options.lighthouse is not None:
        return _run_worker(config, task)
    return _run_local(config, task)


def _run_worker(config: TrainConfig, task: Task | None) -> dict[str, Any] | None:
    """This process is one worker of a cluster job; SIGTERM (a scheduler's stop) unwinds it
    as Ctrl-C does, so its torchft Manager shuts down and its files are closed."""
    from lowcomm.launch.spawn import Interrupted
    from lowcomm.membership.worker import train_replica
    from lowcomm.train.rundir import read_summary, run_directory

    check_replay(config)  # (a trace is refused here: the local launcher replays one)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        record = train_replica(config, task)
    except KeyboardInterrupt as stop:
        raise Interrupted(stop.signum if isinstance(stop, _Stopped) else signal.SIGINT) from None
    except RuntimeError as failed:
        _say_round_failed(config, failed)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if record.get("stopped") is not None:
        _say_stopped(config)
        return None
    return read_summary(run_directory(config))


def _say_round_failed(config: TrainConfig, failed: RuntimeError) -> None:
    """A cluster worker that gave up on a round (or on its admission) ends as a failed worker
    does, in one line with what it kept (:class:`lowcomm.launch.spawn.WorkerFailed`), not
    with a traceback. (Only once the worker ran: torchft is installed.)"""
    from lowcomm.launch.spawn import WorkerFailed
    from lowcomm.membership.torchft_comm import RoundFailed

    if isinstance(failed, RoundFailed):
        slot = int(config.placement.membership_options.worker or 0)
        raise WorkerFailed(slot, str(failed).removeprefix(f"worker {slot}: ")) from None


def _run_local(config: TrainConfig, task: Task | None) -> dict[str, Any] | None:
    """A local job: its lighthouse and worker processes, stopped together on a signal."""
    from lowcomm.launch.spawn import Interrupted, _LauncherSignal, _LauncherSignals

    check_job_dir(config)
    with LocalJob(config, task) as job, _LauncherSignals() as signals:
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
        try:
            job.start_all()
            signals.arm()  # (a signal during the start was held until now)
            if job.replay is not None:
                job.replay.run(job)
            codes = job.wait()
            signals.disarm()
        except _LauncherSignal as received:
            signals.disarm()
            _stop_interrupted(job)
            raise Interrupted(received.signum) from None
    return _finish_local(job, codes)


def _stop_interrupted(job: LocalJob) -> None:
    """Stop a job its launcher got a signal in, and write ``OUT/membership.json`` with each
    process that was still running marked ``stopped``: a resume continues those (a process
    the replayed trace had killed stays dead until the trace's next join)."""
    running = {
        (slot, n)
        for slot, groups in job.groups.items()
        for n, group in enumerate(groups)
        if any(process.is_alive() for process in group)
    }
    started = float(job.channel.started.value) or None
    job.stop()
    # (The trace's run time reached: a resume replays the events placed by time after it.)
    reached = None if started is None else time.time() - started
    _write_job(job, job.wait(0.0), stopped=running, reached_s=reached)


def _finish_local(job: LocalJob, codes: dict[int, list[int | None]]) -> dict[str, Any] | None:
    """What a local job that ran to its end (or to --stop-after) says and returns."""
    from lowcomm.launch.spawn import WorkerFailed
    from lowcomm.train.rundir import read_summary

    config = job.config
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


def check_job_dir(config: TrainConfig) -> None:
    """A new local job (no ``--resume``) into an ``--out`` that holds one is refused, as a
    static run into a run's directory is: its workers would replace the old job's runs.
    ``--overwrite`` replaces it. A file where a worker's directory goes is refused too.

    Raises:
        ConfigError: in one line naming the directory, what it holds and the fix.
    """
    from lowcomm.train.checkpoint import committed
    from lowcomm.train.rundir import run_directory

    job = run_directory(config)
    for slot in range(config.placement.workers):
        own = job / f"worker{slot}"
        if own.exists() and not own.is_dir():
            raise ConfigError(
                f"--out: {own} is a file, where worker {slot} writes its run; move it away or "
                "pass another --out"
            )
    if config.run.resume is not None or config.run.overwrite or not job.is_dir():
        return
    held = sorted(
        path.name
        for path in job.iterdir()
        if path.name == "membership.json" or (path.is_dir() and path.name.startswith("worker"))
    )
    if not held:
        return
    kept = any(committed(job / name) for name in held if name.startswith("worker"))
    resume = f", --resume {job} to continue it" if kept else ""
    raise ConfigError(
        f"--out: {job} already holds a --membership torchft job ({', '.join(held)}); pass "
        f"--overwrite to replace it{resume}, or --out NEW_DIR for a fresh one"
    )


def interrupted_message(config: TrainConfig, interrupt: Exception) -> str:
    """One line: what stopped a ``--membership torchft`` run, what its workers kept and the
    command that continues it."""
    from lowcomm.train.checkpoint import committed
    from lowcomm.train.rundir import run_directory

    run_dir = run_directory(config)
    options = config.placement.membership_options
    if options.lighthouse is not None:
        kept = committed(run_dir)
        if not kept:
            return (
                f"lowcomm: worker {options.worker} {interrupt}: stopped; it wrote no checkpoint "
                f"{_no_checkpoint_why(config)}; started again without --resume it heals from a "
                "live worker"
            )
        return (
            f"lowcomm: worker {options.worker} {interrupt}: stopped; its newest checkpoint is "
            f"{kept[-1].name} in {run_dir}; continue it with: lowcomm train --resume {run_dir} "
            f"--membership.lighthouse {options.lighthouse} --membership.worker {options.worker}"
        )
    return (
        f"lowcomm: {interrupt}: every worker and the lighthouse stopped; {kept_job_state(config)}"
    )


def kept_job_state(config: TrainConfig) -> str:
    """What a stopped local job kept: each worker's newest checkpoint and the command that
    continues the job, or that it kept none."""
    from lowcomm.train.rundir import run_directory

    run_dir = run_directory(config)
    newest = _newest_checkpoints(run_dir, config.placement.workers)
    if not newest:
        return (
            f"each worker's run is in {run_dir}/workerK, and no checkpoint was written "
            f"{_no_checkpoint_why(config)}; run it again with --overwrite"
        )
    named = ", ".join(f"{name} {step}" for name, step in newest.items())
    return (
        f"each worker's run is in {run_dir}/workerK, newest checkpoints: {named}; continue "
        f"with: lowcomm train --resume {run_dir}"
    )


def _no_checkpoint_why(config: TrainConfig) -> str:
    every = config.run.checkpoint_every
    if every is None:
        return "(--checkpoint-every N writes them)"
    return f"yet (--checkpoint-every {every}: the first at step {every})"


def _newest_checkpoints(job: Path, workers: int) -> dict[str, str]:
    """Each slot's last process's newest checkpoint (``OUT/membership.json`` names the
    process; a slot with none is left out)."""
    from lowcomm.membership.replay import read_record
    from lowcomm.train.checkpoint import committed

    processes = (read_record(job / "membership.json") or {}).get("workers") or {}
    newest: dict[str, str] = {}
    for slot in range(workers):
        runs = processes.get(str(slot)) or [{"run": f"worker{slot}"}]
        directory = job / Path(str(runs[-1]["run"])).name
        kept = committed(directory)
        if kept:
            newest[directory.name] = kept[-1].name
    return newest


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
    from lowcomm.membership.replay import read_record, trace_of

    assert config.run.resume is not None
    job = Path(config.run.resume)
    if not job.is_dir():
        what = "is a file" if job.exists() else "does not exist"
        raise ConfigError(
            f"--resume: {job} {what}; give the --out directory of a local job run with "
            "--checkpoint-every or --stop-after (it holds workerK/checkpoints)"
        )
    _check_job_workers(config, job)
    record = read_record(job / "membership.json") or {}
    processes = record.get("workers") or {}
    traced = trace_of(config) is not None
    steps: dict[int, int] = {}
    dirs: dict[int, Path | None] = {}
    first: dict[int, int] = {}
    names: dict[int, str] = {}
    for slot in range(config.placement.workers):
        runs = processes.get(str(slot)) or [{"run": f"worker{slot}", "exit_code": 0}]
        directory = job / Path(str(runs[-1]["run"])).name  # (the job's directory may move)
        index = _process_index(directory.name)
        if traced and killed_by_trace(runs[-1]):
            dirs[slot], first[slot] = None, index + 1
            continue
        steps[slot] = _slot_checkpoint(config, slot, directory)
        dirs[slot], first[slot], names[slot] = directory, index, directory.name
    if len(set(steps.values())) > 1:
        named = ", ".join(f"{names[slot]} at step {step}" for slot, step in steps.items())
        raise ConfigError(
            f"--resume: {job}: the workers' checkpoints name different steps ({named}); a "
            f"job resumes every worker from one step: {_common_step_fix(job, names, steps)}"
        )
    if not steps:
        raise ConfigError(
            f"--resume: {job}: no worker was alive at the job's stop; give a job with a live one"
        )
    step = next(iter(steps.values()))
    replayed = record.get("replayed") or {}
    return ResumePoint(step, dirs, first, (step, float(replayed.get("run_s") or 0.0)))


def _slot_checkpoint(config: TrainConfig, slot: int, directory: Path) -> int:
    """The step of slot ``slot``'s newest intact checkpoint of this configuration in
    ``directory``, with torchft's step beside it; else ConfigError in one line."""
    from lowcomm.membership.replay import without_faults
    from lowcomm.membership.worker import torchft_step
    from lowcomm.train.checkpoint import CheckpointError, find_latest, fingerprint

    worker = without_faults(with_options(config, out=str(directory), resume=str(directory)))
    ranks = config.placement.ranks_per_worker  # (one checkpoint file per rank of a worker)
    try:
        step, found = find_latest(directory, ranks, fingerprint(worker))
    except CheckpointError as error:
        reason = str(error).removeprefix("--resume: ")
        raise ConfigError(f"--resume: worker {slot}: {reason}") from None
    try:
        torchft_step(found)
    except ConfigError as error:  # (its fix for a local job: every worker resumes)
        problem = str(error).split("; ", 1)[0]
        raise ConfigError(
            f"{problem}; remove {found} to resume from the step before (the resume then "
            "names any other worker's newer checkpoints to remove)"
        ) from None
    return step


def killed_by_trace(process: dict[str, Any]) -> bool:
    """Whether a process of a traced job's ``OUT/membership.json`` was dead at the job's stop
    (its replayed trace killed it), not stopped with the job: the launcher stopped it at a
    signal (``stopped``), or it ended at ``--stop-after`` (exit code 0)."""
    return process.get("exit_code") != 0 and not process.get("stopped")


def _common_step_fix(job: Path, names: dict[int, str], steps: dict[int, int]) -> str:
    """How to resume workers whose newest checkpoints differ: remove the checkpoints newer
    than the oldest newest one, where every worker holds that step."""
    from lowcomm.train.checkpoint import committed, step_directory

    oldest = min(steps.values())
    newer: list[str] = []
    for name in names.values():
        if not (step_directory(job / name, oldest) / "manifest.json").exists():
            return "remove the newer checkpoints (or give a job whose workers stopped together)"
        newer += [str(path) for path in committed(job / name) if int(path.name[5:]) > oldest]
    return f"remove {', '.join(newer)} to resume every worker from step {oldest}"


def _check_job_workers(config: TrainConfig, job: Path) -> None:
    """A local job resumes with its own worker count: each worker continues its own
    checkpoint, and its data shard is its slot's of that count."""
    try:
        saved = json.loads((job / "config.json").read_text())
        workers = int(saved["placement"]["workers"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # (no saved options: the workers' own checkpoints are checked)
    if workers != config.placement.workers:
        raise ConfigError(
            f"--workers: {config.placement.workers} differs from the job's {workers} "
            f"({job}/config.json); a --membership torchft job resumes every worker from its "
            "own checkpoint, with its own data shard: drop --workers (a worker more joins a "
            "running job in a free slot: docs/membership.md)"
        )


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
    _check_worker_slot(config, resume)
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


def _check_worker_slot(config: TrainConfig, resume: Path) -> None:
    """A cluster worker resumes in its own slot, of its own job's worker count: the slot and
    the count name its data shard, which its checkpoint continues."""
    try:
        placement = json.loads((resume / "config.json").read_text())["placement"]
        saved = {
            "worker": placement["membership_options"]["worker"],
            "workers": placement["workers"],
        }
    except (OSError, ValueError, KeyError, TypeError):
        return  # (no saved options: the checkpoint's own checks follow)
    given = {
        "worker": config.placement.membership_options.worker,
        "workers": config.placement.workers,
    }
    for name, flag in (("worker", "--membership.worker"), ("workers", "--workers")):
        if saved[name] is not None and given[name] != saved[name]:
            raise ConfigError(
                f"{flag}: {given[name]} differs from {resume}'s {saved[name]} (its config.json); "
                f"a worker resumes its own run, in its own slot of its job: give {flag} "
                f"{saved[name]} (a worker in another slot starts without --resume and heals)"
            )


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


def _write_job(
    job: LocalJob,
    codes: dict[int, list[int | None]],
    stopped: set[tuple[int, int]] | frozenset[tuple[int, int]] = frozenset(),
    reached_s: float | None = None,
) -> None:
    """OUT/membership.json: where each worker's run is and how its processes ended
    (``stopped``: the (slot, start) processes the launcher stopped at a signal, at
    ``reached_s`` run seconds: the workers had not finished, so theirs say no end); a
    resumed job's is its own part's, with the stopped parts' records in ``parts``)."""
    faults = job_faults(job, codes)
    if faults is not None:
        _patch_summaries(job, codes, faults)
    record: dict[str, Any] = {
        "engine": "torchft",
        "lighthouse": job.address,
        "workers": {
            str(slot): [
                {
                    "run": str(job.worker_dir(slot, n)),
                    "exit_code": code,
                    **({"stopped": True} if (slot, n) in stopped else {}),
                }
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
        run_s = reached_s if run_s is None else run_s
        record["replayed"] = {
            "step": job.config.run.stop_after or job.config.run.steps,
            "run_s": before + float(run_s or 0.0),
        }
    job.run_dir.mkdir(parents=True, exist_ok=True)
    path = job.run_dir / "membership.json"
    if job.resumed is not None:
        # The stopped parts' records, oldest first: a resume continues them, never loses them.
        from lowcomm.membership.replay import read_record

        earlier = read_record(path)
        if earlier is not None:
            record["parts"] = [*earlier.pop("parts", []), earlier]
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
