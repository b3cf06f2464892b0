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

from test_membership_ranks import (
    ON_THE_CLOCK,
    _follow_the_static_losses,
    _kill_and_restart_worker_2,
    _ranks_config,
    _static_losses,
)
from test_membership_torchft import _digests, _needs_torchft, _record

#: Each rank's membership record, rank 0's and rank 1's.
RANK_RECORDS = ("membership.json", "membership.rank1.json")


def _restarted(
    method: str, out: Path, *, same_sender: bool = True, **overrides: Any
) -> list[dict[str, Any]]:
    """Per rank: the joiner's healed event and record, and the survivors' records of the same
    rank, after worker 2's group is killed and started again. With ``same_sender`` (a method
    whose workers hold the same global state), each joining rank assembled the whole
    declared state (its slice from the same rank of a live worker, the others from its own
    group's ranks) bit for bit as its sender held it: global state, and every exchange in
    flight as the sender's worker applies it."""
    _kill_and_restart_worker_2(_ranks_config(method, out, steps=160, workers=3, **overrides))
    joiner = out / "worker2.1"
    ranks = []
    for name in RANK_RECORDS:
        mine = json.loads((joiner / name).read_text())
        healed = [e for e in mine["events"] if e["event"] == "healed"]
        assert len(healed) == 1 and healed[0]["bytes"] > 0, mine["events"]
        assert healed[0]["took_sha256"] is not None
        if same_sender:
            assert healed[0]["took_sha256"] == healed[0]["sent_sha256"], (name, healed[0])
        survivors = [json.loads((out / f"worker{k}" / name).read_text()) for k in (0, 1)]
        ranks.append({"healed": healed[0], "joiner": mine, "survivors": survivors})
    assert _record(joiner)["data_position"] == _record(out / "worker0")["data_position"] == 160
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "dtype"), [("eager", "fp32"), ("diloco_delayed", "fp32"), ("eager", "bf16")]
)
def test_no_fault_an_exchange_in_flight_on_groups_of_two_ranks_follows_the_static_trajectory(
    tmp_path: Path, method: str, dtype: str
) -> None:
    """The gather of each exchange in flight before a quorum (data only) changes no numbers:
    8 steps of 2 workers of 2 ranks on the virtual clock give the static run's losses."""
    _needs_torchft()
    from lowcomm.launch.run import run_training

    def config(method: str, out: Path, **overrides: Any) -> Any:
        return _ranks_config(method, out, comm_dtype=dtype, **overrides)

    expected = _static_losses(config, method, tmp_path / "static")
    live = tmp_path / "torchft"
    run_training(config(method, live, **ON_THE_CLOCK), report=None)
    _follow_the_static_losses(expected, live)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.long)])
def test_a_diloco_delayed_joiner_of_two_ranks_applies_the_whole_mean_in_flight(
    tmp_path: Path, dtype: str
) -> None:
    """diloco_delayed's workers restart each round from the same phi, which applies the mean
    of the exchange launched a round before: a joiner healed with that mean partly reduced
    (a slice of it from a rank that had not yet gathered it from its worker's other rank;
    in bf16, not yet cast back) applies another outer step and holds other bits from then
    on."""
    _needs_torchft()
    for rank in _restarted("diloco_delayed", tmp_path, comm_dtype=dtype):
        step = rank["healed"]["step"]
        mine = _digests(rank["joiner"])
        theirs = [_digests(record) for record in rank["survivors"]]
        assert min(mine) == step + 4  # (its round settles a round later)
        assert all(mine[s] == theirs[0][s] == theirs[1][s] for s in mine), (step, mine, theirs)
        assert max(mine) == 159


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.long)])
def test_an_eager_joiner_of_two_ranks_takes_each_slice_whole_from_one_live_worker(
    tmp_path: Path, dtype: str
) -> None:
    """Each eager worker keeps its own phi_m and its own Delta in the exchange in flight, and
    torchft heals the joiner's two ranks from different live workers: every element of the
    state the joiner assembles comes, in every declared tensor alike (phi, its momentum, the
    mean in flight and the own Delta the joiner subtracts from it), from the live worker that
    sent that slice, and the mean in flight is the one every live worker applies, whole."""
    _needs_torchft()
    ranks = _restarted("eager", tmp_path, same_sender=False, comm_dtype=dtype)
    sent = [rank["healed"]["sent_sha256"] for rank in ranks]
    for rank in ranks:
        took = rank["healed"]["took_sha256"]
        assert took == ranks[0]["healed"]["took_sha256"]  # (the group's ranks assembled alike)
        # Slice r of each tensor from the sender of rank r, as it held it.
        assert all(took[t][r] == sent[r][t][r] for t in range(len(took)) for r in range(2))
        # The mean in flight (the payload's last tensor but the sender's own Delta) is whole
        # and the same on either sender.
        assert sent[0][-2] == sent[1][-2]
        step = rank["healed"]["step"]
        assert min(_digests(rank["joiner"])) == step + 4  # (its round settles a round later)
        assert max(_digests(rank["joiner"])) == 159


def test_a_sliced_healing_payload_is_assembled_element_by_element_from_each_ranks_sender() -> None:
    """Two ranks healed from two live workers whose state differs: each tensor's first half of
    elements is the first sender's, the rest the second's (an odd length, a 0-dim tensor,
    several dtypes), whatever each tensor's size in bytes."""
    pytest.importorskip("torchft")
    from types import SimpleNamespace

    import torch

    from lowcomm.membership.torchft_comm import Replica, _rank_slice

    senders = [
        [
            torch.arange(7, dtype=torch.float32) + 100 * k,
            torch.tensor(3 + k, dtype=torch.int64),
            torch.arange(4, dtype=torch.float64) - 100 * k,
            torch.tensor([k == 0, k == 1, True]),
        ]
        for k in range(2)
    ]
    layout = [(tuple(t.shape), t.dtype) for t in senders[0]]
    pieces = [_rank_slice(senders[r], r, 2) for r in range(2)]

    class _Group:
        def all_gather(self, output: Any, input: Any, *, role: Any) -> Any:
            chunk = input.numel()
            for r, piece in enumerate(pieces):
                output[r * chunk : r * chunk + piece.numel()].copy_(piece)
            return SimpleNamespace(wait=lambda: None)

    replica = Replica.__new__(Replica)
    replica.ranks, replica.rank = 2, 0
    replica._strategy = SimpleNamespace(runtime=SimpleNamespace(replica_group=_Group()))
    tensors, gathered = replica._whole_state({"layout": layout, "tensors": [pieces[0]]})
    assert gathered >= sum(p.numel() for p in pieces)
    for tensor, first, second in zip(tensors, *senders, strict=True):
        assert tensor.dtype == first.dtype and tensor.shape == first.shape
        flat, a, b = (x.reshape(-1) for x in (tensor, first, second))
        half = -(-a.numel() // 2)
        assert torch.equal(flat[:half], a[:half]) and torch.equal(flat[half:], b[half:])


@pytest.mark.parametrize("method", ["eager", "diloco_delayed"])
def test_a_bf16_exchange_in_flight_runs_on_workers_of_several_ranks(method: str) -> None:
    from lowcomm.config import TrainConfig, with_options
    from lowcomm.membership.options import membership_refusal

    config = with_options(
        TrainConfig(method=method), membership="torchft", comm_dtype="bf16", ranks_per_worker=2
    )
    assert membership_refusal(config) is None
    config.validate()
