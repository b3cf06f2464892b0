"""The one launch path: a training configuration in, its summary out.

``lowcomm train``, ``lowcomm bench compare`` and ``lowcomm reproduce`` all run a training job
through :func:`run_training`, so every job is checked the same way and starts the same
processes:

1. ``config.validate()``: the options alone (no file read, no model built);
2. :func:`preflight`: the checks that read files or build the model (the data path, the
   calibration file, the checkpoint to resume, the method's options on the real model, the
   run directory);
3. the corpus is prepared (cached) and checked against the worker count and batch size;
4. ``workers x ranks-per-worker`` processes are spawned (or, under ``torchrun``, this process
   joins as one of them) and each runs :func:`lowcomm.train.loop.train_worker`; with
   ``--workers-per-process`` = ``--workers``, every worker runs it on a thread of this process
   (:mod:`lowcomm.launch.inprocess`); with a divisor K in between, ``workers / K`` processes
   run K worker threads each (:mod:`lowcomm.launch.stacked`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowcomm.config import ConfigError, TrainConfig
from lowcomm.launch.spawn import spawn_workers, under_torchrun
from lowcomm.train.rundir import read_summary

if TYPE_CHECKING:
    from lowcomm.data import PreparedCorpus
    from lowcomm.train.task import Task

#: Where a start-up phase is said (``None``: nowhere, e.g. inside a sweep).
Report = Callable[[str], None] | None


def say(message: str) -> None:
    """A start-up phase, shown as it happens (stdout, flushed: a pipe sees it at once)."""
    print(f"lowcomm: {message}", flush=True)


def run_training(
    config: TrainConfig, *, report: Report = say, task: Task | None = None
) -> dict[str, Any] | None:
    """Check, prepare and run one training job; return its ``summary.json``.

    Args:
        config: the job; its paths are made absolute in place, and under ``torchrun`` its
            worker count is taken from the world.
        report: where the start-up phases are said (also the oversubscription warning).
        task: the model, data and loss (:mod:`lowcomm.train.task`, pickled to every worker
            process); None: ``lowcomm train``'s (``--model.*`` on the ``--data`` corpus).

    Returns:
        The run's summary (what rank 0 wrote to ``summary.json``), or None when the run stopped
        early (``--stop-after``) or this process is a ``torchrun`` rank other than 0.

    Raises:
        ConfigError: an option, file or directory the run cannot use (one line naming the fix).
        DataError: the corpus cannot be read or gives a worker no batch.
        WorkerFailed: a worker failed (its traceback is in the run's ``error.log``).
        Interrupted: the launcher was sent SIGINT or SIGTERM; every worker was stopped.
    """
    from lowcomm.train.task import CorpusTask

    task = CorpusTask() if task is None else task
    make_paths_absolute(config)
    torchrun = under_torchrun()
    if torchrun and config.placement.membership != "torchft":
        adopt_torchrun_world(config)  # (with torchft, torchrun's world is one worker's ranks)
    config.validate()
    if (
        config.placement.membership == "torchft"
    ):  # (lowcomm.membership: each worker a torchft replica)
        _check_membership_engine(config, torchrun)
    task.check(config)
    note = preflight(config, task)
    if config.placement.membership == "torchft":
        return _launch_membership(config, note, report, task)
    if torchrun:
        return _join_torchrun(config, note, report, task)
    check_process_memory(config, task)
    _prepare(config, task, report)
    processes = config.placement.processes
    if report is not None and processes > 1 and config.placement.workers_per_process > 1:
        warn_if_oversubscribed(processes, config)
    start_run_dir(config, note)
    return _launch(config, processes, report, task)


def _check_membership_engine(config: TrainConfig, torchrun: bool) -> None:
    """Before anything is built: torchft is installed, and the lighthouse answers."""
    from lowcomm.membership.options import require_torchft

    try:
        require_torchft()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    from lowcomm.membership.worker import check_lighthouse, check_torchrun_group

    if torchrun:  # (one replica group: its ranks, of one worker that names its lighthouse)
        if config.placement.membership_options.lighthouse is None:
            raise ConfigError(
                "--membership torchft: under torchrun, one worker (a replica group of "
                "--ranks-per-worker ranks) of a running lighthouse; give --membership.lighthouse "
                "HOST:PORT --membership.worker K (docs/membership.md)"
            )
        check_torchrun_group(config)
    if config.placement.membership_options.lighthouse is not None:
        check_lighthouse(config.placement.membership_options.lighthouse)


def _launch_membership(
    config: TrainConfig, note: str | None, report: Report, task: Task
) -> dict[str, Any] | None:
    """A ``--membership torchft`` job (:func:`lowcomm.membership.local.run_membership`)."""
    from lowcomm.membership.local import run_membership

    _prepare(config, task, report)
    if not under_torchrun() or os.environ.get("RANK") == "0":  # (the group's rank 0 writes it)
        start_run_dir(config, note)
    return run_membership(config, task)


def _launch(
    config: TrainConfig, processes: int, report: Report, task: Task
) -> dict[str, Any] | None:
    """Run the checked and prepared job: its workers in this process, or ``processes``
    processes (of ``--workers-per-process`` workers each); return its summary."""
    from lowcomm.train.rundir import ERROR_LOG, run_directory

    if processes == 1 and config.placement.workers_per_process > 1:
        if report is not None:
            report(f"starting {config.placement.workers} workers in this process (one thread each)")
        from lowcomm.launch.inprocess import train_in_process

        train_in_process(config, log_path=run_directory(config) / ERROR_LOG, task=task)
        return read_summary(run_directory(config))
    entry: Callable[[TrainConfig, Task], Any]
    if config.placement.workers_per_process > 1:
        if report is not None:
            report(
                f"starting {processes} processes of {config.placement.workers_per_process} workers "
                f"each (one thread per worker)"
            )
        from lowcomm.launch.stacked import spawned_stacked as entry
    else:
        if report is not None:
            report(f"starting {config.placement.world_size} worker processes")
        from lowcomm.faults.run import FaultSettings

        if FaultSettings.of(config.fault).enabled:  # (the strategy's group follows the quorum)
            from lowcomm.faults.processes import process_layout
            from lowcomm.train.loop import spawned_train_with_faults as entry

            processes = len(process_layout(config))  # (with a process for each rejoin)
        else:
            from lowcomm.train.loop import spawned_train as entry

    spawn_workers(
        entry,
        processes,
        (config, task),
        device=config.placement.device,
        timeout_s=config.comm.collective_timeout_s,
        log_path=run_directory(config) / ERROR_LOG,
    )
    return read_summary(run_directory(config))


def kept_state(config: TrainConfig) -> str:
    """What a stopped run's directory holds: its steps, its newest checkpoint and the command
    that continues from it (or that it kept none)."""
    from lowcomm.train.checkpoint import committed
    from lowcomm.train.rundir import run_directory

    if config.placement.membership == "torchft" and (
        config.placement.membership_options.lighthouse is None
    ):  # (a local job: each worker's run in its own directory)
        from lowcomm.membership.local import kept_job_state

        return kept_job_state(config)
    run_dir = run_directory(config)
    try:
        steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
    except (OSError, UnicodeDecodeError):
        steps = 0
    kept = committed(run_dir)
    if kept:
        checkpoint = (
            f"its newest checkpoint is {kept[-1]}; continue with: lowcomm train --resume {run_dir}"
        )
    else:
        checkpoint = "no checkpoint was kept (--checkpoint-every N writes them)"
    return f"{run_dir}/metrics.jsonl holds {steps} steps, {checkpoint}"


def _prepare(config: TrainConfig, task: Task, report: Report) -> None:
    """Prepare and check the run's data (the corpus, cached, where the task reads it)."""
    if task.reads_corpus:
        prepare_checked_corpus(config, report)
    task.prepare(config, report)
    if report is not None and config.placement.workers_per_process == 1:
        workers = (
            config.placement.workers if config.placement.worker_sharding == "replicate" else None
        )
        warn_if_oversubscribed(config.placement.world_size, config, workers=workers)


def check_process_memory(config: TrainConfig, task: Task) -> None:
    """Refuse CPU worker processes (``--workers-per-process 1``) that cannot fit this
    machine's free host memory, before any starts (workers sharing processes are checked by
    their processes, with their activations measured), the processes standing by for a
    fault trace's joins counted. The model's shapes only: on the meta device where it can
    be built.

    Raises:
        ConfigError: naming the estimate, the free memory and the fix.
    """
    if config.placement.device != "cpu" or config.placement.workers_per_process != 1:
        return
    from lowcomm.faults.processes import process_layout
    from lowcomm.launch.device_memory import check_worker_processes

    standbys = len(process_layout(config)) - config.placement.world_size
    model = task.shapes_model(config)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    check_worker_processes(config, parameters, standbys=standbys)


def make_paths_absolute(config: TrainConfig) -> None:
    """Store every path option absolute (``~`` expanded), so the saved config.json, and
    ``--resume`` from it, mean the same files from any working directory. A path that does
    not exist stays as given (an ``--init-from`` or ``--tokenizer`` that is a hub name), for
    pre-flight to name."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else os.path.abspath(os.path.expanduser(path))

    config.run.out = absolute(config.run.out)
    if config.run.resume != "auto":
        config.run.resume = absolute(config.run.resume)
    config.data.data = absolute(config.data.data)
    if config.run.init_from is not None and os.path.exists(
        os.path.expanduser(config.run.init_from)
    ):
        config.run.init_from = absolute(config.run.init_from)
    tokenizer = config.data.tokenizer
    if tokenizer is not None and os.path.exists(os.path.expanduser(tokenizer)):
        config.data.tokenizer = absolute(tokenizer)
    config.data.cache_dir = absolute(config.data.cache_dir)
    if config.fault.faults is not None and os.path.exists(os.path.expanduser(config.fault.faults)):
        config.fault.faults = absolute(config.fault.faults)


def preflight(config: TrainConfig, task: Task | None = None) -> str | None:
    """The checks that need files or a model, run once before any worker starts (after
    ``config.validate()``, which checks the options alone).

    Returns:
        The lines to print at the start (a resume that passes over damaged checkpoints, a
        method's note, an overlap window NCCL's watchdog may not cover), else None.

    Raises:
        ConfigError: the first problem, in one line naming the option and the fix.
    """
    from lowcomm.faults.run import run_trace, trace_notes
    from lowcomm.launch.devices import watchdog_note
    from lowcomm.launch.init_check import check_init_from
    from lowcomm.train.metrics import check_loggers
    from lowcomm.train.rundir import check_run_dir

    check_init_from(config)  # first: it settles the tokenizer the resume check compares
    _check_resume(config)
    _check_calibration_file(config)
    check_loggers(config)
    traced = trace_notes(run_trace(config), config)  # (a bad trace ends here, in one line)
    method_note = check_method_options(config, task)
    _check_data_path(config)
    watchdog = watchdog_note(config)
    checks = (check_run_dir(config), method_note, watchdog, traced)
    notes = [note for note in checks if note is not None]
    return "\n".join(notes) if notes else None


def _check_data_path(config: TrainConfig) -> None:
    if config.data.data is not None and not Path(config.data.data).expanduser().exists():
        raise ConfigError(
            f"--data: path {config.data.data!r} does not exist; pass a text, JSONL or parquet "
            f"file, a folder of them, a save_to_disk dataset, a .npy/.bin token file, or omit "
            f"it to use the bundled corpus"
        )


def _check_calibration_file(config: TrainConfig) -> None:
    """``--calibration FILE``: an existing file is a calibration of this run's shapes."""
    if config.comm.calibration is None:
        return
    from lowcomm.comm.calibration import check_calibration_file

    problem = check_calibration_file(
        Path(config.comm.calibration),
        micro_batch_size=config.data.micro_batch_size,
        block_size=config.model.block_size,
        bf16=config.numerics.precision == "bf16-mixed",
    )
    if problem is not None:
        raise ConfigError(
            f"--calibration: {config.comm.calibration} {problem}; pass another file (a missing "
            f"one is measured and written)"
        )


def _check_resume(config: TrainConfig) -> None:
    """``--resume DIR``: the directory holds a checkpoint this configuration can continue
    (and is the run's directory: an ``--out`` elsewhere is refused)."""
    if config.run.resume is None or config.run.resume == "auto":
        return
    if config.placement.membership == "torchft":
        from lowcomm.membership.local import check_resume

        check_resume(config)  # (each worker's own directory; a local job's at one step)
        return
    if (
        config.run.out is not None
        and Path(config.run.out).resolve() != Path(config.run.resume).resolve()
    ):
        raise ConfigError(
            f"--out: {config.run.out!r} differs from --resume {config.run.resume!r}; a resumed run "
            f"continues in its own directory, so omit --out"
        )
    from lowcomm.train.checkpoint import (
        CheckpointError,
        find_latest,
        fingerprint,
        has_checkpoint,
        preflight_ranks,
    )

    if not has_checkpoint(Path(config.run.resume)):
        latest = Path(config.run.resume) / "checkpoints" / "latest"
        raise ConfigError(
            f"--resume: {config.run.resume!r} holds no checkpoint ({latest} is missing); pass "
            f"the --out directory of a run trained with --checkpoint-every or "
            f"--stop-after, or --resume auto"
        )
    try:
        find_latest(
            Path(config.run.resume),
            config.placement.world_size,
            fingerprint(config),
            preflight_ranks(config.placement.ranks_per_process),
        )
    except CheckpointError as error:
        raise ConfigError(str(error)) from None


def check_method_options(config: TrainConfig, task: Task | None = None) -> str | None:
    """Construct the method once on a recording communicator of the run's worker count, so
    options that depend on the model or the worker count fail here, before any worker starts,
    with the method's own message. Returns the method's note on a run of ``--steps`` whose
    final model leaves out the last steps (:meth:`Strategy.unsynchronized_tail`; not for a
    --token-budget run, which may end sooner). ``task``: the run's model (default:
    ``--model.*``'s)."""
    from lowcomm.comm.fake import RecordingComm
    from lowcomm.models.deferred import ShapesOnly
    from lowcomm.strategies import build_strategy
    from lowcomm.train.context import strategy_context
    from lowcomm.train.task import CorpusTask

    try:
        # On the meta device where the model can be built there: the method needs the
        # shapes, not a copy of the weights.
        model = (CorpusTask() if task is None else task).shapes_model(config)
        with ShapesOnly():
            strategy = build_strategy(
                config.method, model, RecordingComm(world_size=config.placement.workers),
                strategy_context(config), config,
            )  # fmt: skip
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.run.token_budget is not None:
        return None
    tail = strategy.unsynchronized_tail(config.run.steps)
    return None if tail is None else f"lowcomm: note: {tail}"


def prepare_checked_corpus(
    config: TrainConfig,
    report: Report,
    *,
    check: bool = True,
    waiting: Callable[[str], None] | None = None,
) -> PreparedCorpus:
    """Prepare the corpus (tokenizer and tokens, cached) and (with ``check``) check that every
    worker gets a batch from it; ``waiting`` is told while another process prepares it."""
    from lowcomm.data import prepare_corpus

    source = "the bundled corpus" if config.data.data is None else config.data.data
    if report is not None:
        report(f"preparing corpus from {source}")
    started = time.perf_counter()
    try:
        corpus = prepare_corpus(config.data, report=report, waiting=waiting)
    except OSError as error:  # e.g. a cache directory that cannot be written
        where = f" ({error.filename})" if error.filename else ""
        raise ConfigError(
            f"--data, --cache-dir: preparing the corpus failed: {error.strerror or error}{where}; "
            f"check that the data is readable and the cache directory (--cache-dir, "
            f"$LOWCOMM_CACHE_DIR or ~/.cache/lowcomm) is writable"
        ) from None
    if check:
        check_corpus(config, corpus)
    if report is not None:
        report(describe_corpus(corpus, time.perf_counter() - started))
    return corpus


def check_corpus(config: TrainConfig, corpus: PreparedCorpus) -> None:
    """Check, on the prepared corpus, that every worker gets a micro-batch per epoch and the
    validation split holds a window (what each worker would otherwise fail on at start).

    Raises:
        ConfigError: naming the options that size the batches, and the corpus's reason.
    """
    from lowcomm.data import WorkerShard, validation_batches

    try:
        WorkerShard(
            corpus, rank=0, world_size=config.placement.workers, seq_len=config.model.block_size,
            micro_batch_size=config.data.micro_batch_size, seed=config.run.seed,
            split=config.data.split, replica=0, replicas=config.placement.ranks_per_worker,
        )  # fmt: skip
        validation_batches(
            corpus,
            seq_len=config.model.block_size,
            batch_size=config.data.micro_batch_size * config.placement.ranks_per_worker,
            num_batches=1,
        )
    except ValueError as error:  # DataError included
        raise ConfigError(f"--workers, --micro-batch-size, --model.block-size: {error}") from None


def describe_corpus(corpus: PreparedCorpus, seconds: float) -> str:
    """The line saying what the prepared corpus holds."""
    files = len(corpus.source_names)
    tokens = corpus.num_train_tokens + corpus.num_val_tokens
    from lowcomm.data.tokenfile import is_token_file

    if is_token_file(str(corpus.token_file)):
        checked = "checked before" if corpus.from_cache else "checked now"
        tokenizer = f"mapped from {corpus.token_file}, {checked},"
    else:
        tokenizer = "tokenizer and tokens from the cache" if corpus.from_cache else "tokenized now"
    return (
        f"corpus: {files:,} file{'s' if files != 1 else ''}, {corpus.num_documents:,} "
        f"documents, {tokens:,} tokens ({corpus.num_train_tokens:,} train, "
        f"{corpus.num_val_tokens:,} validation), vocabulary {corpus.vocab_size:,}; "
        f"{tokenizer} in {seconds:.1f} s"
    )


def warn_if_oversubscribed(
    processes: int, config: TrainConfig | None = None, *, workers: int | None = None
) -> None:
    """Say when this machine runs more worker processes than it has CPU cores, and what that
    does to the run's clock (``config``'s; without one, the default clock's). ``workers``: the
    run's worker count where each worker is a process the local spawner starts; the warning
    then names ``--workers-per-process``, which runs them as threads of one process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores is not None and processes > cores:
        threads = (
            ""
            if workers is None
            else f"; --workers-per-process {workers} runs them as threads of one process"
        )
        print(
            f"lowcomm: warning: {processes} worker processes on {cores} CPU cores: they take "
            f"turns, so start-up and wall-clock times grow with the count "
            f"({_clock_under_load(config or TrainConfig())}){threads}",
            file=sys.stderr,
            flush=True,
        )


def _clock_under_load(config: TrainConfig) -> str:
    """What the run's clock makes of workers taking turns on the cores."""
    if config.comm.clock == "real":
        return "the real clock's modeled time grows with them: try --clock virtual"
    if config.comm.seconds_per_microbatch is not None:
        return "the virtual clock charges the declared --seconds-per-microbatch and is not inflated"
    if config.comm.compute_model == "cpu-time":
        return (
            "the virtual clock counts each worker's own CPU time, which sharing a core "
            "inflates by a few percent"
        )
    return (
        "the virtual clock charges the compute cost the workers calibrate in turn before "
        "training, and is not inflated"
    )


def start_run_dir(config: TrainConfig, note: str | None) -> None:
    """Say which checkpoint a resume falls back to, and clear the directory for --overwrite."""
    from lowcomm.train.rundir import clear_run, run_directory

    if note is not None:
        print(note, file=sys.stderr)
    if config.run.overwrite:
        removed = clear_run(run_directory(config))
        if removed:
            print(
                f"lowcomm: --overwrite: removed {', '.join(removed)} from {run_directory(config)}",
                file=sys.stderr,
            )


def adopt_torchrun_world(config: TrainConfig) -> None:
    """Take the worker count from torchrun's world (before the checks that depend on it)."""
    world_size = int(os.environ["WORLD_SIZE"])
    if config.placement.ranks_per_worker < 1:
        return  # validate() names it
    if config.placement.workers_per_process <= 1 and world_size % config.placement.ranks_per_worker:
        raise ConfigError(
            f"--ranks-per-worker: {config.placement.ranks_per_worker} does not divide the torchrun world "
            f"of {world_size} processes; launch workers x ranks-per-worker processes (e.g. "
            f"--nproc-per-node {config.placement.ranks_per_worker} on each of the workers' nodes)"
        )
    # --workers-per-process K > 1: each of torchrun's processes runs K workers, their ranks
    # as threads (validate() names a K that does not fit); else each process is one rank.
    k = config.placement.workers_per_process
    workers = world_size * k if k > 1 else world_size // config.placement.ranks_per_worker
    if config.placement.workers != workers:
        # torchrun decides the world; keep the recorded config truthful.
        config.placement.workers = workers
        if config.comm.speed_factors and len(config.comm.speed_factors) != workers:
            raise ConfigError(
                f"--speed-factors: {len(config.comm.speed_factors)} values for a torchrun world of "
                f"{workers} workers; give one per worker"
            )


def _join_torchrun(
    config: TrainConfig, note: str | None, report: Report, task: Task
) -> dict[str, Any] | None:
    """Run this process as one rank of a ``torchrun`` job."""
    import torch
    import torch.distributed as dist

    from lowcomm.comm.torch_comm import QuorumTorchComm, TorchComm
    from lowcomm.faults.run import FaultSettings
    from lowcomm.launch.spawn import init_from_env, leave_failed_rank
    from lowcomm.train.loop import train_worker
    from lowcomm.train.rundir import run_directory

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank == 0 and report is not None:
        warn_if_oversubscribed(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), config)
    init_from_env(device=config.placement.device, timeout_s=config.comm.collective_timeout_s)
    try:
        # Every process checked the run directory before the rendezvous; only then is it cleared.
        first = dist.get_rank() == 0
        if first:
            start_run_dir(config, note)
            if report is not None:
                report(f"workers connected: {dist.get_world_size()} processes")
        # Every rank prepares: the first to take the cache's file lock tokenizes, the others
        # wait on that lock (saying so every 30 s), never inside a collective, where NCCL's
        # watchdog would end a long wait; then all map the same token file. Checked on every
        # rank, so all refuse a corpus alike.
        rank = dist.get_rank()

        def waiting(line: str) -> None:
            print(f"lowcomm: rank {rank}: {line}", file=sys.stderr, flush=True)

        if task.reads_corpus:
            prepare_checked_corpus(config, report if first else None, waiting=waiting)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if config.placement.workers_per_process > 1:  # this process's K workers, as threads
            from lowcomm.launch.stacked import train_stacked

            train_stacked(config, task)
        elif FaultSettings.of(config.fault).enabled:  # (the strategy's group follows the quorum)
            train_worker(
                config, QuorumTorchComm(timeout_s=config.comm.collective_timeout_s), task=task
            )
        else:
            train_worker(config, TorchComm(timeout_s=config.comm.collective_timeout_s), task=task)
    except BaseException as error:
        leave_failed_rank(error)
    dist.destroy_process_group()
    return read_summary(run_directory(config)) if first else None
