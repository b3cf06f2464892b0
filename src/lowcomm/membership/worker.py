"""One worker of a ``--membership torchft`` run: a torchft replica group that trains with
lowcomm's loop, its collectives in torchft rounds (:mod:`lowcomm.membership.torchft_comm`).

A worker of ``--ranks-per-worker R > 1`` is R processes (:class:`GroupRank`): inside it the
ranks are a plain ``torch.distributed`` group (Gloo, over the local launcher's file store or
torchrun's), lowcomm's replica level as in a static run; between workers rank r's collectives
go through its own torchft Manager to rank r of the other workers (the strategy's
``HierarchicalComm``, whose outer level is this rank's :class:`TorchftComm`). With
``--worker-sharding fsdp`` FSDP2 shards the model over the group's own ranks (a mesh of them
alone) and rank r's shard is what its :class:`TorchftComm` exchanges
(:func:`lowcomm.train.sharding.shard_worker`). Group rank 0
writes the run directory; rank r > 0 writes only its ``membership.rank{r}.json``.

The worker's run is its own: nodes share no disk, so each worker writes its own run directory
(``--out``): metrics.jsonl and summary.json as a run of one worker does (its loss, its clock,
its bytes), and membership.json, what torchft decided for it: each quorum (its id, members
and participants), each round committed or dropped, and when it was healed (the loop step it
was healed at, the bytes received and how long it took, the declared state's bytes it
took and, for replicated ranks, those gathered among them).

A worker started while the others train is healed before its first step
(:meth:`Replica.admit`) and continues from the others' loop step; its first round sits out
their sync.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowcomm.config import ConfigError, TrainConfig
from lowcomm.membership.options import parse_address, require_torchft
from lowcomm.membership.replay import WorkerReplay, without_faults
from lowcomm.train.task import Task

if TYPE_CHECKING:
    import torch

    from lowcomm.comm.base import Comm, Handle, ReduceOp, Role, Segments
    from lowcomm.membership.torchft_comm import Replica, TorchftComm
    from lowcomm.train.loop import FinalState, Progress, Worker
    from lowcomm.train.metrics import RunWriter

__all__ = [
    "GroupRank",
    "check_host",
    "check_lighthouse",
    "check_torchrun_group",
    "local_address",
    "train_replica",
]

#: How long the lighthouse may take to accept a connection before the run is refused.
REACH_TIMEOUT_S = 5.0


def check_lighthouse(address: str) -> None:
    """Refuse, in one line, a lighthouse that cannot be reached."""
    host, port = parse_address(address, "--membership.lighthouse")
    try:
        with socket.create_connection((host, port), timeout=REACH_TIMEOUT_S):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(
            f"--membership.lighthouse {address}: cannot be reached ({reason}); start one there "
            f"(torchft_lighthouse --bind {host}:{port} --min_replicas 1) or give its address"
        ) from None


def check_host(host: str) -> None:
    """Refuse, in one line, a ``--membership.host`` this machine cannot bind (its worker's
    listeners bind it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host.strip("[]"), 0))
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(
            f"--membership.host: {host} cannot be bound on this machine ({reason}); give the "
            "address of one of its interfaces that the other workers reach, or omit it (the "
            "interface that routes to the lighthouse)"
        ) from None


def local_address(lighthouse: str) -> str:
    """The address of this machine's interface that routes to the lighthouse (nothing is
    sent: a UDP socket's connect only picks the route)."""
    host, port = parse_address(lighthouse, "--membership.lighthouse")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


@dataclass(frozen=True)
class GroupRank:
    """This process's place in its worker's replica group (``--ranks-per-worker R > 1``)."""

    rank: int
    """Its rank in the group, 0 to R - 1."""
    ranks: int
    """The group's size R."""
    store_path: str | None = None
    """The file store the group's ranks meet in (the local launcher's: no listener); None:
    torchrun's rendezvous (its environment)."""


