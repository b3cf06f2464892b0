"""Several workers in one process (``--workers-per-process``): refusals, and
checkpoints that cross placements (written by worker processes, resumed by threads, and the
other way round, on the same and on another worker count). The numbers of every method in
both placements are compared in the regression tier (test_regression.py)."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from lowcomm.comm.turns import TurnStall
from lowcomm.config import ConfigError, PlacementConfig, TrainConfig
from lowcomm.data import DataConfig
from lowcomm.launch.run import run_training
from lowcomm.models import ModelConfig
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.acco import AccoOptions
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.decoupled_diloco import DecoupledOptions
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.sparseloco import SparseLoCoOptions
from lowcomm.strategies.sparta import SpartaOptions
from test_resume import tiny_config

STEPS = 6
STOP = 3
METHOD = "diloco"  # outer state, an overlapped sync and local steps: much to carry over


def _config(out: Path, *, threads: bool, workers: int = 2, **overrides: Any) -> TrainConfig:
    config = tiny_config(METHOD, out, steps=STEPS, checkpoint_every=STOP, **overrides)
    config.placement.workers = workers
    config.placement.workers_per_process = workers if threads else 1
    return config


def _steps(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_steps(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        for name in ("train_loss", "val_loss"):
            a, b = g[name], w[name]
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-6), (name, g, w)
        assert abs(g["clock_s"] - w["clock_s"]) <= 1e-9, (g, w)
        assert g["bytes_sent_per_worker"] == w["bytes_sent_per_worker"]


@pytest.mark.parametrize(
    ("workers", "per_process", "rule"),
    [
        (4, 3, "does not divide --workers 4"),
        (4, 0, "0 must be 1 or more"),
        (4, -2, "-2 must be 1 or more"),
        (4, 64, "64 is more than --workers 4; pass --workers 64 too"),
    ],
)
def test_a_placement_that_does_not_fit_is_refused_in_one_line(
    workers: int, per_process: int, rule: str
) -> None:
    config = TrainConfig(
        placement=PlacementConfig(workers=workers, workers_per_process=per_process)
    )
    with pytest.raises(ConfigError, match=rule) as caught:
        config.validate()
    assert str(caught.value).startswith("--workers-per-process: ")
    assert "\n" not in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["demo", "sparseloco", "acco"])
def test_calibrated_runs_charge_alike_in_one_process_and_in_processes(
    method: str, tmp_path: Path
) -> None:
    """The regression tier compares the placements on a declared compute cost. On the
    calibrated clock (the default) each worker is charged the elements its operations write,
    so work one process does once for its workers (a decode of an all-gather they share, a
    constant a cache keeps, a communication chain on one scheduler) must be charged to each
    as a worker process charges it. One calibration file: both placements price alike."""
    calibration = tmp_path / "calibration.json"
    steps = {}
    for threads in (False, True):
        out = tmp_path / ("threads" if threads else "processes")
        config = _config(out, threads=threads, calibration=str(calibration))
        config.method, config.comm.seconds_per_microbatch, config.run.steps = method, None, 4
        run_training(config, report=None)
        steps[threads] = _steps(out)
    assert calibration.exists()
    _same_steps(steps[True], steps[False])


@pytest.mark.slow
def test_checkpoints_cross_placements_and_worker_counts(tmp_path: Path) -> None:
    """A run stopped in worker processes continues in one process (and the other way round)
    exactly as the straight run; a checkpoint of either placement resumes on 4 workers in one
    process to the same numbers."""
    straight = tmp_path / "straight"
    run_training(_config(straight, threads=True), report=None)

    by_processes, by_threads = tmp_path / "processes", tmp_path / "threads"
    run_training(_config(by_processes, threads=False, stop_after=STOP), report=None)
    run_training(_config(by_threads, threads=True, stop_after=STOP), report=None)
    elastic = {}
    for name, out in (("processes", by_processes), ("threads", by_threads)):
        copy = tmp_path / f"{name}-on-4"
        shutil.copytree(out, copy)
        resumed = _config(copy, threads=True, workers=4)
        resumed.run.resume, resumed.run.out = str(copy), None
        run_training(resumed, report=None)
        elastic[name] = _steps(copy)
    _same_steps(elastic["processes"], elastic["threads"])

    for out, threads in ((by_processes, True), (by_threads, False)):
        resumed = _config(out, threads=threads)
        resumed.run.resume, resumed.run.out = str(out), None
        run_training(resumed, report=None)
        _same_steps(_steps(out), _steps(straight))


def _sixty_four_workers(method: str, out: Path) -> TrainConfig:
    """``method`` on 64 workers in one process, cheap enough for the slow tier (about 2 s a
    method here): a 1-block GPT 16 wide on 8 tokens, one sequence per micro-batch, 2 steps on
    the datacenter link (on wan, 64 workers' ring latency is over a second of modeled time per
    collective, which ACCO, DPU and WP fill with about 100 micro-batches a step), every
    method's period 1 or 2 so that each communicates within them."""
    config = tiny_config(method, out, steps=2, eval_every=100, eval_batches=1, network="datacenter")
    config.placement.workers = config.placement.workers_per_process = 64
    config.model = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
    config.data = DataConfig(micro_batch_size=1)
    config.local = LocalOptions(sync_every=1)
    config.diloco = DiLoCoOptions(sync_every=2, overlap_steps=0)
    config.decoupled = DecoupledOptions(sync_every=2, overlap_steps=0, fragments=1)
    config.desloc = DeslocOptions(
        param_period=1, **({"first_moment_period": 2, "second_moment_period": 2}
                           if method == "desloc" else {})
    )  # fmt: skip
    config.sparseloco = SparseLoCoOptions(sync_every=1)
    config.sparta = SpartaOptions(sync_every=1)
    config.acco = AccoOptions(dpu_warmup_steps=1)
    return config


