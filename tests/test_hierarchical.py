"""Hierarchical workers (--ranks-per-worker): the two-level communicator against plain math on
Gloo, the reduction of hierarchical methods to flat ones with the union batch, bytes per level,
and every method either running hierarchically or refusing clearly."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm.base import CollectiveKind, Handle, Role, Settled
from lowcomm.comm.clock import Clock, make_clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.fake import RecordingComm
from lowcomm.comm.hierarchical import HierarchicalComm, slice_length, slice_segments
from lowcomm.comm.network import NetworkProfile
from lowcomm.config import CommConfig, ConfigError, PlacementConfig, RunConfig, TrainConfig
from lowcomm.strategies import STRATEGIES

M, R = 2, 2  # workers, ranks per worker
B = 2  # sequences per rank per micro-batch
STEPS, MICROBATCHES = 4, 2


# --- units -----------------------------------------------------------------------------------


def test_slices_and_fused_segments_are_split_exactly() -> None:
    assert slice_length(10, 2) == 5 and slice_length(11, 2) == 6 and slice_length(0, 4) == 1
    segments = [(Role.PARAMETER, 4), (Role.FIRST_MOMENT, 3), (Role.SECOND_MOMENT, 3)]
    assert slice_segments(segments, 0, 5, 10, Role.OTHER) == [
        (Role.PARAMETER, 4),
        (Role.FIRST_MOMENT, 1),
    ]
    assert slice_segments(segments, 5, 10, 10, Role.OTHER) == [
        (Role.FIRST_MOMENT, 2),
        (Role.SECOND_MOMENT, 3),
    ]
    # an 11-element payload in 2 slices of 6: the last slice carries one padding element
    assert slice_segments([(Role.GRADIENT, 11)], 6, 12, 11, Role.OTHER) == [
        (Role.GRADIENT, 5),
        (Role.OTHER, 1),
    ]


def test_each_rank_sends_one_rth_of_the_payload_on_the_outer_link() -> None:
    for r in range(R):
        inner, outer = RecordingComm(rank=r, world_size=R), RecordingComm(rank=0, world_size=M)
        comm = HierarchicalComm(inner, outer)
        assert (comm.rank, comm.world_size, comm.local_rank) == (0, M, r)
        tensor = torch.arange(12, dtype=torch.float32)
        segments = [(Role.PARAMETER, 8), (Role.FIRST_MOMENT, 4)]
        comm.all_reduce(tensor, op="mean", role=Role.PARAMETER, segments=segments).wait()
        # (values are checked on Gloo: the recording fake's all-gather tiles its own slice)
        (call,) = outer.calls
        assert call.kind is CollectiveKind.ALL_REDUCE and call.numel == 12 // R
        expected = (
            [(Role.PARAMETER, 6)] if r == 0 else [(Role.PARAMETER, 2), (Role.FIRST_MOMENT, 4)]
        )
        assert list(call.segments or ()) == expected
        (gather,) = inner.calls
        assert gather.kind is CollectiveKind.ALL_GATHER and gather.numel == 12


def _two_level_comm() -> tuple[HierarchicalComm, Clock]:
    """One rank of a 2 x 2 run on recording fakes, both levels emulated, on a virtual clock."""
    clock = make_clock("virtual", seconds_per_microbatch=0.01)
    inner = NetworkComm(
        RecordingComm(rank=1, world_size=R), NetworkProfile.from_preset("ethernet"), clock
    )
    outer = NetworkComm(
        RecordingComm(rank=0, world_size=M), NetworkProfile.from_preset("wan"), clock
    )
    return HierarchicalComm(inner, outer, clock), clock


_COLLECTIVES: dict[str, Callable[[HierarchicalComm], Handle]] = {
    "all_reduce": lambda c: c.all_reduce(torch.ones(50_001), role=Role.PSEUDO_GRADIENT),
    "broadcast": lambda c: c.broadcast(torch.ones(50_001), src=0, role=Role.PARAMETER),
    "reduce_scatter": lambda c: c.reduce_scatter(
        torch.empty(25_001), torch.ones(M * 25_001), role=Role.GRADIENT
    ),
    "all_gather": lambda c: c.all_gather(
        torch.empty(M * 25_001), torch.ones(25_001), role=Role.PARAMETER
    ),
    "barrier": lambda c: c.barrier(),
}


def _timeline(collective: str, stop: str | None) -> tuple[object, ...]:
    """Launch a collective, compute a little, (settle it; with "resume", rebuild the comm and
    clock from the checkpointed state and restore the handle), compute, wait: the readings."""
    comm, clock = _two_level_comm()
    handle = _COLLECTIVES[collective](comm)
    clock.microbatch_done()
    if stop is not None:
        settled = handle.settle()
        assert handle.settle() == settled  # settling twice changes nothing
        if stop == "resume":
            saved = clock.state_dict(), comm.state_dict(), settled.state_dict()
            comm, clock = _two_level_comm()
            clock.load_state_dict(saved[0])
            comm.load_state_dict(saved[1])
            handle = comm.runtime().restore(Settled.from_state(saved[2]))
    for _ in range(3):
        clock.microbatch_done()
    handle.wait()
    handle.wait()
    return clock.now(), clock.exposed_comm_s, json.dumps(comm.level_counters(), sort_keys=True)


@pytest.mark.parametrize("collective", sorted(_COLLECTIVES))
def test_a_settled_two_level_handle_charges_the_clock_as_if_never_settled(collective: str) -> None:
    """Settling (a checkpoint) moves the data without charging the clock; waiting afterwards,
    on the same handle or on the one the runtime restores after a resume, charges exactly what
    the unsettled handle would have: the outer completion, then the inner all-gather from the
    moment the worker waits."""
    straight = _timeline(collective, None)
    assert straight[1] > 0  # the transfer is exposed: the settle really had something to defer
    assert _timeline(collective, "settle") == straight
    assert _timeline(collective, "resume") == straight


def test_methods_that_cannot_run_hierarchically_refuse_with_the_reason() -> None:
    refused = sorted(name for name, cls in STRATEGIES.items() if cls.hierarchical_refusal)
    assert refused == ["acco", "dpu", "wp"]
    with pytest.raises(ConfigError, match=r"--ranks-per-worker: 2 with --method acco: .*thread"):
        TrainConfig(
            method="acco",
            placement=PlacementConfig(ranks_per_worker=2),
        ).validate()
    TrainConfig(
        method="acco",
        placement=PlacementConfig(ranks_per_worker=1, workers=2),
    ).validate()  # flat: fine
    with pytest.raises(ConfigError, match=r"--ranks-per-worker: 0 .*pass 1"):
        TrainConfig(placement=PlacementConfig(ranks_per_worker=0)).validate()
    with pytest.raises(ConfigError, match=r"--inner-network: unknown preset 'fast'"):
        TrainConfig(
            placement=PlacementConfig(ranks_per_worker=2), comm=CommConfig(inner_network="fast")
        ).validate()


def test_worker_layout() -> None:
    from lowcomm.launch.groups import worker_layout

    assert worker_layout(6, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    with pytest.raises(ValueError, match=r"--ranks-per-worker: 4 does not divide the world size 6"):
        worker_layout(6, 4)


# --- the communicator on Gloo ------------------------------------------------------------------


def _worker_value(m: int, numel: int, salt: float) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (m + 1) + salt


def _gloo_collectives() -> dict[str, Any]:
    import torch.distributed as dist

    from lowcomm.comm.clock import VirtualClock
    from lowcomm.comm.emulated import NetworkComm
    from lowcomm.comm.network import NetworkProfile
    from lowcomm.launch.groups import level_comms

    inner_raw, outer_raw = level_comms(R)
    clock = VirtualClock()
    inner = NetworkComm(inner_raw, NetworkProfile.from_preset("datacenter"), clock)
    outer = NetworkComm(outer_raw, NetworkProfile.from_preset("wan"), clock)
    comm = HierarchicalComm(inner, outer, clock)
    m = comm.rank
    out: dict[str, Any] = {"rank": dist.get_rank(), "worker": m, "local": comm.local_rank}
    for numel in (8, 7):  # divisible by R, and padded
        for op in ("sum", "mean", "max"):
            x = _worker_value(m, numel, 1.0)
            comm.all_reduce(x, op=op, role=Role.GRADIENT).wait()  # type: ignore[arg-type]
            out[f"all_reduce_{op}_{numel}"] = x
        x = _worker_value(m, numel, 2.0).view(1, numel)  # 2-D, segments
        comm.all_reduce(
            x, role=Role.PARAMETER, segments=[(Role.PARAMETER, 3), (Role.FIRST_MOMENT, numel - 3)]
        ).wait()
        out[f"fused_{numel}"] = x
        x = _worker_value(m, numel, 3.0)
        comm.broadcast(x, src=1, role=Role.PARAMETER).wait()
        out[f"broadcast_{numel}"] = x
        big = _worker_value(m, M * numel, 4.0)
        small = torch.empty(numel)
        comm.reduce_scatter(small, big, op="sum", role=Role.GRADIENT).wait()
        out[f"reduce_scatter_{numel}"] = small
        gathered = torch.empty(M * numel)
        comm.all_gather(gathered, _worker_value(m, numel, 5.0), role=Role.PARAMETER).wait()
        out[f"all_gather_{numel}"] = gathered
    comm.barrier().wait()
    # Bytes per level for one 8-element fp32 all-reduce and nothing else.
    before = (inner.bytes_sent, outer.bytes_sent)
    comm.all_reduce(torch.ones(8), role=Role.GRADIENT).wait()
    out["inner_bytes"] = inner.bytes_sent - before[0]
    out["outer_bytes"] = outer.bytes_sent - before[1]
    out["outer_by_role"] = outer.counters()
    return out


def test_hierarchical_collectives_equal_plain_math_on_gloo() -> None:
    from lowcomm.launch import spawn_workers

    results = spawn_workers(_gloo_collectives, M * R)
    for res in results:
        assert (res["worker"], res["local"]) == divmod(res["rank"], R)
        for numel in (8, 7):
            values = [_worker_value(m, numel, 1.0) for m in range(M)]
            total = sum(values, torch.zeros(numel))
            assert torch.equal(res[f"all_reduce_sum_{numel}"], total)
            assert torch.allclose(res[f"all_reduce_mean_{numel}"], total / M)
            assert torch.equal(res[f"all_reduce_max_{numel}"], torch.stack(values).max(0).values)
            fused = sum((_worker_value(m, numel, 2.0) for m in range(M)), torch.zeros(numel)) / M
            assert res[f"fused_{numel}"].shape == (1, numel)
            assert torch.allclose(res[f"fused_{numel}"].view(-1), fused)
            assert torch.equal(res[f"broadcast_{numel}"], _worker_value(1, numel, 3.0))
            big_total = sum(
                (_worker_value(m, M * numel, 4.0) for m in range(M)), torch.zeros(M * numel)
            )
            w = res["worker"]
            assert torch.equal(
                res[f"reduce_scatter_{numel}"], big_total[w * numel : (w + 1) * numel]
            )
            assert torch.equal(
                res[f"all_gather_{numel}"],
                torch.cat([_worker_value(m, numel, 5.0) for m in range(M)]),
            )
        # ring formulas: outer all-reduce of S/R over M, inner all-gather of S over R
        payload = 8 * 4
        assert res["outer_bytes"] == 2 * (M - 1) / M * payload / R
        assert res["inner_bytes"] == (R - 1) / R * payload


# --- reduction to flat workers -----------------------------------------------------------------


def _options_source(method: str) -> TrainConfig:
    config = TrainConfig(method=method)
    config.diloco.sync_every = 2
    config.local.sync_every = 2
    config.desloc.param_period = 1
    config.sparta.fraction, config.sparta.sync_every = 0.05, 2
    if method == "desloc":
        config.desloc.first_moment_period = 2
        config.desloc.second_moment_period = 4
    return config


def _batches(worker: int, replica: int, replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Worker ``worker``'s micro-batches are rows [worker R B, (worker + 1) R B) of a global
    batch; a rank of a hierarchical worker takes its B rows of them (``replicas`` = R), a flat
    worker all R B (``replicas`` = 1)."""
    rows = R * B // replicas
    batches = []
    for index in range(STEPS * MICROBATCHES):
        x, y = global_batch(index, M, per_rank=R * B)
        begin = worker * R * B + replica * rows
        batches.append((x[begin : begin + rows], y[begin : begin + rows]))
    return batches