def check_torchrun_group(config: TrainConfig) -> GroupRank:
    """This torchrun process's place in its replica group, or ConfigError in one line: under
    torchrun a torchft worker is one replica group, so torchrun's world is its R ranks."""
    ranks = config.placement.ranks_per_worker
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != ranks:
        raise ConfigError(
            f"--ranks-per-worker: {ranks} is not torchrun's world of {world} processes; with "
            "--membership torchft one torchrun starts one worker (a replica group): "
            f"torchrun --nnodes 1 --nproc-per-node {ranks}, one per worker"
        )
    return GroupRank(int(os.environ.get("RANK", "0")), ranks)


def train_replica(
    config: TrainConfig,
    task: Task | None = None,
    replay: WorkerReplay | None = None,
    group: GroupRank | None = None,
) -> dict[str, Any]:
    """Train this process as worker ``--membership.worker`` of a torchft job (with
    ``--ranks-per-worker R > 1``, rank ``group.rank`` of it; None: torchrun's rank); return
    what membership.json holds. ``replay``: the local launcher replays a fault trace on this
    worker (lowcomm.membership.replay); its trace is then not simulated here."""
    require_torchft()
    if replay is not None:
        config = without_faults(config)
    options = config.placement.membership_options
    assert options.lighthouse is not None and options.worker is not None
    check_lighthouse(options.lighthouse)
    if options.host is not None:
        check_host(options.host)

    from lowcomm.membership.records import record_name
    from lowcomm.membership.torchft_comm import TorchftComm
    from lowcomm.train.compute import finish_calibration
    from lowcomm.train.rundir import run_directory

    if config.placement.ranks_per_worker > 1 and group is None:
        group = check_torchrun_group(config)
    inner = _join_group(config, group)
    if replay is not None and group is not None:
        replay.reports = group.rank == 0
    replica = _replica(config, group, replay)
    started = time.time()
    try:
        raw = TorchftComm(replica)
        worker = _set_up(config, raw, replica, task, (inner, replay))
        path = run_directory(config) / record_name(replica.rank)
        replica.on_event = lambda: _write(path, _record(replica, config, started))
        raw.start()
        # (--resume: this worker's own checkpoint, in its own run directory; the launcher
        # has checked that every worker's names the same step.)
        progress = _resume(worker, replica)
        finish_calibration(worker.clock, config, 0)
        admitted = _admit(replica, config)  # (0: no peer further on; else healed into their step)
        # (Not healed: its shard stays where its checkpoint left it, which for a
        # decoupled_diloco learner that sat ticks out is short of its steps' micro-batches.)
        if admitted:
            progress.start_step = admitted
            _skip_to(worker.shard, admitted * config.run.microbatches_per_step)
        return _train(config, worker, replica, (progress, path, started), replay)
    finally:
        replica.shutdown()
        if inner is not None:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _join_group(config: TrainConfig, group: GroupRank | None) -> Comm | None:
    """The worker's own group of its R ranks (None: one rank), on the launcher's file store
    or torchrun's rendezvous; Gloo, on the interface of ``GLOO_SOCKET_IFNAME``."""
    if group is None:
        return None
    import torch.distributed as dist

    from lowcomm.comm.torch_comm import TorchComm

    timeout_s = config.comm.collective_timeout_s
    if group.store_path is None:
        from lowcomm.launch.spawn import init_from_env

        init_from_env(device="cpu", timeout_s=timeout_s)
    else:
        store = dist.FileStore(group.store_path, group.ranks)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo", store=store, rank=group.rank, world_size=group.ranks,
            timeout=timedelta(seconds=max(timeout_s, 60.0)),
        )  # fmt: skip
    return TorchComm(timeout_s=timeout_s)


