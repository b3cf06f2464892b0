"""--membership torchft with --ranks-per-worker R > 1: each worker is one torchft replica group
of R processes (its ranks a plain Gloo group inside it; rank r's collectives between workers go
to rank r of the other groups through its own torchft Manager), started by the local launcher
or by torchrun.

Each job is 2 workers of 2 ranks of a tiny GPT on a local lighthouse, on the loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from _cli import TINY
from lowcomm.config import TrainConfig
from lowcomm.membership.options import MembershipOptions, membership_refusal
from test_membership_torchft import (
    _config,
    _digests,
    _lines,
    _needs_torchft,
    _quorum_without_2,
    _record,
    _wait_for,
)

if TYPE_CHECKING:
    from lowcomm.membership.local import LocalJob

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2


def _ranks_config(method: str, out: Path, steps: int, **overrides: Any) -> TrainConfig:
    return _config(method, out, steps, **{"workers": 2, "ranks_per_worker": RANKS, **overrides})


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["train_loss"] for line in path.read_text().splitlines()]


#: The options of a run held to the static trajectory: 8 steps on the virtual clock.
ON_THE_CLOCK: dict[str, Any] = {"clock": "virtual", "seconds_per_microbatch": 0.01, "steps": 8}


def _static_losses(config: Callable[..., TrainConfig], method: str, out: Path) -> list[float]:
    """The losses of ``method``'s run of ``config`` with --membership static, in ``out``."""
    from lowcomm.launch.run import run_training

    static = config(method, out, membership="static", **ON_THE_CLOCK)
    static.placement.membership_options = MembershipOptions()
    run_training(static, report=None)
    return _losses(out / "metrics.jsonl")


def _follow_the_static_losses(expected: list[float], live: Path) -> None:
    """Each of the 8 steps of the two workers' runs in ``live`` has the mean loss of the
    static run's step to 1e-6."""
    workers = [_losses(live / f"worker{k}" / "metrics.jsonl") for k in range(2)]
    assert all(len(w) == 8 for w in workers)
    for step, want in enumerate(expected):
        mean = sum(w[step] for w in workers) / 2
        assert mean == pytest.approx(want, rel=1e-6, abs=1e-6), step


def _kill_and_restart_worker_2(
    config: TrainConfig, killed: Callable[[LocalJob, list[BaseProcess]], None] | None = None
) -> None:
    """Runs ``config``'s 3 workers; after worker 2's 10th step SIGKILLs its replica group (then
    ``killed`` sees the job and the group), waits for a quorum without it and starts it again:
    every worker ends well, worker 2 after its kill."""
    from lowcomm.membership.local import LocalJob

    with LocalJob(config) as job:
        job.start_all()
        worker_2 = job.worker_dir(2, 0) / "metrics.jsonl"
        _wait_for(lambda: _lines(worker_2) >= 10, "10 steps", timeout_s=240.0)
        group = job.groups[2][0]
        at = job.kill(2)
        if killed is not None:
            killed(job, group)
        survivor = job.worker_dir(0, 0)
        _wait_for(lambda: _quorum_without_2(survivor, at), "a quorum without it", timeout_s=240.0)
        job.start(2)
        codes = job.wait(300)
    assert codes == {0: [0], 1: [0], 2: [-9, 0]}, codes


def _healed_once(joiner: Path, survivor: Path) -> dict[str, Any]:
    """The one healing of a restarted rank (``joiner``: its membership record), checked: it
    received bytes, its first quorum held 2 workers, and from the sync it healed in (its
    first) to step 159 its digests are those of the same rank of a survivor (``survivor``)."""
    record = json.loads(joiner.read_text())
    healed = [e for e in record["events"] if e["event"] == "healed"]
    assert len(healed) == 1 and healed[0]["bytes"] > 0, record["events"]
    first_quorum = next(e for e in record["events"] if e["event"] == "quorum")
    assert first_quorum["participants"] == 2, first_quorum
    mine = _digests(record)
    theirs = _digests(json.loads(survivor.read_text()))
    first_sync = min(mine)
    assert first_sync == healed[0]["step"]
    assert mine[first_sync] == theirs[first_sync]
    assert mine[159] == theirs[159]
    return dict(healed[0])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "ddp", "streaming_diloco", "demo", "local_sgd"])