def _train(methods: list[str], hierarchical: bool) -> dict[str, torch.Tensor]:
    from lowcomm.comm.torch_comm import TorchComm
    from lowcomm.launch.groups import level_comms
    from lowcomm.strategies import StrategyContext, build_strategy

    if hierarchical:
        inner, outer = level_comms(R)
        comm: Any = HierarchicalComm(inner, outer)
        worker, replica, replicas = comm.rank, comm.local_rank, R
    else:
        comm = TorchComm()
        worker, replica, replicas = comm.rank, 0, 1
    context = StrategyContext(total_steps=STEPS, microbatches_per_step=MICROBATCHES)
    results: dict[str, torch.Tensor] = {}
    for method in methods:
        strategy = build_strategy(method, tiny_gpt(), comm, context, _options_source(method))
        closure = closure_for(strategy, _batches(worker, replica, replicas))
        for _ in range(STEPS):
            strategy.step(closure)
        strategy.finish()
        with strategy.deployed() as deployed:
            results[method] = flat_params(deployed)
    return results


REDUCED = ["ddp", "zero1", "diloco", "co2", "desloc"]
REDUCED += ["demo"]  # the inner average is the union batch's gradient: same top-k, same sign
REDUCED += ["sparta", "sparta_diloco"]  # replicas draw the same S_t and hold the same values