def _replica(config: TrainConfig, group: GroupRank | None, replay: WorkerReplay | None) -> Replica:
    """This process's torchft Replica. In a group of R ranks, rank 0 opens the group's store
    and manager server on its host, then tells the other ranks where (they connect to it)."""
    from lowcomm.membership.torchft_comm import Replica

    options = config.placement.membership_options
    assert options.lighthouse is not None and options.worker is not None
    rank, ranks = (0, 1) if group is None else (group.rank, group.ranks)
    host = options.host or local_address(options.lighthouse)
    # (A resumed job whose trace had killed a slot before the stop starts without it: its
    # first round waits for the workers that start, not for --workers.)
    workers = config.placement.workers
    if replay is not None and replay.assembling is not None:
        workers = replay.assembling

    def make(host: str, store_port: int | None) -> Replica:
        assert options.lighthouse is not None and options.worker is not None
        return Replica(
            options, slot=options.worker, workers=workers,
            lighthouse=options.lighthouse, host=host, timeout_s=config.comm.collective_timeout_s,
            rank=rank, ranks=ranks, store_port=store_port,
        )  # fmt: skip

    if group is None:
        return make(host, None)
    import torch.distributed as dist

    replica = make(host, None) if rank == 0 else None
    shared: list[Any] = [None if replica is None else (host, replica.store_port)]
    dist.broadcast_object_list(shared, src=0)
    if replica is None:
        host, port = shared[0]
        replica = make(str(host), int(port))
    replica.agree = _every_rank
    return replica


def _every_rank(ready: bool) -> bool:
    """Whether every rank of this worker's group is ready (its admission: a deadline each rank
    reads from its own clock must not split the group, some ranks committing the startup
    round and others asking for a quorum again)."""
    import torch
    import torch.distributed as dist

    waiting = torch.tensor([0.0 if ready else 1.0])
    dist.all_reduce(waiting, op=dist.ReduceOp.MAX)
    return bool(waiting.item() == 0.0)


def _train(
    config: TrainConfig,
    worker: Worker,
    replica: Replica,
    admitted: tuple[Progress, Path, float],
    replay: WorkerReplay | None,
) -> dict[str, Any]:
    """Train the admitted worker to --steps (or --stop-after), write its run and return what
    membership.json holds."""
    from lowcomm.strategies import strategy_class
    from lowcomm.train import loop

    progress, path, started = admitted
    rule = strategy_class(config.method).membership
    step_rounds = rule is not None and rule.round == "step"
    writer = loop._run_writer(worker, progress)
    if writer is not None:
        _record_membership(writer, replica)
    final = loop.FinalState()
    start_wall = time.perf_counter()
    clean = _CleanSteps(config.placement.workers)
    stopped = False
    try:
        with worker.clock.training():
            stopped = not _replica_steps(
                config, worker, replica, (progress, writer, final), step_rounds, replay, clean
            )
            replica.trained_until = time.time()
            if not stopped:
                loop.final_evaluation(worker, progress, final, keep_parameters=False)
                if _checkpoints(config) and progress.start_step < config.run.steps:
                    # The last step's checkpoint, as a static run's.
                    end = progress.end_step or config.run.steps
                    with worker.clock.excluded():
                        loop._save_checkpoint(worker, end, progress)
                    _keep_torchft_step(config, replica, end, end)
    finally:
        if writer is not None:
            if final.last_record is not None:
                writer.write_step(final.last_record)
            writer.close_steps()
    if stopped:  # (--stop-after: its checkpoint is written; the launcher says how to go on)
        record = _record(replica, config, started)
        record["stopped"] = config.run.stop_after
        _write(path, record)
        return record
    if writer is not None:
        writer.faults = _membership_summary(writer, replica, config)
    loop.finish(worker, progress, writer, final, False, time.perf_counter() - start_wall)
    record = _record(replica, config, started)
    record["finished"] = time.time()
    record["clean_step_s"], record["clean_steps"] = clean.seconds, clean.count
    record["data_position"] = worker.shard.state_dict().get("position")
    _write(path, record)
    return record


