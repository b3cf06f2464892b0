"""--membership torchft: a worker SIGKILLed and started again, for the methods whose workers
differ from the diloco family's in what they hold alike (eager, cocodc), or that reset their
state or all-gather (favg_reset, sparseloco).

Each job is tests/test_membership_torchft.py's: 3 worker processes of a tiny GPT on a local
lighthouse, worker 2 killed after 10 steps and started again once the survivors' quorum has
left it out, 160 steps.

Then rounds tried again: a joiner's healing round dropped (a real kill inside it, and
torchft's healing rule scripted), a survivor whose commit alone failed (scripted), and the
weight an eager joiner takes an exchange in flight with.
"""

from __future__ import annotations

import json
import os
import signal
import time
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


def _healed(directory: Path) -> bool:
    try:
        events = json.loads((directory / "membership.json").read_text())["events"]
    except (OSError, ValueError):
        return False
    return any(e["event"] == "healed" for e in events)


@pytest.mark.slow
def test_a_joiner_whose_healing_round_is_dropped_sits_the_retry_out(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    from lowcomm.membership.local import LocalJob
    from test_membership_torchft import _config, _lines, _quorum_without_2, _record, _wait_for

    with LocalJob(_config("local_sgd", tmp_path, 160)) as job:
        job.start_all()
        _wait_for(lambda: _lines(job.worker_dir(2, 0) / "metrics.jsonl") >= 10, "10 steps")
        killed = job.kill(2)
        _wait_for(lambda: _quorum_without_2(job.worker_dir(0, 0), killed), "a new quorum")
        joiner = job.start(2)
        # Held as soon as it is healed, before its first step issues the round's collective,
        # while worker 1 is killed inside that round: the round breaks on every member. (It
        # is held for less than the heartbeat timeout: the lighthouse keeps it.)
        _wait_for(lambda: _healed(job.worker_dir(2, 1)), "the joiner's healing", poll_s=0.005)
        os.kill(joiner.pid, signal.SIGSTOP)
        job.kill(1)
        time.sleep(0.5)
        os.kill(joiner.pid, signal.SIGCONT)
        codes = job.wait(300)
    assert codes[0] == [0] and codes[2] == [-9, 0], codes
    events = _record(job.worker_dir(2, 1))["events"]
    healed = next(i for i, e in enumerate(events) if e["event"] == "healed")
    step = events[healed]["step"]
    assert [e["event"] for e in events[healed + 1 : healed + 3]] == ["dropped", "quorum"], events
    # The retry's quorum is workers 0 and 2; the joiner sits it out as it sat out the attempt:
    # worker 0 is its one participant, not the joiner with the parameters it took, stepped.
    retry = events[healed + 2]
    assert retry["members"] == [0, 2] and retry["participants"] == 1, retry
    assert any(e["event"] == "commit" and e["step"] == step for e in events), events
    mine, theirs = (_digests(_record(job.worker_dir(k, n))) for k, n in ((2, 1), (0, 0)))
    assert mine[step] == theirs[step] and mine[159] == theirs[159]


# --- a joiner whose healing round is dropped: torchft's rule, scripted ------------------------


class _Attempt:
    """One attempt of the round: the live peers' torchft step and payloads, and whether
    the collective breaks (a peer dies inside it)."""

    def __init__(self, step: int, payloads: list[float], broken: bool = False) -> None:
        self.step, self.payloads, self.broken = step, payloads, broken


class _Work:
    def wait(self) -> bool:
        return True


class _Error:
    original_exception = RuntimeError("Connection reset by peer")


class _HealingManager:
    """torchft's Manager as it treats a worker behind the others (Manager._async_quorum):
    a quorum whose highest torchft step is above this worker's heals it (the state is
    offered again at should_commit, through the load callback), it does not take part (its
    payload is zeroed, the mean divides by the others), and it then holds their step."""

    def __init__(self, script: list[_Attempt], step: int, load: Any, payload: Any = None) -> None:
        self.script, self.attempt, self.issued = script, -1, 0
        self._step, self._healing, self._pending_state_dict = step, False, None
        self.load, self.error, self.offered, self.payload = load, None, [], payload
        self.start_quorum(allow_heal=True, timeout=None)  # (the quorum of its first attempt)

    def start_quorum(self, allow_heal: bool, timeout: Any) -> None:
        self.attempt += 1
        assert self.attempt < len(self.script), "asked for a quorum the others never form"
        self.error, top = None, self.script[self.attempt].step
        self._healing = self._step < top
        if self._healing:
            payload = self.payload or {"attempt": self.attempt}
            self._pending_state_dict = {"user": {"default": payload}}
            self._step = top

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return 0

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._step = state["step"]

    def is_participating(self) -> bool:
        return not self._healing

    def num_participants(self) -> int:
        return len(self.script[self.attempt].payloads) + int(not self._healing)

    def errored(self) -> _Error | None:
        return self.error

    def allreduce(self, tensor: Any, reduce_op: Any) -> _Work:
        self.issued += 1
        attempt = self.script[self.attempt]
        if self._healing:
            tensor.zero_()
        if attempt.broken:
            self.error = _Error()
            return _Work()
        tensor.add_(sum(attempt.payloads)).div_(self.num_participants())
        return _Work()

    def wait_quorum(self) -> None:
        pass

    def should_commit(self) -> bool:
        if self._healing and self._pending_state_dict is not None:
            offered = self._pending_state_dict["user"]["default"]
            self.offered.append(offered)
            self.load(offered)  # (Manager._apply_pending_state_dict)
            self._pending_state_dict = None
        if self.error is not None:
            return False
        self._step += 1
        return True


def test_a_joiner_whose_healing_round_is_dropped_sits_the_retry_out_too() -> None:
    pytest.importorskip("torchft")
    import torch

    from lowcomm.membership.torchft_comm import _RoundHandle
    from test_membership_torchft import _fake_replica

    # Worker 2 joins the others (torchft step 5) at their round of step 7 and is healed;
    # worker 1 dies inside that round's collective; the retry's quorum is workers 0 and 2.
    replica = _fake_replica(failures=0, attempts=3)
    script = [_Attempt(5, [1.0, 3.0], broken=True), _Attempt(5, [1.0])]
    replica.manager = _HealingManager(script, step=0, load=replica._load)
    replica.slot, replica._strategy, replica._in_flight = 2, None, None
    replica._asked_as = {"step": 0, "batches_committed": 0}  # (what admit() asked with)
    replica._admitted_with = replica.manager._pending_state_dict["user"]["default"]
    replica._joined = True
    payload = torch.full((2,), 100.0)  # (its own payload: the parameters it took, stepped)
    _RoundHandle(replica, payload, "mean").wait()
    # It sat the retry out as it sat out the attempt: the mean is worker 0's alone, not
    # (1 + 100) / 2 with the parameters it took from a peer counted a second time.
    assert payload.tolist() == [1.0, 1.0]
    assert [e["event"] for e in replica.events] == ["dropped", "commit"]
    # Healed again on the retry, it kept the state of its admission (offered again at each
    # commit, applied neither time: this replica has no strategy to apply it to).
    assert len(replica.manager.offered) == 2 and replica.manager._step == 6
    assert replica.committed_tokens == 0 and not replica._joined


class _Strategy:
    """What healing asks of a strategy: the state it takes, and its own started afresh."""

    def __init__(self) -> None:
        self.took: list[dict[str, int]] = []

    def take_healing_payload(self, tensors: list[Any], counters: dict[str, int]) -> None:
        self.took.append(counters)

    def rank_state(self) -> list[Any]:
        return []

    def start_worker_state(self, *, kept: bool) -> None:
        pass


def test_a_survivor_whose_commit_alone_failed_heals_at_the_next_rounds_quorum() -> None:
    pytest.importorskip("torchft")
    from types import SimpleNamespace

    import torch

    from lowcomm.membership.torchft_comm import _RoundHandle
    from test_membership_torchft import _fake_replica

    # An overlapping method's round, launched at loop step 7 and waited at step 11, where the
    # others committed it and opened their next round; this worker's collective broke alone.
    # The retry's quorum is their round of step 11 (torchft step 6): it heals this worker.
    replica = _fake_replica(failures=0, attempts=3)
    script = [_Attempt(5, [1.0, 3.0], broken=True), _Attempt(6, [2.0, 4.0])]
    taken = {
        "tensors": [],
        "rank_tensors": [],
        "layout": None,
        "counters": {"step_index": 12},
        "loop_step": 11,
    }
    replica.manager = _HealingManager(script, step=5, load=replica._load, payload=taken)
    replica._strategy, replica._in_flight, replica._asked_as = _Strategy(), None, None
    replica._admitted_with = None
    replica.workers, replica.transport = 3, SimpleNamespace(last_receive_s=None)
    handle = _RoundHandle(replica, torch.full((2,), 100.0), "mean")
    replica.loop_step = 11
    replica.open_round()  # (step 11 opens its round: it waits for the one in flight first)
    # It took the state at once (once: the commit that offers it again leaves it), issued
    # nothing on its next round's quorum for the old round, and that quorum is its round of
    # step 11, which it sits out: it asks for no quorum of its own, a round behind.
    assert handle.done() and replica.manager.issued == 1 and replica.manager.attempt == 1
    assert replica._strategy.took == [{"step_index": 12}] and replica.take_healed_step() == 11
    assert replica.quorum().joined and not replica.manager.is_participating()
    assert [e["event"] for e in replica.events] == ["dropped", "healed"]
    payload = torch.full((2,), 100.0)
    _RoundHandle(replica, payload, "mean").wait()  # (its round of step 11)
    assert payload.tolist() == [3.0, 3.0] and replica._strategy.took == [{"step_index": 12}]
    assert [e["event"] for e in replica.events][-1] == "commit" and not replica._joined


def test_an_exchange_in_flight_heals_a_joiner_with_its_rounds_weight() -> None:
    import torch

    from _dist import tiny_gpt
    from lowcomm.strategies.eager import Eager, PendingSync
    from test_eager import CONTEXT, ScriptedComm

    # Eager's exchange in flight was launched over workers 0, 1 and 2, one of whom was healed
    # in that round and sat it out (torchft): its mean divided by 2, which the weight says.
    options = DiLoCoOptions(sync_every=2)
    sender, joiner = (Eager(tiny_gpt(), ScriptedComm([]), CONTEXT, options) for _ in range(2))
    mean, own = torch.ones(sender.globals_[0].numel()), torch.zeros(sender.globals_[0].numel())
    sender.pending[0].append(PendingSync(sender.received_exchange(mean, own), 4, (0, 1, 2), size=2))
    tensors, counters = sender.healing_payload()
    joiner.take_healing_payload(tensors, counters)
    (sync,) = joiner.pending[0]
    assert sync.members == (0, 1, 2) and sync.weight == 2
