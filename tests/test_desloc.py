"""DES-LOC family: equations, reductions, bytes per step, resets, joining workers, CLI, example."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _cli import SMALL, lowcomm
from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm import CollectiveKind, LocalComm, NetworkComm, NetworkProfile, RecordingComm, Role
from lowcomm.comm.clock import make_clock
from lowcomm.comm.network import bytes_sent
from lowcomm.optim import AdamWConfig, FlatAdamW, ScheduleConfig, learning_rate
from lowcomm.optim.adopt import AdoptConfig, FlatAdopt
from lowcomm.strategies import StrategyContext, strategy_class
from lowcomm.strategies.desloc import (
    Desloc,
    DeslocOptions,
    FavgOpt,
    FavgReset,
    LocalAdamMethod,
    half_life,
    half_lives,
)

CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=3e-3, weight_decay=0.1),
    schedule=ScheduleConfig(kind="cosine", warmup_steps=3),
    total_steps=30,
    max_grad_norm=None,
)


# --- optimizers against their equations ---------------------------------------------------------


def test_adopt_follows_its_equations() -> None:
    torch.manual_seed(0)
    x0 = torch.randn(40)
    # Gradients of very different scales, so the t^(1/4) clip and the eps floor both act.
    grads = [torch.randn(40) * (0.01 if s % 3 == 0 else 3.0) for s in range(8)]
    grads[1][:5] = 0.0
    config = AdoptConfig(betas=(0.9, 0.9999), eps=1e-6, weight_decay=0.05)
    optimizer = FlatAdopt(x0.clone(), config)
    # Written straight from docs/ALGORITHMS.md §5.1 (ADOPT), with decoupled weight decay.
    x, u, v = x0.clone(), torch.zeros(40), grads[0] ** 2
    clipped_any = False
    for t, g in enumerate(grads):
        optimizer.step(g, lr=0.01)
        if t == 0:
            continue  # v_0 = g_0^2, no parameter update
        x = x * (1 - 0.01 * 0.05)
        normalised = g / torch.clamp(v.sqrt(), min=1e-6)
        clipped_any |= bool((normalised.abs() > t**0.25).any())
        u = 0.9 * u + 0.1 * torch.clamp(normalised, -(t**0.25), t**0.25)
        x = x - 0.01 * u
        v = 0.9999 * v + 0.0001 * g * g
    assert clipped_any  # the toy exercises the clip
    assert torch.allclose(optimizer.master, x, atol=1e-6)
    assert torch.allclose(optimizer.exp_avg, u, atol=1e-6)
    assert torch.allclose(optimizer.exp_avg_sq, v, atol=1e-6)
    assert optimizer.step_count == len(grads)


def test_adopt_first_step_only_seeds_the_second_moment() -> None:
    optimizer = FlatAdopt(torch.ones(3), AdoptConfig())
    optimizer.step(torch.tensor([1.0, -2.0, 3.0]), lr=1.0)
    assert torch.equal(optimizer.master, torch.ones(3))
    assert torch.equal(optimizer.exp_avg_sq, torch.tensor([1.0, 4.0, 9.0]))
    with pytest.raises(ValueError, match=r"adopt.betas\[1\]: 1.0 must lie in \[0, 1\)"):
        AdoptConfig(betas=(0.9, 1.0))


def _counters(optimizer: object) -> dict[str, int]:
    """The bias-correction counters of a DES-LOC Adam."""
    assert isinstance(optimizer, FlatAdamW)
    return {
        "first_moment_steps": optimizer.first_moment_steps,
        "second_moment_steps": optimizer.second_moment_steps,
    }


def test_half_lives_match_the_table() -> None:
    # docs/ALGORITHMS.md §5.1: 0.9 -> 6.6, 0.99 -> 69, 0.999 -> 693, 0.9999 -> 6931.
    assert half_life(0.9) == pytest.approx(6.58, abs=0.01)
    lives = half_lives((0.99, 0.9999))
    assert lives["first_moment"] == pytest.approx(68.97, abs=0.01)
    assert lives["second_moment"] == pytest.approx(6931.1, abs=0.1)
    with pytest.raises(ValueError, match=r"beta: 1\.0 must lie in"):
        half_life(1.0)


def test_default_periods_and_clipping() -> None:
    strategy = Desloc(tiny_gpt(), LocalComm(), CONTEXT, options=DeslocOptions(param_period=4))
    assert strategy.periods == {Role.PARAMETER: 4, Role.FIRST_MOMENT: 12, Role.SECOND_MOMENT: 24}
    # 1/K + 1/3K + 1/6K = 1.5/K: half of Local Adam's 3/K.
    assert strategy.payloads_per_step() == pytest.approx(1.5 / 4)
    # Coordinate-wise clipping at rho: lr 0 keeps the parameters, the flat gradient keeps the clip.
    frozen = StrategyContext(optim=AdamWConfig(lr=0.0), total_steps=1, max_grad_norm=None)
    clipped = Desloc(tiny_gpt(), LocalComm(), frozen, options=DeslocOptions(clip_rho=1e-3))
    clipped.step(closure_for(clipped, [global_batch(0, 1)]))
    assert float(clipped.flat.grads.abs().max()) == pytest.approx(1e-3)
    # u = (1 - beta1) g_hat, beta1 = 0.9 from --optim.betas.
    assert float(clipped.inner.states()[Role.FIRST_MOMENT].abs().max()) == pytest.approx(
        0.1 * 1e-3, rel=1e-5
    )


def test_options_are_validated_with_the_flag_name() -> None:
    with pytest.raises(ValueError, match=r"--desloc.param-period: 0 must be >= 1"):
        DeslocOptions(param_period=0)
    with pytest.raises(ValueError, match=r"--desloc.clip-rho: -1.0 must be positive"):
        DeslocOptions(clip_rho=-1.0)
    with pytest.raises(ValueError, match=r"--desloc.rejoin-rank .* go together"):
        DeslocOptions(rejoin_rank=1)
    with pytest.raises(
        ValueError, match=r"--desloc.first-moment-period: 5 is only used by --method desloc"
    ):
        LocalAdamMethod(
            tiny_gpt(), LocalComm(), CONTEXT, options=DeslocOptions(first_moment_period=5)
        )
    with pytest.raises(
        ValueError, match=r"--desloc.rejoin-rank: 3 is not a worker of a group of 2"
    ):
        Desloc(
            tiny_gpt(),
            RecordingComm(world_size=2),
            CONTEXT,
            options=DeslocOptions(rejoin_rank=3, rejoin_step=1),
        )


# --- communication pattern and bytes ----------------------------------------------------------


def _network_comm(world_size: int) -> tuple[NetworkComm, RecordingComm]:
    recording = RecordingComm(rank=0, world_size=world_size)
    profile = NetworkProfile(name="custom", bandwidth_gbps=1.0, latency_ms=1.0)
    comm = NetworkComm(recording, profile, make_clock("virtual", seconds_per_microbatch=0.01))
    return comm, recording


@pytest.mark.parametrize(
    ("method", "options", "expected_roles"),
    [
        (
            "desloc",
            DeslocOptions(param_period=2),
            {Role.PARAMETER: 2, Role.FIRST_MOMENT: 6, Role.SECOND_MOMENT: 12},
        ),
        (
            "desloc",
            DeslocOptions(param_period=2, fuse=False),
            {Role.PARAMETER: 2, Role.FIRST_MOMENT: 6, Role.SECOND_MOMENT: 12},
        ),
        (
            "desloc",
            DeslocOptions(param_period=3, first_moment_period=4, optimizer="sgdm"),
            {Role.PARAMETER: 3, Role.FIRST_MOMENT: 4},
        ),
        (
            "local_adam",
            DeslocOptions(param_period=4),
            {Role.PARAMETER: 4, Role.FIRST_MOMENT: 4, Role.SECOND_MOMENT: 4},
        ),
        ("favg_opt", DeslocOptions(param_period=4), {Role.PARAMETER: 4}),
        ("favg_reset", DeslocOptions(param_period=6), {Role.PARAMETER: 6}),
    ],
)
def test_bytes_per_step_follow_the_periods(
    method: str, options: DeslocOptions, expected_roles: dict[Role, int]
) -> None:
    world, steps = 4, 24
    comm, recording = _network_comm(world)
    strategy = strategy_class(method)(tiny_gpt(), comm, CONTEXT, options=options)  # type: ignore[call-arg]
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(steps)])
    synced = {role: 0 for role in Role}
    for _ in range(steps):
        stats = strategy.step(closure)
        for role, name in (
            (Role.PARAMETER, "synced_parameters"),
            (Role.FIRST_MOMENT, "synced_first_moment"),
            (Role.SECOND_MOMENT, "synced_second_moment"),
        ):
            synced[role] += int(stats.extras[name])
    payload = 4 * strategy.flat.padded_numel
    one = bytes_sent(CollectiveKind.ALL_REDUCE, payload, world, 0)
    for role in (Role.PARAMETER, Role.FIRST_MOMENT, Role.SECOND_MOMENT):
        period = expected_roles.get(role)
        expected_syncs = steps // period if period else 0
        assert synced[role] == expected_syncs, role
        assert comm.bytes_by_role[role] == pytest.approx(expected_syncs * one), role
    per_step = sum(1 / k for k in expected_roles.values())
    assert comm.bytes_sent == pytest.approx(steps * per_step * one)
    assert strategy.payloads_per_step() == pytest.approx(per_step)
    # Fusion: one payload collective per sync step (unless disabled).
    payload_calls = [c for c in recording.calls if c.role is not Role.OTHER]
    sync_steps = sum(
        1 for t in range(1, steps + 1) if any(t % k == 0 for k in expected_roles.values())
    )
    if options.fuse:
        assert len(payload_calls) == sync_steps
    else:
        assert len(payload_calls) == sum(synced.values()) > sync_steps
    assert sum(c.numel for c in payload_calls) == sum(synced.values()) * strategy.flat.padded_numel


def test_fused_sync_sends_the_concatenation_of_due_states() -> None:
    recording = RecordingComm(world_size=2)
    strategy = LocalAdamMethod(
        tiny_gpt(), recording, CONTEXT, options=DeslocOptions(param_period=2)
    )
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(2)])
    assert strategy.step(closure).extras["synced_parameters"] == 0.0
    strategy.step(closure)
    (call,) = recording.calls
    n = strategy.flat.padded_numel
    assert (call.kind, call.role, call.numel, call.op) == (
        CollectiveKind.ALL_REDUCE,
        Role.PARAMETER,
        3 * n,
        "mean",
    )


def test_favg_reset_zeroes_moments_and_counter_after_each_sync() -> None:
    strategy = FavgReset(
        tiny_gpt(), RecordingComm(world_size=2), CONTEXT, options=DeslocOptions(param_period=3)
    )
    keep = FavgOpt(
        tiny_gpt(), RecordingComm(world_size=2), CONTEXT, options=DeslocOptions(param_period=3)
    )
    batches = [global_batch(s, 1) for s in range(9)]
    closure, keep_closure = closure_for(strategy, batches), closure_for(keep, batches)
    for t in range(1, 10):
        strategy.step(closure)
        keep.step(keep_closure)
        states = strategy.inner.states()
        counters = _counters(strategy.inner)
        if t % 3 == 0:
            assert all(float(s.abs().max()) == 0.0 for s in states.values()), t
            assert counters == {"first_moment_steps": 0, "second_moment_steps": 0}
        else:
            assert all(float(s.abs().max()) > 0.0 for s in states.values()), t
            assert counters["first_moment_steps"] == t % 3
        # favg_opt keeps its state and its global counter.
        assert _counters(keep.inner)["first_moment_steps"] == t
        assert float(keep.inner.states()[Role.SECOND_MOMENT].abs().max()) > 0.0
    # After a reset the first update is a fresh Adam step: bias correction with s = 1.
    assert not torch.allclose(flat_params(strategy.model), flat_params(keep.model))


def test_finish_averages_parameters_unless_just_synced() -> None:
    recording = RecordingComm(world_size=2)
    strategy = FavgOpt(tiny_gpt(), recording, CONTEXT, options=DeslocOptions(param_period=4))
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(5)])
    for _ in range(4):
        strategy.step(closure)
    strategy.finish()
    assert len(recording.calls) == 1  # step 4 synced, finish adds nothing
    strategy.step(closure)
    strategy.finish()
    assert [(c.role, c.numel) for c in recording.calls][-1] == (
        Role.PARAMETER,
        strategy.flat.padded_numel,
    )


def test_state_dict_round_trip_resumes_exactly() -> None:
    options = DeslocOptions(param_period=2, optimizer="adopt")
    first = Desloc(tiny_gpt(), RecordingComm(world_size=2), CONTEXT, options=options)
    batches = [global_batch(s, 1) for s in range(6)]
    closure = closure_for(first, batches)
    for _ in range(3):
        first.step(closure)
    saved = first.state_dict()
    second = Desloc(tiny_gpt(seed=5), RecordingComm(world_size=2), CONTEXT, options=options)
    second.load_state_dict(saved)
    second_closure = closure_for(second, batches[3:])
    for _ in range(3):
        first.step(closure)
        second.step(second_closure)
    assert torch.equal(flat_params(first.model), flat_params(second.model))
    assert first.state_bytes() == 16 * first.flat.padded_numel


def test_every_variant_trains_a_tiny_model() -> None:
    for method, optimizer in (
        ("desloc", "adam"),
        ("desloc", "adopt"),
        ("desloc", "sgdm"),
        ("local_adam", "adam"),
        ("favg_reset", "adam"),
    ):
        lr = 0.3 if optimizer == "sgdm" else 1e-2
        context = StrategyContext(
            optim=AdamWConfig(lr=lr, weight_decay=0.0), total_steps=30, max_grad_norm=None
        )
        options = DeslocOptions(param_period=2, optimizer=optimizer)  # type: ignore[arg-type]
        strategy = strategy_class(method)(
            tiny_gpt(), RecordingComm(world_size=2), context, options=options
        )  # type: ignore[call-arg]
        closure = closure_for(strategy, [global_batch(0, 1)] * 30)
        losses = [strategy.step(closure).loss for _ in range(30)]
        assert losses[-1] < losses[0] - 0.5, (method, optimizer, losses[0], losses[-1])


def test_track_state_change_reports_relative_moment_changes() -> None:
    options = DeslocOptions(param_period=4, track_state_change=True, optimizer="adopt")
    strategy = Desloc(tiny_gpt(), LocalComm(), CONTEXT, options=options)
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(6)])
    extras = [strategy.step(closure).extras for _ in range(6)]
    assert math.isnan(extras[0]["first_moment_change"])  # u starts at zero
    later = extras[-1]
    # ADOPT's beta2 = 0.9999: v moves far slower than u (docs/ALGORITHMS.md §7.3 F1).
    assert 0 < later["second_moment_change"] < later["first_moment_change"]


# --- multi-process: reductions and a joining worker ---------------------------------------------


def _shard_batches(steps: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = []
    for step in range(steps):
        x, y = global_batch(step, world)
        batches.append((x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]))
    return batches


class _RecordingDesloc(Desloc):
    """Desloc that keeps (x, u, v) right before and after every step's syncs."""

    def synchronize(self, roles: list[Role]) -> None:
        if not hasattr(self, "trace"):
            self.trace: list[dict[str, torch.Tensor | list[Role]]] = []
        before = {
            "x": self.inner.master.clone(),
            **{r.value: t.clone() for r, t in self.inner.states().items()},
        }
        super().synchronize(roles)
        after = {
            "x": self.inner.master.clone(),
            **{r.value: t.clone() for r, t in self.inner.states().items()},
        }
        self.trace.append({"roles": list(roles), "before": before, "after": after})  # type: ignore[dict-item]