@pytest.mark.slow  # 23 methods, 60-90 s in all on this 2-core machine
@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_every_method_trains_64_workers_in_one_process(method: str, tmp_path: Path) -> None:
    config = _sixty_four_workers(method, tmp_path / method)
    with warnings.catch_warnings():  # (every wait gives its turn away: none stalls)
        warnings.simplefilter("error", TurnStall)
        summary = run_training(config, report=None)
    assert summary is not None and math.isfinite(summary["final_val_loss"])
    assert len(_steps(tmp_path / method)) == config.run.steps
    assert summary["bytes_sent_per_worker"] > 0  # (every method communicated)


def test_a_run_in_one_process_starts_no_worker_server() -> None:
    from lowcomm.cli import _in_this_process

    assert _in_this_process(["--workers", "8", "--workers-per-process", "8"])
    assert _in_this_process(["--workers-per-process=4", "--steps", "3"])
    assert not _in_this_process(["--workers-per-process", "1"])
    assert not _in_this_process(["--workers", "8"])


def test_a_workers_copy_of_the_initial_model_is_deepcopys() -> None:
    """SharedSetup.copy_model hands deepcopy the empty containers already copied: the copy is
    still the model's deep copy (own parameters equal in value, tied weights still tied, own
    hook dicts, a hook registered on the original stays on it and a non-empty container is
    copied), and copies share nothing with each other."""
    import copy

    import torch

    from _dist import tiny_gpt
    from lowcomm.train.shared import SharedSetup

    model = tiny_gpt()
    model.lm_head.register_forward_hook(lambda *args: None)
    shared = SharedSetup(None, model, torch.get_rng_state(), None)
    first, second, reference = shared.copy_model(), shared.copy_model(), copy.deepcopy(model)
    for copied in (first, second):
        assert copied.lm_head.weight is copied.token_embedding.weight  # (tied in the GPT)
        for (name, mine), theirs in zip(copied.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr(), name
        for mine, theirs in zip(copied.modules(), model.modules(), strict=True):
            assert mine is not theirs and mine._forward_hooks is not theirs._forward_hooks
        assert len(copied.lm_head._forward_hooks) == 1  # the non-empty dict, copied
    first.token_embedding.register_forward_hook(lambda *args: None)
    assert not second.token_embedding._forward_hooks and not model.token_embedding._forward_hooks
    assert first.state_dict().keys() == reference.state_dict().keys()


def test_a_workers_copy_lays_its_parameters_out_for_its_flat_buffers() -> None:
    """SharedSetup's copy: the trainable parameters copied once, end to end, into a buffer
    the worker's first flat buffers adopt (no second copy); tied weights stay one; the shared
    model is never written; a padding the buffer has no room for, or a second flat buffer,
    copies as before."""
    import torch

    from _dist import tiny_gpt
    from lowcomm.strategies.flat import FlatBuffers, laid_out_copy

    shared = tiny_gpt()
    before = {name: t.clone() for name, t in shared.state_dict().items()}
    copy = laid_out_copy(shared, {}, room=8)
    flat = FlatBuffers(copy, pad_to=4)
    params = [p for p in copy.parameters() if p.requires_grad]
    assert params[0].data_ptr() == flat.params.data_ptr()  # adopted: the copy's own buffer
    assert flat.params.numel() == flat.padded_numel and not flat.params[flat.numel :].any()
    whole = torch.cat([p.detach().reshape(-1) for p in shared.parameters()])
    assert torch.equal(flat.params[: flat.numel], whole)
    assert copy.lm_head.weight is copy.token_embedding.weight  # (tied)
    with torch.no_grad():
        flat.params.add_(1.0)  # a worker's update reaches its model, not the shared one
    assert torch.equal(copy.lm_head.weight, shared.lm_head.weight + 1.0)
    assert all(torch.equal(t, before[name]) for name, t in shared.state_dict().items())
    again = FlatBuffers(copy)  # (a second flat buffer: its own, copied)
    assert again.params.data_ptr() != flat.params.data_ptr()
    assert torch.equal(again.params, flat.params[: flat.numel])
    wider = FlatBuffers(laid_out_copy(shared, {}, room=1), pad_to=1024)  # no room: copied
    assert torch.equal(wider.params[: wider.numel], whole)
    assert wider.params.numel() % 1024 == 0 and not wider.params[wider.numel :].any()