def _set_up(
    config: TrainConfig,
    raw: TorchftComm,
    replica: Replica,
    task: Task | None,
    around: tuple[Comm | None, WorkerReplay | None],
) -> Worker:
    """This replica's worker, its strategy's rounds following the lighthouse's quorums (and
    its emulated link following a replayed trace's link events, as a simulated run's).
    ``around``: the group of the worker's R ranks (None: one rank) and the replayed trace."""
    from lowcomm.comm.emulated import NetworkComm
    from lowcomm.comm.local import LocalComm
    from lowcomm.membership.torchft_comm import TorchftMembership
    from lowcomm.train import loop

    inner, replay = around
    if inner is None:
        worker = loop.set_up(config, raw, LocalComm(), None, task)
        # This process's run is its own: it writes its directory as a run's rank 0 does.
        worker.rank, worker.world_size = 0, 1
        if isinstance(worker.comm, NetworkComm):
            # (The virtual clock agrees launch times over the round's members, not locally.)
            worker.comm._bookkeeping = None
            if replay is not None and replay.has_link_events():
                worker.comm.link_model = replay.link_model(worker.clock.now)
    else:
        # The worker's run is its R ranks': metrics, evaluation and totals over its own
        # group, the method between workers over each rank's torchft group (the outer level).
        ranks = config.placement.ranks_per_worker
        place = _JobRank(raw, replica.slot * ranks + inner.rank, config.placement.workers * ranks)
        worker = loop.set_up(config, place, inner, None, task, (inner, raw))
        worker.rank, worker.world_size = inner.rank, inner.world_size
        # (A sharded worker's communicator is itself the link between workers; its inner
        # link is its own attribute.)
        outer = getattr(worker.comm, "outer_comm", worker.comm)
        if isinstance(outer, NetworkComm) and replay is not None and replay.has_link_events():
            # (A link event is the link between workers: the inner link is the worker's own.)
            outer.link_model = replay.link_model(worker.clock.now)
    worker.strategy.runtime = replace(
        worker.strategy.runtime, membership=TorchftMembership(replica)
    )
    replica.attach(worker.strategy)
    if config.run.token_budget is not None:
        # The budget counts the job's committed tokens, which every round carries
        # (Replica.carry_count): each worker holds the same count and stops at the same step.
        replica.count_tokens = True
        replica.count_at_commit = _commits_at_completion(worker.strategy)
        worker.job_tokens = lambda: replica.job_tokens
    replica.clock = worker.clock
    return worker


class _JobRank:
    """A worker rank's place among the job's ranks during set-up: rank r of worker K takes
    the data of the job's rank K R + r, as in a static run. Its collectives are those of
    this rank's :class:`TorchftComm` (nothing crosses workers during set-up)."""

    def __init__(self, comm: Comm, rank: int, world_size: int) -> None:
        self._comm = comm
        self._rank = rank
        self._world_size = world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: ReduceOp = "mean",
        role: Role,
        segments: Segments | None = None,
    ) -> Handle:
        return self._comm.all_reduce(tensor, op=op, role=role, segments=segments)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", role: Role
    ) -> Handle:
        return self._comm.reduce_scatter(output, input, op=op, role=role)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        return self._comm.all_gather(output, input, role=role)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, role: Role) -> Handle:
        return self._comm.all_to_all(output, input, role=role)

    def broadcast(self, tensor: torch.Tensor, *, src: int, role: Role) -> Handle:
        return self._comm.broadcast(tensor, src=src, role=role)

    def barrier(self) -> Handle:
        return self._comm.barrier()


def _commits_at_completion(strategy: Any) -> bool:
    """Whether the strategy's rounds commit the tokens up to the step that completes them
    (the default), not those up to their launch (a method that reports its syncs settled
    after their launch: ``Strategy.settled_syncs``), as a simulated run counts them."""
    from lowcomm.strategies.base import Strategy

    return type(strategy).settled_syncs is Strategy.settled_syncs


