"""Elastic resume: a checkpoint of M workers continues on M2 (lowcomm.train.reshard).

Every registered method is checkpointed on 3 workers and on 2 (threads of the test's process),
then each is resumed on the other count and run to completion. The pure re-sharding
function is checked on the real checkpoints (replicated state kept exactly, ZeRO-1/ACCO
shards gathered back equal) and on hand-made states; the data order on real shards.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from _cli import TINY, lowcomm, torchrun
from lowcomm.data import DataConfig, WorkerShard, prepare_corpus
from lowcomm.data.sampling import Carry, consumed_in_pass
from lowcomm.strategies import STRATEGIES
from lowcomm.train.checkpoint import CheckpointError, read_rank_state
from lowcomm.train.reshard import Layout, Rules, parameter_count, reshard, rules_for
from test_resume import tiny_config, train_threads

STEPS = 8
STOP = 5
METHODS = sorted(STRATEGIES)


def _config(method: str, out: Path, workers: int, **overrides: object) -> Any:
    config = tiny_config(method, out, **overrides)
    config.placement.workers = workers
    return config


def _checkpoint_every_method(base: Path, workers: int) -> dict[str, str]:
    done: dict[str, str] = {}
    for method in METHODS:
        out = base / f"m{workers}" / method
        try:
            train_threads(_config(method, out, workers, stop_after=STOP, checkpoint_every=2))
            done[method] = "ok"
        except Exception as error:  # reported by the method's own test
            done[method] = f"{type(error).__name__}: {error}"
    return done


def _resume_every_method(base: Path, old: int, new: int) -> dict[str, str]:
    """Resume each method's checkpoint of ``old`` workers on ``new``."""
    done: dict[str, str] = {}
    for method in METHODS:
        source, out = base / f"m{old}" / method, base / f"r{old}{new}" / method
        try:
            summaries = train_threads(_config(method, out, new, resume=str(source)))
            done[method] = "ok" if all(s.tokens > 0 for s in summaries) else "no tokens"
        except Exception as error:
            done[method] = f"{type(error).__name__}: {error}"
    return done


