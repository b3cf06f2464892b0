"""The options of live membership (``--membership torchft``, ``--membership.*``), and what
such a run refuses.

``--membership static`` (the default) is lowcomm's fixed set of workers: one process group
made at launch, a dead worker ends the run. ``--membership torchft`` makes every worker one
torchft replica group: who takes part in each round is decided by torchft's lighthouse, a dead
worker is left out at the next quorum, and a worker started later joins and is healed from a
live one (:mod:`lowcomm.membership.torchft_comm`).

Nothing here imports torch or torchft.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lowcomm.config import TrainConfig

__all__ = [
    "INSTALL_HINT",
    "SHARDED_METHODS",
    "TORCHFT_METHODS",
    "MembershipOptions",
    "membership_refusal",
    "parse_address",
    "require_torchft",
]

#: What installs the optional engine.
INSTALL_HINT = "pip install 'lowcomm[ft]'"

#: Methods that run with --membership torchft: each round is one quorum and the method's
#: mean all-reduces or all-gathers (demo, sparseloco) of its payload, which torchft's Manager
#: commits or drops (decoupled_diloco: a round per tick, an all-gather of the tick's
#: contributions and posted clocks that every live learner's replica of the synchronizer
#: merges alike); each is checked against static membership with no fault and through a
#: kill and a restart.
TORCHFT_METHODS: tuple[str, ...] = (
    "ddp", "diloco", "streaming_diloco", "desloc", "sparta", "sparta_diloco", "local_sgd",
    "local_adamw", "local_adam", "overlap_local_sgd", "slowmo", "favg_opt", "favg_reset",
    "co2", "cocodc", "diloco_delayed", "eager", "demo", "sparseloco", "decoupled_diloco",
)  # fmt: skip

#: Methods whose optimizer state is sharded across workers: a lost worker takes a shard the
#: others need.
SHARDED_METHODS: frozenset[str] = frozenset({"zero1", "acco", "dpu", "wp"})


@dataclass(kw_only=True)
class MembershipOptions:
    """Live membership on torchft (with --membership torchft)."""

    lighthouse: str | None = None
    """The torchft lighthouse HOST:PORT; this process is then one worker. The lighthouse
    decides each round's quorum; this process is worker --membership.worker of a job that
    workers join and leave. None: a local run starts a lighthouse on 127.0.0.1 and --workers
    worker processes, and stops them at the end."""

    worker: int | None = None
    """This process's worker slot (with --membership.lighthouse). 0 to --workers - 1: its data
    shard and its torchft replica id. A slot whose worker died may be started again: it joins."""

    min_workers: int = 1
    """The fewest workers a round may commit with. torchft's min_replica_size; a local run's
    lighthouse also forms no quorum below it."""

    detect_s: float = 5.0
    """Seconds without a heartbeat before a worker is dropped (the detection time). The local
    lighthouse's heartbeat timeout; on a cluster, torchft_lighthouse's --heartbeat_timeout_ms
    says it."""

    quorum_s: float = 60.0
    """Seconds a worker waits for a quorum to form. Also how long the local lighthouse waits
    for a live worker that has not asked yet (torchft's join timeout)."""

    host: str | None = None
    """The address this worker's listeners bind and advertise. Its manager server,
    replica-group store and Gloo group. None: 127.0.0.1 in a local run; with a lighthouse, the
    address of the interface that routes to it."""

    attempts: int = 3
    """Tries of a round that did not commit, each on a new quorum. Then the worker gives
    up."""

    digests: bool = False
    """Record a SHA-256 of the parameters after each committed round. In membership.json,
    to check that workers hold the same bits."""

    def __post_init__(self) -> None:
        checks: list[tuple[str, object, bool, str]] = [
            ("--membership.min-workers", self.min_workers, self.min_workers >= 1,
             "at least 1 worker commits a round"),
            ("--membership.detect-s", self.detect_s,
             math.isfinite(self.detect_s) and self.detect_s > 0,
             "a finite time > 0 seconds, e.g. 5 (torchft's default)"),
            ("--membership.quorum-s", self.quorum_s,
             math.isfinite(self.quorum_s) and self.quorum_s >= 1,
             "a finite time >= 1 second, e.g. 60"),
            ("--membership.attempts", self.attempts, self.attempts >= 1,
             "at least 1 attempt, e.g. 3"),
            ("--membership.worker", self.worker, self.worker is None or self.worker >= 0,
             "a slot 0 to --workers - 1"),
        ]  # fmt: skip
        for flag, value, ok, rule in checks:
            if not ok:
                raise ValueError(f"{flag}: {value} is not valid: {rule}")
        if self.lighthouse is not None:
            parse_address(self.lighthouse, "--membership.lighthouse")


def parse_address(address: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets; an ``http://`` prefix is allowed) as (host,
    port); a malformed one raises ValueError naming ``flag``."""
    text = address.strip()
    if text.startswith("http://"):
        text = text[len("http://") :]
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{flag}: {address!r} is not HOST:PORT; give the lighthouse's address, e.g. "
            "10.0.0.5:29510 (torchft_lighthouse --bind 0.0.0.0:29510)"
        )
    return host, int(port)


def require_torchft() -> None:
    """Import torchft, or raise ValueError in one line naming the install command."""
    import os
    import warnings

    # torchft's Rust side logs every quorum request and commit at info level; a run says
    # what happened in membership.json instead (RUST_LOG set by the user wins).
    os.environ.setdefault("RUST_LOG", "warn")
    # Its Python loggers print a traceback for every collective a dead peer broke; the worker
    # says a dropped round in one line instead (lowcomm.membership.torchft_comm).
    import logging

    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    # (PGTransport makes tensors of read-only pickles and uses a deprecated pytree check)
    warnings.filterwarnings("ignore", module="torchft.checkpointing.pg_transport")
    try:
        import torchft
        import torchft.manager  # noqa: F401
    except ImportError as error:
        raise ValueError(
            f"--membership torchft: torchft is not installed ({error.msg}); install it with "
            f"{INSTALL_HINT}"
        ) from None


def membership_refusal(config: TrainConfig) -> str | None:
    """Why this run's membership options cannot run (one line: the option, the value, the
    rule and the fix), or None. Imports nothing heavy; whether torchft is installed is checked
    by :func:`require_torchft` at launch."""
    options = config.placement.membership_options
    flag = "--membership torchft"
    if config.placement.membership == "static":
        given = options.lighthouse is not None or options.worker is not None
        if given:
            return (
                "--membership.lighthouse / --membership.worker: they take effect with "
                "--membership torchft; add it, or drop them"
            )
        return None
    refusal = _host_refusal(options) or _method_refusal(config, flag)
    if refusal is not None:
        return refusal
    k = config.placement.workers_per_process
    if k != 1:
        return f"{flag}: not yet supported with --workers-per-process {k}; use 1"
    # (Workers of R > 1 ranks run every method here, replicated or FSDP-sharded over the
    # group's own ranks: rank r exchanges and heals with rank r of the other workers.)
    device = config.placement.device
    if device != "cpu":
        return f"{flag}: not yet supported on --device {device} (torchft's Gloo group); use cpu"
    refusal = _checkpoint_refusal(config, flag)
    if refusal is not None:
        return refusal
    if config.run.token_budget is not None and config.method == "decoupled_diloco":
        # (Every other method's rounds carry the job's committed tokens: each worker holds
        # the same count and stops at the same step. decoupled_diloco commits a learner's
        # tokens when the synchronizer merges its contribution, not when a round commits.)
        return (
            f"--token-budget: {config.run.token_budget} with {flag} --method "
            f"{config.method} is not yet supported (it commits a learner's tokens when its "
            "synchronizer merges them, which no tick carries to the job's count yet); "
            "give --steps"
        )
    if options.worker is not None and not options.worker < config.placement.workers:
        return (
            f"--membership.worker: {options.worker} is not a slot of --workers "
            f"{config.placement.workers}; give 0 to {config.placement.workers - 1}"
        )
    if options.lighthouse is not None and options.worker is None:
        return (
            "--membership.lighthouse: this process is then one worker; say which with "
            "--membership.worker K (0 to --workers - 1)"
        )
    workers = config.placement.workers
    if options.min_workers > workers:
        return (
            f"--membership.min-workers: {options.min_workers} is more than --workers "
            f"{workers}; no round could commit; give at most {workers}"
        )
    return None


def _host_refusal(options: MembershipOptions) -> str | None:
    """A local job binds its workers to 127.0.0.1: another --membership.host would be
    ignored."""
    if options.lighthouse is None and options.host not in (None, "127.0.0.1"):
        return (
            f"--membership.host: {options.host} is a cluster worker's address (with "
            "--membership.lighthouse); a local job's workers bind 127.0.0.1: drop it"
        )
    return None


def _checkpoint_refusal(config: TrainConfig, flag: str) -> str | None:
    """Why the run's checkpoints cannot be kept with live membership, or None.

    Every method that runs with live membership keeps them, at any step: a worker's checkpoint
    is its whole state in its own run directory (its strategy's ``state_dict`` settles a round
    still in flight first, as a static run's does: a streaming fragment, a delayed sync), with
    torchft's step beside it. A local job's resume starts every live worker from the same step
    (:func:`lowcomm.membership.local.resume_point`), where each holds the same committed
    rounds and its own steps since; a cluster's workers (``--membership.lighthouse``) each
    resume their own newest checkpoint, and their first quorum heals any worker behind the
    newest among them (lowcomm.membership.worker's ``_admit``). A step inside a sync round is
    such a step too: no round is open there. Nothing here names a method, so a method that
    starts running with live membership keeps checkpoints with no rule of its own."""
    if config.run.resume == "auto":
        if config.placement.membership_options.lighthouse is not None:
            return (
                f"--resume auto: not with {flag}; give this worker's own run directory "
                "(--resume OUT, its --out), which holds its checkpoints"
            )
        return (
            f"--resume auto: not with {flag}; give the job's directory (--resume OUT), whose "
            "workerK directories hold each worker's checkpoints"
        )
    return None


def _method_refusal(config: TrainConfig, flag: str) -> str | None:
    """Why the run's method cannot run with live membership, or None."""
    if config.method in SHARDED_METHODS:
        return (
            f"{flag}: --method {config.method} keeps its optimizer state sharded across "
            "workers, so a lost worker takes a shard the others need (it does not re-shard "
            f"from the survivors); use {' or '.join(TORCHFT_METHODS)}"
        )
    if config.method not in TORCHFT_METHODS:
        return (
            f"{flag}: --method {config.method} is not yet supported (its rounds are not yet "
            f"checked through a kill and a restart); use {', '.join(TORCHFT_METHODS)}"
        )
    quantization = getattr(getattr(config, "diloco", None), "quantization", "none")
    if quantization == "none":
        return None
    # (diloco's two-step quantized exchange is one round of two collectives, issued and
    # committed in the step that syncs, tried again whole on a new quorum:
    # TorchftComm.run_round. sparta_diloco's exchange is never quantized.)
    if config.method in ("streaming_diloco", "cocodc", "eager", "diloco_delayed"):
        return (
            f"{flag}: --method {config.method} with --diloco.quantization {quantization}: "
            "its two-step exchange flies across inner steps (its second step is issued "
            "where the exchange is applied), and a round of two collectives here runs both "
            "in the step that launches it; use --diloco.quantization none"
        )
    ranks = config.placement.ranks_per_worker
    if config.method == "diloco" and ranks > 1:
        return (
            f"{flag}: --method {config.method} with --diloco.quantization {quantization} with "
            f"--ranks-per-worker {ranks}: its two-step exchange runs as one round on a "
            "worker of one rank only; use --ranks-per-worker 1 or --diloco.quantization none"
        )
    return None
