"""``lowcomm bench reallink``: training over a real, bandwidth-shaped link.

The emulator (:mod:`lowcomm.comm.emulated`) charges each collective what the ring model of
:class:`~lowcomm.comm.network.NetworkProfile` says it costs. This benchmark checks that model
against a real link: it builds 2-4 Linux network namespaces, one per worker, joined in a star
through a bridge in one more namespace (the hub) by veth pairs, and shapes both directions of
every worker's veth with ``tc tbf`` to the declared bandwidth (this kernel has no ``netem``,
so no latency is added: the link is bandwidth only). Each worker is a separate
``lowcomm train`` process started with ``ip netns exec`` under a torchrun-style env://
rendezvous (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` = rank 0's veth address), with
``GLOO_SOCKET_IFNAME`` set to the worker's veth, no emulation (``--network none``) and the
real clock: every second of exposed communication is spent on the shaped wire.

Reported: DDP's measured exposed communication per step (median over the steps after the
first, which also opens the connections) against the ring model's all-reduce time for the
same payload at the shaped bandwidth with zero latency, their ratio, and the utilisation
(compute / (compute + exposed communication)) of DDP and of an overlapped method.

With ``--virtual`` (the default), every method also runs once more, locally, on the virtual
clock (calibrated compute model) with the link declared to the emulator (``--bandwidth-gbps``
at the link's TCP goodput, ``--latency-ms 0``), and the report sets the modeled time per step
beside the measured one. The goodput is the shaped rate times ``TCP_PAYLOAD / FRAME`` (1448
payload bytes in every 1514-byte Ethernet frame): tbf meters whole frames, the emulator's
bandwidth is the payload rate.

Traffic stays inside the namespaces this module creates; they carry unique names (with this
process's id) and are deleted on exit, error or interrupt. Needs root (``ip netns add``).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from lowcomm.atomic import atomic_write_text
from lowcomm.comm.base import CollectiveKind
from lowcomm.comm.network import NetworkProfile

#: Interface name of the veth end inside every worker namespace (GLOO_SOCKET_IFNAME).
WORKER_IFNAME = "lcveth"
#: Subnet of the star (only ever configured inside the namespaces this module creates).
SUBNET_PREFIX = "10.231.0"
#: Rendezvous port of rank 0's TCPStore, inside rank 0's namespace (so it never collides).
MASTER_PORT = 29500
MAX_WORKERS = 4
#: TCP payload bytes in one full Ethernet frame at MTU 1500 (with TCP timestamps), and the
#: frame's bytes as tbf meters them (headers included, no preamble or gap).
TCP_PAYLOAD = 1448
FRAME = 1514


class RealLinkUnavailable(RuntimeError):
    """Network namespaces or tbf shaping cannot be set up on this machine."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def _netns_run(namespace: str, *args: str) -> None:
    _ip("netns", "exec", namespace, *args)


def worker_address(rank: int) -> str:
    """The veth address of worker ``rank`` inside its namespace."""
    return f"{SUBNET_PREFIX}.{rank + 1}"