@pytest.mark.slow
def test_hierarchical_methods_equal_flat_workers_with_the_union_batch() -> None:
    from lowcomm.launch import spawn_workers

    runnable = sorted(name for name, cls in STRATEGIES.items() if cls.hierarchical_refusal is None)
    hierarchical = spawn_workers(_train, M * R, (runnable, True))
    flat = spawn_workers(_train, M, (REDUCED, False))
    for rank, result in enumerate(hierarchical):
        worker = rank // R
        for method in runnable:
            # Every method runs; the replicas of a worker stay bitwise identical.
            assert torch.equal(result[method], hierarchical[worker * R][method]), method
        for method in REDUCED:
            assert torch.allclose(result[method], flat[worker][method], rtol=1e-4, atol=1e-5), (
                method
            )
            # and training moved the parameters (the comparison is not vacuous)
            assert not torch.allclose(result[method], flat_params(tiny_gpt()), atol=1e-4), method


# --- end to end through the training loop -------------------------------------------------------


def _config(out: Path, ranks: int, micro_batch: int) -> TrainConfig:
    config = TrainConfig(
        method="ddp",
        placement=PlacementConfig(workers=M, ranks_per_worker=ranks),
        run=RunConfig(
            steps=3, eval_every=3, eval_batches=2, progress=False, plot=False, out=str(out)
        ),
        comm=CommConfig(network="wan", inner_network="datacenter"),
    )
    config.model.n_layer, config.model.n_embd, config.model.n_head = 1, 32, 2
    config.model.block_size = 16
    config.data.micro_batch_size = micro_batch
    return config