def _worker(steps: int, join_step: int) -> dict[str, object]:
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    rank, world = comm.rank, comm.world_size
    batches = _shard_batches(steps, rank, world)
    out: dict[str, object] = {}
    unclipped = DeslocOptions(clip_rho=None)
    # (a) desloc, all periods 1, SGDM.
    sgdm_context = StrategyContext(
        optim=AdamWConfig(lr=0.2, betas=(0.8, 0.95), weight_decay=0.05),
        schedule=CONTEXT.schedule,
        total_steps=steps,
        max_grad_norm=None,
    )
    options = DeslocOptions(
        param_period=1,
        first_moment_period=1,
        second_moment_period=1,
        optimizer="sgdm",
        clip_rho=None,
    )
    sgdm = Desloc(tiny_gpt(), comm, sgdm_context, options=options)
    closure = closure_for(sgdm, batches)
    for _ in range(steps):
        sgdm.step(closure)
    out["sgdm"] = flat_params(sgdm.model)
    # (b) local_adam(K) and desloc(K, K, K).
    for name, cls, opts in (
        ("local_adam", LocalAdamMethod, DeslocOptions(param_period=3, clip_rho=unclipped.clip_rho)),
        (
            "desloc_kkk",
            Desloc,
            DeslocOptions(
                param_period=3, first_moment_period=3, second_moment_period=3, clip_rho=None
            ),
        ),
    ):
        strategy = cls(tiny_gpt(), comm, CONTEXT, options=opts)
        closure = closure_for(strategy, batches)
        for _ in range(steps):
            strategy.step(closure)
        out[name] = flat_params(strategy.model)
    # (c) rank 1 rejoins with fresh state at join_step (K_x = 2, K_u = 4, K_v = 8).
    join = DeslocOptions(
        param_period=2,
        first_moment_period=4,
        second_moment_period=8,
        rejoin_rank=1,
        rejoin_step=join_step,
    )
    joiner = _RecordingDesloc(tiny_gpt(), comm, CONTEXT, options=join)
    closure = closure_for(joiner, batches)
    counters = []
    for _ in range(steps):
        joiner.step(closure)
        counters.append(_counters(joiner.inner))
    out["trace"] = joiner.trace
    out["counters"] = counters
    return out


