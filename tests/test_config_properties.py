"""Property: every ``lowcomm train`` configuration is either accepted and runs a step, or
rejected with a one-line error naming the option (exit code 2); never a traceback.

Configurations are command lines drawn over the option space: methods, worker and step
counts, network presets and overrides (zero, negative, NaN, inf), speed factors of any
length, micro-batches, clipping, model shapes (heads not dividing the width included), the
optimizer and schedule, and every method family's options, valid and invalid. Half the
examples draw only valid values for the fields (cross-field rules may still reject them).

Acceptance is checked in-process through ``lowcomm.cli.main`` with the worker spawner
replaced by a recorder. An accepted configuration then runs what a worker runs before and
during its first step, in this process: the data shard and validation set, the model, the
clock and the emulated network around a ``RecordingComm`` of the run's world size, one
strategy step, ``finish()`` and an evaluation of the deployed model. The step always uses the
virtual clock with a declared micro-batch cost (a real clock would sleep the modeled transfer
time); the configured clock is still built.
"""

from __future__ import annotations

import copy
import datetime
import io
import math
import os
import re
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lowcomm import cli
from lowcomm.comm.clock import VirtualClock, make_clock
from lowcomm.comm.emulated import NetworkComm
from lowcomm.comm.fake import RecordingComm
from lowcomm.comm.hierarchical import HierarchicalComm
from lowcomm.comm.inprocess import InProcessGroup
from lowcomm.comm.network import PRESETS
from lowcomm.config import TrainConfig
from lowcomm.data import WorkerShard, prepare_corpus, validation_batches
from lowcomm.models import build_model
from lowcomm.strategies import STRATEGIES, MicroBatchResult, build_strategy
from lowcomm.train.context import network_profile, replica_network_profile, strategy_context

# option -> (valid values, invalid values); values are command-line strings.
Choices = tuple[tuple[str, ...], tuple[str, ...]]

COMMON: dict[str, Choices] = {
    "--steps": (("1", "2", "5"), ("0", "-3")),
    "--microbatches-per-step": (("1", "2"), ("0", "-1")),
    "--max-grad-norm": (("None", "1.0", "0.5", "inf"), ("0", "-1", "nan")),
    "--bandwidth-gbps": (("10", "0.5", "inf"), ("0", "-1", "nan", "-inf")),
    "--latency-ms": (("0", "5", "0.01"), ("-1", "nan", "inf")),
    "--clock": (("real", "virtual"), ()),
    "--seconds-per-microbatch": (("None",), ("0", "-1", "nan", "inf")),
    "--seed": (("0", "7", "123456"), ("-1", str(2**70))),
    "--eval-every": (("1", "20"), ("0", "-2")),
    "--eval-batches": (("1", "3"), ("0", "-1")),
    "--collective-timeout-s": (("60", "0.5", "300"), ("0", "-5", "nan", "inf", "1e300")),
    "--micro-batch-size": (("1", "2"), ("0", "-1", "10000000")),
    "--split": (("iid", "non-iid"), ("by-book",)),
    "--model.n-layer": (("1", "2"), ("0", "-1")),
    "--model.block-size": (("8", "16"), ("0", "-4")),
    "--model.dropout": (("0.0", "0.1"), ("1.0", "-0.1", "nan")),
    "--optim.lr": (("1e-3", "0", "0.01"), ("-1", "nan", "inf")),
    "--optim.weight-decay": (("0.1", "0"), ("-1", "nan", "inf")),
    "--optim.eps": (("1e-8", "1e-6"), ("0", "-1", "nan", "inf")),
    "--optim.name": (("adamw", "muon"), ("sgd",)),
    "--optim.muon-momentum": (("0.95", "0.9"), ("1.0", "-0.1")),
    "--schedule.kind": (("constant", "cosine"), ()),
    "--schedule.warmup-steps": (("0", "3"), ("-1",)),
    "--schedule.min-lr-ratio": (("0.1", "0", "1"), ("-0.5", "2", "nan")),
    "--ranks-per-worker": (("1", "2"), ("0", "-1")),
    "--inner-network": (("datacenter", "ethernet"), ("lan",)),
    "--inner-bandwidth-gbps": (("100", "None"), ("0", "-1", "nan")),
    "--inner-latency-ms": (("0.005", "None"), ("-1", "nan", "inf")),
    "--checkpoint-every": (("None", "1", "5"), ("0", "-1")),
    "--keep-checkpoints": (("1", "2"), ("0", "-1")),
    "--stop-after": (("None", "1"), ("0", "-1", "1000")),
    "--resume": (("None", "auto"), ("/nonexistent/lowcomm-run",)),
}