def _resume(worker: Worker, replica: Replica) -> Progress:
    """This worker's progress: a fresh start, or with --resume its own directory's newest
    intact checkpoint (the worker's run is its own; the job's other workers are not a layout
    to re-shard from): one file per rank of its group, rank r reading ``rank{r}.pt``, as a
    static run's ranks of one worker do.

    A resumed worker also takes back the loop step and torchft's step
    (:data:`TORCHFT_STEP`, kept beside its files): nodes share no disk, so no one compares
    the workers' checkpoints before they start; their first quorum does (:func:`_admit`).
    torchft's quorum finds its max step among the live workers, and a worker whose checkpoint
    is behind it (its newest checkpoint lost, or older than a peer's) is healed from one that
    holds it, as a joiner is. That is torchft's own design (each replica's checkpoint holds
    its Manager's step, and the quorum heals the ones behind); a shared step agreed over the
    quorum would need every worker to hold a checkpoint of that step, which a worker that
    lost its newer ones cannot offer.

    The step taken back is the one before the checkpoint's: the resumed job's startup round
    commits it back to the checkpoint's, so resumed workers compare as their checkpoints
    do, while workers that trained on past the checkpoint (a running job this one restarts
    into) are ahead of it even before their next commit, and heal it."""
    from lowcomm.membership import records
    from lowcomm.train import checkpoint, loop

    config = worker.config
    if config.run.resume is None:
        return loop.Progress()
    resume_from = Path(config.run.resume)
    ranks = config.placement.ranks_per_worker
    step, directory = checkpoint.find_latest(resume_from, ranks, checkpoint.fingerprint(config))
    saved = checkpoint.read_rank_state(directory, worker.rank, worker.device)
    progress = loop.restore(worker, saved, step, resume_from, directory)
    state = torchft_step(directory)
    replica.manager.load_state_dict({**state, "step": max(state["step"] - 1, 0)})
    if replica.count_tokens:
        replica.job_tokens, replica.pending_tokens = _token_counts(directory)
    replica.loop_step = step  # (what a peer healed from this worker continues from)
    # (Its membership.json goes on from the checkpoint, as its metrics.jsonl does.)
    records.take_back(
        replica, resume_from, step, json.loads((directory / TORCHFT_STEP).read_text())
    )
    if worker.rank == 0:
        print(
            f"lowcomm: worker {config.placement.membership_options.worker} resumed "
            f"{resume_from} from step {step}; training steps {step + 1} to {config.run.steps}",
            flush=True,
        )
    return progress


#: The file beside a worker's checkpoint files that holds torchft's step there (the
#: Manager's state dict: its step and committed batches).
TORCHFT_STEP = "torchft.json"

#: The key of the state a healed worker receives besides the method's: whether its source
#: was still being admitted (:func:`_admit`).
ADMISSION_KEY = "lowcomm_admission"

#: The key of the options a healed worker receives from its source (:func:`job_options`).
OPTIONS_KEY = "lowcomm_options"


def torchft_step(directory: Path) -> dict[str, int]:
    """torchft's step (the Manager's state dict) at the checkpoint in ``directory``.

    Raises:
        ConfigError: in one line naming the file and the fix.
    """
    path = directory / TORCHFT_STEP
    try:
        state = json.loads(path.read_text())
        return {"step": int(state["step"]), "batches_committed": int(state["batches_committed"])}
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = "is missing" if isinstance(error, FileNotFoundError) else "is unreadable"
        raise ConfigError(
            f"--resume: {path} {reason} (torchft's step at that checkpoint, which its "
            "workers' first quorum compares); remove that checkpoint directory to resume from "
            "the one before, or start this worker without --resume (it heals from a live one)"
        ) from None