@pytest.mark.slow
def test_reductions_and_a_joining_worker_on_three_gloo_ranks() -> None:
    from lowcomm.launch import spawn_workers

    steps, join_step, world = 12, 5, 3
    results = spawn_workers(_worker, world, (steps, join_step))

    # (a) DDP with SGDM, written from the equations: u <- b u + (1-b) g, x <- x(1 - lr wd) - lr u,
    # with g the gradient of the global batch (the mean of the equal shards' gradients).
    model = tiny_gpt()
    x = flat_params(model)
    u = torch.zeros_like(x)
    for step in range(steps):
        for p, value in zip(
            model.parameters(), torch.split(x, [p.numel() for p in model.parameters()]), strict=True
        ):
            p.data = value.view_as(p).clone()
            p.grad = None
        inputs, targets = global_batch(step, world)
        _, loss = model(inputs, targets)
        assert loss is not None
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
        lr = learning_rate(CONTEXT.schedule, 0.2, step, steps)
        u = 0.8 * u + 0.2 * g
        x = x * (1 - lr * 0.05) - lr * u
    start = flat_params(tiny_gpt())
    for result in results:
        assert not torch.allclose(result["sgdm"], start)  # type: ignore[arg-type]
        assert torch.allclose(result["sgdm"], x, atol=1e-5, rtol=0)  # type: ignore[arg-type]
    # (b) local_adam(K) == desloc(K, K, K), bit for bit, and the replicas agree after the last sync.
    for result in results:
        assert torch.equal(result["local_adam"], result["desloc_kkk"])  # type: ignore[arg-type]
        assert torch.equal(result["local_adam"], results[0]["local_adam"])  # type: ignore[arg-type]

    # (c) the joining worker.
    traces = [r["trace"] for r in results]
    for t in range(1, steps + 1):
        records = [trace[t - 1] for trace in traces]  # type: ignore[index]
        roles = records[0]["roles"]
        assert roles == [
            r
            for r, k in ((Role.PARAMETER, 2), (Role.FIRST_MOMENT, 4), (Role.SECOND_MOMENT, 8))
            if t % k == 0
        ]
        for key, role in (
            ("x", Role.PARAMETER),
            ("first_moment", Role.FIRST_MOMENT),
            ("second_moment", Role.SECOND_MOMENT),
        ):
            befores = torch.stack([rec["before"][key] for rec in records])
            afters = [rec["after"][key] for rec in records]
            if role in roles:
                # Everyone, the joiner included, holds the mean of the pre-sync states.
                for after in afters:
                    assert torch.allclose(after, befores.mean(0), atol=1e-6), (t, key)
            elif t > join_step:
                # Not synced since the join: the joiner's state is its own.
                synced_since_join = any(
                    t2 > join_step
                    and t2 % {"x": 2, "first_moment": 4, "second_moment": 8}[key] == 0
                    for t2 in range(join_step + 1, t + 1)
                )
                if not synced_since_join:
                    assert not torch.allclose(afters[1], afters[0], atol=1e-6), (t, key)
    # The joiner's moments right after the join are fresh: u = (1 - beta1) g_hat for one step.
    first_after_join = traces[1][join_step]["before"]  # type: ignore[index]
    joined_u = first_after_join["first_moment"]
    joined_v = first_after_join["second_moment"]
    assert torch.allclose(joined_v, (joined_u / (1 - 0.9)) ** 2 * (1 - 0.95), rtol=1e-4, atol=1e-12)
    # Counters: the joiner's restart at the join and catch up to the global step at each moment sync.
    joiner_counters = results[1]["counters"]
    assert joiner_counters[join_step] == {"first_moment_steps": 1, "second_moment_steps": 1}  # type: ignore[index]
    assert joiner_counters[7]["first_moment_steps"] == 8  # type: ignore[index]  # u synced at t = 8
    assert joiner_counters[7]["second_moment_steps"] == 8  # type: ignore[index]  # v synced at t = 8
    assert results[0]["counters"][11] == {"first_moment_steps": 12, "second_moment_steps": 12}  # type: ignore[index]


