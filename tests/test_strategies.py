"""DDP and ZeRO-1: equations, reductions, communication pattern, memory."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm import CollectiveKind, LocalComm, RecordingComm, Role
from lowcomm.optim import AdamWConfig, FlatAdamW, ScheduleConfig
from lowcomm.strategies import DDP, StrategyContext, ZeRO1, strategy_class

CONTEXT = StrategyContext(
    optim=AdamWConfig(lr=3e-3, weight_decay=0.1),
    schedule=ScheduleConfig(kind="cosine", warmup_steps=3),
    total_steps=20,
)


def test_flat_adamw_follows_the_equations() -> None:
    torch.manual_seed(0)
    theta = torch.randn(50)
    grads = [torch.randn(50) for _ in range(4)]
    config = AdamWConfig(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    optimizer = FlatAdamW(theta.clone(), config)
    # Written straight from docs/ALGORITHMS.md §0.3.
    ref, m, v = theta.clone(), torch.zeros(50), torch.zeros(50)
    for s, g in enumerate(grads, start=1):
        optimizer.step(g, lr=0.01)
        ref = ref * (1 - 0.01 * 0.1)
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        ref = ref - 0.01 * (m / (1 - 0.9**s)) / ((v / (1 - 0.95**s)).sqrt() + 1e-8)
    assert torch.allclose(optimizer.master, ref, atol=1e-6)
    # ... and matches PyTorch's AdamW.
    p = torch.nn.Parameter(theta.clone())
    torch_opt = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        torch_opt.step()
    assert torch.allclose(optimizer.master, p.detach(), atol=1e-6)


def test_ddp_makes_one_gradient_all_reduce_per_step() -> None:
    comm = RecordingComm(world_size=4)
    strategy = DDP(tiny_gpt(), comm, CONTEXT)
    batches = [global_batch(s, 1) for s in range(3)]
    closure = closure_for(strategy, batches)
    for _ in range(3):
        strategy.step(closure)
    assert [c.kind for c in comm.calls] == [CollectiveKind.ALL_REDUCE] * 3
    assert all(c.role is Role.GRADIENT for c in comm.calls)
    assert comm.calls[0].numel == strategy.flat.padded_numel


def test_zero1_reduce_scatters_gradients_and_all_gathers_parameters() -> None:
    comm = RecordingComm(rank=2, world_size=4)
    unclipped = StrategyContext(optim=CONTEXT.optim, total_steps=5, max_grad_norm=None)
    strategy = ZeRO1(tiny_gpt(), comm, unclipped)
    closure = closure_for(strategy, [global_batch(0, 1)])
    strategy.step(closure)
    assert [(c.kind, c.role) for c in comm.calls] == [
        (CollectiveKind.REDUCE_SCATTER, Role.GRADIENT),
        (CollectiveKind.ALL_GATHER, Role.PARAMETER),
    ]
    assert strategy.flat.padded_numel % 4 == 0
    assert strategy.optimizer.master.numel() == strategy.flat.padded_numel // 4


def test_zero1_clipping_all_reduces_the_squared_shard_norms() -> None:
    comm = RecordingComm(rank=0, world_size=4)
    strategy = ZeRO1(tiny_gpt(), comm, CONTEXT)
    strategy.step(closure_for(strategy, [global_batch(0, 1)]))
    assert [(c.kind, c.role, c.numel) for c in comm.calls][1] == (
        CollectiveKind.ALL_REDUCE,
        Role.OTHER,
        1,
    )


def test_gradient_clipping_caps_the_update_norm() -> None:
    # The clipped gradient is left in DDP's flat buffer; lr 0 keeps the parameters fixed.
    tight = StrategyContext(optim=AdamWConfig(lr=0.0), total_steps=1, max_grad_norm=1e-3)
    strategy = DDP(tiny_gpt(), LocalComm(), tight)
    strategy.step(closure_for(strategy, [global_batch(0, 1)]))
    assert float(strategy.flat.grads.norm()) == pytest.approx(1e-3, rel=1e-3)
    loose = StrategyContext(optim=AdamWConfig(lr=0.0), total_steps=1, max_grad_norm=1e6)
    reference = DDP(tiny_gpt(), LocalComm(), loose)
    reference.step(closure_for(reference, [global_batch(0, 1)]))
    assert float(reference.flat.grads.norm()) > 1e-2  # untouched below the threshold


def test_zero1_on_identical_replicas_equals_ddp_exactly() -> None:
    # With identical replicas (the fake), the RS+AG result must equal DDP's step.
    ddp = DDP(tiny_gpt(), RecordingComm(world_size=4), CONTEXT)
    zero = ZeRO1(tiny_gpt(), RecordingComm(rank=0, world_size=1), CONTEXT)
    batches = [global_batch(s, 1) for s in range(5)]
    ddp_closure, zero_closure = closure_for(ddp, batches), closure_for(zero, batches)
    for _ in range(5):
        ddp.step(ddp_closure)
        zero.step(zero_closure)
    assert torch.allclose(flat_params(ddp.model), flat_params(zero.model), atol=1e-6)


@pytest.mark.parametrize("accumulate", [2, 3])
def test_zero1_with_accumulated_microbatches_equals_ddp(accumulate: int) -> None:
    # Unclipped (clipping would normalise away a wrong gradient scale), and the moments are
    # compared too: AdamW's update is nearly invariant to the scale of the gradient, m is not.
    context = StrategyContext(
        optim=CONTEXT.optim, schedule=CONTEXT.schedule, total_steps=5,
        microbatches_per_step=accumulate, max_grad_norm=None,
    )  # fmt: skip
    ddp, zero = DDP(tiny_gpt(), LocalComm(), context), ZeRO1(tiny_gpt(), LocalComm(), context)
    batches = [global_batch(s, 1) for s in range(5 * accumulate)]
    ddp_closure, zero_closure = closure_for(ddp, batches), closure_for(zero, batches)
    n = ddp.flat.numel
    for _ in range(5):
        assert (
            ddp.step(ddp_closure).microbatches == zero.step(zero_closure).microbatches == accumulate
        )
        assert torch.allclose(
            zero.optimizer.exp_avg[:n], ddp.optimizer.exp_avg, rtol=1e-5, atol=1e-9
        )
        assert torch.allclose(
            zero.optimizer.exp_avg_sq[:n], ddp.optimizer.exp_avg_sq, rtol=1e-5, atol=1e-12
        )
        assert torch.allclose(flat_params(ddp.model), flat_params(zero.model), atol=1e-6)
    assert not torch.allclose(flat_params(ddp.model), flat_params(tiny_gpt()))


def test_state_bytes_follow_the_memory_formulas() -> None:
    model = tiny_gpt()
    psi = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, LocalComm(), CONTEXT)
    # fp32: params 4 + grads 4 + two moments 8 bytes per parameter (params double as master).
    assert ddp.state_bytes() == 16 * ddp.flat.padded_numel
    assert ddp.flat.padded_numel == psi
    world = 4
    zero = ZeRO1(tiny_gpt(), RecordingComm(world_size=world), CONTEXT)
    padded = zero.flat.padded_numel
    # params 4 + grads 4, plus fp32 master and moments (12) and the gradient shard (4) over M.
    assert zero.state_bytes() == 8 * padded + (12 + 4) * padded // world


def test_strategies_train_a_tiny_model() -> None:
    for cls in (DDP, ZeRO1):
        strategy = cls(
            tiny_gpt(), LocalComm(), StrategyContext(optim=AdamWConfig(lr=1e-2), total_steps=30)
        )
        batch = global_batch(0, 1)
        closure = closure_for(strategy, [batch] * 30)
        losses = [strategy.step(closure).loss for _ in range(30)]
        assert losses[-1] < losses[0] - 1.0, cls.name


def test_unknown_method_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown method 'adam'.*ddp.*zero1"):
        strategy_class("adam")


#: What a strategy may import of the communication layer: the Comm/Handle protocol, the
#: runtime handed in with its context, and the communication-thread utility. Never the
#: emulation, the two-level communicator, the clocks, a concrete communicator or the launcher
#: (nor ``torch.distributed``): those reach it only through the ``Runtime``.
ALLOWED_COMM_MODULES = ("lowcomm.comm.base", "lowcomm.comm.runtime", "lowcomm.comm.overlap")
FORBIDDEN_PREFIXES = ("torch.distributed", "lowcomm.launch", "lowcomm.train", "lowcomm.cli")


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # a relative import: spell it out as the package it names
                found += [(node.lineno, f"lowcomm.strategies.{node.module or ''}")]
            elif node.module:
                found.append((node.lineno, node.module))
                # ``from lowcomm import comm`` / ``from lowcomm.comm import emulated``
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            found += [
                (node.lineno, arg.value)
                for arg in node.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            ]
    return found


def _forbidden(module: str) -> bool:
    if any(module == p or module.startswith(p + ".") for p in FORBIDDEN_PREFIXES):
        return True
    if module == "lowcomm.comm":
        return True  # the package re-exports the emulation
    if module in ALLOWED_COMM_MODULES:
        return False
    if module.startswith("lowcomm.comm."):
        # ``from lowcomm.comm.base import Comm`` also yields "lowcomm.comm.base.Comm".
        return not any(module.startswith(allowed + ".") for allowed in ALLOWED_COMM_MODULES)
    return False


def test_strategies_import_only_the_comm_protocol_and_the_runtime() -> None:
    package = Path(__file__).resolve().parents[1] / "src" / "lowcomm" / "strategies"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        for lineno, module in _imported_modules(ast.parse(path.read_text())):
            if _forbidden(module):
                offenders.append(f"{path.name}:{lineno}: {module}")
    assert len(list(package.rglob("*.py"))) >= 4
    assert offenders == []


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist",
        "from torch.distributed import all_reduce",
        "from lowcomm.comm.emulated import NetworkComm",
        "from lowcomm.comm.hierarchical import replica_group",
        "from lowcomm.comm import emulated",
        "from lowcomm.comm import NetworkComm",
        "import lowcomm.comm.hierarchical",
        "from lowcomm.comm.clock import Clock",
        "from lowcomm.comm.torch_comm import TorchComm",
        "from lowcomm.launch.groups import level_comms",
        "from lowcomm.launch import spawn_workers",
        "importlib.import_module('lowcomm.comm.emulated')",
    ],
)
def test_the_import_check_catches(source: str) -> None:
    assert any(_forbidden(module) for _, module in _imported_modules(ast.parse(source)))


@pytest.mark.parametrize(
    "source",
    [
        "from lowcomm.comm.base import Comm, Handle, Role",
        "from lowcomm.comm.runtime import Runtime, pending_state",
        "from lowcomm.comm.overlap import CommThread",
        "from lowcomm.optim.adamw import make_adamw",
        "from lowcomm.strategies.base import Strategy",
    ],
)
def test_the_import_check_allows(source: str) -> None:
    assert not any(_forbidden(module) for _, module in _imported_modules(ast.parse(source)))


# --- multi-process ---------------------------------------------------------------------


def _ddp_vs_zero1(steps: int, accumulate: int) -> tuple[torch.Tensor, ...]:
    """DDP and ZeRO-1 on this rank's rows of each global batch (split into ``accumulate``
    micro-batches): both final parameter vectors, then both first moments on ZeRO-1's shard."""
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    rank, world = comm.rank, comm.world_size
    context = StrategyContext(
        optim=CONTEXT.optim,
        schedule=CONTEXT.schedule,
        total_steps=steps,
        microbatches_per_step=accumulate,
    )
    per_micro = 4 // accumulate
    results = []
    moments = []
    for cls in (DDP, ZeRO1):
        strategy = cls(tiny_gpt(), comm, context)
        mine = []
        for step in range(steps):
            x, y = global_batch(step, world)
            rows = slice(4 * rank, 4 * rank + 4)
            for k in range(accumulate):
                part = slice(k * per_micro, (k + 1) * per_micro)
                mine.append((x[rows][part], y[rows][part]))
        closure = closure_for(strategy, mine)
        for _ in range(steps):
            strategy.step(closure)
        results.append(flat_params(strategy.model))
        moments.append(strategy.optimizer.exp_avg.clone())  # type: ignore[attr-defined]
    shard = moments[1].numel()
    ddp_moment = torch.nn.functional.pad(moments[0], (0, shard * world - moments[0].numel()))
    return results[0], results[1], ddp_moment[rank * shard : (rank + 1) * shard], moments[1]


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_zero1_equals_ddp_on_four_gloo_ranks(accumulate: int) -> None:
    from lowcomm.launch import spawn_workers

    results = spawn_workers(_ddp_vs_zero1, 4, (20, accumulate))
    start = flat_params(tiny_gpt())
    for ddp_params, zero_params, ddp_moment, zero_moment in results:
        assert not torch.allclose(ddp_params, start)  # it trained
        assert torch.allclose(ddp_params, zero_params, atol=1e-5, rtol=0)
        # The gradient's scale (sum over ranks and micro-batches / their count) shows in m.
        assert torch.allclose(ddp_moment, zero_moment, rtol=1e-4, atol=1e-8)
    assert torch.equal(results[0][0], results[3][0])  # replicas agree


