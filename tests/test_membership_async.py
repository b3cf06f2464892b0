"""--membership torchft: a method that syncs every H steps asks for its sync's quorum at the
start of the step whose end syncs, so the quorum forms while that step computes.

membership.json's commit events say, for each round, when its quorum was asked for
(``asked``, at loop step ``asked_step``) and when the worker reached the round (``entered``:
the strategy entered it or issued its collective). A round opened early was asked for before
the worker reached it; a round opened at the sync, after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from test_membership_torchft import _digests, _follows_static, _kill_and_restart, _record


def _needs_torchft() -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")


def _commits(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The worker's committed rounds of its training loop (the startup round left out), by
    loop step."""
    return {
        int(e["step"]): e
        for e in record["events"]
        if e["event"] == "commit" and e.get("entered") is not None
    }


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco"])
def test_a_sync_quorum_is_asked_for_in_the_step_that_ends_in_it(
    tmp_path: Path, method: str
) -> None:
    _needs_torchft()
    # With no fault the trajectory is the static run's.
    records = _follows_static(method, tmp_path, steps=16)
    assert _digests(records[0]) == _digests(records[1]) == _digests(records[2])
    for record in records:
        commits = _commits(record)
        assert sorted(commits) == [3, 7, 11, 15], commits
        # The first two syncs give the period: their quorums are asked for at the sync.
        for step in (3, 7):
            assert commits[step]["asked"] >= commits[step]["entered"], commits[step]
        # From the third on, at the start of the sync's own step (not earlier: a joiner
        # asking meanwhile is in this quorum), before the worker reaches the sync.
        for step in (11, 15):
            assert commits[step]["asked_step"] == step, commits[step]
            assert commits[step]["asked"] < commits[step]["entered"], commits[step]


@pytest.mark.slow
def test_diloco_heals_bit_for_bit_at_a_quorum_asked_for_early(tmp_path: Path) -> None:
    _needs_torchft()
    job = _kill_and_restart("diloco", tmp_path, steps=160, restart=True)
    codes, dirs = job["codes"], job["dirs"]
    assert codes[0] == [0] and codes[1] == [0] and codes[2] == [-9, 0], codes
    survivors = [_record(dirs[(0, 0)]), _record(dirs[(1, 0)])]
    joiner = _record(dirs[(2, 1)])
    healed = [e for e in joiner["events"] if e["event"] == "healed"]
    assert len(healed) == 1 and healed[0]["bytes"] > 0, joiner["events"]
    step = int(healed[0]["step"])
    for record in survivors:
        # The survivors asked for the quorum the joiner healed at before they reached that
        # sync: the state they sent is the sync's, read once they reached it.
        commit = _commits(record)[step]
        assert commit["asked_step"] == step and commit["asked"] < commit["entered"], commit
    mine, theirs = _digests(joiner), _digests(survivors[0])
    assert min(mine) == step  # (the sync it healed in, and sat out)
    for s in mine:
        assert mine[s] == theirs[s] == _digests(survivors[1])[s], s
    assert max(mine) == 159