@pytest.mark.slow
def test_training_loop_hierarchical_ddp_matches_flat_and_bytes_per_level(tmp_path: Path) -> None:
    from lowcomm.data import prepare_corpus
    from lowcomm.launch import spawn_workers
    from lowcomm.train.loop import spawned_train

    hier, flat = _config(tmp_path / "h", R, 2), _config(tmp_path / "f", 1, 2 * R)
    hier.validate()
    prepare_corpus(hier.data)
    spawn_workers(spawned_train, hier.placement.world_size, (hier,))
    spawn_workers(spawned_train, flat.placement.world_size, (flat,))
    h = json.loads((tmp_path / "h" / "summary.json").read_text())
    f = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert h["final_val_loss"] == pytest.approx(f["final_val_loss"], rel=1e-5)
    assert h["tokens"] == f["tokens"]
    assert (h["workers"], h["ranks_per_worker"]) == (M, R)
    payload = 4 * h["num_params"]  # fp32 gradients; the flat buffer is not padded here
    steps = 3
    outer = h["levels"]["outer"]["bytes_sent_per_rank"]
    inner = h["levels"]["inner"]["bytes_sent_per_rank"]
    # outer: one gradient all-reduce per step, each rank 1/R of it over M workers
    assert outer == pytest.approx(steps * 2 * (M - 1) / M * payload / R)
    assert outer == pytest.approx(f["levels"]["outer"]["bytes_sent_per_rank"] / R)
    # inner: per micro-batch a gradient all-reduce over R, per step the all-gather of the
    # all-reduce's result and the all-gather of the sharded AdamW step (padded to R slices)
    padded = 4 * R * -(-h["num_params"] // R)
    assert inner == pytest.approx(
        steps * (2 * (R - 1) / R * payload + (R - 1) / R * (payload + padded))
    )
    # ZeRO-1 inside the worker: each rank keeps 1/R of the AdamW moments
    assert f["state_bytes_per_worker"] - h["state_bytes_per_worker"] == pytest.approx(
        2 * payload - 2 * (padded // R), abs=8
    )
    assert h["bytes_sent_per_worker"] == pytest.approx(R * (inner + outer))
    assert h["inner_network"]["name"] == "datacenter"
    assert 0 < h["utilization"] <= 1


# --- the planner -------------------------------------------------------------------------------


def test_plan_splits_the_outer_payload_over_the_ranks_and_prices_the_inner_link() -> None:
    from lowcomm.comm.network import NetworkProfile
    from lowcomm.plan import PlanConfig, make_plan
    from lowcomm.strategies.diloco import DiLoCoOptions

    base = {
        "method": "diloco",
        "params": "1b",
        "workers": 4,
        "network": "wan",
        "diloco": DiLoCoOptions(sync_every=50),
        "comm_dtype": "bf16",  # 2 bytes per element: the payload below
    }
    flat = make_plan(PlanConfig(**base))  # type: ignore[arg-type]
    hier = make_plan(PlanConfig(**base, ranks_per_worker=8, inner_network="datacenter"))  # type: ignore[arg-type]
    payload = 2.0 * 1e9
    assert hier.outer_bytes_per_rank_per_step == pytest.approx(
        flat.comm_bytes_per_worker_per_step / 8
    )
    # per step: the gradient all-reduce, the all-gather of the sharded inner AdamW step, and
    # 1/H of the all-gather that reassembles the outer result
    gathers = 1 + 1 / 50
    assert hier.inner_bytes_per_rank_per_step == pytest.approx(
        2 * 7 / 8 * payload + gathers * 7 / 8 * payload
    )
    inner = NetworkProfile.from_preset("datacenter")
    per_step = inner.collective_time(
        CollectiveKind.ALL_REDUCE, payload, 8
    ) + gathers * inner.collective_time(CollectiveKind.ALL_GATHER, payload, 8)
    # AdamW's moments (8 of its 12 bytes per parameter) are split over the 8 replicas
    assert flat.memory_per_worker_bytes - hier.memory_per_worker_bytes == pytest.approx(
        (8 - 1) * 1e9
    )
    assert hier.inner_comm_s == pytest.approx(hier.steps * per_step)
    outer = NetworkProfile.from_preset("wan").collective_time(
        CollectiveKind.ALL_REDUCE, payload / 8, 4
    )
    assert hier.comm_total_s == pytest.approx(hier.steps * (outer / 50 + per_step))
    assert hier.compute_s == pytest.approx(flat.compute_s / 8)  # 8 ranks share each worker's batch
    with pytest.raises(ValueError, match=r"--ranks-per-worker: 2 with --method acco"):
        make_plan(PlanConfig(method="acco", ranks_per_worker=2))
