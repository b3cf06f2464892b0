"""A method is one file: a new module in strategies/ reaches train, plan, make_strategy,
`lowcomm methods` and --help with no other edit (docs/ADDING_A_METHOD.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TOY_MODULE = '''
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from lowcomm.comm.base import Comm
from lowcomm.strategies.base import Strategy, StrategyContext
from lowcomm.strategies.ddp import DDP
from lowcomm.strategies.declaration import CostModel, Transfer


@dataclass(kw_only=True)
class ToyOptions:
    """Options of toy_ddp."""

    period: int = 3
    """T: steps between the toy's syncs."""

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"--toy.period: {self.period} must be >= 1")


class ToyDDP(DDP):
    """A toy: DDP under another name, with options of its own."""

    name: ClassVar[str] = "toy_ddp"
    options_field: ClassVar[str | None] = "toy"
    cost: ClassVar[CostModel] = CostModel(
        description="a toy",
        traffic=lambda o, t: [Transfer(1.0, 1 / o.period)],
        schedule=lambda o: f"T = {o.period}",
    )

    def __init__(
        self, model: nn.Module, comm: Comm, context: StrategyContext, options: ToyOptions | None = None
    ) -> None:
        self.options = options or ToyOptions()
        if self.options.period > 100:
            raise ValueError(f"--toy.period: {self.options.period} is too long for a toy")
        super().__init__(model, comm, context)


