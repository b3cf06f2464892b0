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
    "decoupled": {"sync_every": 4, "fragments": 2, "overlap_steps": 1},
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
    from lowcomm.comm import CollectiveKind, RecordingComm, Role
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
        if call.role is Role.OTHER:
            continue  # (bookkeeping, not model payload: decoupled_diloco's replicas' exchange)
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


# --- what the planner, selftest, exports and precision checks read -----------------------------

DECLARED_TOY = '''
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from lowcomm.strategies.base import Strategy
from lowcomm.strategies.ddp import DDP
from lowcomm.strategies.declaration import CostModel, QuantizedExchange, Transfer


@dataclass(kw_only=True)
class SquashOptions:
    """Options of squash."""

    encoding: str = "none"
    """How the toy's exchange is encoded (none, bf16, fp8, int4)."""

    rows: int = 128
    """Elements per scale row."""

    fixed_count: int | None = None
    """Micro-batches per step (None: as many as communication allows)."""


class Squash(DDP):
    """A toy declaring everything a method can declare, each under its own option names."""

    name: ClassVar[str] = "squash"
    options_field: ClassVar[str | None] = "squash"
    cost: ClassVar[CostModel] = CostModel(
        description="a toy", traffic=lambda o, t: [Transfer(1.0, 1.0)]
    )
    quantized_exchange: ClassVar[QuantizedExchange | None] = QuantizedExchange("encoding", "rows")
    comm_dtypes: ClassVar[tuple[str, ...]] = ("fp32",)
    comm_dtype_refusal: ClassVar[str | None] = "the toy sends what it is given"
    quick_options: ClassVar[Mapping[str, object]] = {"rows": 64}

    @classmethod
    def takes_variable_microbatches(cls, options: Any) -> bool:
        return options.fixed_count is None

    def __init__(self, model, comm, context, options: SquashOptions | None = None) -> None:
        self.options = options or SquashOptions()
        super().__init__(model, comm, context)


METHODS: tuple[type[Strategy], ...] = (Squash,)
'''

DECLARED_PROBE = """
import importlib.util, json, sys
from dataclasses import replace
from pathlib import Path

import lowcomm

real = Path(lowcomm.__file__).parent / "strategies"
spec = importlib.util.spec_from_file_location(
    "lowcomm.strategies", real / "__init__.py", submodule_search_locations=[str(real), sys.argv[1]]
)
module = importlib.util.module_from_spec(spec)
sys.modules["lowcomm.strategies"] = module
spec.loader.exec_module(module)

import torch
from lowcomm.comm.local import LocalComm
from lowcomm.config import CommConfig, ConfigError, RunConfig, TrainConfig
from lowcomm.plan import PlanConfig, make_plan
from lowcomm.reproduce.runner import equal_tokens
from lowcomm import selftest

toy = sys.modules["lowcomm.strategies.squash"]
result = {}
plain = make_plan(PlanConfig(method="squash", workers=8))
fp8 = make_plan(PlanConfig(method="squash", workers=8, squash=toy.SquashOptions(encoding="fp8")))
result["fp8_bytes_ratio"] = fp8.comm_bytes_per_worker_per_step / plain.comm_bytes_per_worker_per_step
for name, attempt in (
    ("train_bf16", lambda: TrainConfig(method="squash", comm=CommConfig(comm_dtype="bf16")).validate()),  # noqa: E501
    ("plan_bf16", lambda: make_plan(PlanConfig(method="squash", comm_dtype="bf16"))),
):
    try:
        attempt()
        result[name] = None
    except ValueError as error:
        result[name] = str(error)
result["selftest_lists"] = "squash" in selftest.methods_to_check()
result["selftest_rows"] = selftest.quick_options("squash").rows
result["selftest_check"] = selftest._check_method(
    "squash", LocalComm(), LocalComm(), torch.device("cpu")
).startswith("4 steps")
result["exported"] = lowcomm.SquashOptions is toy.SquashOptions
base = TrainConfig(method="squash", run=RunConfig(steps=10))
result["budget"] = equal_tokens(base).run.token_budget
result["tokens_per_microbatch"] = base.tokens_per_microbatch()
fixed = replace(base, squash=toy.SquashOptions(fixed_count=2))
result["fixed_budget"] = equal_tokens(fixed).run.token_budget
print(json.dumps(result))
"""


