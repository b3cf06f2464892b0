"""DiLoCo and Streaming DiLoCo: equations, reductions, schedule, fragments, multi-process, CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _cli import lowcomm, small_flags
from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm import CollectiveKind, LocalComm, RecordingComm, Role
from lowcomm.config import RunConfig
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.optim.outer import OuterNesterov
from lowcomm.strategies import MicroBatchResult, StrategyContext, strategy_class
from lowcomm.strategies.diloco import DiLoCo, DiLoCoOptions, fragment_assignment
from lowcomm.strategies.streaming import StreamingDiLoCo

CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=3e-3, weight_decay=0.1),
    schedule=ScheduleConfig(kind="constant", warmup_steps=0),
    total_steps=40,
    max_grad_norm=None,
)


def two_layer_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=16, vocab_size=64))


def test_outer_nesterov_matches_torch_sgd_nesterov() -> None:
    torch.manual_seed(0)
    theta = torch.randn(30)
    deltas = [torch.randn(30) for _ in range(4)]
    outer = OuterNesterov(theta.clone(), lr=0.7, momentum=0.9)
    # Written from docs/ALGORITHMS.md §0.3.
    ref, b = theta.clone(), torch.zeros(30)
    for delta in deltas:
        outer.step(delta)
        b = 0.9 * b + delta
        ref = ref - 0.7 * (delta + 0.9 * b)
    assert torch.allclose(outer.params, ref, atol=1e-6)
    p = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True, dampening=0)
    for delta in deltas:
        p.grad = delta.clone()
        sgd.step()
    assert torch.allclose(outer.params, p.detach(), atol=1e-6)


def test_diloco_outer_round_follows_the_equations() -> None:
    # One worker (identical replicas): the AR mean of Delta is Delta itself.
    options = DiLoCoOptions(sync_every=3, outer_lr=0.7, outer_momentum=0.9)
    comm = RecordingComm(world_size=4)
    strategy = DiLoCo(tiny_gpt(), comm, CONTEXT, options)
    anchor = flat_params(strategy.model)
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(6)])
    for _ in range(2):
        strategy.step(closure)
    assert comm.calls == []  # nothing before H steps
    strategy.step(closure)  # inner step 3 runs, then the outer round
    assert [(c.kind, c.role) for c in comm.calls] == [
        (CollectiveKind.ALL_REDUCE, Role.PSEUDO_GRADIENT)
    ]
    # Reference: replay the three inner AdamW steps on a copy.
    replay = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, DiLoCoOptions(sync_every=1000))
    replay_closure = closure_for(replay, [global_batch(s, 1) for s in range(3)])
    for _ in range(3):
        replay.step(replay_closure)
    local = flat_params(replay.model)
    delta = anchor - local
    expected = anchor - 0.7 * (delta + 0.9 * delta)  # b = Delta on the first call
    assert torch.allclose(flat_params(strategy.model), expected, atol=1e-6)
    assert torch.allclose(strategy.globals_[0], expected, atol=1e-6)


def test_fragment_assignment_is_strided_with_embeddings_first_and_norm_last() -> None:
    model = two_layer_gpt()
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    owners = dict(zip(names, fragment_assignment(names, sizes, 2), strict=True))
    assert owners["token_embedding.weight"] == 0 and owners["position_embedding.weight"] == 0
    assert owners["final_norm.weight"] == 1
    assert {owners[n] for n in names if n.startswith("blocks.0.")} == {0}
    assert {owners[n] for n in names if n.startswith("blocks.1.")} == {1}
    assert {owners[n] for n in names if n.startswith("blocks.2.")} == {0}
    assert {owners[n] for n in names if n.startswith("blocks.3.")} == {1}
    # Fallback for a model without blocks: contiguous groups of about equal size.
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    mlp_names = [n for n, _ in mlp.named_parameters()]
    mlp_sizes = [p.numel() for _, p in mlp.named_parameters()]
    fallback = fragment_assignment(mlp_names, mlp_sizes, 3)
    assert fallback == sorted(fallback) and set(fallback) == {0, 1, 2}


def test_streaming_one_fragment_no_overlap_global_merge_equals_diloco() -> None:
    batches = [global_batch(s, 1) for s in range(12)]
    options = DiLoCoOptions(sync_every=4, fragments=1, overlap_steps=0, mixing=0.0)
    diloco = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, DiLoCoOptions(sync_every=4))
    streaming = StreamingDiLoCo(tiny_gpt(), LocalComm(), CONTEXT, options)
    for strategy in (diloco, streaming):
        closure = closure_for(strategy, batches)
        for _ in range(12):
            strategy.step(closure)
    assert not torch.allclose(flat_params(diloco.model), flat_params(tiny_gpt()))
    assert torch.equal(flat_params(diloco.model), flat_params(streaming.model))
    assert torch.equal(diloco.outer[0].momentum_buffer, streaming.outer[0].momentum_buffer)


def test_streaming_schedule_merge_and_drain() -> None:
    # H=8, K=4, tau=1: fragment p launches at (p+1)*2 - 1 and merges one step later.
    options = DiLoCoOptions(
        sync_every=8, fragments=4, overlap_steps=1, mixing=0.3, outer_lr=0.7, outer_momentum=0.9
    )
    context = StrategyContext(
        optim=CONTEXT.optim, schedule=CONTEXT.schedule, total_steps=16, max_grad_norm=None
    )
    strategy = StreamingDiLoCo(two_layer_gpt(), LocalComm(), context, options)
    launches: list[tuple[int, int]] = []
    original_launch = strategy.launch_sync
    checked: list[int] = []

    def record_launch(p: int, extras: torch.Tensor | None = None) -> Any:
        launches.append((strategy.step_index, p))
        return original_launch(p, extras)

    original_complete = strategy.complete

    def check_complete(sync: Any) -> None:
        p = sync.fragment
        before_global = strategy.globals_[p].clone()
        momentum = strategy.outer[p].momentum_buffer.clone()
        local = strategy.local_fragment(p)
        delta = sync.exchange.wait()[0].clone()
        original_complete(sync)
        b = 0.9 * momentum + delta
        new_global = before_global - 0.7 * (delta + 0.9 * b)
        assert torch.allclose(strategy.globals_[p], new_global, atol=1e-6)
        # alpha weights the LOCAL side.
        assert torch.allclose(strategy.local_fragment(p), 0.3 * local + 0.7 * new_global, atol=1e-6)
        checked.append(p)

    strategy.launch_sync = record_launch  # type: ignore[method-assign]
    strategy.complete = check_complete  # type: ignore[method-assign]
    batch = global_batch(0, 1)
    closure = closure_for(strategy, [batch] * 16)
    for _ in range(16):
        strategy.step(closure)
    assert launches == [(1, 0), (3, 1), (5, 2), (7, 3), (9, 0), (11, 1), (13, 2), (15, 3)]
    assert checked == [0, 1, 2, 3, 0, 1, 2, 3]
    assert strategy.in_flight == []


def test_streaming_does_not_launch_within_tau_of_the_end_and_finish_drains() -> None:
    options = DiLoCoOptions(sync_every=8, fragments=2, overlap_steps=3)
    context = StrategyContext(optim=CONTEXT.optim, total_steps=6, max_grad_norm=None)
    strategy = StreamingDiLoCo(two_layer_gpt(), RecordingComm(world_size=2), context, options)
    closure = closure_for(strategy, [global_batch(0, 1)] * 6)
    strategy.step(closure)  # launches fragment 0 at step 1 (4 - 3), completes at 4
    assert len(strategy.in_flight) == 1
    for _ in range(5):
        strategy.step(closure)  # fragment 1 would launch at 5, complete at 8 > 6: skipped
    assert strategy.in_flight == []
    assert isinstance(strategy.comm, RecordingComm) and len(strategy.comm.calls) == 1
    # A user loop stopping early: finish() drains the in-flight sync.
    early = StreamingDiLoCo(two_layer_gpt(), LocalComm(), context, options)
    early.step(closure_for(early, [global_batch(0, 1)]))
    assert len(early.in_flight) == 1
    early.finish()
    assert early.in_flight == [] and early.outer[0].step_count == 1


def test_quantized_streaming_sends_quantized_shards_in_two_steps() -> None:
    """Each fragment's fp8 outer gradient: a reduce-scatter of the three encoded shards, then
    an all-gather of the three encoded mean shards (lowcomm.strategies.two_step)."""
    from lowcomm.strategies.two_step import shard_payload_bytes

    options = DiLoCoOptions(sync_every=4, fragments=2, overlap_steps=1, quantization="fp8")
    comm = RecordingComm(world_size=3)
    strategy = StreamingDiLoCo(two_layer_gpt(), comm, CONTEXT, options)
    closure = closure_for(strategy, [global_batch(0, 1)] * 4)
    for _ in range(4):
        strategy.step(closure)
    kinds = (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER)
    steps = [c for c in comm.calls if c.kind in kinds]
    assert [c.kind for c in steps] == list(kinds) * 2
    assert all(c.role is Role.PSEUDO_GRADIENT and c.dtype == torch.uint8 for c in steps)
    for index, fragment in enumerate(strategy.fragments):
        shard = shard_payload_bytes(fragment.numel, 3, "fp8", 256)
        for call in steps[2 * index : 2 * index + 2]:
            assert call.payload_bytes == 3 * shard
            assert call.payload_bytes < 4 * fragment.numel / 3.5  # about a quarter of fp32


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"sync_every": 0}, "--diloco.sync-every"),
        ({"outer_momentum": 1.0}, "--diloco.outer-momentum"),
        ({"mixing": 1.5}, "--diloco.mixing"),
        ({"outer_delay": 0}, "--diloco.outer-delay"),
        ({"quantization": "fp4"}, "--diloco.quantization"),
        ({"compensation_sign": "minus"}, "--diloco.compensation-sign"),
    ],
)
def test_bad_options_name_the_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        DiLoCoOptions(**kwargs)


def test_overlap_must_leave_room_for_the_fragment_schedule() -> None:
    with pytest.raises(ValueError, match=r"--diloco.overlap-steps: 4 must be < H/K = 16//4 = 4"):
        StreamingDiLoCo(
            two_layer_gpt(),
            LocalComm(),
            CONTEXT,
            DiLoCoOptions(sync_every=16, fragments=4, overlap_steps=4),
        )
    with pytest.raises(ValueError, match=r"--diloco\.fragments: 6 leaves fragment 4"):
        StreamingDiLoCo(
            two_layer_gpt(),
            LocalComm(),
            CONTEXT,
            DiLoCoOptions(sync_every=24, fragments=6, overlap_steps=1),
        )
    with pytest.raises(ValueError, match=r"--diloco\.fragments: 2 is not allowed for diloco"):
        DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, DiLoCoOptions(fragments=2))


def test_state_dict_round_trip_resumes_exactly() -> None:
    options = DiLoCoOptions(sync_every=2)
    batches = [global_batch(s, 1) for s in range(6)]
    full = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, options)
    closure = closure_for(full, batches)
    for _ in range(6):
        full.step(closure)
    first = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, options)
    closure = closure_for(first, batches[:4])
    for _ in range(4):
        first.step(closure)
    resumed = DiLoCo(tiny_gpt(seed=5), LocalComm(), CONTEXT, options)
    resumed.load_state_dict(first.state_dict())
    closure = closure_for(resumed, batches[4:])
    for _ in range(2):
        resumed.step(closure)
    assert torch.equal(flat_params(full.model), flat_params(resumed.model))


def test_state_bytes_count_anchor_and_momentum() -> None:
    strategy = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT)
    psi = strategy.flat.padded_numel
    # params 4 + grads 4 + AdamW moments 8 + anchor 4 + outer momentum 4 (fp32 bytes/param).
    assert strategy.state_bytes() == 24 * psi


# --- multi-process ---------------------------------------------------------------------


def _gloo_worker(steps: int) -> dict[str, torch.Tensor]:
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    rank, world = comm.rank, comm.world_size

    def shard(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = global_batch(step, world)
        return x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]

    mine = [shard(s) for s in range(steps)]
    # Weight decay 0: the reference below is plain SGD (inner SGD applies --optim.weight-decay).
    sgd_context = StrategyContext(
        optim=AdamWConfig(lr=0.1, weight_decay=0.0),
        schedule=ScheduleConfig(kind="constant", warmup_steps=0),
        total_steps=steps,
        max_grad_norm=None,
    )
    results: dict[str, torch.Tensor] = {}
    ddp_like = DiLoCo(
        tiny_gpt(),
        comm,
        sgd_context,
        DiLoCoOptions(sync_every=1, inner_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0),
    )
    closure = closure_for(ddp_like, mine)
    for _ in range(steps):
        ddp_like.step(closure)
    results["diloco_h1"] = flat_params(ddp_like.model)
    for key, method, options in (
        ("diloco", "diloco", DiLoCoOptions(sync_every=3)),
        (
            "streaming_diloco",
            "streaming_diloco",
            DiLoCoOptions(sync_every=3, fragments=1, overlap_steps=0, mixing=0.0),
        ),
        (
            "streaming_int4",
            "streaming_diloco",
            DiLoCoOptions(sync_every=4, fragments=1, overlap_steps=1, quantization="int4"),
        ),
    ):
        cls = strategy_class(method)
        strategy = cls(tiny_gpt(), comm, CONTEXT, options=options)  # type: ignore[call-arg]
        closure = closure_for(strategy, mine)
        for _ in range(steps):
            strategy.step(closure)
        strategy.finish()
        results[key] = flat_params(strategy.model)
    return results


def test_diloco_reductions_on_two_gloo_ranks() -> None:
    from lowcomm.launch import spawn_workers

    steps = 6
    results = spawn_workers(_gloo_worker, 2, (steps,))
    # DDP with SGD, written directly: one model, the mean gradient of both ranks' batches.
    reference = tiny_gpt()
    for step in range(steps):
        x, y = global_batch(step, 2)
        reference.zero_grad()
        _, loss_a = reference(x[:4], y[:4])
        _, loss_b = reference(x[4:], y[4:])
        assert loss_a is not None and loss_b is not None
        ((loss_a + loss_b) / 2).backward()
        with torch.no_grad():
            for p in reference.parameters():
                assert p.grad is not None
                p.add_(p.grad, alpha=-0.1)
    for rank_result in results:
        assert torch.allclose(rank_result["diloco_h1"], flat_params(reference), atol=1e-5)
        assert torch.equal(rank_result["diloco"], rank_result["streaming_diloco"])
    # Rank replicas agree after a final synchronizing round (steps = 2 H for diloco).
    assert torch.equal(results[0]["diloco"], results[1]["diloco"])
    assert not torch.equal(results[0]["streaming_int4"], flat_params(tiny_gpt()))


# --- command line ----------------------------------------------------------------------

SMALL = small_flags(n_layer=2)  # two blocks, so two fragments


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("diloco", []),
        ("streaming_diloco", ["--diloco.fragments", "2", "--diloco.quantization", "bf16"]),
        ("diloco_delayed", []),
        ("eager", ["--diloco.outer-delay", "2"]),
        ("cocodc", ["--diloco.fragments", "2"]),
    ],
)
def test_cli_selects_the_method_and_writes_summary(
    tmp_path: Path, method: str, extra: list[str]
) -> None:
    out = tmp_path / "run"
    result = lowcomm("train", "--method", method, "--steps", "8", "--diloco.sync-every", "4",
                     "--out", str(out), *SMALL, *extra)  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and summary["steps"] == 8
    assert summary["bytes_by_role"]["pseudo_gradient"] > 0
    assert summary["bytes_by_role"]["gradient"] == 0
    # Two outer rounds of the whole model at most (cocodc may sync more often).
    assert summary["bytes_sent_per_worker"] < 8 * 4 * summary["num_params"] / 2


def test_cli_rejects_a_bad_overlap_with_a_clear_error(tmp_path: Path) -> None:
    result = lowcomm("train", "--method", "streaming_diloco", "--steps", "2",
                     "--diloco.overlap-steps", "-1", "--out", str(tmp_path / "r"), *SMALL,
                     timeout=120)  # fmt: skip
    assert result.returncode == 2  # rejected before any worker starts
    assert result.stderr.strip().startswith("lowcomm: error: --diloco.overlap-steps")


def test_deployed_evaluates_the_global_parameters_and_restores_the_local_ones() -> None:
    from lowcomm.comm import LocalComm
    from lowcomm.strategies import StrategyContext
    from lowcomm.strategies.diloco import DiLoCo, DiLoCoOptions

    strategy = DiLoCo(
        tiny_gpt(), LocalComm(), StrategyContext(total_steps=8), options=DiLoCoOptions(sync_every=4)
    )
    batches = [global_batch(s, 1) for s in range(2)]

    def closure():  # type: ignore[no-untyped-def]

        x, y = batches.pop(0)
        _, loss = strategy.model(x, y)
        loss.backward()
        return MicroBatchResult(float(loss), x.shape[0], x.numel())

    start = flat_params(strategy.model)
    strategy.step(closure)
    strategy.step(closure)  # mid-round: local parameters have moved, the global ones not
    local = flat_params(strategy.model)
    assert not torch.equal(local, start)
    with strategy.deployed() as deployed:
        assert torch.equal(flat_params(deployed), start)
    assert torch.equal(flat_params(strategy.model), local)


def test_default_fragment_count_is_capped_at_the_number_of_blocks() -> None:
    from lowcomm.comm import LocalComm
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.strategies import StrategyContext
    from lowcomm.strategies.diloco import DiLoCoOptions, default_fragment_count
    from lowcomm.strategies.streaming import StreamingDiLoCo

    two_blocks = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=64))
    assert default_fragment_count(two_blocks, 4) == 2
    # No blocks: the element-count split, at the largest count leaving no fragment empty
    # (two tensors, weight and bias, cannot fill four fragments).
    assert default_fragment_count(torch.nn.Linear(3, 3), 4) == 2
    assert (
        default_fragment_count(torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)]), 4)
        == 4
    )
    strategy = StreamingDiLoCo(
        two_blocks, LocalComm(), StrategyContext(), options=DiLoCoOptions(sync_every=8)
    )
    assert strategy.num_fragments == 2
    with pytest.raises(ValueError, match=r"--diloco\.fragments: 4 leaves fragment"):
        StreamingDiLoCo(
            two_blocks,
            LocalComm(),
            StrategyContext(),
            options=DiLoCoOptions(sync_every=8, fragments=4),
        )


def test_a_run_that_ends_mid_round_is_told_its_final_model_leaves_out_the_tail(
    tmp_path: Path,
) -> None:
    """DiLoCo deploys the outer model (§4.1 has no final round): before a run of --steps that
    is not a multiple of H starts, the launcher says which inner steps the final model leaves
    out and which --steps ends on a round; not for a run that ends on one, nor for a
    --token-budget run."""
    from lowcomm.config import TrainConfig, with_options
    from lowcomm.launch.run import preflight

    def note(**options: object) -> str | None:
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        return preflight(with_options(TrainConfig(method="diloco"), out=str(out), **options))

    sixteen = DiLoCoOptions(sync_every=16)
    assert note(steps=30, diloco=sixteen) == (
        "lowcomm: note: --steps 30 is not a multiple of --diloco.sync-every 16: the final model "
        "is the outer one of step 16, without the last 14 inner steps of every worker "
        "(--steps 32 ends on a round)"
    )
    assert "the initial one (no round ends)" in str(note(steps=10, diloco=sixteen))
    assert note(steps=32, diloco=sixteen) is None
    assert note(steps=30, diloco=sixteen, token_budget=10**6) is None
    assert (
        preflight(
            TrainConfig(
                method="ddp",
                run=RunConfig(steps=30, out=str(tmp_path / "ddp")),
            )
        )
        is None
    )


def test_an_exchange_without_extras_copies_nothing_from_the_host() -> None:
    """A sync with no extras sends ``[Delta]`` alone, made where the flat buffer lives: no
    empty host tensor copied to the device. ``meta`` stands in for a GPU: the group declares
    it, and Delta lives there."""
    from _host import HostTraffic

    meta = torch.device("meta")
    strategy = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, DiLoCoOptions(sync_every=4))
    group = RecordingComm(world_size=2, device=meta)
    strategy.comm = group
    numel = strategy.globals_[0].numel()
    strategy.globals_[0] = torch.zeros(numel, device=meta)
    strategy.local_fragment = lambda p: torch.zeros(numel, device=meta)  # type: ignore[method-assign]
    with HostTraffic() as traffic:
        strategy.launch_sync(0)
    assert traffic.copies == [] and traffic.reads == []
    assert [call.numel for call in group.calls] == [numel]