def _ddp_reference(base: Path) -> float:
    """DDP on 2 workers set up afresh, given the 3-worker checkpoint's parameters and optimizer
    state (rank 0's file, as they are, no re-sharding) and the rest of the pass: its final
    parameters minus those of the elastic resume (max abs, over the workers)."""
    from lowcomm.comm.inprocess import InProcessGroup
    from lowcomm.launch.inprocess import run_threads
    from lowcomm.train.loop import FinalState, Progress, set_up, train_steps
    from lowcomm.train.metrics import RunWriter
    from lowcomm.train.shared import shared_setup

    source = base / "m3" / "ddp" / "checkpoints" / f"step-{STOP:06d}"
    resumed = train_threads(
        _config("ddp", base / "ddp-again", 2, resume=str(source.parent.parent)),
        keep_parameters=True,
    )
    config = _config("ddp", base / "ddp-reference", 2)
    config.placement.workers_per_process = 2
    saved = read_rank_state(source, 0)
    carry = consumed_in_pass([read_rank_state(source, rank)["data"] for rank in range(3)])
    world, books, shared = InProcessGroup(2), InProcessGroup(2), shared_setup(config)

    def reference(rank: int) -> torch.Tensor:
        worker = set_up(config, world.comm(rank), books.comm(rank), shared)
        worker.model.load_state_dict(saved["model"])
        worker.strategy.load_state_dict(saved["strategy"])
        worker.shard.carry = carry
        writer = RunWriter(config) if rank == 0 else None
        train_steps(worker, Progress(start_step=STOP), writer, FinalState())
        return torch.cat([p.detach().reshape(-1) for p in worker.model.parameters()])

    mine = run_threads(reference, 2, (world, books))
    differences = []
    for own, summary in zip(mine, resumed, strict=True):
        assert summary.parameters is not None
        differences.append(float((own - summary.parameters).abs().max()))
    return max(differences)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every method checkpointed on 3 workers and on 2, and resumed on the other count, its
    workers threads of this process (the methods' state is checked here, not the process
    machinery: test_inprocess.py resumes a checkpoint of worker processes on another count)."""
    base = tmp_path_factory.mktemp("elastic")
    prepare_corpus(DataConfig(micro_batch_size=2))
    three = _checkpoint_every_method(base, 3)
    two = {
        "checkpoint": _checkpoint_every_method(base, 2),
        "resume": _resume_every_method(base, 3, 2),
        "ddp_reference": _ddp_reference(base),
    }
    back = _resume_every_method(base, 2, 3)
    return {"base": base, "three": three, "two": two, "back": back}


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_resumes_on_another_worker_count(method: str, elastic: dict[str, Any]) -> None:
    assert elastic["three"][method] == "ok", elastic["three"][method]
    assert elastic["two"]["checkpoint"][method] == "ok", elastic["two"]["checkpoint"][method]
    assert elastic["two"]["resume"][method] == "ok", f"3 -> 2: {elastic['two']['resume'][method]}"
    assert elastic["back"][method] == "ok", f"2 -> 3: {elastic['back'][method]}"
    for old, new in ((3, 2), (2, 3)):
        out = elastic["base"] / f"r{old}{new}" / method
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(STOP, STEPS))
        change = records[0]["membership"]
        assert change["step"] == STOP and (change["old_workers"], change["new_workers"]) == (
            old,
            new,
        )
        assert all("membership" not in r for r in records[1:])
        assert all(len(r["microbatches_per_worker"]) == new for r in records)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["workers"] == new
        assert summary["membership_changes"] == [
            {"step": STOP, "old_workers": old, "new_workers": new}
        ]
        # The old checkpoint is read, never written.
        assert not (elastic["base"] / f"m{old}" / method / "summary.json").exists()
        _check_pure_reshard(elastic["base"] / f"m{old}" / method, method, old, new)


@pytest.mark.slow
def test_ddp_resumed_on_two_equals_ddp_started_on_two_from_the_checkpoint(
    elastic: dict[str, Any],
) -> None:
    assert elastic["two"]["ddp_reference"] == 0.0


def _leaves(tree: Any, path: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_leaves(value, f"{path}.{key}"))
        return out
    if isinstance(tree, list | tuple):
        out = {}
        for index, value in enumerate(tree):
            out.update(_leaves(value, f"{path}[{index}]"))
        return out
    return {path: tree}


def _same(a: Any, b: Any, numel: int | None = None) -> bool:
    if isinstance(a, torch.Tensor) and numel is not None and a.dim() == 1 and a.numel() >= numel:
        # A flat buffer padded to the worker count: equal up to the padding.
        return isinstance(b, torch.Tensor) and torch.equal(a[:numel], b[:numel])
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


def _check_pure_reshard(run: Path, method: str, old: int, new: int) -> None:
    directory = run / "checkpoints" / f"step-{STOP:06d}"
    states = [read_rank_state(directory, rank) for rank in range(old)]
    rules = rules_for(method, parameter_count(states[0]))
    out = reshard(states, Layout(old), Layout(new), rules)
    assert len(out) == new
    before = [_leaves(s["strategy"]) for s in states]
    after = [_leaves(s["strategy"]) for s in out]
    sharded = {"master", "exp_avg", "exp_avg_sq"} if rules.shards_over_workers else set()
    padded = rules.numel if rules.shards_over_workers else None
    for path, value in before[0].items():
        name = path.rsplit(".", 1)[-1]
        if name in sharded and isinstance(value, torch.Tensor) and value.dim() == 1:
            # Re-sharded: gathered back, the new shards equal the old ones exactly.
            gathered_old = torch.cat([b[path] for b in before])[: rules.numel]
            gathered_new = torch.cat([a[path] for a in after])[: rules.numel]
            assert torch.equal(gathered_old, gathered_new), f"{method} {path}"
        elif name in rules.pooled:
            total = sum((b[path] for b in before[1:]), start=before[0][path])
            assert _same(total, after[0][path], padded), f"{method} {path}"
        elif all(_same(value, b[path]) for b in before[1:]):
            # Replicated: kept exactly on every new rank.
            assert all(_same(value, a[path], padded) for a in after), f"{method} {path}"
    old_model = [s["model"] for s in states]
    for key, value in old_model[0].items():
        if all(torch.equal(value, m[key]) for m in old_model[1:]):
            assert all(torch.equal(value, s["model"][key]) for s in out), f"{method} {key}"


def test_reshard_pure_function_on_hand_made_states() -> None:
    """ZeRO-1 shards (a length not divisible by either count) re-shard exactly; differing
    per-worker tensors are averaged, equal ones kept bit for bit; pooled sums go to worker 0;
    the input is not modified."""
    numel, old, new = 10, 3, 4
    full = torch.arange(12, dtype=torch.float32)  # padded to 12 for 3 workers
    full[numel:] = 0
    states = []
    for rank in range(old):
        shard = full[rank * 4 : (rank + 1) * 4].clone()
        states.append({
            "format": 2, "step": 7, "val_loss": 1.0, "tokens": 10 * (rank + 1),
            "model": {"w": torch.full((numel,), 0.5)},
            "strategy": {
                "step_index": 7,
                "optimizer": {"master": shard, "exp_avg": shard * 2, "exp_avg_sq": shard * 3,
                              "step_count": 7},
                "local": torch.full((2,), float(rank)),
                "grads": torch.ones(3), "accumulated": 2,
            },
            "data": {"position": 3, "seed": 0, "rank": rank, "world_size": old, "seq_len": 4,
                     "micro_batch_size": 2, "num_windows": 100, "replica": 0, "replicas": 1},
            "clock": {"kind": "virtual", "now": float(rank), "compute_s": 1.0,
                      "exposed_comm_s": 0.5},
            "comm": {"bytes": 5.0}, "rng": {"torch": torch.zeros(3, dtype=torch.uint8)},
        })  # fmt: skip
    snapshot = [json.dumps(_leaves(s), default=str) for s in states]
    rules = Rules(numel=numel, shards_over_workers=True, pooled=frozenset({"grads", "accumulated"}))
    out = reshard(states, Layout(old), Layout(new), rules)
    assert [json.dumps(_leaves(s), default=str) for s in states] == snapshot
    assert [s["strategy"]["optimizer"]["master"].numel() for s in out] == [3] * 4  # 12 / 4
    gathered = torch.cat([s["strategy"]["optimizer"]["master"] for s in out])[:numel]
    assert torch.equal(gathered, full[:numel])
    assert torch.equal(torch.cat([s["strategy"]["optimizer"]["exp_avg_sq"] for s in out])[:numel],
                       3 * full[:numel])  # fmt: skip
    assert all(torch.equal(s["strategy"]["local"], torch.full((2,), 1.0)) for s in out)
    assert all(s["model"]["w"] is states[0]["model"]["w"] for s in out)
    assert torch.equal(out[0]["strategy"]["grads"], torch.full((3,), 3.0))
    assert out[0]["strategy"]["accumulated"] == 6
    assert all(s["strategy"]["accumulated"] == 0 for s in out[1:])
    assert [s["tokens"] for s in out] == [10, 20, 30, 0]
    assert all(s["clock"]["now"] == 2.0 for s in out)
    assert [s["data"]["rank"] for s in out] == [0, 1, 2, 3]
    assert out[0]["membership"] == {
        "step": 7, "old_workers": 3, "new_workers": 4, "old_ranks_per_worker": 1,
        "new_ranks_per_worker": 1,
    }  # fmt: skip


@pytest.mark.parametrize(("old", "new", "ranks"), [(3, 2, 1), (2, 3, 1), (2, 3, 2)])
def test_data_pass_continues_without_skips_or_repeats(old: int, new: int, ranks: int) -> None:
    corpus = prepare_corpus(DataConfig(micro_batch_size=2))
    settings = {"seq_len": 16, "micro_batch_size": 2, "seed": 3}

    def shards(workers: int, replicas: int) -> list[WorkerShard]:
        return [
            WorkerShard(corpus, rank=w, world_size=workers, replica=r, replicas=replicas,
                        **settings)  # type: ignore[arg-type]
            for w in range(workers) for r in range(replicas)
        ]  # fmt: skip

    first = shards(old, 1)
    pass_windows = first[0].num_windows
    seen: list[int] = []
    for shard in first:
        order = shard.window_indices(0)
        seen.extend(int(i) for i in order[: 5 * 2])
        for _ in range(5):
            shard.next_batch()
    carry = consumed_in_pass([s.state_dict() for s in first])
    second = shards(new, ranks)
    for shard in second:
        shard.load_state_dict({**shard.state_dict(), **carry.state()})
    remaining = second[0]._carry_batches()
    for shard in second:
        rows = shard._carried_order()[: remaining * ranks * 2].reshape(remaining, ranks, 2)
        seen.extend(int(i) for i in rows[:, shard.replica].reshape(-1))
        x, _ = shard.next_batch()  # the first carried micro-batch is the one dealt here
        assert x.shape == (2, 16)
        shard.position = remaining
        assert shard.epoch == 1  # the carried pass is done: the next batch starts pass 1
    assert len(seen) == len(set(seen))  # nothing repeated
    # Nothing skipped but the last windows that do not fill a micro-batch on every rank.
    assert pass_windows - len(seen) < new * ranks * 2
    again = WorkerShard(corpus, rank=0, world_size=new, **settings)  # type: ignore[arg-type]
    again.load_state_dict({**again.state_dict(), **carry.state()})
    assert isinstance(Carry.from_state(again.state_dict()), Carry)


TINY_FLAGS = (*TINY, "--steps", "6", "--method", "zero1")


@pytest.mark.slow
def test_cli_elastic_resume_and_refusals(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = lowcomm("train", *TINY_FLAGS, "--out", str(out), "--stop-after", "3", timeout=120)
    assert first.returncode == 0, first.stderr
    step = out / "checkpoints" / "step-000003"
    listing = sorted((p.name, p.stat().st_mtime_ns) for p in step.iterdir())

    # A manifest that disagrees with the rank files present: one line, before any worker.
    shutil.copy(step / "rank1.pt", step / "rank2.pt")
    extra = lowcomm("train", "--resume", str(out), "--workers", "3", timeout=120)
    assert extra.returncode == 2, extra.stderr
    assert "re-sharded" in extra.stderr and "rank2.pt" in extra.stderr
    assert len(extra.stderr.strip().splitlines()) == 1 and "workers connected" not in extra.stdout
    (step / "rank2.pt").unlink()

    resumed = lowcomm("train", "--resume", str(out), "--workers", "3", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in step.iterdir()) == listing
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 3
    assert summary["membership_changes"] == [{"step": 3, "old_workers": 2, "new_workers": 3}]


@pytest.mark.slow
def test_non_iid_and_incomplete_checkpoints_are_refused_before_resharding(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = lowcomm("train", *TINY_FLAGS, "--out", str(out), "--stop-after", "3", "--split",
                    "non-iid", timeout=120)  # fmt: skip
    assert first.returncode == 0, first.stderr
    # Non-IID data is cut into worker blocks: refused, naming the option.
    non_iid = lowcomm("train", "--resume", str(out), "--workers", "3", timeout=120)
    assert non_iid.returncode == 2 and "--split non-iid" in non_iid.stderr
    assert len(non_iid.stderr.strip().splitlines()) == 1
    (out / "checkpoints" / "step-000003" / "rank1.pt").unlink()
    missing = lowcomm("train", "--resume", str(out), "--workers", "3", timeout=120)
    assert missing.returncode == 2
    assert "rank1.pt is missing" in missing.stderr and "Traceback" not in missing.stderr


def test_plan_prices_losing_a_worker(capsys: pytest.CaptureFixture[str]) -> None:
    from lowcomm.plan import PlanConfig, make_plan, run_plan

    config = PlanConfig(method="diloco", workers=4, lose_workers=1)
    result = run_plan(config)
    after = result["after_losing"]
    assert isinstance(after, dict) and after["workers"] == 3
    three = make_plan(PlanConfig(method="diloco", workers=3))
    assert after["step_s_after"] == three.wall_clock_s / three.steps
    assert after["step_s_after"] > after["step_s_before"]  # fewer workers, same global batch
    assert "losing 1 of 4" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--lose-workers"):
        PlanConfig(workers=2, lose_workers=2)


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
    return found


def _steps(metrics: Path) -> list[int]:
    steps = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        with contextlib.suppress(ValueError):  # a line being written
            steps.append(json.loads(line)["step"])
    return steps


def _wait_listening(port: int, host: subprocess.Popen[str], timeout_s: float = 60) -> None:
    """Until something accepts connections on 127.0.0.1:``port`` (``host`` must stay up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert host.poll() is None, "the first agent ended before its rendezvous store was up"
        assert time.monotonic() < deadline, f"no rendezvous store on port {port}"
        time.sleep(0.05)


@pytest.mark.benchmark
def test_torchrun_goes_on_with_fewer_workers_when_one_never_returns(tmp_path: Path) -> None:
    """(Benchmark tier: it rests on torchelastic's rendezvous timeouts, which a loaded 2-core
    machine can overrun, at 74-185 s a run; make test-benchmarks runs it.) 3 single-process
    torchrun agents (c10d rendezvous on loopback, --nnodes 2:3); one is SIGKILLed with its
    worker mid-run and never comes back: the other two restart, re-shard the latest checkpoint
    for 2 workers and finish."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    steps, out = 80, tmp_path / "elastic"
    command = [
        *torchrun(tmp_path), "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
        "--local-addr", "127.0.0.1", "--rdzv-conf",
        "join_timeout=120,last_call_timeout=15,close_timeout=5,read_timeout=180",
        "--monitor-interval", "0.5", "-m", "lowcomm", "train", "--method", "ddp", "--steps",
        str(steps), "--checkpoint-every", "10", "--model.n-layer", "1", "--model.n-embd", "32",
        "--model.n-head", "2", "--model.block-size", "16", "--micro-batch-size", "2",
        "--eval-every", "100", "--eval-batches", "2", "--progress", "False", "--plot", "False", "--clock", "real",
        "--network", "slow-wan", "--collective-timeout-s", "10", "--resume", "auto", "--out",
        str(out),
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    agents: list[subprocess.Popen[str]] = []
    logs = []
    try:
        for index in range(3):
            logs.append(open(tmp_path / f"agent{index}.log", "w"))  # noqa: SIM115
            agents.append(
                subprocess.Popen(
                    command, stdout=logs[-1], stderr=subprocess.STDOUT, text=True, env=env
                )
            )
            if index == 0:  # the first agent hosts the rendezvous store: the others join it
                _wait_listening(port, agents[0])
        # (A bound on a hang, not a speed claim: three agents and their workers start on
        # 2 cores beside the rest of the suite, which can take more than 180 s. The first
        # rendezvous waits up to last_call_timeout for the third agent: with a short one, a
        # third agent slow to start under load joins a running pair, and torchelastic's
        # re-rendezvous then hangs for read_timeout.)
        deadline = time.monotonic() + 420
        while len(_steps(out / "metrics.jsonl")) < 20:
            assert all(a.poll() is None for a in agents), "an agent ended before the kill"
            assert time.monotonic() < deadline, "the job never reached the kill step"
            time.sleep(0.02)
        victims = _children(agents[2].pid)
        assert len(victims) == 1, victims
        os.kill(agents[2].pid, signal.SIGKILL)
        os.kill(victims[0], signal.SIGKILL)
        codes = [agent.wait(timeout=240) for agent in agents[:2]]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
        for log in logs:
            log.close()
    tail = (tmp_path / "agent0.log").read_text()[-3000:]
    assert codes == [0, 0], tail
    assert _steps(out / "metrics.jsonl") == list(range(steps))  # every step once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 2
    (change,) = summary["membership_changes"]
    assert (change["old_workers"], change["new_workers"]) == (3, 2)
    # The latest checkpoint at the kill (after 20 steps: step 20's may not be committed yet).
    assert change["step"] in (10, 20, 30)
    assert "re-sharded from 3 to 2 workers" in tail


def test_reshard_moments_split_over_a_workers_ranks() -> None:
    """ZeRO-1 inside a worker (--ranks-per-worker): the AdamW moments split over a worker's
    ranks are joined and split again for the new ranks; the master is replicated and kept."""
    master = torch.arange(5, dtype=torch.float32)
    moments = torch.arange(10, 15, dtype=torch.float32)
    slices = [slice(0, 3), slice(3, 5)]  # ReplicaShardedAdamW: ceil(5 / 2) = 3 per rank
    states = []
    for rank in range(4):  # 2 workers x 2 ranks
        part = slices[rank % 2]
        states.append({
            "format": 2, "step": 4, "val_loss": 1.0, "tokens": 8,
            "model": {"w": master.clone()},
            "strategy": {"step_index": 4, "inner": {
                "master": master.clone(), "exp_avg": moments[part].clone(),
                "exp_avg_sq": 2 * moments[part], "step_count": 4}},
            "data": {"position": 1, "seed": 0, "rank": rank // 2, "world_size": 2, "seq_len": 4,
                     "micro_batch_size": 2, "num_windows": 100, "replica": rank % 2,
                     "replicas": 2},
            "clock": {"kind": "virtual", "now": 1.0, "compute_s": 1.0, "exposed_comm_s": 0.0},
            "comm": {"inner": {}, "outer": {}}, "rng": {"torch": torch.zeros(3, dtype=torch.uint8)},
        })  # fmt: skip
    rules = Rules(numel=5, shards_over_replicas=True)
    out = reshard(states, Layout(2, 2), Layout(1, 3), rules)
    assert len(out) == 3
    inner = [s["strategy"]["inner"] for s in out]
    assert [i["exp_avg"].numel() for i in inner] == [2, 2, 1]  # ceil(5 / 3) = 2 per rank
    assert torch.equal(torch.cat([i["exp_avg"] for i in inner]), moments)
    assert torch.equal(torch.cat([i["exp_avg_sq"] for i in inner]), 2 * moments)
    assert all(torch.equal(i["master"], master) for i in inner)
    assert [(s["data"]["rank"], s["data"]["replica"]) for s in out] == [(0, 0), (0, 1), (0, 2)]
    assert all(s["comm"] is None for s in out)  # another --ranks-per-worker: counters afresh


def _fsdp_slices(whole: torch.Tensor, rows: int, ranks: int) -> list[torch.Tensor]:
    """Each rank's slice of a (rows x -1) tensor as FSDP cuts it: torch.chunk on dim 0,
    padded to the first chunk's rows."""
    chunks = list(whole.reshape(rows, -1).chunk(ranks))
    chunks += [whole.reshape(rows, -1)[:0]] * (ranks - len(chunks))
    size = chunks[0].shape[0]
    return [torch.cat([c, c.new_zeros(size - c.shape[0], c.shape[1])]).reshape(-1) for c in chunks]


def test_reshard_cuts_sharded_workers_fsdp_slices_for_other_ranks() -> None:
    """--worker-sharding fsdp, 2 workers x 2 ranks resumed on 1 x 3: each worker's slices are
    joined whole, the workers averaged (local state) and cut again as FSDP cuts for 3 ranks;
    the model's sharded tensors likewise, its buffers (whole on every rank) kept."""
    shapes = [(5, 2), (3,), (1, 4)]  # chunk rows at R = 2: 3, 2, 1; at R = 3: 2, 1, 1
    numel = sum(math.prod(s) for s in shapes)
    wholes = [torch.arange(numel, dtype=torch.float32) + 100 * w for w in range(2)]

    def flat(whole: torch.Tensor, ranks: int) -> list[torch.Tensor]:
        parts, begin = [], 0
        for shape in shapes:
            size = math.prod(shape)
            parts.append(_fsdp_slices(whole[begin : begin + size], shape[0], ranks))
            begin += size
        return [torch.cat([p[r] for p in parts]) for r in range(ranks)]

    states = []
    for rank in range(4):
        worker, replica = divmod(rank, 2)
        mine = flat(wholes[worker], 2)[replica]
        model = {"a": wholes[worker][:10].reshape(5, 2).chunk(2)[replica], "buffer": torch.ones(3)}
        states.append({
            "format": 2, "step": 4, "val_loss": 1.0, "tokens": 8, "model": model,
            "fsdp_layout": {"sharded": {"a": [5, 2]}, "flat": [list(s) for s in shapes]},
            "strategy": {
                "step_index": 4, "anchor": mine.clone(), "count": torch.tensor(3.0),
                "buffer": torch.cat([mine, 2 * mine]),  # two flat buffers end to end (CO2)
                # fragments: runs of whole parameters (the first two, the last)
                "globals": [mine[:8].clone(), mine[8:].clone()],
                "outer": [{"momentum_buffer": -mine[:8]}, {"momentum_buffer": -mine[8:]}],
                # an exchange in flight of the second fragment
                "in_flight": [{"fragment": 1, "exchange": {"own": 3 * mine[8:]}}],
            },
            "data": {"position": 1, "seed": 0, "rank": worker, "world_size": 2, "seq_len": 4,
                     "micro_batch_size": 2, "num_windows": 100, "replica": replica,
                     "replicas": 2},
            "clock": {"kind": "virtual", "now": 1.0, "compute_s": 1.0, "exposed_comm_s": 0.0},
            "comm": {"inner": {}, "outer": {}}, "rng": {"torch": torch.zeros(3, dtype=torch.uint8)},
        })  # fmt: skip
    assert states[0]["strategy"]["anchor"].numel() == 3 * 2 + 2 + 1 * 4  # a rank's flat length
    out = reshard(states, Layout(2, 2), Layout(1, 3), Rules(numel=12), sharded_workers=True)
    mean = (wholes[0] + wholes[1]) / 2
    want = flat(mean, 3)
    assert [s["strategy"]["anchor"].numel() for s in out] == [2 * 2 + 1 + 4] * 3
    for rank, state in enumerate(out):
        assert torch.equal(state["strategy"]["anchor"], want[rank]), rank
        assert torch.equal(state["strategy"]["buffer"], torch.cat([want[rank], 2 * want[rank]]))
        assert torch.equal(torch.cat(state["strategy"]["globals"]), want[rank])
        assert [g.numel() for g in state["strategy"]["globals"]] == [2 * 2 + 1, 4]
        momentum = [o["momentum_buffer"] for o in state["strategy"]["outer"]]
        assert torch.equal(torch.cat(momentum), -want[rank])
        (flight,) = state["strategy"]["in_flight"]
        assert torch.equal(flight["exchange"]["own"], 3 * want[rank][5:])
        assert float(state["strategy"]["count"]) == 3.0
        assert torch.equal(state["model"]["buffer"], torch.ones(3))
        assert (state["data"]["rank"], state["data"]["replica"]) == (0, rank)
    rows = torch.cat([s["model"]["a"] for s in out])
    assert [s["model"]["a"].shape[0] for s in out] == [2, 2, 1]  # torch.chunk of 5 rows by 3
    assert torch.equal(rows, mean[:10].reshape(5, 2))
    # on fewer workers with the same ranks: rank r is the workers' rank r slices combined
    same = reshard(states, Layout(2, 2), Layout(1, 2), Rules(numel=12), sharded_workers=True)
    for rank, state in enumerate(same):
        assert torch.equal(state["strategy"]["anchor"], flat(mean, 2)[rank]), rank
        assert torch.equal(state["model"]["a"], mean[:10].reshape(5, 2).chunk(2)[rank])
    # and back to 2 ranks: the slices written at first (the workers' mean)
    for state in out:
        state["fsdp_layout"] = states[0]["fsdp_layout"]
    back = reshard(out, Layout(1, 3), Layout(1, 2), Rules(numel=9), sharded_workers=True)
    assert len(back) == 2
    for state, want_back in zip(back, flat(mean, 2), strict=True):
        assert torch.equal(state["strategy"]["anchor"], want_back)
    # a tensor that differs between a worker's ranks and is no slice of the parameters
    odd = [{**state, "strategy": {**state["strategy"], "odd": torch.full((2,), float(rank))}}
           for rank, state in enumerate(states)]  # fmt: skip
    with pytest.raises(CheckpointError, match=r"shape \(2,\).*--ranks-per-worker 2"):
        reshard(odd, Layout(2, 2), Layout(1, 3), Rules(numel=12), sharded_workers=True)
    # a checkpoint without the layout (an older lowcomm's) is refused in one line
    for state in states:
        del state["fsdp_layout"]
    with pytest.raises(CheckpointError, match="--ranks-per-worker it was written with"):
        reshard(states, Layout(2, 2), Layout(1, 3), Rules(numel=12), sharded_workers=True)


def test_bench_elastic_sets_each_methods_period_from_its_declared_options() -> None:
    """The flag comes from the method's options class, not a list of method names."""
    from lowcomm.bench.elastic import _method_flags

    assert _method_flags("ddp", 8) == []
    assert _method_flags("streaming_diloco", 8) == ["--diloco.sync-every", "8"]
    assert _method_flags("favg_opt", 8) == ["--desloc.param-period", "8"]
    assert _method_flags("co2", 8) == ["--local.sync-every", "8"]
