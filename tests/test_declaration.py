"""A method is one file: a new module in strategies/ reaches train, plan, make_strategy,
`lowcomm methods` and --help with no other edit (docs/ADDING_A_METHOD.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

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

PROBE = '''
import contextlib, importlib.util, io, json, sys
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
'''


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
