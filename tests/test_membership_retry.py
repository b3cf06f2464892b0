"""--membership torchft: a joiner needed for --membership.min-workers in the retry of the round
it healed in. It cannot sit the retry out (the round could never commit without it), so it
takes part with only its own steps: a gradient or pseudo-gradient it computed from the state it
took counts as any member's, and its parameters, which hold its sender's steps, count with
weight 0 in a parameter average (the mean is the others').

The first test scripts torchft's rule for such a retry; the second replays a kill on worker
processes (2 workers of a tiny GPT, both needed for a round) and checks the committed average.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lowcomm.membership.options import MembershipOptions
from test_membership_torchft import _config, _digests, _fake_replica, _record


class _Work:
    def wait(self) -> bool:
        return True


class _MinimumManager:
    """torchft's Manager for a joiner (torchft step 0) in a job whose one live peer sends
    ``peer`` and whose rounds need 2 participants (min_replica_size): the first quorum heals
    the joiner, which does not take part, so the round cannot commit; the retry asks with the
    step it was healed to, so the joiner takes part. A SUM adds the peer's payload, and a
    trailing weight of 1 to a weighted payload (the peer sends its own with it); an AVG
    divides the sum by the participants, as torchft's does."""

    def __init__(self, peer: float) -> None:
        self.peer, self._step, self._healing, self.quorums = peer, 0, False, 0
        self._pending_state_dict: dict[str, Any] | None = None
        self.start_quorum(allow_heal=True, timeout=None)

    def start_quorum(self, allow_heal: bool, timeout: Any) -> None:
        self.quorums += 1
        self._healing = self._step < 5
        if self._healing:
            self._pending_state_dict = {"user": {"default": {"attempt": self.quorums}}}
            self._step = 5

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return 0

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._step = state["step"]

    def is_participating(self) -> bool:
        return not self._healing

    def num_participants(self) -> int:
        return 1 + int(not self._healing)

    def errored(self) -> None:
        return None

    def wait_quorum(self) -> None:
        pass

    def allreduce(self, tensor: Any, reduce_op: Any) -> _Work:
        from torch.distributed import ReduceOp

        if self._healing:
            tensor.zero_()
        if reduce_op == ReduceOp.SUM:
            tensor[:-1] += self.peer
            tensor[-1] += 1.0
        else:
            tensor.add_(self.peer).div_(self.num_participants())
        return _Work()

    def should_commit(self) -> bool:
        if self._healing:
            self._pending_state_dict = None  # (offered again; the joiner keeps its own)
        if self.num_participants() < 2:
            return False
        self._step += 1
        return True


def _joiner(peer: float) -> Any:
    """A replica just admitted with a live peer's state (its admission's quorum is the
    round's first attempt), in a job of --membership.min-workers 2."""
    replica = _fake_replica(failures=0, attempts=3)
    replica.options = MembershipOptions(attempts=3, min_workers=2)
    replica.manager = _MinimumManager(peer)
    replica.slot, replica._strategy, replica._in_flight = 1, None, None
    replica._asked_as = {"step": 0, "batches_committed": 0}  # (what admit() asked with)
    replica._admitted_with = replica.manager._pending_state_dict["user"]["default"]
    replica._joined = True
    return replica