METHODS: tuple[type[Strategy], ...] = (ToyDDP,)
'''

PROBE = """
import contextlib, importlib.util, io, json, sys
from pathlib import Path

import pytest
import torch

import lowcomm

real = Path(lowcomm.__file__).parent / "strategies"
spec = importlib.util.spec_from_file_location(
    "lowcomm.strategies", real / "__init__.py", submodule_search_locations=[str(real), sys.argv[1]]
)
module = importlib.util.module_from_spec(spec)
sys.modules["lowcomm.strategies"] = module
spec.loader.exec_module(module)

import torch
from lowcomm.api import make_strategy
from lowcomm.cli import main
from lowcomm.comm.local import LocalComm
from lowcomm.config import TrainConfig
from lowcomm.plan import PlanConfig, make_plan

result = {}
result["train_default"] = TrainConfig().toy.period
result["plan_default"] = PlanConfig().toy.period
result["plan_schedule"] = make_plan(PlanConfig(method="toy_ddp")).schedule
toy = sys.modules["lowcomm.strategies.toy"]
strategy = make_strategy("toy_ddp", torch.nn.Linear(2, 2), LocalComm(), options=toy.ToyOptions(period=5))
result["built"] = type(strategy).__name__
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["plan", "--method", "toy_ddp", "--toy.period", "7", "--json"])
result["cli_schedule"] = json.loads(out.getvalue())["schedule"]
try:
    make_plan(PlanConfig(method="toy_ddp", toy=toy.ToyOptions(period=101)))
except ValueError as error:
    result["plan_refusal"] = str(error)
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["methods"])
result["listed"] = "toy_ddp" in out.getvalue()
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["train", "--help"])
result["help"] = "--toy.period" in out.getvalue() and "Options of toy_ddp." in out.getvalue()
print(json.dumps(result))
"""


def test_a_method_in_one_new_file_reaches_train_plan_and_the_api(tmp_path: Path) -> None:
    (tmp_path / "toy.py").write_text(textwrap.dedent(TOY_MODULE))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "train_default": 3,
        "plan_default": 3,
        "plan_schedule": "T = 3",
        "built": "ToyDDP",
        "cli_schedule": "T = 7",
        "plan_refusal": "--toy.period: 101 is too long for a toy",
        "listed": True,
        "help": True,
    }


# --- the declared cost model against the collectives the method issues ------------------------

#: Small periods so a few steps cover whole schedules (12 steps: every period below divides it).
PERIODS = {
    "acco": {"microbatches_per_phase": 1},
    "local": {"sync_every": 3},
    "diloco": {"sync_every": 4, "fragments": 2, "overlap_steps": 1},
    "desloc": {"param_period": 2, "first_moment_period": 6, "second_moment_period": 12},
    "sparseloco": {"sync_every": 4, "chunk": 64, "topk": 4},
    "demo": {"chunk": 4, "topk": 1},  # 4 x 4 blocks: the tiny GPT is almost all whole blocks
    "sparta": {"fraction": 0.05, "sync_every": 4},
}
SINGLE_PERIOD = {"param_period": 3}  # local_adam, favg_opt, favg_reset: K_u, K_v refused
WHOLE_MODEL = {
    "diloco": {"fragments": None},
    "diloco_delayed": {"fragments": None},
    "eager": {"fragments": None},
}


def _options(method: str) -> object | None:
    from lowcomm.strategies import options_class, strategy_class

    cls = strategy_class(method)
    kind = options_class(cls)
    if kind is None or cls.options_field is None:
        return None
    values = dict(PERIODS[cls.options_field])
    if method in ("local_adam", "favg_opt", "favg_reset"):
        values = dict(SINGLE_PERIOD)
    values.update(WHOLE_MODEL.get(method, {}))
    return kind(**values)


def _registered() -> list[str]:
    from lowcomm.strategies import STRATEGIES

    return sorted(STRATEGIES)


@pytest.mark.parametrize("method", _registered())
def test_declared_traffic_matches_the_collectives_issued(method: str) -> None:
    """Model payloads per step from the declaration = what the strategy puts on a recording
    communicator over 12 steps (an all-reduce of the model is 1; a reduce-scatter plus an
    all-gather of it is 1 too). CoCoDC without a clock keeps N = K, as its cost model does when
    T_c / T_s is small (its adaptive N is checked by hand in tests/test_plan.py)."""
    from _dist import closure_for, global_batch
    from lowcomm.comm import CollectiveKind, RecordingComm
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.strategies import StrategyContext, strategy_class
    from lowcomm.strategies.declaration import Timing

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    model_numel = sum(p.numel() for p in model.parameters())
    cls = strategy_class(method)
    options = _options(method)
    comm = RecordingComm(world_size=2)
    # One step beyond the 12 measured, so that no method skips a sync it could not finish.
    context = StrategyContext(total_steps=13, max_grad_norm=None)
    strategy = (
        cls(model, comm, context) if options is None else cls(model, comm, context, options=options)
    )  # type: ignore[call-arg]
    steps = 12
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(4 * steps)])
    for _ in range(steps):
        strategy.step(closure)
    strategy.finish()
    measured = 0.0
    for call in comm.calls:
        units = call.payload_bytes / (4 * model_numel)
        if call.kind is CollectiveKind.ALL_REDUCE:
            measured += units
        elif call.kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER):
            measured += units / 2
    timing = Timing(step_seconds=1e-9, all_reduce_seconds=lambda fraction: 1.0)
    # A compressed transfer (bytes_per_parameter) is an all-gather of that many bytes per
    # parameter from each worker: in fp32 model payloads, bytes_per_parameter / 4 (the two
    # workers' gathered output, halved above, is one worker's part).
    declared = sum(
        t.fraction
        * t.per_step
        * (1.0 if t.bytes_per_parameter is None else t.bytes_per_parameter / 4)
        for t in cls.cost.traffic(options, timing)
    )
    assert measured / steps == pytest.approx(declared, rel=0.05, abs=1e-3), method


@pytest.mark.parametrize("method", _registered())
def test_declared_worker_sharding_matches_the_state_held(method: str) -> None:
    """A method declaring ``shards_over_workers`` holds less state on 4 workers than on 1; the
    others hold the same."""
    from lowcomm.comm import RecordingComm
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.strategies import StrategyContext, strategy_class

    cls = strategy_class(method)
    held = []
    for workers in (1, 4):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
        options = _options(method)
        context = StrategyContext(total_steps=13)
        comm = RecordingComm(world_size=workers)
        strategy = (
            cls(model, comm, context)
            if options is None
            else cls(model, comm, context, options=options)
        )  # type: ignore[call-arg]
        held.append(strategy.state_bytes())
        strategy.finish()
    if cls.cost.shards_over_workers:
        assert held[1] < 0.9 * held[0], method
    else:
        assert held[1] == pytest.approx(held[0], rel=0.01), method


@pytest.mark.parametrize("method", _registered())
def test_declared_replica_sharding_matches_the_state_held(method: str) -> None:
    """With 2 ranks per worker, a method declaring ``shards_over_replicas`` holds less state per
    rank than a flat worker; the others hold the same. Methods that refuse hierarchical workers
    declare why."""
    from lowcomm.comm import RecordingComm
    from lowcomm.comm.hierarchical import HierarchicalComm
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.strategies import StrategyContext, strategy_class

    cls = strategy_class(method)
    if cls.hierarchical_refusal is not None:
        assert not cls.cost.shards_over_replicas, method
        return
    held = []
    for comm in (
        RecordingComm(world_size=2),
        HierarchicalComm(RecordingComm(world_size=2), RecordingComm(world_size=2)),
    ):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
        options = _options(method)
        context = StrategyContext(total_steps=13)
        strategy = (
            cls(model, comm, context)
            if options is None
            else cls(model, comm, context, options=options)
        )  # type: ignore[call-arg]
        held.append(strategy.state_bytes())
        strategy.finish()
    if cls.cost.shards_over_replicas:
        assert held[1] < 0.95 * held[0], method
    else:
        assert held[1] == pytest.approx(held[0], rel=0.01), method
