"""--membership torchft: worker processes on a local torchft lighthouse (Gloo on the loopback)
that die and join while the others keep training.

Each job is 3 workers of a tiny GPT; the real clock with an emulated 200 ms link paces the
rounds, so a kill and a restart land while the others still train. What a worker's torchft
Manager decided (quorums, commits, healing) and a SHA-256 of its parameters after every
committed round are in its membership.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from _cli import TINY
from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.membership.options import INSTALL_HINT, SHARDED_METHODS, MembershipOptions
from lowcomm.models import ModelConfig
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.diloco import DiLoCoOptions

HEARTBEAT_S = 2.0
#: A guard against a hang, not a speed claim: a refusal waits at most the lighthouse probe's
#: REACH_TIMEOUT_S beyond starting Python and importing torch, which a loaded machine slows.
HANG_GUARD_S = 300.0
ROOT = Path(__file__).resolve().parents[1]


def _needs_torchft() -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")


def _config(method: str, out: Path, steps: int, **overrides: Any) -> TrainConfig:
    config = with_options(
        TrainConfig(
            method=method,
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
            diloco=DiLoCoOptions(sync_every=4),
            local=LocalOptions(sync_every=4),
        ),
        workers=3,
        steps=steps,
        clock="real",
        network="wan",
        latency_ms=200.0,
        eval_every=1000,
        eval_batches=2,
        progress=False,
        plot=False,
        out=str(out),
        log_every=1,
        membership="torchft",
        membership_options=MembershipOptions(detect_s=HEARTBEAT_S, quorum_s=60.0, digests=True),
    )
    config = with_options(config, **overrides)
    config.validate()
    return config


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def _record(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "membership.json").read_text()))


def _wait_for(condition: Any, what: str, timeout_s: float = 180.0, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def _digests(record: dict[str, Any], key: str = "sha256") -> dict[int, str]:
    """Per committed round's step, the SHA-256 of the parameters (``key`` "global_sha256":
    of the global parameters the method declares)."""
    return {int(entry["step"]): str(entry[key]) for entry in record["digests"]}


def _listening(pids: list[int], port: int | None = None) -> set[str]:
    """The addresses the processes ``pids`` listen on (TCP; on ``port`` only, if given)."""
    psutil = pytest.importorskip("psutil")
    found: set[str] = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        found |= {
            c.laddr.ip
            for c in connections
            if c.status == psutil.CONN_LISTEN and port in (None, c.laddr.port)
        }
    return found


def _quorum_without_2(directory: Path, since: float) -> bool:
    """Whether the worker writing ``directory`` has met a quorum of workers 0 and 1 alone
    after ``since``."""
    path = directory / "membership.json"
    if not path.is_file():
        return False
    events = json.loads(path.read_text())["events"]
    return any(
        e["event"] == "quorum" and e["time"] > since and e["members"] == [0, 1] for e in events
    )


def _kill_and_restart(
    method: str, out: Path, steps: int, restart: bool, **overrides: Any
) -> dict[str, Any]:
    """A local job whose worker 2 is SIGKILLed after 10 steps (and, with ``restart``, started
    again at once); every process's membership.json and exit code. ``overrides``: the
    method's options (``with_options``)."""
    from lowcomm.membership.local import LocalJob

    config = _config(method, out, steps, **overrides)
    with LocalJob(config) as job:
        job.start_all()
        _wait_for(lambda: _lines(job.worker_dir(2, 0) / "metrics.jsonl") >= 10, "10 steps")
        pids = [p.pid for ps in job.processes.values() for p in ps if p.pid]
        port = int(job.address.rpartition(":")[2])
        listening = _listening(pids) | _listening([os.getpid()], port=port)
        killed = job.kill(2)
        if restart:  # (once the survivors have a quorum without it: a later step)
            _wait_for(lambda: _quorum_without_2(job.worker_dir(0, 0), killed), "a new quorum")
            job.start(2)
        codes = job.wait(300)
        dirs = {(slot, n): job.worker_dir(slot, n) for slot, ps in job.processes.items()
                for n in range(len(ps))}  # fmt: skip
    return {"codes": codes, "killed": killed, "dirs": dirs, "listening": listening}