def test_no_fault_groups_of_two_ranks_follow_the_static_trajectory(
    tmp_path: Path, method: str
) -> None:
    """A round of each kind: diloco's outer sync, ddp's per-step mean, streaming_diloco's
    fragments (which leave the workers' parameters apart between their syncs), demo's
    all-gather of every worker's payload and local_sgd's mean of parameters (each rank's
    slice with its worker's weight)."""
    _needs_torchft()
    from lowcomm.launch.run import run_training

    expected = _static_losses(_ranks_config, method, tmp_path / "static")
    live = tmp_path / "torchft"
    run_training(_ranks_config(method, live, **ON_THE_CLOCK), report=None)
    assert len(expected) == 8
    _follow_the_static_losses(expected, live)
    # Every rank of every worker holds the same parameters after each committed round.
    records = [_record(live / f"worker{k}") for k in range(2)]
    ranks = [
        json.loads((live / f"worker{k}" / "membership.rank1.json").read_text()) for k in range(2)
    ]
    for k in range(2):  # (the ranks of a worker hold the same parameters)
        assert _digests(records[k]) == _digests(ranks[k]), k
    digests = [_digests(r) for r in records]
    if method != "streaming_diloco":
        assert digests[0] == digests[1]
    rounds = list(range(8)) if method in ("ddp", "demo") else [3, 7]
    assert sorted(digests[0]) == sorted(digests[1]) == rounds
    # The quorums name the workers (slots), not the ranks' torchft numbers (k R + r); one
    # formed while the job assembled may hold worker 0 alone.
    quorums = [e["members"] for e in records[0]["events"] if e["event"] == "quorum"]
    assert quorums[-1] == [0, 1] and all(set(m) <= {0, 1} for m in quorums), quorums


@pytest.mark.slow
def test_a_killed_group_restarted_heals_every_rank_bit_for_bit(tmp_path: Path) -> None:
    """3 workers of 2 ranks (the two survivors keep the emulated link's pace while the
    joiner's processes start); worker 2's group is SIGKILLed and started again."""
    _needs_torchft()

    def killed(job: LocalJob, group: list[BaseProcess]) -> None:
        assert [len(job.groups[k][0]) for k in range(3)] == [RANKS] * 3
        assert [p.exitcode for p in group] == [-9] * RANKS  # the whole group

    _kill_and_restart_worker_2(_ranks_config("diloco", tmp_path, steps=160, workers=3), killed)
    survivor, joiner = tmp_path / "worker0", tmp_path / "worker2.1"
    # Each rank of the joiner was healed from the same rank of a live group, sat out the sync
    # it healed in, and then holds the survivors' parameters bit for bit.
    for name in ("membership.json", "membership.rank1.json"):
        healed = _healed_once(joiner / name, survivor / name)
        # The rank received 1/R of the declared state from its peer (a contiguous slice of
        # its bytes) and gathered the whole from its own group's ranks.
        state = healed["state_bytes"]
        assert healed["bytes"] == pytest.approx(state / RANKS, rel=1e-3), healed
        assert healed["gathered_bytes"] >= state
    assert _record(joiner)["data_position"] == _record(survivor)["data_position"] == 160
    assert (joiner / "summary.json").is_file() and (survivor / "summary.json").is_file()


