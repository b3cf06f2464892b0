"""Muon as the inner optimizer (--optim.name muon; diloco with it is MuLoCo): Newton-Schulz and
one step against the equations and against torch.optim.Muon, which parameters get Muon, the
refusals, the planner's state bytes, two Gloo processes and an exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from _cli import lowcomm, small_flags
from _dist import closure_for, flat_params, global_batch, tiny_gpt
from lowcomm.comm import LocalComm, RecordingComm
from lowcomm.config import ConfigError, PlacementConfig, RunConfig, TrainConfig, with_options
from lowcomm.optim import AdamWConfig, ScheduleConfig
from lowcomm.optim.muon import (
    FlatMuon,
    MuonLayout,
    lr_scale,
    muon_parameter_names,
    newton_schulz,
)
from lowcomm.plan import PlanConfig, make_plan
from lowcomm.strategies import STRATEGIES, StrategyContext
from lowcomm.strategies.co2 import CO2, LocalOptions
from lowcomm.strategies.ddp import DDP
from lowcomm.strategies.diloco import DiLoCo, DiLoCoOptions
from lowcomm.strategies.flat import FlatBuffers

MUON = AdamWConfig(name="muon", lr=3e-3, weight_decay=0.1)
CONTEXT = StrategyContext(
    optim=MUON,
    schedule=ScheduleConfig(kind="constant", warmup_steps=0),
    total_steps=40,
    max_grad_norm=None,
)


def _run(strategy: Any, steps: int, start: int = 0) -> None:
    closure = closure_for(strategy, [global_batch(s, 1) for s in range(start, start + steps)])
    for _ in range(steps):
        strategy.step(closure)


# --- the equations ---------------------------------------------------------------------------


def _ns_by_hand(g: torch.Tensor, steps: int) -> torch.Tensor:
    # X = G / ||G||_F (on the wide side), then X <- a X + b (X X^T) X + c (X X^T)^2 X.
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(8, 24), (24, 8)])
def test_newton_schulz_follows_the_quintic_and_flattens_the_spectrum(
    shape: tuple[int, int],
) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    got = newton_schulz(g, 5).double()
    # bfloat16 as the reference computes it: about 3 significant digits.
    assert torch.allclose(got, _ns_by_hand(g, 5), atol=3e-2)
    singular = torch.linalg.svdvals(got)
    # The quintic pushes every singular value into roughly [0.5, 1.5] (not exactly 1).
    assert singular.min() > 0.4 and singular.max() < 1.5
    assert got.shape == g.shape and newton_schulz(g, 5).dtype == torch.bfloat16


def test_lr_scale_conventions() -> None:
    assert lr_scale(768, 3072, "match_rms_adamw") == pytest.approx(0.2 * math.sqrt(3072))
    assert lr_scale(3072, 768, "original") == pytest.approx(2.0)
    assert lr_scale(768, 3072, "original") == 1.0


def test_one_step_follows_the_equations() -> None:
    # A flat master of a 4 x 6 matrix (Muon) then 5 loose entries (AdamW).
    torch.manual_seed(0)
    master = torch.randn(29)
    before = master.clone()
    grads = [torch.randn(29), torch.randn(29)]
    layout = MuonLayout(matrices=(_matrix(0, 4, 6),), adamw_ranges=((24, 29),), numel=29)
    config = AdamWConfig(name="muon", weight_decay=0.1, muon_momentum=0.9)
    optimizer = FlatMuon(master, config, layout)
    lr = 0.01
    for grad in grads:
        optimizer.step(grad, lr=lr)
    # By hand: B1 = 0.1 g1, B2 = 0.9 B1 + 0.1 g2; Nesterov U = 0.1 g2 + 0.9 B2.
    g1, g2 = (g[:24].view(4, 6) for g in grads)
    b2 = 0.9 * (0.1 * g1) + 0.1 * g2
    w = before[:24].view(4, 6).clone()
    for direction in (0.1 * g1 + 0.9 * (0.1 * g1), 0.1 * g2 + 0.9 * b2):
        w = w * (1 - lr * 0.1) - lr * 0.2 * math.sqrt(6) * newton_schulz(direction, 5).float()
    assert torch.allclose(master[:24].view(4, 6), w, atol=1e-6)
    # The loose entries took two plain AdamW steps.
    reference = torch.nn.Parameter(before[24:].clone())
    adamw = torch.optim.AdamW([reference], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for grad in grads:
        reference.grad = grad[24:].clone()
        adamw.step()
    assert torch.allclose(master[24:], reference.detach(), atol=1e-6)
    assert optimizer.state_bytes() == 4 * (24 + 2 * 5)


def _matrix(offset: int, rows: int, cols: int) -> Any:
    from lowcomm.optim.muon import Matrix

    return Matrix(offset, rows, cols)


def test_matches_torch_muon_and_adamw_on_the_tiny_gpt() -> None:
    model = tiny_gpt()
    flat = FlatBuffers(model)
    config = AdamWConfig(name="muon", lr=0.02, weight_decay=0.1)
    ours = FlatMuon(
        flat.params.clone(),
        config,
        MuonLayout.build(model, flat.parameters, flat.offsets, flat.padded_numel),
    )
    reference = tiny_gpt()
    names = set(muon_parameter_names(reference))
    named = dict(reference.named_parameters())
    hidden = [p for n, p in named.items() if n in names]
    rest = [p for n, p in named.items() if n not in names]
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(3):
        x, y = global_batch(step, 1)
        reference.zero_grad()
        reference(x, y)[1].backward()
        muon.step()
        adamw.step()
        grad = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        ours.step(grad, lr=0.02)
        # The same gradients on both sides: evaluate torch's at its own parameters, then
        # check ours stayed equal (so the next gradient is the same).
        assert torch.allclose(ours.master, flat_params(reference), atol=1e-6)


# --- which parameters get Muon -------------------------------------------------------------


def test_muon_takes_the_hidden_matrices_only() -> None:
    model = tiny_gpt()
    names = muon_parameter_names(model)
    assert names == [
        f"blocks.{i}.{m}.weight"
        for i in range(len(model.blocks))
        for m in ("attention.qkv", "attention.proj", "mlp.expand", "mlp.proj")
    ]
    flat = FlatBuffers(model)
    layout = MuonLayout.build(model, flat.parameters, flat.offsets, flat.padded_numel)
    # Everything else (tied embedding/head, positions, norms, biases) is AdamW's, exactly once.
    covered = sum(m.numel for m in layout.matrices) + sum(e - b for b, e in layout.adamw_ranges)
    assert covered == flat.padded_numel
    assert layout.muon_numel == sum(dict(model.named_parameters())[n].numel() for n in names)


def test_state_bytes_one_momentum_on_muon_two_moments_elsewhere() -> None:
    strategy = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT)
    layout = strategy.inner.layout  # type: ignore[attr-defined]
    psi = strategy.flat.padded_numel
    assert strategy.inner.state_bytes() == 4 * layout.muon_numel + 8 * (psi - layout.muon_numel)
    adamw = DiLoCo(tiny_gpt(), LocalComm(), StrategyContext())
    assert adamw.state_bytes() - strategy.state_bytes() == 4 * layout.muon_numel


# --- the methods ---------------------------------------------------------------------------


def test_diloco_muon_differs_from_adamw_and_resumes_exactly() -> None:
    options = DiLoCoOptions(sync_every=2)
    full = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, options)
    _run(full, 6)
    adamw_context = StrategyContext(
        optim=AdamWConfig(lr=3e-3), schedule=CONTEXT.schedule, total_steps=40, max_grad_norm=None
    )
    adamw = DiLoCo(tiny_gpt(), LocalComm(), adamw_context, options)
    _run(adamw, 6)
    assert not torch.allclose(flat_params(full.model), flat_params(adamw.model), atol=1e-4)
    first = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, options)
    _run(first, 3)  # mid-round: the momentum and moments are non-zero
    state = first.state_dict()
    assert state["inner"]["muon_momentum"].any()
    resumed = DiLoCo(tiny_gpt(seed=5), LocalComm(), CONTEXT, options)
    resumed.load_state_dict(state)
    _run(resumed, 3, start=3)
    assert torch.equal(flat_params(full.model), flat_params(resumed.model))
    assert torch.equal(full.inner.state.momentum, resumed.inner.state.momentum)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "build",
    [
        lambda: DDP(tiny_gpt(), LocalComm(), CONTEXT),
        lambda: CO2(tiny_gpt(), LocalComm(), CONTEXT, LocalOptions(sync_every=2)),
        lambda: STRATEGIES["sparta"](tiny_gpt(), LocalComm(), CONTEXT),
    ],
)
def test_other_adamw_methods_take_muon(build: Any) -> None:
    strategy = build()
    assert isinstance(getattr(strategy, "optimizer", None) or strategy.inner, FlatMuon)
    _run(strategy, 2)
    assert torch.isfinite(flat_params(strategy.model)).all()


def test_the_python_api_builds_muloco() -> None:
    from lowcomm.api import make_strategy

    strategy = make_strategy("diloco", tiny_gpt(), LocalComm(), optimizer="muon")
    assert isinstance(strategy.inner, FlatMuon)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"--optim\.name: muon with --method zero1"):
        make_strategy("zero1", tiny_gpt(), LocalComm(), optimizer="muon")


@pytest.mark.parametrize(
    ("method", "words"),
    [
        ("zero1", "ZeRO-1 shards"),
        ("acco", "flat optimizer shard"),
        ("desloc", "DES-LOC family"),
        ("local_adam", "DES-LOC family"),
        ("local_sgd", "inner optimizer is SGD"),
        ("demo", "DeMo's optimizer is its own"),
    ],
)
def test_methods_without_an_adamw_to_replace_refuse(method: str, words: str) -> None:
    cls = STRATEGIES[method]
    with pytest.raises(ValueError, match=f"--optim.name: muon with --method {method}: .*{words}"):
        if cls.options_field is None:
            cls(tiny_gpt(), RecordingComm(world_size=2), CONTEXT)
        else:
            cls(tiny_gpt(), RecordingComm(world_size=2), CONTEXT, options=None)  # type: ignore[call-arg]


def test_sgd_inner_and_several_ranks_refuse() -> None:
    with pytest.raises(ValueError, match=r"--diloco\.inner-optimizer sgd"):
        DiLoCo(tiny_gpt(), LocalComm(), CONTEXT, DiLoCoOptions(inner_optimizer="sgd"))
    with pytest.raises(ValueError, match=r"--local\.inner-optimizer sgd"):
        CO2(tiny_gpt(), LocalComm(), CONTEXT, LocalOptions(inner_optimizer="sgd"))
    config = TrainConfig(
        method="diloco",
        optim=MUON,
        placement=PlacementConfig(ranks_per_worker=2),
    )
    with pytest.raises(ConfigError, match=r"--optim\.name: muon with --ranks-per-worker 2"):
        config.validate()
    with pytest.raises(ConfigError, match="--method zero1"):
        TrainConfig(method="zero1", optim=MUON).validate()
    TrainConfig(method="diloco", optim=MUON).validate()


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"name": "sgd"}, "--optim.name"),
        ({"muon_momentum": 1.0}, "--optim.muon-momentum"),
        ({"muon_ns_steps": 0}, "--optim.muon-ns-steps"),
        ({"muon_lr_scale": "rms"}, "--optim.muon-lr-scale"),
    ],
)
def test_bad_muon_options_name_the_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        AdamWConfig(**kwargs)


def test_a_muon_setting_without_muon_is_refused() -> None:
    # It would be silently unused.
    with pytest.raises(ValueError, match=r"--optim\.muon-momentum: 0\.9 is set but --optim\.name"):
        AdamWConfig(muon_momentum=0.9)
    with pytest.raises(ValueError, match=r"--optim\.muon-ns-steps: 3 .* add --optim\.name muon"):
        AdamWConfig(muon_ns_steps=3)
    AdamWConfig(name="muon", muon_momentum=0.9, muon_ns_steps=3)


def test_a_checkpoint_of_one_optimizer_does_not_resume_under_the_other() -> None:
    from lowcomm.train.checkpoint import fingerprint

    adamw, muon = TrainConfig(method="diloco"), TrainConfig(method="diloco", optim=MUON)
    assert fingerprint(adamw)["optim"] != fingerprint(muon)["optim"]
    # An AdamW run's fingerprint names no optimizer, so checkpoints written without one resume.
    assert set(fingerprint(adamw)["optim"]) == {"lr", "betas", "eps", "weight_decay"}
    strategy = DiLoCo(tiny_gpt(), LocalComm(), CONTEXT)
    with pytest.raises(ValueError, match=r"resume with --optim\.name adamw"):
        strategy.inner.load_state_dict(
            DiLoCo(tiny_gpt(), LocalComm(), StrategyContext()).inner.state_dict()
        )


# --- the planner -----------------------------------------------------------------------------


def test_plan_prices_one_momentum_on_the_muon_share() -> None:
    base = PlanConfig(method="diloco", params="1e9", workers=4)
    adamw = make_plan(base)
    muon = make_plan(
        PlanConfig(method="diloco", params="1e9", workers=4, optim=MUON, muon_share=0.75)
    )  # fmt: skip
    # AdamW's K = 12 bytes per parameter; Muon's share keeps 4 bytes fewer (one momentum).
    assert adamw.memory_per_worker_bytes - muon.memory_per_worker_bytes == pytest.approx(3e9)
    assert muon.comm_bytes_per_worker == adamw.comm_bytes_per_worker
    # The default share of 1b: 1 - (50257 + 2048) * 2048 / 1e9.
    estimated = make_plan(PlanConfig(method="diloco", params="1b", workers=4, optim=MUON))
    share = 1 - (50257 + 2048) * 2048 / 1e9
    assert adamw.memory_per_worker_bytes - estimated.memory_per_worker_bytes == pytest.approx(
        4 * share * 1e9
    )
    with pytest.raises(ValueError, match=r"--optim\.name: muon with --method zero1"):
        make_plan(PlanConfig(method="zero1", optim=MUON))


# --- multi-process and the command line ------------------------------------------------------


def _gloo_worker(steps: int, base: str) -> dict[str, Any]:
    from lowcomm.comm.torch_comm import TorchComm
    from lowcomm.train.loop import train_worker

    comm = TorchComm()
    rank, world = comm.rank, comm.world_size

    def shard(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = global_batch(step, world)
        return x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]

    strategy = DiLoCo(tiny_gpt(), comm, CONTEXT, DiLoCoOptions(sync_every=3))
    closure = closure_for(strategy, [shard(s) for s in range(steps)])
    for _ in range(steps):
        strategy.step(closure)
    strategy.finish()
    inner = strategy.inner
    assert isinstance(inner, FlatMuon)
    # The training loop: 6 steps straight, and 3 + a checkpoint + a resume for 3 more.
    straight = train_worker(_config(Path(base) / "straight"), comm, keep_parameters=True)
    train_worker(_config(Path(base) / "resumed", stop_after=3), comm)
    resumed = train_worker(
        _config(Path(base) / "resumed", resume=str(Path(base) / "resumed")),
        comm,
        keep_parameters=True,
    )
    assert straight.parameters is not None and resumed.parameters is not None
    train_worker(_config(Path(base) / "elastic", stop_after=3), comm)  # resumed on 1 below
    return {
        "params": flat_params(strategy.model),
        "momentum": inner.state.momentum.clone(),
        "resume_diff": float((straight.parameters - resumed.parameters).abs().max()),
        "bytes_diff": abs(straight.bytes_sent - resumed.bytes_sent),
    }


def _config(out: Path, **overrides: object) -> TrainConfig:
    from lowcomm.data import DataConfig
    from lowcomm.models import ModelConfig

    config = TrainConfig(
        method="diloco",
        optim=AdamWConfig(name="muon"),
        diloco=DiLoCoOptions(sync_every=2),
        model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
        data=DataConfig(micro_batch_size=2),
        placement=PlacementConfig(workers=2),
        run=RunConfig(
            steps=6, eval_every=6, eval_batches=1, progress=False, plot=False, out=str(out)
        ),
    )
    config = with_options(config, **overrides)
    return config


def test_two_gloo_ranks_agree_resume_exactly_and_on_one_worker(tmp_path: Path) -> None:
    from lowcomm.data import DataConfig, prepare_corpus
    from lowcomm.launch import spawn_workers

    prepare_corpus(DataConfig(micro_batch_size=2))  # the tokenizer once, before the workers
    results = spawn_workers(_gloo_worker, 2, (6, str(tmp_path)), timeout_s=120)
    assert torch.equal(results[0]["params"], results[1]["params"])
    assert not torch.equal(results[0]["params"], flat_params(tiny_gpt()))
    # Each worker's Muon momentum is its own (local, never averaged).
    assert not torch.equal(results[0]["momentum"], results[1]["momentum"])
    for result in results:
        assert result["resume_diff"] == 0.0 and result["bytes_diff"] == 0
    # Elastic resume on one worker: Muon's momentum and AdamW's moments (per-worker state,
    # mid-round at step 3) are averaged over the old workers, then the run goes on.
    from lowcomm.train.checkpoint import read_rank_state
    from lowcomm.train.reshard import Layout, parameter_count, reshard, rules_for

    directory = tmp_path / "elastic" / "checkpoints" / "step-000003"
    states = [read_rank_state(directory, rank) for rank in range(2)]
    (merged,) = reshard(
        states, Layout(2), Layout(1), rules_for("diloco", parameter_count(states[0]))
    )
    old = [state["strategy"]["inner"] for state in states]
    assert not torch.equal(old[0]["muon_momentum"], old[1]["muon_momentum"])
    for key in ("muon_momentum", "adamw_exp_avg", "adamw_exp_avg_sq", "master"):
        mean = ((old[0][key].double() + old[1][key].double()) / 2).float()
        assert torch.equal(merged["strategy"]["inner"][key], mean), key
    spawn_workers(_elastic_worker, 1, (str(tmp_path),), timeout_s=120)
    summary = json.loads((tmp_path / "elastic" / "summary.json").read_text())
    assert summary["steps"] == 6 and math.isfinite(summary["final_val_loss"])


def _elastic_worker(base: str) -> None:
    from lowcomm.comm.torch_comm import TorchComm
    from lowcomm.train.loop import train_worker

    config = _config(Path(base) / "elastic", resume=str(Path(base) / "elastic"))
    config.placement.workers = 1
    train_worker(config, TorchComm())


def test_cli_refuses_muon_where_it_cannot_apply(capsys: pytest.CaptureFixture[str]) -> None:
    refused = lowcomm("train", "--method", "zero1", "--optim.name", "muon", *small_flags())
    assert refused.returncode != 0
    assert "--optim.name: muon with --method zero1" in refused.stderr
    from lowcomm.cli import run_methods

    run_methods()
    listing = " ".join(capsys.readouterr().out.split())
    assert (
        "With --optim.name muon (Muon inner steps on the hidden matrices) it is MuLoCo" in listing
    )


@pytest.mark.slow
def test_cli_trains_muloco(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = lowcomm("train", "--method", "diloco", "--optim.name", "muon", "--steps", "4",
                     "--diloco.sync-every", "2", "--out", str(out), *small_flags())  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["optim"]["name"] == "muon"
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["final_val_loss"])