FAMILY: dict[str, dict[str, Choices]] = {
    "acco": {
        "--acco.microbatches-per-phase": (("None", "1", "2"), ("0", "-1")),
        "--acco.dpu-warmup-steps": (("0", "1", "3"), ("-1",)),
        "--acco.optimizer": (("adamw", "sgd"), ()),
    },
    "local": {
        "--local.sync-every": (("1", "2", "6"), ("0", "-1")),
        "--local.inner-optimizer": (("adamw", "sgd"), ()),
        "--local.sgd-momentum": (("0", "0.9"), ("1", "-0.1", "nan")),
        "--local.pull": (("0.5", "1"), ("0", "1.5", "nan")),
        "--local.outer-lr": (("1", "0.5"), ("0", "-1", "inf", "nan")),
        "--local.outer-momentum": (("0.5", "0"), ("1", "nan")),
        "--local.gap-penalty": (("True", "False"), ()),
        "--local.penalty-epsilon": (("1e-12", "1e-3"), ("0", "inf", "nan")),
        "--local.clip": (("True", "False"), ()),
        "--local.clip-threshold": (("1", "inf", "0.5"), ("0", "nan", "-1")),
        "--local.shared-displacement": (("True", "False"), ()),
    },
    "diloco": {
        "--diloco.sync-every": (("1", "2", "16"), ("0", "-1")),
        "--diloco.inner-optimizer": (("adamw", "sgd"), ()),
        "--diloco.outer-lr": (("0.7", "0", "1"), ("-1", "nan", "inf")),
        "--diloco.outer-momentum": (("0.9", "0"), ("1", "nan")),
        "--diloco.outer-nesterov": (("True", "False"), ()),
        "--diloco.fragments": (("None", "1", "2"), ("0", "-2", "64")),
        "--diloco.overlap-steps": (("0", "1", "3"), ("-1", "100")),
        "--diloco.mixing": (("0.5", "0", "1"), ("1.5", "-0.1", "nan")),
        "--diloco.outer-delay": (("1", "2"), ("0",)),
        "--diloco.quantization": (("none", "bf16", "fp8", "int4"), ()),
        "--diloco.quantization-row-size": (("256", "1", "7"), ("0", "-1")),
        "--diloco.compensation": (("0.5", "0"), ("-1", "nan", "inf")),
        "--diloco.compensation-sign": (("fixed", "literal"), ()),
        "--diloco.transmission-gamma": (("0.4", "2"), ("0", "inf", "nan")),
    },
    "decoupled": {
        "--decoupled.sync-every": (("4", "16"), ("0", "-1")),
        "--decoupled.min-quorum": (("1",), ("0", "-1")),
        "--decoupled.grace": (("adaptive", "none"), ()),
        "--decoupled.grace-gamma": (("0.5", "0"), ("1", "-0.1", "nan")),
        "--decoupled.weighting": (("paper", "tokens", "equal"), ()),
        "--decoupled.late": (("next", "drop"), ()),
        "--decoupled.mixing": (("0.5", "0"), ("1.5", "nan")),
    },
    "desloc": {
        "--desloc.param-period": (("1", "2", "16"), ("0", "-1")),
        "--desloc.first-moment-period": (("None", "1", "3"), ("0",)),
        "--desloc.second-moment-period": (("None", "1", "6"), ("0",)),
        "--desloc.optimizer": (("adam", "adopt", "sgdm"), ()),
        "--desloc.eps": (("None", "1e-8"), ("0", "nan", "inf")),
        "--desloc.clip-rho": (("None", "1", "inf"), ("0", "-1", "nan")),
        "--desloc.fuse": (("True", "False"), ()),
        "--desloc.final-sync": (("True", "False"), ()),
        "--desloc.track-state-change": (("True", "False"), ()),
    },
}
FAMILY_OF = {name: cls.options_field for name, cls in STRATEGIES.items()}
BETAS_VALID = (("0.9", "0.999"), ("0", "0.5"))
BETAS_INVALID = (("1", "0.9"), ("nan", "0.9"), ("0.9", "-0.1"), ("0.9", "inf"))


