"""TrainConfig as components: each checks its own fields, the flags keep their names, and a
configuration of the flat shape (every option at the top level, as config.json was written
before the components) still loads, as a file, a run directory and a run to resume."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from _cli import lowcomm
from lowcomm.config import (
    FLAT_COMPONENTS,
    FLAT_KEYS,
    CommConfig,
    ConfigError,
    FaultConfig,
    PlacementConfig,
    RunConfig,
    TrainConfig,
    flat,
    nested,
    option_value,
    with_options,
)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DATA = Path(__file__).resolve().parent / "data"
ROOT = DATA.parents[1]
#: A run's config.json as lowcomm wrote it before the components: every option flat.
FLAT_CONFIG = DATA / "config_main.json"
#: Every flag `lowcomm train` took before the components (tyro's parser, sorted).
FLAGS_BEFORE = DATA / "train_flags_main.txt"
#: Every flag `lowcomm bench compare` took then, where TrainConfig is nested (--train.workers).
COMPARE_FLAGS_BEFORE = DATA / "bench_compare_flags_main.txt"


def _flags(kind: type) -> list[str]:
    import warnings

    import tyro

    from lowcomm.cli import _TYRO

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (get_parser is deprecated)
        parser = tyro.extras.get_parser(kind, config=_TYRO)
    return sorted({flag for a in parser._actions for flag in a.option_strings if flag[:2] == "--"})


def test_every_flag_keeps_its_name() -> None:
    from lowcomm.bench.compare import CompareBench

    assert _flags(TrainConfig) == FLAGS_BEFORE.read_text().split()
    # The components add no prefix of their own, and drop none of the level above them.
    assert _flags(CompareBench) == COMPARE_FLAGS_BEFORE.read_text().split()


def test_a_component_flag_sets_its_component() -> None:
    import tyro

    from lowcomm.cli import _TYRO

    args = ["--workers", "3", "--steps", "5", "--network", "ethernet", "--precision",
            "bf16-mixed", "--fault-mtbf-s", "60", "--micro-batch-size", "2"]  # fmt: skip
    config = tyro.cli(TrainConfig, args=args, config=_TYRO)
    assert config.placement.workers == 3 and config.run.steps == 5
    assert config.comm.network == "ethernet" and config.numerics.precision == "bf16-mixed"
    assert config.fault.fault_mtbf_s == 60.0 and config.data.micro_batch_size == 2


def test_the_quorum_and_membership_options_have_their_components() -> None:
    import tyro

    from lowcomm.cli import _TYRO
    from lowcomm.membership import MembershipOptions

    args = ["--fault-min-workers", "2", "--fault-quorum-wait-s", "60", "--membership",
            "torchft", "--membership.lighthouse", "127.0.0.1:29510"]  # fmt: skip
    config = tyro.cli(TrainConfig, args=args, config=_TYRO)
    assert (config.fault.fault_min_workers, config.fault.fault_quorum_wait_s) == (2, 60.0)
    assert config.placement.membership == "torchft"
    assert config.placement.membership_options.lighthouse == "127.0.0.1:29510"
    # A config of the flat shape spells them at its top level.
    flat_shape = {"membership": "torchft", "membership_options": {"lighthouse": "h:1"}}
    loaded = TrainConfig.from_dict({**flat_shape, "fault_min_workers": 2})
    assert loaded.placement.membership == "torchft" and loaded.fault.fault_min_workers == 2
    assert loaded.placement.membership_options == MembershipOptions(lighthouse="h:1")
    # The quorum's size alone is the fault component's to check; against --workers, the run's.
    with pytest.raises(ConfigError, match=r"^--fault-min-workers: 0 is not valid"):
        FaultConfig(fault_min_workers=0).validate()
    many = with_options(TrainConfig(), workers=2, fault_min_workers=3)
    many.fault.validate()
    with pytest.raises(ConfigError, match=r"^--fault-min-workers: 3 is not valid.*--workers \(2\)"):
        many.validate()


def test_every_option_belongs_to_one_component() -> None:
    names = [f.name for kind in FLAT_COMPONENTS.values() for f in dataclasses.fields(kind)]
    assert len(names) == len(set(names)) == len(FLAT_KEYS)
    own = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not own & set(FLAT_KEYS), "a component's option shadows a TrainConfig field"


@pytest.mark.parametrize(
    ("component", "message"),
    [
        (PlacementConfig(workers=0), "--workers: 0 is not a positive worker count"),
        (PlacementConfig(workers=4, workers_per_process=3), "--workers-per-process: 3 does not"),
        (RunConfig(steps=0), "--steps: 0 is not a positive step count"),
        (RunConfig(stop_after=5, steps=5), "--stop-after: 5 must lie in [1, --steps 5)"),
        (CommConfig(network="moon"), "--network"),
        (CommConfig(clock="real", seconds_per_microbatch=1.0), "--seconds-per-microbatch"),
        (CommConfig(collective_timeout_s=0.0), "--collective-timeout-s: 0.0"),
        (FaultConfig(fault_mtbf_s=-1.0), "--fault-mtbf-s: -1.0 is not valid"),
    ],
    ids=lambda value: type(value).__name__ if dataclasses.is_dataclass(value) else "",
)
def test_each_component_checks_its_own_fields(component: object, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        component.validate()  # type: ignore[attr-defined]
    assert str(refused.value).startswith(message)
    assert "\n" not in str(refused.value)
    # The run's check runs the component's.
    name = next(n for n, kind in FLAT_COMPONENTS.items() if isinstance(component, kind))
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        TrainConfig(**{name: component}).validate()  # type: ignore[arg-type]


def test_combinations_are_the_runs_to_check() -> None:
    """Fields of two components together: each alone is fine, the run refuses them."""
    speed = TrainConfig(
        placement=PlacementConfig(workers=2), comm=CommConfig(speed_factors=(1.0, 1.0, 2.0))
    )
    speed.placement.validate()
    speed.comm.validate()
    with pytest.raises(ConfigError, match=r"^--speed-factors: 3 values for 2 workers"):
        speed.validate()
    cuda = with_options(TrainConfig(), device="cuda", compute_model="cpu-time")
    cuda.placement.validate()
    cuda.comm.validate()
    with pytest.raises(ConfigError, match=r"^--compute-model cpu-time: on cuda"):
        cuda.validate()


def test_a_moved_field_is_an_error_naming_its_component() -> None:
    config = TrainConfig()
    with pytest.raises(AttributeError, match=r"it is config\.placement\.workers"):
        config.workers  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(AttributeError, match=r"it is config\.run\.steps"):
        config.steps = 3  # type: ignore[attr-defined]
    assert config.run.steps == RunConfig().steps


def test_options_are_set_and_read_by_their_flag_names() -> None:
    base = TrainConfig()
    changed = with_options(base, workers=2, steps=7, method="diloco", fault_seed=1)
    assert (changed.placement.workers, changed.run.steps, changed.method) == (2, 7, "diloco")
    assert option_value(changed, "fault_seed") == 1 and option_value(changed, "method") == "diloco"
    assert base.placement.workers == 4 and base.run.steps == 80  # a copy
    assert changed.comm is base.comm  # the components left alone are shared


def test_a_config_json_of_the_flat_shape_loads_into_the_components() -> None:
    values = json.loads(FLAT_CONFIG.read_text())
    assert "workers" in values and "placement" not in values  # the flat shape
    config = TrainConfig.from_dict(values)
    assert config.method == "diloco" and config.diloco.sync_every == 2
    assert (config.placement.workers, config.placement.workers_per_process) == (2, 2)
    assert (config.run.steps, config.run.seed, config.run.checkpoint_every) == (4, 3, 2)
    assert config.comm.network == "ethernet" and config.comm.speed_factors == (1.0, 1.5)
    assert config.fault.fault_detection_s == 7.0 and config.model.n_embd == 32
    # Today's shape holds the same values, and reads back to the same config.
    assert flat(json.loads(config.to_json())) == values
    assert nested(values) == json.loads(config.to_json())
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_an_option_given_both_flat_and_in_its_table_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^workers is given twice.*placement\.workers"):
        TrainConfig.from_dict({"workers": 2, "placement": {"workers": 3}})


def test_the_run_directory_name_does_not_move() -> None:
    """The default run directory hashes the settings off their defaults by their flat names,
    as before the components: the same run goes to the same directory."""
    from lowcomm.train.rundir import run_directory

    config = with_options(
        TrainConfig(method="diloco"), steps=7, precision="bf16-mixed", fault_detection_s=5.0,
        ranks_per_worker=2, latency_ms=3.0, eval_every=5, log_every=3, plot=False,
    )  # fmt: skip
    assert str(run_directory(config)) == "runs/diloco-wan-w4-s0-3d8f6c"
    assert str(run_directory(TrainConfig())) == "runs/ddp-wan-w4-s0"


def test_the_example_configs_are_of_todays_shape_and_load() -> None:
    from lowcomm.config_file import read_config

    examples = sorted((ROOT / "examples" / "configs").glob("*.toml"))
    assert examples
    for example in examples:
        values = tomllib.loads(example.read_text())
        assert not set(values) & set(FLAT_KEYS), example.name
        config = read_config(str(example))
        assert config.method == values["method"]
        assert config.placement.workers == values["placement"]["workers"]
        assert config.run.steps == values["run"]["steps"]


def test_a_flat_config_file_is_read_and_printed_in_todays_shape(tmp_path: Path) -> None:
    path = tmp_path / "flat.toml"
    path.write_text('method = "diloco"\nworkers = 2\nsteps = 6\nnetwork = "ethernet"\n')
    printed = lowcomm("train", "--config", str(path), "--print-config")
    assert printed.returncode == 0, printed.stderr
    values = tomllib.loads(printed.stdout)
    assert values["placement"]["workers"] == 2 and values["run"]["steps"] == 6
    assert values["comm"]["network"] == "ethernet" and "workers" not in values


def _metrics(run: Path) -> list[tuple[object, ...]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train_loss"], r["clock_s"]) for r in records]


def test_a_run_directory_of_the_flat_shape_is_read_and_resumed(tmp_path: Path) -> None:
    """A run stopped at step 2 whose config.json is of the flat shape (as before the
    components) resumes from it alone (``--resume DIR``) to the run taken straight; the same
    file is read by ``--config DIR`` as a new run."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    flags = ("--config", str(FLAT_CONFIG), "--workers", "2")
    first = lowcomm("train", *flags, "--out", str(straight))
    assert first.returncode == 0, first.stderr
    part = lowcomm("train", *flags, "--out", str(stopped), "--stop-after", "2")
    assert part.returncode == 0, part.stderr
    assert len(_metrics(stopped)) == 2
    old = json.loads(FLAT_CONFIG.read_text())
    (stopped / "config.json").write_text(
        json.dumps({**old, "out": str(stopped), "stop_after": 2}, indent=2) + "\n"
    )
    resumed = lowcomm("train", "--resume", str(stopped), "--workers-per-process", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert _metrics(stopped) == _metrics(straight)
    printed = lowcomm("train", "--config", str(stopped), "--print-config")
    assert printed.returncode == 0, printed.stderr
    values = tomllib.loads(printed.stdout)
    assert values["run"]["steps"] == 4 and "resume" not in values["run"]