def test_a_toy_method_gets_planner_selftest_export_and_precision_checks(tmp_path: Path) -> None:
    """A method declared in one new file, with its quantization, variable
    micro-batch count and comm dtypes under names of its own, is priced by the planner,
    refused --comm-dtype bf16 by train and plan with its reason, run by selftest with its short
    options, exported from lowcomm and given a token budget by equal-token studies, with no
    other edit."""
    (tmp_path / "squash.py").write_text(textwrap.dedent(DECLARED_TOY))
    done = subprocess.run(
        [sys.executable, "-c", DECLARED_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    refusal = (
        "--comm-dtype: bf16 with --method squash: the toy sends what it is given; use "
        "--comm-dtype fp32"
    )
    # fp8 in 128-element rows, in two steps (a reduce-scatter of encoded shards, an all-gather
    # of the re-encoded mean shards): 2 (M - 1) shards of N / M elements, 1 byte each plus a
    # 4-byte scale per row, against 2 (M - 1) / M x 4 bytes per element all-reduced.
    assert result.pop("fp8_bytes_ratio") == pytest.approx((1 + 4 / 128) / 4, rel=1e-4)
    tokens = result.pop("tokens_per_microbatch")
    assert result == {
        "train_bf16": refusal,
        "plan_bf16": refusal,
        "selftest_lists": True,
        "selftest_rows": 64,
        "selftest_check": True,
        "exported": True,
        "budget": 10 * 4 * tokens,
        "fixed_budget": None,
    }


def test_a_wrong_declaration_fails_at_discovery_naming_the_fix() -> None:
    from lowcomm.strategies import check_declaration, strategy_class
    from lowcomm.strategies.declaration import QuantizedExchange

    diloco = strategy_class("diloco")
    misnamed = type(
        "Misnamed", (diloco,), {"quantized_exchange": QuantizedExchange("quant", "rows")}
    )
    with pytest.raises(TypeError, match=r"quantized_exchange names quant, rows, but DiLoCoOpt"):
        check_declaration(misnamed)
    unexplained = type("Unexplained", (diloco,), {"comm_dtypes": ("fp32",)})
    with pytest.raises(TypeError, match="declare comm_dtype_refusal"):
        check_declaration(unexplained)
    unknown = type("Unknown", (diloco,), {"quick_options": {"sync_evry": 2}})
    with pytest.raises(TypeError, match="quick_options names sync_evry"):
        check_declaration(unknown)


def test_the_declared_dtypes_are_the_values_of_comm_dtype() -> None:
    import typing

    from lowcomm.comm.cast import COMM_DTYPES
    from lowcomm.config import CommConfig
    from lowcomm.strategies.declaration import COMM_DTYPES as DECLARED

    assert (
        DECLARED == COMM_DTYPES == typing.get_args(typing.get_type_hints(CommConfig)["comm_dtype"])
    )


def test_every_registered_options_class_is_exported_and_listed() -> None:
    """lowcomm.<Options> for every registered method, and named in __all__ (for `import *`
    and type checkers; a new method's class resolves without it, but add it there)."""
    import lowcomm
    from lowcomm.strategies import STRATEGIES
    from lowcomm.strategies.option_groups import option_groups

    for kind in option_groups(STRATEGIES).values():
        assert getattr(lowcomm, kind.__name__) is kind
        assert kind.__name__ in lowcomm.__all__, f"add {kind.__name__} to lowcomm._PUBLIC"


@pytest.mark.parametrize("method", _registered())
def test_declared_comm_dtypes_are_what_the_method_sends(method: str) -> None:
    """With --comm-dtype bf16, a method declaring bf16 puts no gradient or pseudo-gradient
    collective on the wire in float32; a method that refuses it (its reason:
    they would travel in float32) indeed sends some in float32."""
    from lowcomm.comm import RecordingComm, Role
    from lowcomm.comm.clock import make_clock
    from lowcomm.comm.emulated import NetworkComm
    from lowcomm.comm.network import NetworkProfile
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.selftest import quick_options
    from lowcomm.strategies import MicroBatchResult, StrategyContext, strategy_class

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    recording = RecordingComm(world_size=2)
    clock = make_clock("virtual", seconds_per_microbatch=0.01)
    comm = NetworkComm(
        recording, NetworkProfile.from_preset("wan"), clock, wire_dtype=torch.bfloat16
    )
    cls, options = strategy_class(method), quick_options(method)
    context = StrategyContext(total_steps=4, runtime=comm.runtime())
    strategy = (
        cls(model, comm, context) if options is None else cls(model, comm, context, options=options)
    )  # type: ignore[call-arg]
    tokens = torch.randint(0, 64, (2, 17))

    def closure() -> MicroBatchResult:
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        assert loss is not None
        loss.backward()
        clock.microbatch_done()
        return MicroBatchResult(loss=float(loss.detach()), samples=2, tokens=32)

    for _ in range(4):
        strategy.step(closure)
    strategy.finish()
    close = getattr(getattr(strategy, "thread", None), "close", None)
    if close is not None:
        close()
    cast_roles = (Role.GRADIENT, Role.PSEUDO_GRADIENT)
    dtypes = {call.dtype for call in recording.calls if call.role in cast_roles}
    # (A quantized exchange's encoded payload travels as bytes, uint8.)
    assert (torch.float32 in dtypes) == ("bf16" not in cls.comm_dtypes), (method, dtypes)


@pytest.mark.parametrize("method", _registered())
@pytest.mark.parametrize("blocks", [1, 2])
def test_quick_options_build_every_method_for_models_of_one_and_two_blocks(
    method: str, blocks: int
) -> None:
    """A method's quick options (a short run's: the selftest's, the scale benchmark's) are
    accepted for the small models those runs train; the fragmented methods' H = 2 refused a
    2-block model's 2 fragments."""
    from lowcomm.comm import LocalComm
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.selftest import quick_options
    from lowcomm.strategies import StrategyContext, strategy_class

    model = GPT(GPTConfig(n_layer=blocks, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    cls, options = strategy_class(method), quick_options(method)
    context = StrategyContext(total_steps=4)
    comm = LocalComm()
    strategy = (
        cls(model, comm, context) if options is None else cls(model, comm, context, options=options)
    )  # type: ignore[call-arg]
    strategy.finish()