def _pick(draw: Any, option: str, choices: Choices, valid: bool, bad_option: str | None) -> str:
    good, bad = choices
    if option == bad_option and bad:
        return str(draw(st.sampled_from(bad)))
    pool = good if valid or not bad else good + bad
    return str(draw(st.sampled_from(pool)))


INVALID_OPTIONS = sorted(
    option for table in (COMMON, *FAMILY.values()) for option, (_, bad) in table.items() if bad
)


@st.composite
def command_lines(draw: Any) -> list[str]:
    """A ``lowcomm train`` argument list. Modes: every field valid; every field valid but
    one (present, with an invalid value); or any value anywhere."""
    mode = draw(st.sampled_from(["valid", "one-invalid", "any"]))
    valid = mode != "any"
    bad_option = draw(st.sampled_from(INVALID_OPTIONS)) if mode == "one-invalid" else None
    methods = sorted(STRATEGIES)
    method = draw(st.sampled_from(methods if valid else [*methods, "no_such_method"]))
    workers = draw(st.integers(1, 4) if valid else st.sampled_from([-1, 0, 1, 3, 8, 5000]))
    argv = ["--method", method, "--workers", str(workers), "--progress", "False", "--plot", "False"]
    argv += ["--network", draw(st.sampled_from(sorted(PRESETS) + ([] if valid else ["lan"])))]
    n_head = draw(st.sampled_from([1, 2, 4] if valid else [0, 1, 2, 3, 4]))
    width = n_head * draw(st.integers(2, 8)) if valid else draw(st.sampled_from([0, 8, 12, 30]))
    argv += ["--model.n-head", str(n_head), "--model.n-embd", str(width)]
    argv += ["--model.n-layer", "1", "--model.block-size", "8", "--micro-batch-size", "2"]
    argv += ["--model.family", draw(st.sampled_from(["gpt", "gpt", "gpt", "hf-gpt2", "hf-llama"]))]
    for option, choices in COMMON.items():
        # Each option present a quarter of the time (always when it is the invalid one).
        if option == bad_option or draw(st.integers(0, 3)) == 0:
            argv += [option, _pick(draw, option, choices, valid, bad_option)]
    if draw(st.booleans()):
        count = workers if valid and workers > 0 else draw(st.integers(1, 5))
        pool = ["1", "2", "0.5"] if valid else ["1", "2", "0", "-1", "nan", "inf"]
        argv += [
            "--speed-factors",
            *draw(st.lists(st.sampled_from(pool), min_size=count, max_size=count)),
        ]
    family = FAMILY_OF.get(method)
    if valid:
        # Another family's options are refused: a valid line holds only its own.
        families = [family] if family is not None else []
    else:
        families = [family] if family is not None and draw(st.integers(0, 3)) else list(FAMILY)
    for name in FAMILY:
        for option, choices in FAMILY[name].items():
            if option == bad_option or (name in families and draw(st.integers(0, 2)) == 0):
                argv += [option, _pick(draw, option, choices, valid, bad_option)]
    if "desloc" in families and draw(st.integers(0, 2)) == 0:
        argv += [
            "--desloc.betas",
            *draw(st.sampled_from(BETAS_VALID if valid else BETAS_VALID + BETAS_INVALID)),
        ]
        rank, step = draw(
            st.sampled_from(
                [("None", "None"), ("0", "0"), ("1", "0")]
                + ([] if valid else [("0", "None"), ("-1", "0"), ("0", "-1")])
            )
        )
        argv += ["--desloc.rejoin-rank", rank, "--desloc.rejoin-step", step]
    return argv