def _keep_torchft_step(
    config: TrainConfig, replica: Replica, step: int, end: int | None = None
) -> None:
    """After the loop step that ends at ``step``: if the run wrote its checkpoint of that
    step (the loop's rule: --checkpoint-every, --stop-after, the last step, or ``end``, the
    step a token budget ended the run at), write torchft's step beside it (each rank its own
    view of the directory, the same bytes), which a resume takes back. With a token budget
    the job's committed tokens and this worker's pending ones go with it
    (:data:`TOKENS_KEY`): a resumed job then stops where the uninterrupted one does."""
    from lowcomm.atomic import atomic_write_text
    from lowcomm.membership.records import counters
    from lowcomm.train.checkpoint import step_directory
    from lowcomm.train.rundir import run_directory

    run = config.run
    every = run.checkpoint_every
    periodic = every is not None and step % every == 0 and step < run.steps
    if not (_checkpoints(config) and (periodic or step in (run.stop_after, run.steps, end))):
        return
    directory = step_directory(run_directory(config), step)
    if (directory / "manifest.json").exists():
        # (With the records' counters there, which a resumed membership.json goes on from.)
        state = {**replica.manager.state_dict(), **counters(replica)}
        if replica.count_tokens:
            state[TOKENS_KEY] = {"job": replica.job_tokens, "pending": replica.pending_tokens}
        atomic_write_text(directory / TORCHFT_STEP, json.dumps(state) + "\n")


#: torchft.json's key of the token counts a budget needs (the job's committed tokens and
#: the worker's pending ones at the checkpoint's step).
TOKENS_KEY = "lowcomm_tokens"


def _token_counts(directory: Path) -> tuple[int, int]:
    """The job's committed tokens and this worker's pending ones at the checkpoint in
    ``directory``.

    Raises:
        ConfigError: in one line, when the checkpoint was written without a token budget.
    """
    path = directory / TORCHFT_STEP
    counts = json.loads(path.read_text()).get(TOKENS_KEY)
    if not isinstance(counts, dict):
        raise ConfigError(
            f"--token-budget: {path} holds no count of the job's committed tokens (its run "
            "had no --token-budget); resume it without --token-budget, or start it again"
        )
    return int(counts["job"]), int(counts["pending"])


def job_options(config: TrainConfig) -> dict[str, Any]:
    """The options every worker of a job must share: those its checkpoints are compared by
    (the model, the method's, the data, the steps, ...) and the worker count (each slot's data
    shard). A joiner healed from a worker of other options is refused (:func:`_admitted`)."""
    from lowcomm.strategies import strategy_class
    from lowcomm.train.checkpoint import fingerprint

    options = {**fingerprint(without_faults(config)), "workers": config.placement.workers}
    field = strategy_class(config.method).options_field
    if field is not None:  # (named as its flags are: diloco.sync_every)
        options[field] = options.pop("options")
    return options


def _admitted(replica: Replica, options: dict[str, Any]) -> int:
    """``replica.admit()``, refused in one line when the worker it was healed from runs other
    options: a joiner started with options other than the job's (a model of another shape
    fails to take the state; another learning rate would take it and train apart)."""
    try:
        step = replica.admit()
    except Exception:
        _check_same_options(replica, options)
        raise
    _check_same_options(replica, options)
    return step


def _check_same_options(replica: Replica, options: dict[str, Any]) -> None:
    from lowcomm.train.checkpoint import _first_difference

    pending = getattr(replica.manager, "_pending_state_dict", None) or {}
    theirs = (pending.get("user") or {}).get(OPTIONS_KEY)
    if theirs is None or theirs == options:
        return
    name, saved, value = _first_difference("", theirs, options)
    raise ConfigError(
        f"{name.lstrip('.')}: {value!r} is this worker's, and {saved!r} the live workers' "
        f"(worker {replica.slot} was healed from one); a worker joins a job with the job's "
        "options: start it with theirs (lowcomm train --config DIR takes a worker's "
        "config.json) and its own --membership.* and --out"
    )


