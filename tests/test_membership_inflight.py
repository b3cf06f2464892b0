"""--membership torchft with --ranks-per-worker 2: a joiner healed with an exchange in flight
(eager, diloco_delayed), whose mean each rank of a live worker reduces over the workers in
its own slice, the mean being whole once the worker's ranks have gathered it.

Each job is tests/test_membership_ranks.py's: 3 workers of 2 ranks of a tiny GPT on a local
lighthouse, worker 2's group SIGKILLed after 10 steps and started again, 160 steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from test_membership_ranks import _kill_and_restart_worker_2, _ranks_config
from test_membership_torchft import _digests, _needs_torchft, _record

#: Each rank's membership record, rank 0's and rank 1's.
RANK_RECORDS = ("membership.json", "membership.rank1.json")


def _restarted(method: str, out: Path, **overrides: Any) -> list[dict[str, Any]]:
    """Per rank: the joiner's healed event and record, and the survivors' records of the same
    rank, after worker 2's group is killed and started again. Each joining rank assembled
    the whole declared state (its slice from the same rank of a live worker, the others
    from its own group's ranks) bit for bit as its sender held it: global state, and every
    exchange in flight as the sender's worker applies it."""
    _kill_and_restart_worker_2(_ranks_config(method, out, steps=160, workers=3, **overrides))
    joiner = out / "worker2.1"
    ranks = []
    for name in RANK_RECORDS:
        mine = json.loads((joiner / name).read_text())
        healed = [e for e in mine["events"] if e["event"] == "healed"]
        assert len(healed) == 1 and healed[0]["bytes"] > 0, mine["events"]
        assert healed[0]["took_sha256"] is not None
        assert healed[0]["took_sha256"] == healed[0]["sent_sha256"], (name, healed[0])
        survivors = [json.loads((out / f"worker{k}" / name).read_text()) for k in (0, 1)]
        ranks.append({"healed": healed[0], "joiner": mine, "survivors": survivors})
    assert _record(joiner)["data_position"] == _record(out / "worker0")["data_position"] == 160
    return ranks


@pytest.mark.slow
def test_a_diloco_delayed_joiner_of_two_ranks_applies_the_whole_mean_in_flight(
    tmp_path: Path,
) -> None:
    """diloco_delayed's workers restart each round from the same phi, which applies the mean
    of the exchange launched a round before: a joiner healed with that mean partly reduced
    (a slice of it from a rank that had not yet gathered it from its worker's other rank)
    applies another outer step and holds other bits from then on."""
    _needs_torchft()
    for rank in _restarted("diloco_delayed", tmp_path):
        step = rank["healed"]["step"]
        mine = _digests(rank["joiner"])
        theirs = [_digests(record) for record in rank["survivors"]]
        assert min(mine) == step + 4  # (its round settles a round later)
        assert all(mine[s] == theirs[0][s] == theirs[1][s] for s in mine), (step, mine, theirs)
        assert max(mine) == 159