def test_a_joiner_needed_for_the_minimum_contributes_only_its_own_steps_to_the_retry() -> None:
    pytest.importorskip("torchft")
    import torch

    from lowcomm.comm.base import Role
    from lowcomm.membership.torchft_comm import TorchftComm

    # Parameters: the peer holds 1.0 after its round's steps; the joiner took them and
    # stepped once, to 1.5. The average of the retry is the peer's alone, 1.0, not
    # (1.0 + 1.5) / 2, which would count the peer's steps twice; the joiner's step is not
    # kept, nor its tokens.
    replica = _joiner(peer=1.0)
    comm = TorchftComm(replica)
    comm.start()
    parameters = torch.full((3,), 1.5)
    comm.all_reduce(parameters, op="mean", role=Role.PARAMETER).wait()
    assert parameters.tolist() == [1.0, 1.0, 1.0]
    assert [e["event"] for e in replica.events] == ["dropped", "commit"]
    assert replica.manager.quorums == 2 and replica.committed_tokens == 0
    # A pseudo-gradient: the joiner's is its own step since the state it took (theta^g
    # minus its parameters, 0.5); it counts as the peer's does: (0.25 + 0.5) / 2.
    replica = _joiner(peer=0.25)
    comm = TorchftComm(replica)
    comm.start()
    delta = torch.full((3,), 0.5)
    comm.all_reduce(delta, op="mean", role=Role.PSEUDO_GRADIENT).wait()
    assert delta.tolist() == [0.375, 0.375, 0.375]
    assert replica.committed_tokens == 32  # (its step counted)
    # The weight lasts for that round only: the joiner's next average counts its own.
    replica = _joiner(peer=1.0)
    comm = TorchftComm(replica)
    comm.start()
    comm.all_reduce(torch.full((3,), 1.5), op="mean", role=Role.PARAMETER).wait()
    replica.pending_tokens = 32
    parameters = torch.full((3,), 3.0)
    replica.open_round()
    comm.all_reduce(parameters, op="mean", role=Role.PARAMETER).wait()
    assert parameters.tolist() == [2.0, 2.0, 2.0] and replica.committed_tokens == 32


@pytest.mark.slow
def test_a_replayed_kill_whose_joiner_the_minimum_needs_averages_the_survivors_only(
    tmp_path: Path,
) -> None:
    """local_sgd (tau = 4), 2 workers, both needed for a round: a trace crashes worker 1 at
    step 2 and starts it again there. Worker 0 reaches its sync at step 3 alone; the joiner
    is healed there with worker 0's parameters (after its 4 steps) and takes step 3 itself;
    the round cannot commit while it sits out, so it is tried again with the joiner in. The
    committed average is worker 0's parameters alone (the joiner's weight 0), bit for bit
    what the joiner took: with the joiner's parameters in it, worker 0's steps would count
    twice."""
    pytest.importorskip("torchft")
    from lowcomm.launch.run import run_training

    trace = tmp_path / "trace.txt"
    trace.write_text("step=2 worker=1 crash\nstep=2 worker=1 join\n")
    options = MembershipOptions(min_workers=2, detect_s=2.0, quorum_s=240.0, digests=True)
    config = _config(
        "local_sgd", tmp_path / "run", 8, workers=2, faults=str(trace), membership_options=options
    )
    assert run_training(config, report=None) is not None
    run = tmp_path / "run"
    job = json.loads((run / "membership.json").read_text())
    codes = {slot: [p["exit_code"] for p in runs] for slot, runs in job["workers"].items()}
    assert codes == {"0": [0], "1": [-9, 0]}, codes
    joiner, survivor = _record(run / "worker1.1"), _record(run / "worker0")
    events = joiner["events"]
    healed = next(i for i, e in enumerate(events) if e["event"] == "healed")
    assert events[healed]["step"] == 3, events
    kinds = [(e["event"], e.get("participants")) for e in events[healed + 1 : healed + 4]]
    assert kinds == [("dropped", None), ("quorum", 2), ("commit", None)], events
    took = events[healed]["global_sha256"]  # (local_sgd's global: the sender's parameters)
    mine, theirs = _digests(joiner), _digests(survivor)
    assert mine[3] == theirs[3] == took
    assert mine[7] == theirs[7]
    # The joiner's step 3 did not count: its tokens commit from step 4 on (4 steps).
    per_step = config.run.microbatches_per_step * config.tokens_per_microbatch()
    assert joiner["committed_tokens"] == 4 * per_step, joiner["committed_tokens"]