def _admit(replica: Replica, config: TrainConfig) -> int:
    """This worker's first quorum (:meth:`Replica.admit`); the loop step it starts at.

    Workers that start together (a job's start, or a resumed job's) commit an empty round
    together. If their torchft steps differ (a resumed worker whose checkpoint is older than
    a peer's, or one started without a checkpoint), the quorum heals the ones behind from a
    worker at its max step, which is itself being admitted: it commits that empty round, not
    a round of training, so the healed worker, now at the same step with the same global
    state (its own state started by the method's rule), commits it too when the quorum holds
    every worker (as its source does), else asks again with the others. A worker healed from
    one that trains joins that round, as any joiner does.

    Workers at the same torchft step but different loop steps (a checkpoint in the round
    window a peer's newer one is in: no round committed between them) are not healed: each
    continues its own checkpoint, which holds the same committed rounds, and the one behind
    trains its own steps up to the round, where the quorum waits for it."""
    admitting = [True]
    replica.manager.register_state_dict_fn(
        ADMISSION_KEY, lambda _: None, lambda: {"admitting": admitting[0]}
    )
    options = job_options(config)
    replica.manager.register_state_dict_fn(OPTIONS_KEY, lambda _: None, lambda: options)
    start = 0  # (the step of a healing from a worker being admitted)
    try:
        while True:
            healed = _healings(replica)
            step = _admitted(replica, options)
            if _healings(replica) == healed:
                return step or start  # (committed with the others)
            if not _source_admitting(replica):
                return step
            start = step
            if replica.rank == 0:
                print(
                    f"lowcomm: worker {replica.slot}: behind the starting workers' step "
                    f"{step}; healed from one of them",
                    flush=True,
                )
            # (A full quorum: its source commits the empty round now, and so does this one.)
            if replica.quorum().size >= replica.workers and replica.commit():
                return start
            replica.retry_round()
    finally:
        admitting[0] = False


def _healings(replica: Replica) -> int:
    return sum(1 for event in replica.events if event["event"] == "healed")


def _source_admitting(replica: Replica) -> bool:
    """Whether the state this worker was just healed with came from a worker being admitted."""
    pending = getattr(replica.manager, "_pending_state_dict", None) or {}
    return bool(((pending.get("user") or {}).get(ADMISSION_KEY) or {}).get("admitting"))


def _replica_steps(
    config: TrainConfig,
    worker: Worker,
    replica: Replica,
    run: tuple[Progress, RunWriter | None, FinalState],
    step_rounds: bool,
    replay: WorkerReplay | None,
    clean: _CleanSteps,
) -> bool:
    """Train from the admitted step to --steps, each step in the round's quorum; a worker
    healed into a later step goes on from there. A replayed trace kills this worker at its
    crash's step and slows it down over its slow events. False: it stopped after
    --stop-after's step, whose checkpoint it wrote."""
    from lowcomm.train import loop
    from lowcomm.train.step_log import StepLog

    progress, writer, final = run
    log = StepLog(config.run.log_every)
    per_step = config.run.microbatches_per_step
    tokens_per_step = per_step * config.tokens_per_microbatch()
    step = progress.start_step
    while step < config.run.steps:
        if replay is not None:
            replay.at_step(step)  # (a crash placed at this step: killed here)
        replica.loop_step = step
        replica.pending_tokens += tokens_per_step
        if step_rounds:
            replica.open_round()  # (forms while the gradient is computed)
        else:
            replica.open_round_early()  # (a sync at this step's end: forms while it computes)
        commits = replica.commits
        dropped = replica.failed_rounds
        began = time.perf_counter()
        going_on = loop.train_step(worker, step, progress, writer, final, log)
        _keep_torchft_step(config, replica, step + 1, progress.end_step)
        step_s = time.perf_counter() - began
        slow = replay is not None and replay.slow_down(step, step_s)
        clean.add(replica, step, step_s, slow or replica.failed_rounds > dropped)
        if config.placement.membership_options.digests and replica.commits > commits:
            replica.record_digest(step, worker.model.parameters())
            if replica.on_event is not None:  # (on disk now: a resume after a kill keeps it)
                replica.on_event()
        healed = replica.take_healed_step()
        if healed is not None and healed != step:  # (healed into a later step)
            _skip_to(worker.shard, (healed + 1) * per_step)
        if not going_on:
            return False
        if progress.end_step is not None:  # (the job has committed its token budget)
            return True
        step = (step if healed is None else healed) + 1
    return True