@dataclass
class ShapedStar:
    """Worker namespaces joined through a bridge, every direction shaped to ``rate_mbit``.

    Use as a context manager (:func:`shaped_star`); :meth:`remove` deletes everything created.
    """

    workers: int
    rate_mbit: float
    tag: str = field(default_factory=lambda: f"lc{os.getpid()}")
    created: list[str] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"{self.tag}hub"

    def namespace(self, rank: int) -> str:
        return f"{self.tag}w{rank}"

    def _tbf(self, namespace: str, device: str) -> None:
        # burst: a few full-size frames (the kernel's hrtimer-based tbf needs no HZ-sized
        # bucket); queue bound by latency so TCP sees back-pressure, not a huge buffer.
        _netns_run(
            namespace,
            "tc",
            "qdisc",
            "add",
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            f"{self.rate_mbit}mbit",
            "burst",
            "32kb",
            "latency",
            "100ms",
        )

    def create(self) -> None:
        if not 2 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"--workers: {self.workers} must lie in [2, {MAX_WORKERS}]")
        if not (self.rate_mbit > 0 and math.isfinite(self.rate_mbit)):
            raise ValueError(f"--bandwidth-mbit: {self.rate_mbit} must be a positive number")
        try:
            _ip("netns", "add", self.hub)
        except RuntimeError as error:
            raise RealLinkUnavailable(
                f"cannot create a network namespace ({error}); the real-link benchmark needs "
                f"root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and a kernel with namespaces"
            ) from None
        self.created.append(self.hub)
        try:
            _netns_run(self.hub, "ip", "link", "set", "lo", "up")
            _netns_run(self.hub, "ip", "link", "add", "br0", "type", "bridge")
            _netns_run(self.hub, "ip", "link", "set", "br0", "up")
            for rank in range(self.workers):
                namespace = self.namespace(rank)
                _ip("netns", "add", namespace)
                self.created.append(namespace)
                port = f"port{rank}"
                # Both ends are created directly inside their namespaces: no name is ever
                # taken in the caller's namespace.
                _ip(
                    "-n",
                    namespace,
                    "link",
                    "add",
                    WORKER_IFNAME,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    self.hub,
                )
                _netns_run(namespace, "ip", "link", "set", "lo", "up")
                _netns_run(
                    namespace,
                    "ip",
                    "addr",
                    "add",
                    f"{worker_address(rank)}/24",
                    "dev",
                    WORKER_IFNAME,
                )
                _netns_run(namespace, "ip", "link", "set", WORKER_IFNAME, "up")
                _netns_run(self.hub, "ip", "link", "set", port, "master", "br0")
                _netns_run(self.hub, "ip", "link", "set", port, "up")
                self._tbf(namespace, WORKER_IFNAME)  # worker -> hub
                self._tbf(self.hub, port)  # hub -> worker
        except RuntimeError as error:
            self.remove()
            raise RealLinkUnavailable(f"cannot build the shaped link: {error}") from None

    def remove(self) -> None:
        """Delete every namespace created (their veths and the bridge go with them)."""
        while self.created:
            namespace = self.created.pop()
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


@contextmanager
def shaped_star(workers: int, rate_mbit: float) -> Iterator[ShapedStar]:
    """Build a :class:`ShapedStar`; remove it on exit, error, interrupt or interpreter exit."""
    star = ShapedStar(workers, rate_mbit)
    atexit.register(star.remove)
    try:
        star.create()
        yield star
    finally:
        star.remove()
        atexit.unregister(star.remove)


def namespaces_available() -> str | None:
    """None if namespaces and tbf work here; otherwise the reason they do not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    try:
        with shaped_star(2, 100.0):
            pass
    except RealLinkUnavailable as error:
        return str(error)
    return None


@dataclass(kw_only=True)
class RealLinkBench:
    """DDP and an overlapped method on a real tbf-shaped link between network namespaces."""

    workers: int = 2
    """Worker processes, one per network namespace (2 to 4)."""

    bandwidth_mbit: float = 100.0
    """Shaped rate of each direction of every worker's link, in Mbit/s."""

    steps: int = 6
    """Training steps per method."""

    methods: tuple[str, ...] = ("ddp", "acco")
    """Methods to run; ddp (the baseline the model is checked on) must be one of them."""

    n_layer: int = 2
    """Model depth (tiny compute: communication dominates DDP's step)."""

    n_embd: int = 128
    """Model width (with the vocabulary it sets the payload: about 2.6 MB at the defaults)."""

    block_size: int = 32
    """Sequence length."""

    micro_batch_size: int = 2
    """Sequences per micro-batch."""

    out: str = "runs/reallink"
    """Directory for the runs' metrics and the workers' logs."""

    timeout_s: float = 240.0
    """Give up on a method's run after this many seconds."""

    virtual: bool = True
    """Also run every method on the virtual clock with the link declared to the emulator (at
    its TCP goodput, no latency), and report modeled against measured time per step."""


@dataclass
class MethodResult:
    """What one method's run on the real link measured."""

    method: str
    exposed_comm_s_per_step: list[float]
    bytes_sent_per_step: list[float]
    utilization: float
    wall_clock_s: float
    clock_s_per_step: list[float] = field(default_factory=list)
    """The run clock's time at the end of every step (real: wall time; virtual: modeled)."""
    wire_bytes_per_worker: float | None = None
    """Bytes the workers' veths sent during the run, averaged over the workers (frames as tbf
    meters them; connection set-up, the rendezvous and evaluation included). None: not on
    the real link."""


@dataclass
class RealLinkResult:
    """The benchmark's numbers (JSON in ``reallink.json``)."""

    workers: int
    bandwidth_mbit: float
    payload_bytes: float
    measured_exposed_s: float
    predicted_s: float
    ratio: float
    methods: dict[str, MethodResult]
    virtual: dict[str, MethodResult] = field(default_factory=dict)
    """The same methods on the virtual clock (empty without ``--virtual``)."""