@pytest.mark.slow
def test_replica_groups_started_by_torchrun_join_a_lighthouse(tmp_path: Path) -> None:
    """docs/membership.md's cluster recipe with torchrun: torchft_lighthouse, then one
    `torchrun --nproc-per-node 2 -m lowcomm train ...` per worker, on the loopback."""
    _needs_torchft()
    from lowcomm.membership.local import loopback_interface

    binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if binary is None or torchrun is None:
        pytest.skip("torchft_lighthouse or torchrun is not installed beside this Python")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ, "PYTHONPATH": str(ROOT / "src"), "GLOO_SOCKET_IFNAME": loopback_interface(),
        "RUST_LOG": "warn", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    lighthouse = subprocess.Popen(
        [binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
         "--heartbeat_timeout_ms", "2000", "--join_timeout_ms", "60000"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        groups = [
            subprocess.Popen(
                _torchrun_group(torchrun, k, port, tmp_path / f"w{k}"),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(2)
        ]
        errors = [group.communicate(timeout=300)[1] for group in groups]
        assert [group.returncode for group in groups] == [0, 0], errors
    finally:
        lighthouse.kill()
        lighthouse.wait()
    records = [_record(tmp_path / f"w{k}") for k in range(2)]
    digests = [_digests(r) for r in records]
    assert digests[0] == digests[1] and sorted(digests[0]) == [3, 7]
    rank1 = json.loads((tmp_path / "w0" / "membership.rank1.json").read_text())
    assert _digests(rank1) == digests[0]
    assert all(_lines(tmp_path / f"w{k}" / "metrics.jsonl") == 8 for k in range(2))


def _torchrun_group(torchrun: str, slot: int, lighthouse: int, out: Path) -> list[str]:
    """The command of worker ``slot``: one torchrun of R ranks naming the lighthouse (its
    own rendezvous on a port torchrun takes itself: a port probed here beforehand could be
    taken by another test's process before torchrun binds it)."""
    return [
        torchrun, "--standalone", "--nproc-per-node", str(RANKS),
        "-m", "lowcomm", "train", *TINY, "--method", "diloco", "--steps", "8",
        "--diloco.sync-every", "4", "--workers", "2", "--ranks-per-worker", str(RANKS),
        "--membership", "torchft", "--membership.lighthouse", f"127.0.0.1:{lighthouse}",
        "--membership.worker", str(slot), "--membership.digests", "True", "--out", str(out),
    ]  # fmt: skip


def test_every_live_method_runs_with_workers_of_several_ranks() -> None:
    from lowcomm.config import with_options
    from lowcomm.membership.options import TORCHFT_METHODS
    from lowcomm.strategies.worker_sharding import sharded_methods

    base = with_options(
        TrainConfig(method="diloco"), workers=2, ranks_per_worker=2, membership="torchft"
    )
    # Every live-membership method runs with workers of several ranks, with checkpoints, and
    # FSDP-sharded over each group's own ranks where the method runs on sharded workers.
    for method in TORCHFT_METHODS:
        assert membership_refusal(with_options(base, method=method)) is None, method
    assert membership_refusal(with_options(base, checkpoint_every=4, stop_after=4)) is None
    sharded = [m for m in TORCHFT_METHODS if m in sharded_methods()]
    assert "diloco" in sharded and "ddp" in sharded
    for method in sharded:
        config = with_options(base, method=method, worker_sharding="fsdp")
        assert membership_refusal(config) is None, method


@pytest.mark.parametrize(
    ("world", "lighthouse", "expected"),
    [
        ("3", "127.0.0.1:1", "--ranks-per-worker: 2 is not torchrun's world of 3 processes"),
        ("2", None, "under torchrun, one worker"),
    ],
)
def test_a_torchrun_group_that_is_not_one_worker_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: str, lighthouse: str | None,
    expected: str,
) -> None:  # fmt: skip
    _needs_torchft()
    from lowcomm.config import ConfigError, with_options
    from lowcomm.launch.run import run_training

    for key, value in {"TORCHELASTIC_RUN_ID": "t", "RANK": "0", "WORLD_SIZE": world}.items():
        monkeypatch.setenv(key, value)
    config = _ranks_config("diloco", tmp_path, steps=8)
    options = MembershipOptions(lighthouse=lighthouse, worker=None if lighthouse is None else 0)
    config = with_options(config, membership_options=options)
    with pytest.raises(ConfigError, match=expected) as caught:
        run_training(config, report=None)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_a_group_alone_starts_after_the_quorum_timeout_on_every_rank(tmp_path: Path) -> None:
    """Worker 1 never comes: worker 0's ranks, whose set-ups end at different times, all start
    without it once --membership.quorum-s has passed (none commits the startup round while
    another still asks for a quorum)."""
    _needs_torchft()
    from lowcomm.membership.local import LocalJob

    options = MembershipOptions(detect_s=2.0, quorum_s=3.0, digests=True)
    config = _ranks_config("diloco", tmp_path, steps=8, membership_options=options)
    with LocalJob(config) as job:
        job.start(0)
        codes = job.wait(240)
    assert codes == {0: [0]}, codes
    record = _record(tmp_path / "worker0")
    assert sorted(_digests(record)) == [3, 7]
    assert _lines(tmp_path / "worker0" / "metrics.jsonl") == 8


@pytest.mark.slow
def test_a_job_of_groups_stopped_inside_a_round_resumes_on_the_static_trajectory(
    tmp_path: Path,
) -> None:
    """diloco stopped after step 6 (inside its second round: each rank's slice of the inner
    AdamW moments is in flight) and resumed: every rank continues its own checkpoint file,
    and the job's losses are the static run's."""
    _needs_torchft()
    from lowcomm.config import with_options
    from lowcomm.launch.run import run_training

    expected = _static_losses(_ranks_config, "diloco", tmp_path / "static")
    run = tmp_path / "torchft"
    config = _ranks_config("diloco", run, stop_after=6, **ON_THE_CLOCK)
    assert run_training(config, report=None) is None
    for k in range(2):
        latest = run / f"worker{k}" / "checkpoints" / "step-000006"
        assert sorted(p.name for p in latest.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    resumed = with_options(config, resume=str(run), stop_after=None, out=None)
    assert run_training(resumed, report=None) is not None

    _follow_the_static_losses(expected, run)
    records = [_record(run / f"worker{k}") for k in range(2)]
    ranks = [json.loads((run / f"worker{k}" / "membership.rank1.json").read_text()) for k in (0, 1)]
    digests = [_digests(r) for r in records + ranks]
    # (Each rank's record goes on from its checkpoint's: the sync before the stop and after.)
    assert all(d == digests[0] for d in digests) and sorted(digests[0]) == [3, 7], digests


@pytest.mark.slow
def test_a_replayed_trace_kills_a_whole_group_and_its_joiner_heals_rank_to_rank(
    tmp_path: Path,
) -> None:
    """ddp (each rank holds its own slice of the AdamW moments) with a trace that crashes
    worker 1 at step 2 and starts it again there: the launcher kills both its processes and
    starts two, and each joining rank takes its slice from the same rank of worker 0 (the
    parameters then stay equal bit for bit, which moments left at zero would not). Rounds
    need both workers (--membership.min-workers 2), so worker 0 waits at step 2 for the
    joiner however long its processes take to start."""
    _needs_torchft()
    from lowcomm.launch.run import run_training

    steps = 8
    trace = tmp_path / "trace.txt"
    trace.write_text("step=2 worker=1 crash\nstep=2 worker=1 join\n")
    options = MembershipOptions(min_workers=2, detect_s=2.0, quorum_s=240.0, digests=True)
    config = _ranks_config(
        "ddp", tmp_path / "run", steps, faults=str(trace), membership_options=options
    )
    assert run_training(config, report=None) is not None
    run = tmp_path / "run"
    job = json.loads((run / "membership.json").read_text())
    codes = {slot: [p["exit_code"] for p in runs] for slot, runs in job["workers"].items()}
    assert codes == {"0": [0], "1": [-9, 0]}, codes
    assert [(e["event"], e["worker"]) for e in job["faults"]["launcher"]] == [
        ("crash", 1), ("join", 1)
    ]  # fmt: skip
    # The kill landed at the crash's step on the whole group: it trained steps 0 and 1.
    assert [json.loads(line)["step"] for line in (run / "worker1" / "metrics.jsonl").open()] == [
        0, 1
    ]  # fmt: skip
    for name in ("membership.json", "membership.rank1.json"):
        joiner = json.loads((run / "worker1.1" / name).read_text())
        healed = [e for e in joiner["events"] if e["event"] == "healed"]
        assert len(healed) == 1 and healed[0]["bytes"] > 0, joiner["events"]
        mine = _digests(joiner)
        theirs = _digests(json.loads((run / "worker0" / name).read_text()))
        assert healed[0]["step"] == 2 and sorted(mine) == list(range(2, steps)), name
        assert all(mine[step] == theirs[step] for step in mine), name
        assert mine[steps - 1] == theirs[steps - 1]