def _checkpoints(config: TrainConfig) -> bool:
    """Whether this worker's run keeps checkpoints (--checkpoint-every, --stop-after or a
    resume); without them a torchft worker writes none, a joining one heals instead."""
    run = config.run
    return run.checkpoint_every is not None or run.stop_after is not None or run.resume is not None


def _skip_to(shard: Any, position: int) -> None:
    """Put the worker's data shard at ``position`` micro-batches: a worker that joins at a
    step continues its slot's shard where it would be had the slot never been empty (what
    the slot's dead worker did not train on is skipped, and no sample comes twice in a pass).
    A shard of the user's own task that keeps no position is left where it is."""
    state = shard.state_dict()
    if "position" in state:
        state["position"] = position
        shard.load_state_dict(state)


def _record_membership(writer: Any, replica: Any) -> None:
    """Each step's record (metrics.jsonl) gets the size of its quorum, the workers that
    quorum lost (``crash``: torchft cannot tell a crash from a leave) or gained, and whether
    its round was dropped, as a run with simulated faults records them."""
    write_step = writer.write_step

    def with_membership(record: Any) -> None:
        record.quorum = replica.quorum_size_at(record.step)
        record.membership_events = replica.step_changes.get(record.step)
        if record.step in replica.dropped_steps:
            record.dropped = True
        write_step(record)

    writer.write_step = with_membership


def _membership_summary(writer: Any, replica: Any, config: TrainConfig) -> dict[str, Any]:
    """summary.json's ``faults`` of a torchft worker: its quorum changes and dropped rounds,
    as a simulated run's (goodput needs the fault-free rate, which a live run does not know:
    none)."""
    from lowcomm.membership.records import rounds

    return {
        "source": "torchft",
        "detection_s": config.placement.membership_options.detect_s,
        # (With a token budget every round carries the job's count: the job's, as static.)
        "committed_tokens": replica.job_tokens if replica.count_tokens else None,
        "goodput": None,
        "rounds_dropped": rounds(replica.events, "dropped"),
        "worker_seconds_lost": None,
        "membership_changes": [
            {"step": r.step, "events": r.membership_events, "quorum": r.quorum}
            for r in writer.records
            if r.membership_events
        ],
    }


def _record(replica: Any, config: TrainConfig, started: float) -> dict[str, Any]:
    from lowcomm.membership.records import rounds

    return {
        "engine": "torchft",
        "worker": replica.slot,
        "workers": config.placement.workers,
        "started": started,
        "finished": None,
        # (A resumed worker's events go on from its checkpoint's: the whole run's rounds.)
        "commits": rounds(replica.events, "commit"),
        "dropped_rounds": rounds(replica.events, "dropped"),
        "events": replica.events,
        "digests": replica.digests,
        "committed_tokens": replica.committed_tokens,
        "job_tokens": replica.job_tokens if replica.count_tokens else None,
        "trained_until": replica.trained_until,
    }


def _write(path: Path, record: dict[str, Any]) -> None:
    from lowcomm.membership.records import write_record

    write_record(path, record)


class _CleanSteps:
    """The wall seconds of this worker's steps that ran as a fault-free step does: every
    worker in the quorum, no membership change, no slowdown and no dropped round (goodput's
    fault-free step time, lowcomm.membership.replay)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.seconds = 0.0
        self.count = 0

    def add(self, replica: Any, step: int, step_s: float, disturbed: bool) -> None:
        full = replica.quorum_size_at(step) == self.workers
        if full and not disturbed and step not in replica.step_changes:
            self.seconds += step_s
            self.count += 1
