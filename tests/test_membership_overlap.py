"""--membership torchft with the methods whose outer all-reduce overlaps inner steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_membership_torchft import (
    _digests,
    _follows_static,
    _kill_and_restart,
    _survived_and_healed,
)

#: The methods whose outer all-reduce flies across inner steps, and favg_reset.
OVERLAP_METHODS = ("co2", "eager", "diloco_delayed", "cocodc", "favg_reset")


@pytest.mark.slow
@pytest.mark.parametrize("method", OVERLAP_METHODS)
def test_no_fault_follows_the_static_trajectory(tmp_path: Path, method: str) -> None:
    pytest.importorskip("torchft")
    _follows_static(method, tmp_path, steps=12)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["co2", "diloco_delayed"])
def test_overlapping_methods_survive_a_kill_and_heal_a_restarted_worker(
    tmp_path: Path, method: str
) -> None:
    pytest.importorskip("torchft")
    # (160 steps: the survivors train long enough alone for the joiner's process to start
    # on a loaded machine.)
    job = _kill_and_restart(method, tmp_path, steps=160, restart=True)
    survivors, joiner, healed = _survived_and_healed(job)
    dirs = job["dirs"]
    # An exchange whose launch quorum lost the killed worker before it was applied is
    # discarded on every survivor, as in simulation (its mean takes no outer step).
    dropped = [
        {
            row["step"]
            for row in map(json.loads, (dirs[(k, 0)] / "metrics.jsonl").read_text().splitlines())
            if row.get("extras", {}).get("syncs_dropped")
        }
        for k in (0, 1)
    ]
    assert dropped[0] == dropped[1] and dropped[0], dropped
    mine, theirs, other = (_digests(r) for r in (joiner, *survivors))
    # Its first commit is the round it healed in, settled at the next round's end (the
    # all-reduce flies a whole round). Every worker restarts each round from the same
    # parameters (co2's anchor with the shared displacement, diloco_delayed's phi, healed
    # with the exchange in flight), so from then on the joiner holds the others' bit for bit.
    assert min(mine) == healed["step"] + 4
    assert all(mine[s] == theirs[s] == other[s] for s in mine), (mine, theirs)
    assert max(mine) == 159