@contextmanager
def _cwd(path: str) -> Iterator[None]:
    """(contextlib.chdir is Python 3.11+.)"""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def parse(argv: list[str]) -> tuple[TrainConfig | None, object, str]:
    """Run ``lowcomm train ARGV`` up to the spawn; (config handed to the spawner, exit code, stderr)."""
    handed: list[TrainConfig] = []

    def spawner(
        fn: object, world_size: int, args: tuple[Any, ...], **kwargs: object
    ) -> list[object]:
        assert world_size == args[0].placement.world_size
        handed.append(args[0])
        return []

    stderr = io.StringIO()
    code: object = None
    # In an empty directory: the default run directory (runs/...) of a run in the current
    # directory would be refused as already holding a run.
    with (
        tempfile.TemporaryDirectory() as empty,
        _cwd(empty),
        mock.patch("lowcomm.launch.run.spawn_workers", spawner),
        mock.patch("lowcomm.launch.run.under_torchrun", lambda: False),
        # No worker server either: nothing is spawned, and one started in this directory,
        # removed while it imports torch, dies in oneMKL's loader ("Intel oneMKL FATAL
        # ERROR: Cannot load libtorch_cpu.so" on the suite's output).
        mock.patch("lowcomm.prestart.start_forkserver", lambda: None),
        redirect_stderr(stderr),
        redirect_stdout(io.StringIO()),
    ):
        try:
            cli.main(["train", *argv])
        except SystemExit as exit_:
            code = exit_.code
    return (handed[0] if handed else None), code, stderr.getvalue()


def first_step(config: TrainConfig) -> None:
    """What a worker does up to and through its first step (worker 0, in this process; the
    other workers are recordings). A hierarchical worker's R ranks are R threads on a real
    in-process replica group: a recording cannot stand in for the other ranks, whose slices
    of a two-level all-gather differ from this one's."""
    datetime.timedelta(seconds=config.comm.collective_timeout_s)  # the process group's timeout
    profile = network_profile(config.comm)
    make_clock(
        config.comm.clock,
        speed_factor=profile.speed_factor(0),
        seconds_per_microbatch=config.comm.seconds_per_microbatch,
    )
    torch.manual_seed(config.run.seed)
    corpus = prepare_corpus(config.data)
    model = build_model(config.model, corpus.vocab_size)
    ranks = config.placement.ranks_per_worker
    if ranks == 1:
        _rank_first_step(config, corpus, model, None, 0)
        return
    group = InProcessGroup(ranks, timeout_s=120, name="replica")
    errors: list[BaseException] = []

    def rank(replica: int) -> None:
        try:
            _rank_first_step(config, corpus, copy.deepcopy(model), group.comm(replica), replica)
        except BaseException as error:
            errors.append(error)
            group.abort(f"rank {replica}: {error}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _rank_first_step(
    config: TrainConfig, corpus: Any, model: Any, replica_comm: Any, replica: int
) -> None:
    profile = network_profile(config.comm)
    clock = VirtualClock(speed_factor=profile.speed_factor(0), seconds_per_microbatch=0.05)
    comm: NetworkComm | HierarchicalComm = NetworkComm(
        RecordingComm(world_size=config.placement.workers), profile, clock
    )
    if replica_comm is not None:
        inner = NetworkComm(replica_comm, replica_network_profile(config.comm), clock)
        comm = HierarchicalComm(inner, comm, clock)
    strategy = build_strategy(config.method, model, comm, strategy_context(config), config)
    shard = WorkerShard(
        corpus,
        rank=0,
        world_size=config.placement.workers,
        seq_len=config.model.block_size,
        micro_batch_size=config.data.micro_batch_size,
        seed=config.run.seed,
        split=config.data.split,
        replica=replica,
        replicas=config.placement.ranks_per_worker,
    )
    val = validation_batches(
        corpus,
        seq_len=config.model.block_size,
        batch_size=config.data.micro_batch_size,
        num_batches=config.run.eval_batches,
    )

    def closure() -> MicroBatchResult:
        inputs, targets = shard.next_batch()
        _, loss = model(inputs, targets)
        assert loss is not None
        loss.backward()
        clock.microbatch_done()
        return MicroBatchResult(float(loss.detach()), inputs.shape[0], inputs.numel())

    stats = strategy.step(closure)
    assert stats.microbatches >= 1
    assert math.isfinite(stats.loss)
    strategy.finish()
    with strategy.deployed() as deployed, torch.no_grad():
        _, loss = deployed(*val[0])
    assert loss is not None and math.isfinite(float(loss))


