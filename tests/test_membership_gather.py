"""--membership torchft for the methods that all-gather (demo, sparseloco): the gather runs in
the torchft round, over its quorum's participants, committed or dropped with it.

The unit tests drive the round's gather (``_GatherHandle``) with a scripted Manager and group;
the others run local jobs of 3 worker processes on a torchft lighthouse (Gloo on the
loopback), as tests/test_membership_torchft.py does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lowcomm.membership.options import MembershipOptions
from lowcomm.strategies.sparseloco import SparseLoCoOptions

torch = pytest.importorskip("torch")


def _needs_torchft() -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'lowcomm[ft]')")


# --- the gather round, on a scripted Manager and group ---------------------------------------


class _Work:
    def __init__(self, broken: bool) -> None:
        self.broken = broken

    def wait(self) -> bool:
        if self.broken:  # (a peer died inside the collective)
            raise RuntimeError("Connection reset by peer\ndetails")
        return True


class _Error:
    def __init__(self, error: Exception) -> None:
        self.original_exception = error


class _Quorum:
    """One quorum of the script: its members (slots, in the group's rank order), whether this
    worker takes part (False: it is being healed), what each other member sends (its tensor
    and whether it takes part), the participants the lighthouse counts, and whether the
    collective breaks."""

    def __init__(
        self,
        members: tuple[int, ...],
        peers: dict[int, tuple[Any, bool]],
        *,
        participating: bool = True,
        participants: int | None = None,
        broken: bool = False,
    ) -> None:
        self.members = members
        self.peers = peers
        self.participating = participating
        self.broken = broken
        counted = sum(1 for _, takes_part in peers.values() if takes_part)
        self.participants = counted + int(participating) if participants is None else participants


class _Group:
    """The reconfigurable group: this worker's slot, the current quorum's members."""

    def __init__(self, slot: int, script: list[_Quorum]) -> None:
        self.slot = slot
        self.script = script
        self.attempt = 0
        self.quorum_id = 1
        self.replica_rank = script[0].members.index(slot)
        self.members = script[0].members
        self.sent: list[Any] = []

    def reconfigure(self) -> None:
        self.attempt += 1
        self.quorum_id += 1
        self.members = self.script[self.attempt].members
        self.replica_rank = self.members.index(self.slot)

    def allgather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any) -> _Work:
        quorum = self.script[self.attempt]
        rows = outputs[0]
        assert len(rows) == len(quorum.members)
        self.sent.append(inputs[0].clone())
        for rank, slot in enumerate(quorum.members):
            if slot == self.slot:
                rows[rank].copy_(inputs[0])
            else:
                data, takes_part = quorum.peers[slot]
                flag = torch.tensor([int(takes_part)], dtype=torch.uint8)
                rows[rank].copy_(torch.cat([data.reshape(-1).view(torch.uint8), flag]))
        return _Work(quorum.broken)


class _Manager:
    """torchft's Manager as the gather uses it: the quorum, errors and the commit."""

    def __init__(self, group: _Group) -> None:
        self.group = group
        self.error: _Error | None = None
        self.quorums = 0

    def _quorum(self) -> _Quorum:
        return self.group.script[self.group.attempt]

    def wait_quorum(self) -> None:
        pass

    def start_quorum(self, allow_heal: bool, timeout: Any) -> None:
        self.quorums += 1
        self.error = None
        self.group.reconfigure()

    def is_participating(self) -> bool:
        return self._quorum().participating

    def num_participants(self) -> int:
        return self._quorum().participants

    def report_error(self, error: Exception) -> None:
        self.error = _Error(error)

    def errored(self) -> _Error | None:
        return self.error

    def should_commit(self) -> bool:
        return self.error is None


def _replica(slot: int, script: list[_Quorum], attempts: int = 3) -> Any:
    from lowcomm.membership.torchft_comm import Replica, _EarlyRound

    group = _Group(slot, script)
    replica = Replica.__new__(Replica)  # (its state only: no lighthouse, no group)
    replica.options = MembershipOptions(attempts=attempts)
    replica.manager = _Manager(group)
    replica.pg = group
    replica.slot, replica.workers, replica.loop_step = slot, 3, 7
    replica.commits, replica.failed_rounds = 1, 0  # (the job's startup round committed)
    replica.events, replica.digests = [], []
    replica.on_event = None
    replica.dropped_steps, replica.step_quorum, replica.step_changes = set(), {}, {}
    replica._members = tuple(sorted(script[0].members))
    replica.pending_tokens, replica.committed_tokens = 32, 0
    replica._round_open, replica._joined, replica._last_quorum = True, False, 1
    replica._early, replica._in_flight = _EarlyRound(), None
    return replica


def _gather(replica: Any, output: Any, payload: Any) -> Any:
    from lowcomm.membership.torchft_comm import _GatherHandle

    return _GatherHandle(replica, output, payload)


def test_the_gather_keeps_the_participants_rows_in_slot_order() -> None:
    _needs_torchft()
    # Ranks in the group are not slots: worker 2 is rank 0. Worker 2 is being healed: its row
    # travels (the group holds it) but is not the gather's.
    script = [
        _Quorum(
            (2, 0, 1),
            {0: (torch.tensor([10.0, 11.0]), True), 2: (torch.tensor([99.0, 99.0]), False)},
        )
    ]
    replica = _replica(1, script)
    output = torch.empty(4)  # (2 participants x 2)
    _gather(replica, output, torch.tensor([1.5, 2.5])).wait()
    assert output.tolist() == [10.0, 11.0, 1.5, 2.5]
    assert [e["event"] for e in replica.events] == ["commit"]
    assert replica.commits == 2 and replica.committed_tokens == 32
    # What went on the wire: this worker's bytes and its flag (it takes part).
    assert replica.pg.sent[0][-1].item() == 1 and replica.pg.sent[0].numel() == 2 * 4 + 1


def test_a_healing_worker_receives_the_others_rows_but_its_own_does_not_count() -> None:
    _needs_torchft()
    script = [
        _Quorum(
            (0, 1, 2),
            {0: (torch.tensor([1, 2], dtype=torch.int32), True),
             1: (torch.tensor([3, 4], dtype=torch.int32), True)},
            participating=False,
        )
    ]  # fmt: skip
    replica = _replica(2, script)
    output = torch.empty(4, dtype=torch.int32)
    _gather(replica, output, torch.tensor([7, 7], dtype=torch.int32)).wait()
    assert output.tolist() == [1, 2, 3, 4]  # (the healer's own [7, 7] left out)
    assert replica.pg.sent[0][-1].item() == 0
    # The round committed, but none of the healer's own tokens (it sat the round out).
    assert replica.commits == 2 and replica.committed_tokens == 0


def test_a_dropped_gather_is_tried_again_from_its_input_on_the_new_quorum() -> None:
    _needs_torchft()
    # Worker 2 dies inside the first gather; the second quorum is workers 0 and 1 alone.
    payload = torch.tensor([5, 6, 7], dtype=torch.uint8)
    script = [
        _Quorum(
            (0, 1, 2),
            {1: (torch.tensor([1, 1, 1], dtype=torch.uint8), True),
             2: (torch.tensor([2, 2, 2], dtype=torch.uint8), True)},
            broken=True,
        ),
        _Quorum((0, 1), {1: (torch.tensor([3, 3, 3], dtype=torch.uint8), True)}),
    ]  # fmt: skip
    replica = _replica(0, script)
    output = torch.empty(9, dtype=torch.uint8)
    handle = _gather(replica, output, payload)
    payload.fill_(0)  # (the caller's tensor may change: the retry resends the saved input)
    handle.wait()
    # The output follows the committed quorum: 2 rows, not the 3 it was made for.
    assert output.tolist() == [5, 6, 7, 3, 3, 3]
    assert [e["event"] for e in replica.events] == ["dropped", "quorum", "commit"]
    assert replica.failed_rounds == 1 and replica.commits == 2 and replica.manager.quorums == 1
    assert replica.committed_tokens == 32 and replica.dropped_steps == {7}
    assert replica.step_changes == {7: [{"worker": 2, "kind": "crash"}]}


def test_rows_that_disagree_with_the_quorums_participants_never_commit() -> None:
    _needs_torchft()
    from lowcomm.membership.torchft_comm import RoundFailed

    # The lighthouse counts 2 participants, but 3 rows say they take part.
    script = [
        _Quorum(
            (0, 1, 2),
            {1: (torch.tensor([1.0]), True), 2: (torch.tensor([2.0]), True)},
            participants=2,
        )
    ]
    replica = _replica(0, script, attempts=1)
    output = torch.zeros(2)
    with pytest.raises(RoundFailed, match=r"step 7 did not commit in 1 attempts .*3 rows flagged"):
        _gather(replica, output, torch.tensor([4.0])).wait()
    assert replica.commits == 1 and output.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("method", ["demo", "sparseloco"])
def test_gathering_methods_are_not_refused(method: str) -> None:
    from lowcomm.config import TrainConfig, with_options
    from lowcomm.membership.options import membership_refusal

    assert (
        membership_refusal(with_options(TrainConfig(method=method), membership="torchft")) is None
    )


# --- local jobs --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", ["demo", "sparseloco"])
def test_no_fault_gathering_methods_follow_the_static_trajectory(
    tmp_path: Path, method: str
) -> None:
    _needs_torchft()
    from test_membership_torchft import _digests, _follows_static

    common: dict[str, Any] = {}
    if method == "sparseloco":
        common["sparseloco"] = SparseLoCoOptions(sync_every=4, chunk=64, topk=4)
    # (The static run's workers are threads of one process: the same numbers, no spawn.)
    records = _follows_static(
        method, tmp_path, steps=8, static_only={"workers_per_process": 3}, **common
    )
    # Every worker decoded the same gathered rows: the same parameters after every round.
    digests = [_digests(record) for record in records]
    rounds = list(range(8)) if method == "demo" else [3, 7]
    assert digests[0] == digests[1] == digests[2] and sorted(digests[0]) == rounds


@pytest.mark.slow
def test_demo_survives_a_kill_and_heals_a_restarted_worker(tmp_path: Path) -> None:
    _needs_torchft()
    from test_membership_torchft import _digests, _kill_and_restart, _record

    # (160 steps: the survivors train long enough alone for the joiner's process to start
    # on a loaded machine.)
    job = _kill_and_restart("demo", tmp_path, steps=160, restart=True)
    codes, dirs = job["codes"], job["dirs"]
    assert codes[0] == [0] and codes[1] == [0], codes  # the survivors finish
    assert codes[2][0] == -9 and codes[2][1] == 0, codes  # killed, then the joiner finishes
    survivors = [_record(dirs[(0, 0)]), _record(dirs[(1, 0)])]
    joiner = _record(dirs[(2, 1)])
    healed = [e for e in joiner["events"] if e["event"] == "healed"]
    assert len(healed) == 1 and healed[0]["bytes"] > 0, joiner["events"]
    for record in survivors:
        after = [
            e for e in record["events"] if e["event"] == "quorum" and e["time"] > job["killed"]
        ]
        # The dead worker is out at a later quorum, the joiner in at the last one.
        assert any(e["members"] == [0, 1] for e in after), after
        assert after[-1]["members"] == [0, 1, 2], after
    # It sat out the round it healed in: 2 workers' rows were gathered, not 3.
    first_quorum = next(e for e in joiner["events"] if e["event"] == "quorum")
    assert first_quorum["participants"] == 2, first_quorum
    mine, theirs = _digests(joiner), _digests(survivors[0])
    first = min(mine)
    assert first == healed[0]["step"]  # (the step it healed in, and sat out)
    # After that round its parameters equal the others', bit for bit, and stay so.
    assert mine[first] == theirs[first] == _digests(survivors[1])[first]
    assert mine[159] == theirs[159] == _digests(survivors[1])[159]
    assert joiner["data_position"] == survivors[0]["data_position"] == 160