def _train_args(bench: RealLinkBench, method: str, run_dir: Path) -> list[str]:
    return [
        "--method",
        method,
        "--workers",
        str(bench.workers),
        "--steps",
        str(bench.steps),
        "--network",
        "none",
        "--clock",
        "real",
        "--progress",
        "False",
        "--eval-every",
        str(bench.steps + 1),
        "--eval-batches",
        str(bench.workers),
        "--collective-timeout-s",
        str(bench.timeout_s),
        "--model.n-layer",
        str(bench.n_layer),
        "--model.n-head",
        "2",
        "--model.n-embd",
        str(bench.n_embd),
        "--model.block-size",
        str(bench.block_size),
        "--micro-batch-size",
        str(bench.micro_batch_size),
        "--out",
        str(run_dir),
    ]


def _results(method: str, run_dir: Path, wall: float) -> MethodResult:
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    return MethodResult(
        method=method,
        exposed_comm_s_per_step=[float(r["exposed_comm_s"]) for r in records],
        bytes_sent_per_step=[float(r["bytes_sent_per_worker"]) for r in records],
        utilization=float(summary["utilization"]),
        wall_clock_s=wall,
        clock_s_per_step=[float(r["clock_s"]) for r in records],
    )


def _exited(who: str, code: int, log: Path) -> RuntimeError:
    """The error for a training process that exited with ``code``: its log's last line."""
    tail = log.read_text(errors="replace").strip()
    last = tail.splitlines()[-1] if tail else "(no output)"
    return RuntimeError(f"{who} exited with code {code}: {last} (log: {log})")


def goodput_gbps(bandwidth_mbit: float) -> float:
    """The TCP payload rate, in Gbit/s, of a link that tbf shapes to ``bandwidth_mbit``."""
    return bandwidth_mbit / 1e3 * TCP_PAYLOAD / FRAME


def virtual_args(bench: RealLinkBench, method: str, run_dir: Path) -> list[str]:
    """The real run's arguments with the link declared to the emulator, on the virtual clock
    (its default compute model, calibrated) and the local spawner."""
    args = _train_args(bench, method, run_dir)
    network = args.index("--network")
    args[network + 1 : network + 2] = [
        "wan", "--bandwidth-gbps", repr(goodput_gbps(bench.bandwidth_mbit)), "--latency-ms", "0",
    ]  # fmt: skip
    args[args.index("--clock") + 1] = "virtual"
    return args


def run_method_virtual(bench: RealLinkBench, method: str, run_dir: Path) -> MethodResult:
    """Run ``method`` locally on the virtual clock with the shaped link declared."""
    run_dir.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(run_dir / "train.log", "wb") as log:
        try:
            code = subprocess.run(
                [sys.executable, "-m", "lowcomm", "train", *virtual_args(bench, method, run_dir)],
                env=env, stdout=log, stderr=subprocess.STDOUT, timeout=bench.timeout_s,
                check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{method} (virtual clock): did not finish within {bench.timeout_s:.0f} s "
                f"(log: {run_dir / 'train.log'})"
            ) from None
    if code != 0:
        raise _exited(f"{method} (virtual clock)", code, run_dir / "train.log")
    return _results(method, run_dir, time.perf_counter() - begin)


def seconds_per_step(result: MethodResult) -> float:
    """Mean time per step after the first (the first also opens the connections, and on the
    virtual clock follows the calibration)."""
    clock = result.clock_s_per_step
    if len(clock) < 2:
        raise ValueError(f"{result.method}: {len(clock)} step(s) recorded, need 2 or more")
    return (clock[-1] - clock[0]) / (len(clock) - 1)