FLAG = re.compile(r"--[a-z][a-z0-9.\-]*[a-z0-9]")


def check_rejection(argv: list[str], code: object, stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr)
    assert len(lines) == 1, stderr
    assert lines[0].startswith("lowcomm: error: "), stderr
    named = set(FLAG.findall(lines[0]))
    assert named & set(argv) or named & {"--vocab-size"}, f"names no given option: {stderr}"


# Generous: a failure is shrunk example by example, each a real step (the suite-wide 300 s
# limit would cut the shrinking short and hide the failing example).
@pytest.mark.timeout(900)
@settings(
    max_examples=int(__import__("os").environ.get("LOWCOMM_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(command_lines())
def test_a_configuration_is_accepted_and_steps_or_rejected_cleanly(argv: list[str]) -> None:
    config, code, stderr = parse(argv)
    if config is None:
        check_rejection(argv, code, stderr)
        event(f"rejected: {FLAG.findall(stderr)[0]}")
        return
    event(f"accepted: {config.method}")
    # What an accepted run may say on stderr: more processes than this machine's cores, and a
    # note on what the settings mean (a local-update method's steps after its last round).
    said = [
        line
        for line in stderr.splitlines()
        if not line.startswith(("lowcomm: warning: ", "lowcomm: note: "))
    ]
    assert code is None and said == [], stderr
    first_step(config)


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--workers", "two"], "--workers"),
        (["--bandwidth-gbps", "fast"], "--bandwidth-gbps"),
        (["--desloc.betas", "0.9"], "--desloc.betas"),
        (["--clock", "wall"], "--clock"),
        (["--collective-timeout-s", "inf"], "--collective-timeout-s"),
        (["--seconds-per-microbatch", "inf"], "--seconds-per-microbatch"),
        (["--optim.weight-decay", "inf"], "--optim.weight-decay"),
        (["--optim.lr", "-1"], "--optim.lr"),
        (["--speed-factors", "1", "0", "--workers", "2"], "--speed-factors"),
        (["--seed", "-1"], "--seed"),
        (["--seed", str(2**70)], "--seed"),
        (["--micro-batch-size", "10000000"], "--workers, --micro-batch-size"),
        (["--steps"], "--steps"),
        (["--ranks-per-worker", "2", "--inner-bandwidth-gbps", "-1"], "--inner-bandwidth-gbps"),
        (
            ["--model.family", "hf-llama", "--model.n-embd", "6", "--model.n-head", "2"],
            "--model.n-embd",
        ),
    ],
)
def test_values_that_once_escaped_validation_are_one_line_errors(
    argv: list[str], option: str
) -> None:
    config, code, stderr = parse(argv)
    assert config is None
    check_rejection(argv, code, stderr)
    assert stderr.startswith(f"lowcomm: error: {option}"), stderr


def test_default_fragments_fit_a_transformers_model() -> None:
    # A tiny hf-gpt2 (no `blocks.<j>.` names) has fewer parts than streaming_diloco's default 4
    # fragments: the default shrinks to a count with no empty fragment rather than refusing an
    # option the user never passed.
    argv = ["--method", "streaming_diloco", "--model.family", "hf-gpt2", "--model.n-layer", "1",
            "--model.n-embd", "2", "--model.n-head", "1", "--workers", "1", "--progress", "False", "--plot", "False",
            "--model.block-size", "8", "--micro-batch-size", "2", "--steps", "2"]  # fmt: skip
    config, _, stderr = parse(argv)
    assert config is not None, stderr
    first_step(config)
