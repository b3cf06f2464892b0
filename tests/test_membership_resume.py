"""--membership torchft with checkpoints: a local job of 3 worker processes stopped
(--stop-after) and resumed (--resume OUT), each worker from its own checkpoint in its own run
directory, follows the uninterrupted job bit for bit, whether it stopped at a sync round's end
or inside one (streaming's fragment in flight, DES-LOC's states on their own periods, SPARTA's
every-step rounds); every method that runs with live workers keeps checkpoints at any step; a
job whose workers' checkpoints name different steps is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from lowcomm.config import ConfigError, TrainConfig, with_options
from lowcomm.data import DataConfig
from lowcomm.membership.options import TORCHFT_METHODS, MembershipOptions
from lowcomm.models import ModelConfig
from lowcomm.strategies.co2 import LocalOptions
from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.sparta import SpartaOptions

STEPS = 12
H = 4


def _config(out: Path | None, **overrides: Any) -> TrainConfig:
    config = with_options(
        TrainConfig(
            method="diloco",
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
            data=DataConfig(micro_batch_size=2),
            diloco=DiLoCoOptions(sync_every=H),
            local=LocalOptions(sync_every=H),
            # (K_x = 2, so K_u = 6 and K_v = 12: each state syncs at its own steps.)
            desloc=DeslocOptions(param_period=2),
            sparta=SpartaOptions(sync_every=H),
        ),
        workers=3,
        steps=STEPS,
        clock="virtual",
        seconds_per_microbatch=0.01,
        eval_every=1000,
        eval_batches=2,
        progress=False,
        plot=False,
        out=None if out is None else str(out),
        log_every=1,
        membership="torchft",
        membership_options=MembershipOptions(detect_s=2.0, quorum_s=60.0, digests=True),
    )
    return with_options(config, **overrides)


def _losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {int(r["step"]): float(r["train_loss"]) for r in map(json.loads, lines)}


def _record(run: Path) -> dict[str, Any]:
    return dict(json.loads((run / "membership.json").read_text()))


def _digests(run: Path) -> dict[int, str]:
    return {int(d["step"]): str(d["sha256"]) for d in _record(run)["digests"]}


def _at(run: Path, kind: str) -> list[int]:
    """The steps of the worker's membership.json events of ``kind``."""
    return [int(e["step"]) for e in _record(run)["events"] if e["event"] == kind]


#: (method, --stop-after): at a sync round's end (8), or inside rounds: streaming's
#: fragment launched at step 5 merges at 6; DES-LOC's parameters sync every 2 steps, its
#: moments every 6 and 12.
STOPS = [("diloco", 8), ("ddp", 8), ("streaming_diloco", 6), ("desloc", 7)]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "stop"), STOPS)
def test_stopped_and_resumed_job_follows_the_uninterrupted_one(
    tmp_path: Path, method: str, stop: int
) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")
    from lowcomm.launch.run import run_training
    from lowcomm.membership.local import check_resume

    run_training(_config(tmp_path / "whole", method=method), report=None)
    job = tmp_path / "job"
    run_training(_config(job, method=method, checkpoint_every=2, stop_after=stop), report=None)
    for slot in range(3):
        latest = (job / f"worker{slot}" / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step-{stop:06d}", slot  # (each worker's own, at the stop)
        assert sorted(_losses(job / f"worker{slot}")) == list(range(stop))

    # The job's options, which `lowcomm train --resume OUT` alone continues with.
    saved = TrainConfig.from_dict(json.loads((job / "config.json").read_text()))
    assert (saved.method, saved.run.steps, saved.placement.workers) == (method, STEPS, 3)

    # A job whose workers stopped at different steps is refused, naming them.
    skewed = tmp_path / "skewed"
    shutil.copytree(job, skewed)
    earlier = (stop - 1) // 2 * 2  # (the checkpoint before the stop's, which is kept)
    shutil.rmtree(skewed / "worker2" / "checkpoints" / f"step-{stop:06d}")
    (skewed / "worker2" / "checkpoints" / "latest").write_text(f"step-{earlier:06d}\n")
    with pytest.raises(ConfigError, match=rf"different steps .*worker2 at step {earlier}\)"):
        check_resume(_config(None, method=method, resume=str(skewed)))

    run_training(_config(None, method=method, resume=str(job), checkpoint_every=2), report=None)
    for slot in range(3):
        whole, resumed = tmp_path / "whole" / f"worker{slot}", job / f"worker{slot}"
        want, got = _losses(whole), _losses(resumed)
        assert sorted(got) == list(range(STEPS)), slot
        for step in range(STEPS):
            assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), (slot, step)
        # (The resumed workers' rounds after the stop commit the same parameters; streaming's
        # workers each keep their own, mixed with the global fragments.)
        assert _digests(resumed)[STEPS - 1] == _digests(whole)[STEPS - 1], slot
        # membership.json goes on from the stopped process's: every round of the job, before
        # the stop and after, with the resume and its startup round at the stop's step, and
        # the tokens of the whole job.
        assert sorted(_digests(resumed)) == sorted(_digests(whole)), slot
        assert _at(resumed, "resumed") == [stop], slot
        assert _at(resumed, "commit") == sorted([*_at(whole, "commit"), stop]), slot
        lines = (resumed / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(STEPS)), slot
        mine, theirs = _record(resumed), _record(whole)
        assert mine["committed_tokens"] == theirs["committed_tokens"] > 0, slot
        summary = json.loads((resumed / "summary.json").read_text())
        assert summary["committed_tokens"] == theirs["committed_tokens"], slot
        # (The resumed job's first quorums assemble it: no quorum change, as in the straight job.)
        assert summary["faults"]["membership_changes"] == [], summary["faults"]
        assert mine["commits"] == theirs["commits"] + 1 and mine["dropped_rounds"] == 0, slot


