"""--membership torchft: a worker SIGKILLed and started again, for the methods whose workers
differ from the diloco family's in what they hold alike (eager, cocodc), or that reset their
state or all-gather (favg_reset, sparseloco).

Each job is tests/test_membership_torchft.py's: 3 worker processes of a tiny GPT on a local
lighthouse, worker 2 killed after 10 steps and started again once the survivors' quorum has
left it out, 160 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lowcomm.strategies.desloc import DeslocOptions
from lowcomm.strategies.diloco import DiLoCoOptions
from lowcomm.strategies.sparseloco import SparseLoCoOptions
from test_membership_torchft import _digests, _kill_and_restart, _survived_and_healed

#: Per method, its options (a round every 4 steps, as the other kill tests' methods).
KILLED: dict[str, dict[str, Any]] = {
    "eager": {},
    "cocodc": {},
    "favg_reset": {"desloc": DeslocOptions(param_period=4)},
    "sparseloco": {"sparseloco": SparseLoCoOptions(sync_every=4, chunk=64, topk=4)},
}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(KILLED))
def test_a_killed_worker_started_again_heals(tmp_path: Path, method: str) -> None:
    pytest.importorskip("torchft")
    # (160 steps: the survivors train long enough alone for the joiner's process to start
    # on a loaded machine.)
    job = _kill_and_restart(method, tmp_path, steps=160, restart=True, **KILLED[method])
    survivors, joiner, healed = _survived_and_healed(job)
    step = healed["step"]
    if method == "eager":
        # Each worker keeps its own phi_m: the joiner's never equals a survivor's. It took
        # its sender's, bit for bit: phi as that member's last round left it, 4 steps back.
        theirs = [_digests(record, "global_sha256") for record in survivors]
        assert healed["global_sha256"] in (theirs[0][step - 4], theirs[1][step - 4])
        assert min(_digests(joiner)) == step + 4  # (its round settles a round later)
        assert max(_digests(joiner)) == 159
        return
    # cocodc's workers keep their local progress through a merge: they hold the global
    # parameters alike, not their own.
    key = "global_sha256" if method == "cocodc" else "sha256"
    mine = _digests(joiner, key)
    theirs = [_digests(record, key) for record in survivors]
    # Its first commit is the round it healed in (cocodc's completes tau steps later); from
    # then on it holds the survivors' bits. favg_reset's joiner started its moments afresh,
    # and the survivors reset theirs at that round: they continue alike.
    delay = DiLoCoOptions().overlap_steps if method == "cocodc" else 0
    assert min(mine) == step + delay, (step, sorted(mine))
    assert all(mine[s] == theirs[0][s] == theirs[1][s] for s in mine), (mine, theirs)
    assert max(mine) == max(theirs[0]) == max(theirs[1]) >= 156  # (the last round's)