def _tx_bytes(star: ShapedStar, rank: int) -> int:
    """Bytes sent so far by worker ``rank``'s veth (its kernel counter)."""
    result = subprocess.run(
        ["ip", "netns", "exec", star.namespace(rank), "cat",
         f"/sys/class/net/{WORKER_IFNAME}/statistics/tx_bytes"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(result.stdout.strip())


def run_method_on_star(
    star: ShapedStar, bench: RealLinkBench, method: str, run_dir: Path
) -> MethodResult:
    """Run ``lowcomm train --method METHOD`` with one worker process per namespace."""
    run_dir.mkdir(parents=True, exist_ok=True)
    sent_before = [_tx_bytes(star, rank) for rank in range(star.workers)]
    args = _train_args(bench, method, run_dir)
    processes: list[subprocess.Popen[bytes]] = []
    logs: list[BinaryIO] = []
    begin = time.perf_counter()
    try:
        for rank in range(star.workers):
            logs.append(open(run_dir / f"worker{rank}.log", "wb"))  # noqa: SIM115
            processes.append(_start_worker(star, rank, args, logs[-1]))
        _wait_for_workers(processes, bench, method, run_dir)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    result = _results(method, run_dir, time.perf_counter() - begin)
    sent = [_tx_bytes(star, rank) - sent_before[rank] for rank in range(star.workers)]
    result.wire_bytes_per_worker = statistics.fmean(sent)
    return result


def _start_worker(
    star: ShapedStar, rank: int, args: list[str], log: BinaryIO
) -> subprocess.Popen[bytes]:
    """Start worker ``rank`` in its namespace, joining the others through torchrun's variables."""
    env = dict(os.environ)
    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(key, None)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(star.workers),
        LOCAL_RANK="0",  # one worker per "machine" (namespace)
        MASTER_ADDR=worker_address(0),
        MASTER_PORT=str(MASTER_PORT),
        GLOO_SOCKET_IFNAME=WORKER_IFNAME,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    namespace = ["ip", "netns", "exec", star.namespace(rank)]
    command = [*namespace, sys.executable, "-m", "lowcomm", "train", *args]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for_workers(
    processes: list[subprocess.Popen[bytes]], bench: RealLinkBench, method: str, run_dir: Path
) -> None:
    """Wait for every worker until ``bench.timeout_s``; raise naming the first that failed."""
    deadline = time.monotonic() + bench.timeout_s
    for rank, process in enumerate(processes):
        try:
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{method}: worker {rank} did not finish within {bench.timeout_s:.0f} s "
                f"(log: {run_dir / f'worker{rank}.log'})"
            ) from None
        if code != 0:
            raise _exited(f"{method}: worker {rank}", code, run_dir / f"worker{rank}.log")


def predicted_allreduce_s(payload_bytes: float, workers: int, bandwidth_mbit: float) -> float:
    """The emulator's time for one all-reduce of ``payload_bytes`` at this bandwidth, no latency."""
    profile = NetworkProfile(name="reallink", bandwidth_gbps=bandwidth_mbit / 1e3, latency_ms=0.0)
    return profile.collective_time(CollectiveKind.ALL_REDUCE, payload_bytes, workers)


def ddp_comparison(
    ddp: MethodResult, workers: int, bandwidth_mbit: float
) -> tuple[float, float, float]:
    """(payload bytes, measured exposed s per step, predicted s per step) for a DDP run.

    The measurement is the median over the steps after the first (the first also opens the
    connections). The payload is recovered from the bytes each worker sent per step, which for
    a ring all-reduce are ``2 (M-1)/M`` of it.
    """
    steps = ddp.exposed_comm_s_per_step[1:] or ddp.exposed_comm_s_per_step
    measured = statistics.median(steps)
    sent = statistics.median(ddp.bytes_sent_per_step)
    payload = sent * workers / (2.0 * (workers - 1))
    return payload, measured, predicted_allreduce_s(payload, workers, bandwidth_mbit)


def measure(bench: RealLinkBench) -> RealLinkResult:
    """Build the shaped star, run every method on it, compare DDP with the model."""
    from lowcomm.data import DataConfig, prepare_corpus
    from lowcomm.strategies import strategy_class

    if "ddp" not in bench.methods:
        raise ValueError(f"--methods: {' '.join(bench.methods)} must include ddp (the baseline)")
    for method in bench.methods:
        strategy_class(method)
    if bench.steps < 2:
        raise ValueError(f"--steps: {bench.steps} must be >= 2 (the first step is not measured)")
    # Tokenize once here, so the workers only read the cache.
    prepare_corpus(DataConfig(micro_batch_size=bench.micro_batch_size))
    out = Path(bench.out)
    results: dict[str, MethodResult] = {}
    with shaped_star(bench.workers, bench.bandwidth_mbit) as star:
        for method in bench.methods:
            results[method] = run_method_on_star(star, bench, method, out / method)
    virtual = {}
    if bench.virtual:
        for method in bench.methods:
            virtual[method] = run_method_virtual(bench, method, out / f"{method}-virtual")
    payload, measured, predicted = ddp_comparison(
        results["ddp"], bench.workers, bench.bandwidth_mbit
    )
    return RealLinkResult(
        workers=bench.workers,
        bandwidth_mbit=bench.bandwidth_mbit,
        payload_bytes=payload,
        measured_exposed_s=measured,
        predicted_s=predicted,
        ratio=measured / predicted,
        methods=results,
        virtual=virtual,
    )


def _to_json(result: RealLinkResult) -> dict[str, Any]:
    return {
        "workers": result.workers,
        "bandwidth_mbit": result.bandwidth_mbit,
        "payload_bytes": result.payload_bytes,
        "ddp_measured_exposed_s_per_step": result.measured_exposed_s,
        "ddp_predicted_s_per_step": result.predicted_s,
        "ratio_measured_over_predicted": result.ratio,
        "methods": {name: vars(r) for name, r in result.methods.items()},
        "virtual_goodput_gbps": goodput_gbps(result.bandwidth_mbit),
        "virtual": {name: vars(r) for name, r in result.virtual.items()},
        "seconds_per_step": {
            name: {
                "real": seconds_per_step(real),
                **(
                    {
                        "virtual": seconds_per_step(result.virtual[name]),
                        "virtual_over_real": seconds_per_step(result.virtual[name])
                        / seconds_per_step(real),
                    }
                    if name in result.virtual
                    else {}
                ),
            }
            for name, real in result.methods.items()
        },
    }


def format_report(result: RealLinkResult) -> list[str]:
    width = max([12, *(len(name) + 2 for name in result.methods)])  # method names in a column
    lines = [
        f"lowcomm bench reallink: {result.workers} workers in network namespaces, each link "
        f"direction shaped by tbf to {result.bandwidth_mbit:g} Mbit/s (no added latency), "
        f"Gloo, --network none --clock real",
        f"  ddp all-reduce payload            {result.payload_bytes / 1e6:10.3f} MB",
        f"  ddp exposed comm / step, measured {result.measured_exposed_s * 1e3:10.1f} ms "
        f"(median of steps 2..)",
        f"  emulator's ring all-reduce time   {result.predicted_s * 1e3:10.1f} ms",
        f"  ratio measured / predicted        {result.ratio:10.3f}",
    ]
    for name, method in result.methods.items():
        lines.append(
            f"  utilisation {name:22s}{method.utilization:10.3f}  "
            f"(wall {method.wall_clock_s:.1f} s for the run)"
        )
    lines.append(
        "  bytes per worker over the run: counted by lowcomm (the collectives' ring-model "
        "payloads) / sent by the veth (frames)"
    )
    for name, method in result.methods.items():
        counted = sum(method.bytes_sent_per_step)
        wire = method.wire_bytes_per_worker
        if wire is not None:
            ratio = f"{wire / counted:8.3f}" if counted > 0 else "       -"
            lines.append(
                f"    {name:{width}s}{counted / 1e6:10.2f} MB{wire / 1e6:10.2f} MB  "
                f"wire/counted {ratio}"
            )
    if result.virtual:
        lines.append(
            f"  real vs virtual clock (link declared at its TCP goodput "
            f"{goodput_gbps(result.bandwidth_mbit) * 1e3:.2f} Mbit/s, no latency; "
            f"s per step after the first):"
        )
        lines.append(f"    {'method':{width}s}{'real':>10s}{'virtual':>10s}{'virtual/real':>14s}")
        for name, real in result.methods.items():
            if name in result.virtual:
                r, v = seconds_per_step(real), seconds_per_step(result.virtual[name])
                lines.append(f"    {name:{width}s}{r:10.3f}{v:10.3f}{v / r:14.3f}")
    return lines


def _fail(message: str) -> NoReturn:
    # The CLI's one-line error, exit status 1 (not imported from lowcomm.cli: the CLI imports
    # the benchmarks, so that would be an import cycle).
    print(f"lowcomm: error: {message}", file=sys.stderr)
    raise SystemExit(1)


def run_reallink(bench: RealLinkBench) -> None:
    if os.geteuid() != 0:
        _fail("bench reallink: network namespaces need root (ip netns add); run it as root")
    try:
        result = measure(bench)
    except RuntimeError as error:  # RealLinkUnavailable, or a worker that failed
        _fail(f"bench reallink: {error}")
    out = Path(bench.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "reallink.json", json.dumps(_to_json(result), indent=2) + "\n")
    for line in format_report(result):
        print(line)
    print(f"  (details: {out / 'reallink.json'})")
