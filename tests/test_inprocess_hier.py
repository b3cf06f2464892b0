"""Hierarchical workers (several ranks each) as rank threads, in one process and in P
processes of K workers; what cannot share a process, refused in one line; and K workers' device
memory on one GPU, estimated and refused before any starts (the device queries are stand-ins
here, there is no GPU: benchmarks/gpu_inprocess_check.py runs it on one).

The numbers of hierarchical runs in one process against worker processes are checked by the
regression tier (test_regression.py: the pinned 2 workers x 2 ranks runs of ddp, diloco and
streaming_diloco, made by four worker processes, rerun with their four ranks as threads); the
built-in GPT's dropout there too (ddp_dropout, each worker's masks from its own generator)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lowcomm.comm.base import Role
from lowcomm.config import ConfigError, PlacementConfig, TrainConfig, with_options
from lowcomm.launch import device_memory
from lowcomm.launch.device_memory import (
    HOST_SLACK,
    amount,
    available_host_bytes,
    check_device_memory,
    check_host_memory,
    estimate_worker_memory,
    measure_saved_bytes,
)
from lowcomm.launch.groups import worker_layout
from lowcomm.launch.inprocess import RankThreads, check_shared
from lowcomm.launch.run import run_training
from lowcomm.train.shared import SharedSetup
from test_resume import tiny_config

# --- the layout of rank threads ---------------------------------------------------------------


def test_rank_threads_follow_the_hierarchical_layout() -> None:
    """Thread g is global rank g: rank g % R of worker g // R, its replica group its worker's
    R threads and its outer group the threads of local rank g % R (worker_layout's groups)."""
    workers, ranks = 3, 2
    threads = RankThreads.in_process(workers, ranks, timeout_s=None)
    assert threads.count == workers * ranks
    replica_groups, outer_groups = worker_layout(workers * ranks, ranks)
    for g in range(threads.count):
        raw, books = threads.raw(g), threads.books(g)
        assert (raw.rank, raw.world_size, books.rank, books.world_size) == (g, 6, g, 6)
        levels = threads.levels(g)
        assert levels is not None
        replica, outer = levels
        assert (replica.rank, replica.world_size) == (g % ranks, ranks)
        assert (outer.rank, outer.world_size) == (g // ranks, workers)
        assert replica_groups[g // ranks][replica.rank] == g
        assert outer_groups[g % ranks][outer.rank] == g
    flat = RankThreads.in_process(workers, 1, timeout_s=None)
    assert flat.count == workers and flat.levels(0) is None


def test_rank_threads_reduce_over_their_own_levels() -> None:
    """A sum over each level, every thread posting at once, gives each group's own sum."""
    import threading

    threads = RankThreads.in_process(2, 2, timeout_s=30.0)
    results: dict[int, tuple[float, float]] = {}

    def run(g: int) -> None:
        levels = threads.levels(g)
        assert levels is not None
        inner, outer = torch.tensor([float(g)]), torch.tensor([float(g)])
        levels[0].all_reduce(inner, op="sum", role=Role.OTHER).wait()
        levels[1].all_reduce(outer, op="sum", role=Role.OTHER).wait()
        results[g] = (float(inner), float(outer))

    workers = [threading.Thread(target=run, args=(g,)) for g in range(threads.count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    # replicas {0, 1} and {2, 3}; outer groups {0, 2} and {1, 3}
    assert results == {0: (1, 2), 1: (1, 4), 2: (5, 2), 3: (5, 4)}


# --- refusals ---------------------------------------------------------------------------------


def _config(**overrides: Any) -> TrainConfig:
    config = TrainConfig(placement=PlacementConfig(workers=4, workers_per_process=4))
    config = with_options(config, **overrides)
    return config


def test_hierarchical_workers_gpt_dropout_and_one_gpu_are_accepted() -> None:
    _config(ranks_per_worker=2).validate()
    _config(workers_per_process=2, ranks_per_worker=2).validate()  # 2 processes x 2 x 2
    dropout = _config()
    dropout.model.dropout = 0.1
    dropout.validate()
    _config(device="cuda").validate()


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (
            {"ranks_per_worker": 2, "worker_sharding": "fsdp"},
            "FSDP's collectives need torch.distributed process groups",
        ),
        ({"device": "cuda", "workers_per_process": 2}, "2 processes of 2 workers"),
    ],
)
def test_what_still_cannot_share_a_process_is_refused_in_one_line(
    overrides: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ConfigError, match=reason) as caught:
        _config(**overrides).validate()
    message = str(caught.value)
    assert message.startswith("--workers-per-process: ") and "\n" not in message
    assert "use --workers-per-process" in message


def test_transformers_dropout_is_refused_in_one_line() -> None:
    config = _config()
    config.model.family, config.model.dropout = "hf-gpt2", 0.1
    with pytest.raises(ConfigError, match="transformers' dropout draws from the process-global"):
        config.validate()


def _shared(model: nn.Module) -> SharedSetup:
    return SharedSetup(corpus=None, model=model, rng_state=torch.get_rng_state(), validation=None)


def test_a_built_model_whose_dropout_uses_the_global_generator_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model of a config file or --init-from is only known once built: its torch dropout
    modules (a transformers model's) would share the process's generator."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    with pytest.raises(ConfigError, match=r"\(1: Dropout\(p=0.1\)\)") as caught:
        check_shared(_config(), _shared(model), None, torch.device("cpu"))
    assert "\n" not in str(caught.value)
    # (the host's memory unknown: no estimate, which would run the corpus's batch through it)
    monkeypatch.setattr(device_memory, "available_host_bytes", lambda: None)
    check_shared(_config(), _shared(nn.Sequential(nn.Dropout(0.0))), None, torch.device("cpu"))


# --- device memory (the GPU's queries are stand-ins) ------------------------------------------


def test_worker_memory_follows_the_plans_model_in_float32() -> None:
    """Parameters, gradients and the method's copies in float32, the plan's 12 optimizer bytes
    per parameter (sharded over the workers for zero1, the moments over a worker's ranks for
    ddp), plus the measured activations."""
    ddp = estimate_worker_memory(_config(method="ddp"), 1000, 500)
    assert (ddp.parameters, ddp.gradients, ddp.optimizer, ddp.method_state) == (4e3, 4e3, 12e3, 0)
    assert ddp.total == 4e3 + 4e3 + 12e3 + 500
    assert estimate_worker_memory(_config(method="zero1"), 1000, 0).optimizer == 12e3 / 4
    assert estimate_worker_memory(_config(method="diloco"), 1000, 0).method_state == 8e3
    hierarchical = estimate_worker_memory(_config(method="ddp", ranks_per_worker=2), 1000, 0)
    assert hierarchical.optimizer == pytest.approx(12e3 * (1 / 3 + 1 / 3))


def _gpt(config: TrainConfig) -> nn.Module:
    from lowcomm.models import build_model

    return build_model(config.model, vocab_size=64)


def test_workers_that_do_not_fit_the_gpu_are_refused_with_the_estimate() -> None:
    config = _config(method="diloco", device="cuda", workers=8, workers_per_process=8)
    model = _gpt(config)
    parameters = sum(p.numel() for p in model.parameters())
    activations = 3 * 2**20
    each = (4 + 4 + 12 + 8) * parameters + activations  # diloco: two extra copies
    measured: list[bool] = []

    def measure(model: nn.Module, loss: Any, device: torch.device, bf16: bool) -> int:
        measured.append(bf16)
        return activations

    def check(free: float) -> Any:
        return check_device_memory(
            config, model, lambda m: torch.zeros(()), torch.device("cpu"),
            free_bytes=lambda device: free, measure=measure,
        )  # fmt: skip

    assert check(8 * each).total == each  # fits exactly
    with pytest.raises(ConfigError) as caught:
        check(3.5 * each)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("--workers-per-process: 8 workers on cpu need about ")
    assert f"{amount(8 * each)} ({amount(each)} each: parameters" in message
    assert f"but {amount(3.5 * each)} are free" in message
    assert "at most 3 workers fit: pass --workers 3 --workers-per-process 3" in message
    assert "or --micro-batch-size" in message  # (an option that exists)
    with pytest.raises(ConfigError, match="not one worker fits"):
        check(0.5 * each)
    hierarchical = _config(device="cuda", ranks_per_worker=2)  # 4 workers x 2 rank threads
    with pytest.raises(ConfigError, match="at most 1 workers fit") as caught:
        check_device_memory(
            hierarchical, model, lambda m: torch.zeros(()), torch.device("cpu"),
            free_bytes=lambda device: 3 * estimate_worker_memory(
                hierarchical, parameters, activations
            ).total, measure=measure,
        )  # fmt: skip
    assert " per rank, 2 ranks per worker: parameters" in str(caught.value)
    assert measured[0] is False


# --- host memory (CPU workers) ----------------------------------------------------------------


def test_amounts_read_in_mib_under_a_gib() -> None:
    assert amount(3 * 2**20) == "3.0 MiB"
    assert amount(1.5 * 2**30) == "1.50 GiB"


def test_a_forward_saves_its_activations_not_the_parameters_and_leaves_no_trace() -> None:
    """Linear(8, 16), ReLU, Linear(16, 4) on 5 rows: the first layer saves its input (5 x 8
    floats), the ReLU its output (5 x 16), which the second layer saves again (one storage,
    counted once); the weights are the model's. The generator and the gradients are left as
    they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    rows = torch.randn(5, 8)
    state = torch.get_rng_state()
    saved = measure_saved_bytes(model, lambda m: m(rows).sum(), torch.device("cpu"), False)
    assert saved == 4 * (5 * 8 + 5 * 16)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(parameter.grad is None for parameter in model.parameters())
    dropped = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    state = torch.get_rng_state()
    measure_saved_bytes(dropped, lambda m: m(rows).sum(), torch.device("cpu"), False)
    assert torch.equal(torch.get_rng_state(), state)  # (its masks drew, and were given back)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_free_host_memory_is_the_kernels_or_less_under_a_cgroup_limit(tmp_path: Path) -> None:
    meminfo = {"proc/meminfo": "MemTotal: 32000000 kB\nMemAvailable:   20000000 kB\n"}
    assert available_host_bytes(_tree(tmp_path / "plain", meminfo)) == 20000000 * 1024
    v2 = {
        **meminfo, "proc/self/cgroup": "0::/job\n",
        "sys/fs/cgroup/job/memory.max": "8000000000\n",
        "sys/fs/cgroup/job/memory.current": "3000000000\n",
        "sys/fs/cgroup/job/memory.stat": "anon 1\ninactive_file 500000000\nactive_file 9\n",
    }  # fmt: skip
    assert available_host_bytes(_tree(tmp_path / "v2", v2)) == 8e9 - 3e9 + 5e8
    unlimited = {**v2, "sys/fs/cgroup/job/memory.max": "max\n"}
    assert available_host_bytes(_tree(tmp_path / "max", unlimited)) == 20000000 * 1024
    v1 = {
        **meminfo, "proc/self/cgroup": "4:memory:/\n2:cpu,cpuacct:/\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "4000000000\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": "1000000000\n",
        "sys/fs/cgroup/memory/memory.stat": "total_inactive_file 0\n",
    }  # fmt: skip
    assert available_host_bytes(_tree(tmp_path / "v1", v1)) == 3e9
    v1_unlimited = {**v1, "sys/fs/cgroup/memory/memory.limit_in_bytes": str(2**63 - 4096)}
    assert available_host_bytes(_tree(tmp_path / "v1max", v1_unlimited)) == 20000000 * 1024
    assert available_host_bytes(tmp_path / "nothing") is None  # (not Linux)


def test_cpu_workers_that_do_not_fit_the_host_are_refused_with_the_estimate() -> None:
    """K workers on the CPU, alone or in P processes of one machine: the estimate is the
    device's plus a worker's slack, each process checks for all of them, and the check is
    skipped where the free memory is unknown."""
    config = _config(method="ddp", workers=8, workers_per_process=4)  # 2 processes x 4
    model = _gpt(config)
    parameters = sum(p.numel() for p in model.parameters())
    activations = 2**20
    each = (4 + 4 + 12) * parameters + activations + HOST_SLACK

    def check(free: float | None, processes: int = 2) -> Any:
        return check_host_memory(
            config, model, lambda m: torch.zeros(()), processes=processes,
            free_bytes=lambda: free, measure=lambda *args: activations,
        )  # fmt: skip

    estimate, free = check(8 * each)
    assert (estimate.total, free) == (each, 8 * each)
    assert check(4 * each, processes=1) is not None  # one process of 4 fits in 4
    with pytest.raises(ConfigError) as caught:
        check(6.5 * each)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"--workers-per-process: 8 workers on cpu in 2 processes of this machine need about "
        f"{amount(8 * each)} ({amount(each)} each: parameters"
    )
    assert f"the rest of a worker {amount(HOST_SLACK)}) but {amount(6.5 * each)} are free" in (
        message
    )
    assert "at most 3 workers per process fit: pass --workers-per-process 3" in message
    assert check(None) is None  # unknown: nothing measured, nothing refused


def test_a_run_whose_cpu_workers_do_not_fit_stops_before_they_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The estimate is printed when the workers fit; when the machine reports less free memory
    than they need, the run is refused in one line before any worker starts."""
    from lowcomm.launch.inprocess import train_in_process

    config = tiny_config("ddp", tmp_path / "fits", steps=1)
    config.placement.workers_per_process = config.placement.workers
    train_in_process(config)
    printed = capsys.readouterr().out
    assert f"lowcomm: {config.placement.workers} workers on cpu: about " in printed
    assert " free" in printed.split("workers on cpu:")[1].splitlines()[0]
    monkeypatch.setattr(device_memory, "available_host_bytes", lambda: 2.0**20)
    refused = tiny_config("ddp", tmp_path / "refused", steps=1)
    refused.placement.workers_per_process = refused.placement.workers
    with pytest.raises(ConfigError, match=r"but 1\.0 MiB are free; not one worker fits"):
        train_in_process(refused)
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


# --- P processes of K hierarchical workers ----------------------------------------------------

STEPS = 4


def _hier(out: Path, per_process: int) -> TrainConfig:
    config = tiny_config("diloco", out, steps=STEPS, eval_every=2)
    config.placement.workers, config.placement.ranks_per_worker = 4, 2
    config.placement.workers_per_process = per_process
    config.comm.speed_factors = (1.0, 1.5, 1.0, 2.0)  # the clock must follow the worker
    return config


def _steps(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_of_hierarchical_workers_stop_and_resume_in_one_process(
    tmp_path: Path,
) -> None:
    """4 workers x 2 ranks: a run in 2 processes of 2 workers (8 rank threads, the outer
    groups stacked on Gloo) stopped at a checkpoint continues with the 8 ranks in one process,
    to the numbers of the straight run in one process."""
    straight = tmp_path / "straight"
    summary = run_training(_hier(straight, 4), report=None)
    stopped = _hier(tmp_path / "stopped", 2)
    stopped.run.checkpoint_every = stopped.run.stop_after = 2
    run_training(stopped, report=None)
    resumed = _hier(tmp_path / "stopped", 4)
    resumed.run.resume, resumed.run.out = str(tmp_path / "stopped"), None
    again = run_training(resumed, report=None)
    got, want = _steps(tmp_path / "stopped"), _steps(straight)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(STEPS))
    for g, w in zip(got, want, strict=True):
        for name in ("train_loss", "val_loss"):
            a, b = g[name], w[name]
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-6), (name, g, w)
        assert abs(g["clock_s"] - w["clock_s"]) <= 1e-9, (g, w)
        assert g["bytes_sent_per_worker"] == w["bytes_sent_per_worker"]
    assert summary is not None and again is not None
    assert math.isclose(again["final_val_loss"], summary["final_val_loss"], rel_tol=1e-6)
    for level in ("inner", "outer"):
        assert (
            again["levels"][level]["bytes_sent_per_rank"]
            == summary["levels"][level]["bytes_sent_per_rank"]
        )