def _ddp_shard(steps: int, accumulate: int) -> torch.Tensor:
    from lowcomm.comm.torch_comm import TorchComm

    comm = TorchComm()
    rank, world = comm.rank, comm.world_size
    context = StrategyContext(
        optim=CONTEXT.optim,
        schedule=CONTEXT.schedule,
        total_steps=steps,
        microbatches_per_step=accumulate,
    )
    strategy = DDP(tiny_gpt(), comm, context)
    per_micro = 4 // accumulate
    mine = []
    for step in range(steps):
        x, y = global_batch(step, world)
        rows = slice(4 * rank, 4 * rank + 4)
        for k in range(accumulate):
            part = slice(k * per_micro, (k + 1) * per_micro)
            mine.append((x[rows][part], y[rows][part]))
    closure = closure_for(strategy, mine)
    for _ in range(steps):
        strategy.step(closure)
    return flat_params(strategy.model)


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_ddp_on_n_ranks_equals_one_process_on_the_global_batch(accumulate: int) -> None:
    from lowcomm.launch import spawn_workers

    steps, world = 8, 3
    distributed = spawn_workers(_ddp_shard, world, (steps, accumulate))
    single = DDP(
        tiny_gpt(),
        LocalComm(),
        StrategyContext(optim=CONTEXT.optim, schedule=CONTEXT.schedule, total_steps=steps),
    )
    closure = closure_for(single, [global_batch(s, world) for s in range(steps)])
    for _ in range(steps):
        single.step(closure)
    reference = flat_params(single.model)
    for params in distributed:
        assert torch.allclose(params, reference, atol=1e-5, rtol=0)