# --- CLI and example ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "extra", "payloads"),
    [
        ("desloc", ["--desloc.param-period", "2"], 3 + 1),  # x at 2, 4, 6; u at 6; v at 12
        ("local_adam", ["--desloc.param-period", "3"], 6 * 3 / 3),
        (
            "favg_opt",
            [
                "--desloc.param-period",
                "3",
                "--desloc.rejoin-rank",
                "1",
                "--desloc.rejoin-step",
                "2",
            ],
            6 / 3,
        ),
        ("favg_reset", ["--desloc.param-period", "4", "--desloc.optimizer", "adopt"], 6 // 4 + 1),
    ],
)
def test_cli_trains_and_writes_the_summary(
    tmp_path: Path, method: str, extra: list[str], payloads: float
) -> None:
    out = tmp_path / "run"
    result = lowcomm("train", "--method", method, "--steps", "6", "--out", str(out), *SMALL, *extra)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and summary["steps"] == 6
    assert math.isfinite(summary["final_val_loss"])
    # Two workers: one all-reduce moves 2 (M-1)/M = 1 payload per worker. Payloads include
    # the final parameter average when the last step was not a parameter sync.
    assert summary["bytes_sent_per_worker"] == pytest.approx(
        payloads * 4 * summary["num_params"], rel=0.01
    )


def test_cli_rejects_a_bad_period() -> None:
    result = lowcomm("train", "--method", "desloc", "--desloc.param-period", "0", timeout=60)
    assert result.returncode == 2
    assert "--desloc.param-period: 0 must be >= 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_rosenbrock_example_runs(repo_root: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(repo_root / "examples" / "rosenbrock_desloc.py"), "--steps", "1500", "--workers", "16"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    distances = {
        line.split()[0]: float(line.split()[-1])
        for line in result.stdout.splitlines()
        if line.split() and line.split()[0] in {"desloc", "local_adam", "favg_opt", "favg_reset"}
    }
    assert set(distances) == {"desloc", "local_adam", "favg_opt", "favg_reset"}
    start = math.dist((-1.5, 2.0), (1.0, 1.0))
    # DES-LOC and Local Adam walk the curved valley from (-1.5, 2) to near (1, 1).
    assert distances["desloc"] < 0.1 * start and distances["local_adam"] < 0.1 * start, distances
