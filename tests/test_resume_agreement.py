"""--resume auto: the ranks agree on whether there is a checkpoint before any of them branches
(each looks at its own disk; a rank that resumed while another started afresh would wait in
collectives the other never makes). Worker threads on an in-process group."""

from __future__ import annotations

from pathlib import Path

from lowcomm.comm.inprocess import InProcessGroup
from lowcomm.config import PlacementConfig, RunConfig, TrainConfig
from lowcomm.launch.inprocess import run_threads
from lowcomm.train.checkpoint import CheckpointError
from lowcomm.train.loop import _resume_directory


def _with_checkpoint(path: Path) -> Path:
    (path / "checkpoints").mkdir(parents=True)
    (path / "checkpoints" / "latest").write_text("step-000004\n")
    return path


def _decide(dirs: list[Path]) -> list[Path | str | None]:
    """Each rank's decision, on its own disk (``dirs[rank]``); a refusal as its message."""
    config = TrainConfig(placement=PlacementConfig(workers=len(dirs)), run=RunConfig(resume="auto"))
    group = InProcessGroup(len(dirs))

    def decide(rank: int) -> Path | str | None:
        try:
            return _resume_directory(config, dirs[rank], group.comm(rank))
        except CheckpointError as refused:
            return str(refused)

    return run_threads(decide, len(dirs), (group,))


def test_ranks_that_all_see_a_checkpoint_resume_and_none_start_afresh(tmp_path: Path) -> None:
    seen = [_with_checkpoint(tmp_path / f"seen{r}") for r in range(3)]
    assert _decide(seen) == seen
    assert _decide([tmp_path / f"fresh{r}" for r in range(3)]) == [None, None, None]


def test_ranks_that_disagree_are_refused_alike(tmp_path: Path) -> None:
    """One rank's disk holds the checkpoint, the others' do not (node-local run directories):
    every rank is refused, none resumes alone."""
    dirs = [_with_checkpoint(tmp_path / "node0"), tmp_path / "node1", tmp_path / "node2"]
    decisions = _decide(dirs)
    for rank, decision in enumerate(decisions):
        assert isinstance(decision, str), (rank, decision)
        assert decision.startswith("--resume auto: ranks disagree"), decision
        assert f"rank {rank} {'sees one' if rank == 0 else 'sees none'}" in decision