def _survived_and_healed(
    job: dict[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """What every kill-and-restart job of a syncing method shows (:func:`_kill_and_restart`
    with ``restart``): the survivors finish, the dead worker is out at a quorum after the
    kill and the joiner in at the last, the joiner is healed once, sits out the round it
    healed in and ends its slot's shard where the others end theirs. The survivors' and the
    joiner's membership.json records, and its healed event."""
    codes, dirs = job["codes"], job["dirs"]
    assert codes[0] == [0] and codes[1] == [0], codes  # the survivors finish
    assert codes[2][0] == -9 and codes[2][1] == 0, codes  # killed, then the joiner finishes
    survivors = [_record(dirs[(0, 0)]), _record(dirs[(1, 0)])]
    joiner = _record(dirs[(2, 1)])
    healed = [e for e in joiner["events"] if e["event"] == "healed"]
    assert len(healed) == 1 and healed[0]["bytes"] > 0, joiner["events"]
    for record in survivors:
        after = [
            e for e in record["events"] if e["event"] == "quorum" and e["time"] > job["killed"]
        ]
        # (The next quorum leaves the dead worker out, or, where the method's next round
        # comes after the restarted one has asked, already holds the restarted one.)
        assert after[0]["members"] in ([0, 1], [0, 1, 2]), after
        assert after[-1]["members"] == [0, 1, 2], after
    first_quorum = next(e for e in joiner["events"] if e["event"] == "quorum")
    assert first_quorum["participants"] == 2, first_quorum  # (it sat out the round it healed in)
    assert joiner["data_position"] == survivors[0]["data_position"] == 160
    return survivors, joiner, healed[0]


@pytest.mark.slow
def test_diloco_survives_a_kill_and_the_restarted_worker_heals_bit_for_bit(
    tmp_path: Path,
) -> None:
    _needs_torchft()
    job = _kill_and_restart("diloco", tmp_path, steps=160, restart=True)
    codes, dirs = job["codes"], job["dirs"]
    assert codes[0] == [0] and codes[1] == [0], codes  # the survivors finish
    # The lighthouse (in this process) and every worker listen on the loopback only.
    assert job["listening"] == {"127.0.0.1"}, job["listening"]
    assert codes[2][0] == -9 and codes[2][1] == 0, codes  # killed, then the joiner finishes
    # Each worker has its own run directory; none is shared.
    assert len({str(d) for d in dirs.values()}) == 4
    for directory in (dirs[(0, 0)], dirs[(1, 0)], dirs[(2, 1)]):
        assert (directory / "summary.json").is_file()
    survivors = [_record(dirs[(0, 0)]), _record(dirs[(1, 0)])]
    for record in survivors:
        after = [
            e for e in record["events"] if e["event"] == "quorum" and e["time"] > job["killed"]
        ]
        # The dead worker is out at the next quorum the lighthouse forms once its heartbeat
        # has timed out, and the joiner in at a later one. A quorum formed before that
        # timeout still names worker 2; its round cannot commit and is dropped.
        out = next(i for i, e in enumerate(after) if e["members"] == [0, 1])
        assert all(e["members"] == [0, 1, 2] for e in after[:out]), after
        assert record["dropped_rounds"] >= out
        assert any(e["members"] == [0, 1, 2] for e in after[out + 1 :]), after
        assert record["commits"] > 0
    # metrics.jsonl and summary.json record the quorum changes, as a simulated run does.
    rows = [json.loads(line) for line in (dirs[(0, 0)] / "metrics.jsonl").read_text().splitlines()]
    changed = [
        (r["step"], r["quorum"], r["membership_events"]) for r in rows if "membership_events" in r
    ]
    assert [c[1:] for c in changed] == [
        (2, [{"worker": 2, "kind": "crash"}]),
        (3, [{"worker": 2, "kind": "join"}]),
    ], changed
    summary = json.loads((dirs[(0, 0)] / "summary.json").read_text())
    assert [c["step"] for c in summary["faults"]["membership_changes"]] == [c[0] for c in changed]
    joiner = _record(dirs[(2, 1)])
    healed = [e for e in joiner["events"] if e["event"] == "healed"]
    assert len(healed) == 1 and healed[0]["bytes"] > 0, joiner["events"]
    # It sat out the sync it healed in: 2 workers took part in that round, not 3.
    first_quorum = next(e for e in joiner["events"] if e["event"] == "quorum")
    assert first_quorum["participants"] == 2, first_quorum
    mine, theirs = _digests(joiner), _digests(survivors[0])
    first_sync = min(mine)
    assert first_sync == healed[0]["step"]  # (the sync it healed in, and sat out)
    # After its first sync the joiner's parameters equal the others', bit for bit, and stay so.
    assert mine[first_sync] == theirs[first_sync] == _digests(survivors[1])[first_sync]
    assert mine[max(mine)] == theirs[max(theirs)] and max(mine) == 159
    # Its data shard continued where its slot's would be: every worker ends at 160 micro-batches.
    assert joiner["data_position"] == survivors[0]["data_position"] == 160


@pytest.mark.slow
@pytest.mark.parametrize("method", ["local_sgd", "streaming_diloco"])
def test_local_and_streaming_methods_survive_a_kill_and_heal_a_restarted_worker(
    tmp_path: Path, method: str
) -> None:
    _needs_torchft()
    # (160 steps: the survivors train long enough alone for the joiner's process to start
    # on a loaded machine; they step fast between their rounds.)
    job = _kill_and_restart(method, tmp_path, steps=160, restart=True)
    survivors, joiner, _ = _survived_and_healed(job)
    mine, theirs = _digests(joiner), _digests(survivors[0])
    assert max(mine) == max(theirs) == 159
    if method == "local_sgd":  # (an averaged model after every round: equal bits)
        assert mine[159] == theirs[159] == _digests(survivors[1])[159]


@pytest.mark.slow
def test_ddp_survivors_continue_after_a_kill(tmp_path: Path) -> None:
    _needs_torchft()
    job = _kill_and_restart("ddp", tmp_path, steps=30, restart=False)
    codes, dirs = job["codes"], job["dirs"]
    assert codes[0] == [0] and codes[1] == [0] and codes[2] == [-9], codes
    for slot in (0, 1):
        record = _record(dirs[(slot, 0)])
        commits = [e for e in record["events"] if e["event"] == "commit"]
        after = [e for e in commits if e["time"] > job["killed"]]
        assert after, "no round committed after the kill"
        quorum = [
            e for e in record["events"] if e["event"] == "quorum" and e["time"] > job["killed"]
        ]
        assert quorum[0]["members"] == [0, 1], quorum
        assert _lines(dirs[(slot, 0)] / "metrics.jsonl") == 30
    assert _digests(_record(dirs[(0, 0)]))[29] == _digests(_record(dirs[(1, 0)]))[29]


def _follows_static(
    method: str, out: Path, steps: int, static_only: dict[str, Any] | None = None, **common: Any
) -> list[dict[str, Any]]:
    """Run ``method`` with static membership (``static_only`` added) and with torchft, on
    the virtual clock; assert that each step's mean loss over the 3 torchft workers is the
    static run's (to 1e-6); return the torchft workers' membership.json records."""
    from lowcomm.launch.run import run_training

    common = {"clock": "virtual", "seconds_per_microbatch": 0.01, "steps": steps, **common}
    static = _config(method, out / "static", membership="static", **common, **(static_only or {}))
    static.placement.membership_options = MembershipOptions()
    run_training(static, report=None)
    run_training(_config(method, out / "torchft", **common), report=None)

    def losses(path: Path) -> list[float]:
        return [json.loads(line)["train_loss"] for line in path.read_text().splitlines()]

    expected = losses(out / "static" / "metrics.jsonl")
    workers = [losses(out / "torchft" / f"worker{k}" / "metrics.jsonl") for k in range(3)]
    assert len(expected) == steps and all(len(w) == steps for w in workers)
    for step, want in enumerate(expected):
        mean = sum(w[step] for w in workers) / 3
        assert mean == pytest.approx(want, rel=1e-6, abs=1e-6), step
    return [_record(out / "torchft" / f"worker{k}") for k in range(3)]


@pytest.mark.slow
def test_no_fault_diloco_follows_the_static_trajectory(tmp_path: Path) -> None:
    _needs_torchft()
    records = _follows_static("diloco", tmp_path, steps=8)
    digests = [_digests(record) for record in records]
    assert digests[0] == digests[1] == digests[2] and sorted(digests[0]) == [3, 7]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["local_sgd", "streaming_diloco"])
def test_no_fault_local_and_streaming_methods_follow_the_static_trajectory(
    tmp_path: Path, method: str
) -> None:
    _needs_torchft()
    _follows_static(method, tmp_path, steps=8)


def _one_line_refusal(args: list[str], *, python: list[str] | None = None) -> str:
    """Run ``lowcomm train ARGS``; it must end (no hang), exit 2 and say one line."""
    command = python or [sys.executable, "-m", "lowcomm"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [*command, "train", *args], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_unreachable_lighthouse_is_refused_in_one_line(tmp_path: Path) -> None:
    _needs_torchft()
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    line = _one_line_refusal([
        *TINY, "--method", "diloco", "--steps", "4", "--diloco.sync-every", "2", "--membership", "torchft",
        "--membership.lighthouse", f"127.0.0.1:{port}", "--membership.worker", "0",
        "--out", str(tmp_path / "run"),
    ])  # fmt: skip
    assert f"--membership.lighthouse 127.0.0.1:{port}: cannot be reached" in line, line
    assert "torchft_lighthouse" in line


@pytest.mark.parametrize("method", sorted(SHARDED_METHODS))
def test_sharded_methods_are_refused(method: str) -> None:
    with pytest.raises(ConfigError, match=f"--method {method} keeps its optimizer state sharded"):
        with_options(TrainConfig(method=method), membership="torchft").validate()


def test_sharded_method_refused_by_the_cli_in_one_line(tmp_path: Path) -> None:
    line = _one_line_refusal([
        *TINY, "--method", "zero1", "--steps", "4", "--membership", "torchft",
        "--out", str(tmp_path / "run"),
    ])  # fmt: skip
    assert "--method zero1 keeps its optimizer state sharded across workers" in line


def test_missing_torchft_is_refused_naming_the_install_command(tmp_path: Path) -> None:
    # torchft made unimportable in the child, whether or not it is installed here.
    blocked = [
        sys.executable, "-c",
        "import sys; sys.modules['torchft'] = None; sys.argv[0] = 'lowcomm'; "
        "from lowcomm.cli import main; sys.exit(main())",
    ]  # fmt: skip
    line = _one_line_refusal(
        [*TINY, "--method", "diloco", "--steps", "4", "--diloco.sync-every", "2", "--membership", "torchft",
         "--out", str(tmp_path / "run")],
        python=blocked,
    )  # fmt: skip
    assert "torchft is not installed" in line and INSTALL_HINT in line, line
    assert not (tmp_path / "run").exists()


def test_static_membership_refuses_torchft_options() -> None:
    config = with_options(
        TrainConfig(), membership_options=MembershipOptions(lighthouse="127.0.0.1:29510")
    )
    with pytest.raises(ConfigError, match="take effect with --membership torchft"):
        config.validate()


class _FakeWork:
    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def wait(self) -> bool:
        return self.ok


class _FakeError:
    original_exception = RuntimeError("Connection reset by peer\ndetails")


class _FakeManager:
    """A torchft Manager whose first ``allreduce_failures`` collectives break (a peer died
    inside them): the tensor is garbage and the Manager records the error, as torchft's does."""

    def __init__(self, allreduce_failures: int) -> None:
        self.failures = allreduce_failures
        self.error: _FakeError | None = None
        self.quorums = 0
        self.issued = 0

    def allreduce(self, tensor: Any, reduce_op: Any) -> _FakeWork:
        self.issued += 1
        if self.issued <= self.failures:
            tensor.fill_(float("nan"))
            self.error = _FakeError()
            return _FakeWork(False)
        tensor.mul_(2.0)  # (what the reduction makes of it here)
        return _FakeWork(True)

    def should_commit(self) -> bool:
        return self.error is None

    def is_participating(self) -> bool:
        return True

    def errored(self) -> _FakeError | None:
        return self.error

    def start_quorum(self, allow_heal: bool, timeout: Any) -> None:
        self.quorums += 1
        self.error = None


def _fake_replica(failures: int, attempts: int) -> Any:
    from types import SimpleNamespace

    from lowcomm.membership.torchft_comm import Replica, _EarlyRound

    replica = Replica.__new__(Replica)  # (its state only: no lighthouse, no group)
    replica.options = MembershipOptions(attempts=attempts)
    replica.manager = _FakeManager(failures)
    replica.pg = SimpleNamespace(quorum_id=1, members=(0, 1), replica_rank=0)
    replica.slot, replica.loop_step = 0, 7
    replica.commits = replica.failed_rounds = 0
    replica.events, replica.digests = [], []
    replica.on_event = None
    replica.dropped_steps, replica.step_quorum, replica.step_changes = set(), {}, {}
    replica._members = (0, 1)
    replica.pending_tokens, replica.committed_tokens = 32, 0
    replica._round_open, replica._joined, replica._last_quorum = True, False, 1
    replica._early = _EarlyRound()
    return replica


def test_a_round_whose_collective_failed_is_dropped_and_tried_again_from_its_input() -> None:
    _needs_torchft()
    import torch

    from lowcomm.membership.torchft_comm import _RoundHandle

    replica = _fake_replica(failures=1, attempts=3)
    tensor = torch.arange(4, dtype=torch.float32)
    _RoundHandle(replica, tensor, "mean").wait()
    # The broken attempt committed nothing; the new quorum's attempt started from the input.
    assert torch.equal(tensor, torch.arange(4, dtype=torch.float32) * 2)
    assert [e["event"] for e in replica.events] == ["dropped", "commit"]
    assert replica.failed_rounds == 1 and replica.commits == 1 and replica.manager.quorums == 1
    # The step's tokens are committed once, by the round that committed (goodput).
    assert replica.committed_tokens == 32 and replica.pending_tokens == 0
    assert replica.dropped_steps == {7}  # (metrics.jsonl marks the step's round dropped)


def test_a_round_that_never_commits_ends_the_worker_in_one_line() -> None:
    _needs_torchft()
    import torch

    from lowcomm.membership.torchft_comm import RoundFailed, _RoundHandle

    replica = _fake_replica(failures=5, attempts=2)
    handle = _RoundHandle(replica, torch.ones(3), "mean")
    with pytest.raises(
        RoundFailed, match=r"step 7 did not commit in 2 attempts .*Connection reset"
    ):
        handle.wait()
    assert replica.commits == 0 and replica.failed_rounds == 2
    assert replica.committed_tokens == 0


@pytest.mark.slow
def test_cluster_commands_with_torchft_lighthouse(tmp_path: Path) -> None:
    """The cluster recipe of docs/membership.md: torchft_lighthouse, then one `lowcomm train`
    per worker naming it."""
    _needs_torchft()
    import shutil
    import socket

    from lowcomm.membership.local import loopback_interface

    binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("torchft_lighthouse is not installed beside this Python")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ, "PYTHONPATH": str(ROOT / "src"), "GLOO_SOCKET_IFNAME": loopback_interface(),
        "RUST_LOG": "warn",
    }  # fmt: skip
    lighthouse = subprocess.Popen(
        [binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
         "--heartbeat_timeout_ms", "2000", "--join_timeout_ms", "60000"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "lowcomm",
                    "train",
                    *TINY,
                    "--method",
                    "diloco",
                    "--steps",
                    "8",
                    "--diloco.sync-every",
                    "4",
                    "--membership",
                    "torchft",
                    "--membership.lighthouse",
                    f"127.0.0.1:{port}",
                    "--membership.worker",
                    str(k),
                    "--membership.digests",
                    "True",
                    "--out",
                    str(tmp_path / f"w{k}"),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(2)
        ]
        errors = [worker.communicate(timeout=240)[1] for worker in workers]
        assert [worker.returncode for worker in workers] == [0, 0], errors
    finally:
        lighthouse.kill()
        lighthouse.wait()
    digests = [_digests(_record(tmp_path / f"w{k}")) for k in range(2)]
    assert digests[0] == digests[1] and sorted(digests[0]) == [3, 7]