@pytest.mark.parametrize("method", TORCHFT_METHODS)
def test_every_live_method_keeps_checkpoints_at_any_step(tmp_path: Path, method: str) -> None:
    # (3 and 5: off every method's sync period here.)
    _config(tmp_path, method=method, checkpoint_every=3, stop_after=5).validate()
    _config(tmp_path, method=method, resume=str(tmp_path)).validate()


def test_resume_auto_is_refused_in_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path, resume="auto")
    with pytest.raises(ConfigError, match=r"--resume auto: not with --membership torchft") as error:
        config.validate()
    assert "\n" not in str(error.value)


def _checkpoint(config: TrainConfig, directory: Path, step: int) -> None:
    """A worker's intact checkpoint of ``config`` at ``step`` in ``directory`` (its state is
    not read here: only where it is and the step it names)."""
    from lowcomm.membership.replay import without_faults
    from lowcomm.train import checkpoint

    worker = without_faults(with_options(config, out=str(directory), resume=str(directory)))
    path = checkpoint.write_rank_state(directory, step, 0, {"step": step})
    checkpoint.commit_checkpoint(
        directory, step, 1, checkpoint.fingerprint(worker), digests=[checkpoint.file_digest(path)]
    )
    # (torchft's step there, which a worker's resume takes back.)
    (checkpoint.step_directory(directory, step) / "torchft.json").write_text(
        json.dumps({"step": step, "batches_committed": 0})
    )


def test_a_resume_continues_each_slots_last_process(tmp_path: Path) -> None:
    from lowcomm.membership.local import resume_point

    job = tmp_path / "job"
    (job / "trace.txt").parent.mkdir(parents=True)
    (job / "trace.txt").write_text("step=2 worker=2 crash\nstep=3 worker=1 crash\n")
    config = _config(None, resume=str(job), faults=str(job / "trace.txt"))
    # Slot 0 ran throughout; slot 1's worker was killed and one started again, which stopped
    # with the job; slot 2's was killed (its checkpoint before that is older).
    workers = {
        "0": [{"run": str(job / "worker0"), "exit_code": 0}],
        "1": [{"run": str(job / "worker1"), "exit_code": -9},
              {"run": str(job / "worker1.1"), "exit_code": 0}],
        "2": [{"run": str(job / "worker2"), "exit_code": -9}],
    }  # fmt: skip
    (job / "membership.json").write_text(
        json.dumps({"workers": workers, "replayed": {"run_s": 9.5}})
    )
    for directory, step in (("worker0", 8), ("worker1", 2), ("worker1.1", 8), ("worker2", 2)):
        _checkpoint(config, job / directory, step)
    point = resume_point(config)
    assert point.step == 8 and point.replayed == (8, 9.5)
    assert point.dirs == {0: job / "worker0", 1: job / "worker1.1", 2: None}
    # (Slot 2's next worker, started by the trace's join, writes worker2.1.)
    assert point.first_index == {0: 0, 1: 1, 2: 1}
    # Without a trace to start slot 2 again, its older checkpoint is refused.
    with pytest.raises(ConfigError, match=r"different steps \(worker0 at step 8, worker1.1 at"):
        resume_point(_config(None, resume=str(job)))
