"""Sharded workers (--worker-sharding fsdp): a worker's model fully_shard-ed over its ranks on a
workers x ranks DeviceMesh, the method exchanging each rank's local shards with rank r of the
other workers, equals the replicated --ranks-per-worker form on 2 workers x 2 ranks (Gloo)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from _dist import closure_for, global_batch, tiny_gpt
from lowcomm.config import NumericsConfig, PlacementConfig, TrainConfig
from lowcomm.train.sharding import sharded_methods, sharding_refusal

M, R = 2, 2  # workers, ranks per worker
B = 2  # sequences per rank per micro-batch
STEPS, MICROBATCHES = 4, 2


def _options(method: str) -> TrainConfig:
    """Every family's round within the test's 4 steps (and two fragments for the streaming
    methods, on the tiny model's one block: the block and embeddings, the final norm)."""
    config = TrainConfig(method=method)
    config.diloco.sync_every = 2
    if method in ("streaming_diloco", "cocodc"):
        config.diloco.fragments, config.diloco.sync_every = 2, 4  # (tau = 1 < H / K)
    config.local.sync_every = 2
    config.desloc.param_period = 2
    if method == "desloc":
        config.desloc.first_moment_period = 2
        config.desloc.second_moment_period = 4
    config.desloc.track_state_change = True  # its norms are summed over a worker's shards
    config.sparta.sync_every = 2
    config.sparta.fraction = 0.25
    return config


def _batches(worker: int, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``replica`` of worker ``worker`` takes its B rows of the worker's R B rows."""
    batches = []
    for index in range(STEPS * MICROBATCHES):
        x, y = global_batch(index, M, per_rank=R * B)
        begin = worker * R * B + replica * B
        batches.append((x[begin : begin + B], y[begin : begin + B]))
    return batches


def tiny_llama() -> Any:
    """A transformers Llama of the tiny GPT's vocabulary and context, with grouped-query
    attention (4 query heads, 2 key-value heads) and untied embeddings."""
    from lowcomm.models.hf import build_hf_model

    torch.manual_seed(0)
    return build_hf_model(
        "llama", vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, n_kv_head=2,
        tie_embeddings=False,
    )  # fmt: skip


def _train(sharded: bool, export_to: Path, source: Path) -> dict[str, Any]:
    from lowcomm.comm.hierarchical import HierarchicalComm
    from lowcomm.comm.torch_comm import TorchComm
    from lowcomm.launch.groups import level_comms
    from lowcomm.models.recompute import checkpoint_blocks
    from lowcomm.strategies import StrategyContext, build_strategy
    from lowcomm.train.sharding import attach_inner, full_flat, shard_model, worker_mesh

    context = StrategyContext(total_steps=STEPS, microbatches_per_step=MICROBATCHES)
    results: dict[str, Any] = {}
    if sharded:
        mesh = worker_mesh(M, R)
        inner = TorchComm(mesh.get_group("ranks"))
        comm: Any = TorchComm(mesh.get_group("workers"))
        worker, replica = comm.rank, inner.rank
        results.update(_meta_starts(mesh, source))
    else:
        inner, outer = level_comms(R)
        comm = HierarchicalComm(inner, outer)
        worker, replica = comm.rank, comm.local_rank
    for method in sharded_methods():
        model = tiny_gpt()
        whole = sum(p.numel() for p in model.parameters())
        if sharded:
            shard_model(model, mesh["ranks"])
            attach_inner(model, inner)
        strategy = build_strategy(method, model, comm, context, _options(method))
        # (replicated: the strategy averages the gradient over the worker's ranks itself)
        closure = closure_for(strategy, _batches(worker, replica))
        extras = [strategy.step(closure).extras for _ in range(STEPS)]
        strategy.finish()
        results[f"{method}_extras"] = extras
        with strategy.deployed() as deployed:
            results[method] = full_flat(deployed)
        results[f"{method}_local"] = strategy.flat.params.numel()
        results[f"{method}_whole"] = whole
        if sharded:  # where FSDP put this rank's slices, and where a re-cut puts them
            results[f"{method}_ranges"] = _slices_two_ways(model, strategy.flat, replica)
    # --precision bf16-mixed: FSDP2's policy (bfloat16 parameters for compute, float32
    # reduction and master) against a replicated worker's autocast, both under autocast
    model = tiny_gpt()
    if sharded:
        shard_model(model, mesh["ranks"], bf16=True)
        attach_inner(model, inner)
    strategy = build_strategy("ddp", model, comm, context, _options("ddp"))
    closure = closure_for(strategy, _batches(worker, replica))
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            strategy.step(closure)
    results["ddp_bf16"] = full_flat(model)
    # --activation-checkpointing: every block recomputed in the backward (inside FSDP's
    # all-gather hooks when sharded), the same numbers
    model = tiny_gpt()
    checkpoint_blocks(model)
    if sharded:
        shard_model(model, mesh["ranks"])
        attach_inner(model, inner)
    strategy = build_strategy("ddp", model, comm, context, _options("ddp"))
    closure = closure_for(strategy, _batches(worker, replica))
    for _ in range(STEPS):
        strategy.step(closure)
    results["ddp_recomputed"] = full_flat(model)
    # a transformers Llama: its decoder layers are the units; exported whole (gathered to
    # worker 0's rank 0) as the HF directory a replicated run writes
    from lowcomm.models.export import save_model
    from lowcomm.train.sharding import exportable

    model = tiny_llama()
    if sharded:
        shard_model(model, mesh["ranks"])
        attach_inner(model, inner)
    strategy = build_strategy("diloco", model, comm, context, _options("diloco"))
    closure = closure_for(strategy, _batches(worker, replica))
    for _ in range(STEPS):
        strategy.step(closure)
    results["llama"] = full_flat(model)
    results["llama_local"] = strategy.flat.params.numel()
    if sharded:
        results["llama_ranges"] = _slices_two_ways(model, strategy.flat, replica)
        # rows that do not split evenly over the ranks (padded slices, and an empty one)
        from lowcomm.train.sharding import ShardedFlatBuffers

        odd = torch.nn.Sequential(
            torch.nn.Linear(5, 3), torch.nn.Linear(3, 7, bias=False), torch.nn.Embedding(1, 4)
        )
        shard_model(odd, mesh["ranks"])
        results["odd_ranges"] = _slices_two_ways(odd, ShardedFlatBuffers(odd, inner), replica)
    rank = worker * R + replica
    exported = exportable(model, rank, R)
    assert (exported is not None) == (rank == 0 or not sharded)
    if rank == 0:
        assert exported is not None
        save_model(exported, export_to, tokenizer_path=None)
    return results


def _slices_two_ways(model: Any, flat: Any, rank: int) -> tuple[list[Any], list[Any]]:
    """Each parameter's slice on ``rank`` as (whole start, whole stop, local start), empty
    slices as None: read from FSDP's own records at run time
    (``ShardedFlatBuffers.whole_ranges``), and rebuilt from the shapes a checkpoint records
    (``reshard.FsdpCut``, what a resume on another --ranks-per-worker cuts by)."""
    from lowcomm.train.reshard import FsdpCut
    from lowcomm.train.sharding import fsdp_layout

    layout = fsdp_layout(model)
    assert layout is not None
    cut = FsdpCut(tuple(tuple(shape) for shape in layout["flat"]), R)
    assert cut.local_numel <= flat.params.numel()  # (the buffer may pad further)
    at_run = [(start, stop, local) if stop > start else None
              for start, stop, local in flat.whole_ranges]  # fmt: skip
    rebuilt = [(start, start + numel, local) if numel else None
               for local, start, numel in cut.pieces(rank)]  # fmt: skip
    return at_run, rebuilt


def _meta_starts(mesh: Any, source: Path) -> dict[str, Any]:
    """The tiny GPT and Llama built on meta, sharded, then each rank's shards made from the
    deferred initialisation (most tensors replayed: shadows only up to 64 elements): whole
    again (gathered), and the generator's state after the build; and the Llama saved in
    ``source`` (--init-from), each rank reading its own rows of the file."""
    from lowcomm.models.deferred import build_deferred
    from lowcomm.models.init_from import preflight_init_from, sliced_start
    from lowcomm.models.options import ModelConfig
    from lowcomm.train.sharding import full_flat, materialise, shard_model

    results: dict[str, Any] = {}
    for name, build in (("gpt", tiny_gpt), ("llama", tiny_llama)):
        model, deferred = build_deferred(build, shadow_elements=64)
        results[f"{name}_rng"] = torch.get_rng_state()
        shard_model(model, mesh["ranks"])
        materialise(model, deferred, torch.device("cpu"))
        results[f"{name}_start"] = full_flat(model)
    rng = torch.get_rng_state()
    model, rows = sliced_start(preflight_init_from(source, ModelConfig(block_size=16)))
    shard_model(model, mesh["ranks"])
    materialise(model, rows, torch.device("cpu"))
    results["read"] = rows.elements_read
    results["held"] = sum(p.to_local().numel() for p in model.parameters())
    results["loaded"] = full_flat(model)
    results["drew"] = not torch.equal(torch.get_rng_state(), rng)
    return results


@pytest.mark.slow
def test_sharded_workers_equal_replicated_workers(tmp_path: Path) -> None:
    """Every method that runs sharded, one set of 4 processes each way for all of them (and a
    transformers Llama, with its export)."""
    from lowcomm.launch import spawn_workers

    methods = sharded_methods()
    assert {"ddp", "zero1", "local_sgd", "co2", "streaming_diloco", "cocodc", "eager", "desloc",
            "favg_reset", "sparta", "sparta_diloco"} <= set(methods)  # fmt: skip
    source = tmp_path / "source"
    tiny_llama().model.save_pretrained(source)
    sharded = spawn_workers(_train, M * R, (True, tmp_path / "sharded", source))
    replicated = spawn_workers(_train, M * R, (False, tmp_path / "replicated", source))
    start = torch.cat([p.detach().reshape(-1) for p in tiny_gpt().parameters()])
    differ = []
    for rank in range(M * R):
        for method in methods:
            got, want = sharded[rank][method], replicated[rank][method]
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                differ.append((method, rank, float((got - want).abs().max())))
            assert float((got - start).abs().max()) > 1e-5, method  # training moved them
            # each rank holds about 1/R of the replica (up to padding)
            whole = sharded[rank][f"{method}_whole"]
            assert sharded[rank][f"{method}_local"] <= whole // R + 64, method
            at_run, rebuilt = sharded[rank][f"{method}_ranges"]
            assert at_run == rebuilt, (method, rank)
            assert replicated[rank][f"{method}_local"] >= whole, method
            # the metrics a method reads from whole-model norms and means are the replicated
            # run's (summed over a worker's shards)
            for mine, theirs in zip(sharded[rank][f"{method}_extras"],
                                    replicated[rank][f"{method}_extras"], strict=True):  # fmt: skip
                assert mine.keys() == theirs.keys(), method
                for key, value in theirs.items():
                    assert mine[key] == pytest.approx(value, rel=1e-3, abs=1e-6, nan_ok=True), (
                        method, key,
                    )  # fmt: skip
    assert not differ, differ
    for rank in range(M * R):
        # within bfloat16 rounding of the replicated run (measured: 2e-4 apart, as far as
        # either is from float32: FSDP's policy rounds every parameter to bfloat16 for the
        # compute, autocast only a matmul's operands); 4 AdamW steps at lr 1e-3 move them at most 4e-3
        got, want = sharded[rank]["ddp_bf16"], replicated[rank]["ddp_bf16"]
        assert torch.allclose(got, want, rtol=0, atol=1e-3), float((got - want).abs().max())
        assert not torch.allclose(got, replicated[rank]["ddp"], atol=1e-6)  # bf16 differs
        # recomputed activations: the replicated run's bits, and the sharded run's numbers
        assert torch.equal(replicated[rank]["ddp_recomputed"], replicated[rank]["ddp"])
        recomputed = sharded[rank]["ddp_recomputed"]
        assert torch.allclose(recomputed, replicated[rank]["ddp"], rtol=1e-4, atol=1e-5)
        got, want = sharded[rank]["llama"], replicated[rank]["llama"]
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), float((got - want).abs().max())
        assert sharded[rank]["llama_local"] <= want.numel() // R + 64
        at_run, rebuilt = sharded[rank]["llama_ranges"]
        assert at_run == rebuilt and any(piece is not None for piece in at_run), rank
        at_run, rebuilt = sharded[rank]["odd_ranges"]
        assert at_run == rebuilt, (rank, at_run, rebuilt)
        assert (at_run[-1] is None) == (rank % R == 1)  # (one row: rank 1 holds none of it)
    _check_same_export(tmp_path / "sharded", tmp_path / "replicated")
    # the meta-device start: every rank made only its own shards, and the whole is the CPU
    # build's bit for bit, the generator left where the CPU build leaves it
    for name, build in (("gpt", tiny_gpt), ("llama", tiny_llama)):
        want = torch.cat([p.detach().reshape(-1) for p in build().parameters()])
        rng = torch.get_rng_state()
        for rank in range(M * R):
            assert torch.equal(sharded[rank][f"{name}_start"], want), name
            assert torch.equal(sharded[rank][f"{name}_rng"], rng), name
    # --init-from: each rank read only its own rows of the file (no padding is read), and the
    # whole is what a replicated worker loads
    from lowcomm.models.hf import load_pretrained

    loaded = load_pretrained(source, transformers_config(source))
    want = torch.cat([p.detach().reshape(-1) for p in loaded.parameters()])
    for rank in range(M * R):
        assert torch.equal(sharded[rank]["loaded"], want)
        assert 0 < sharded[rank]["read"] <= sharded[rank]["held"] < 0.6 * want.numel()
        assert not sharded[rank]["drew"]  # loading draws no random numbers
    assert sum(sharded[rank]["read"] for rank in range(R)) == want.numel()


def transformers_config(directory: Path) -> Any:
    import transformers

    return transformers.AutoConfig.from_pretrained(directory)


def _check_same_export(mine: Path, theirs: Path) -> None:
    """Two model directories hold the same files, config and (to float32 tolerance) weights."""
    from safetensors.torch import load_file

    assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert json.loads((mine / "config.json").read_text()) == json.loads(
        (theirs / "config.json").read_text()
    )
    got, want = (load_file(d / "model.safetensors") for d in (mine, theirs))
    assert sorted(got) == sorted(want) and len(want) > 10
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, rtol=1e-4, atol=1e-5), name


def test_other_methods_and_values_are_refused_in_one_line() -> None:
    assert sharding_refusal("ddp", "replicate", 1) is None
    assert sharding_refusal("diloco", "fsdp", 2) is None
    for method in ("acco", "dpu", "wp", "demo", "sparseloco"):
        refusal = sharding_refusal(method, "fsdp", 2)
        assert refusal is not None and "--worker-sharding fsdp" in refusal and method in refusal
        assert "replicate" in refusal and "\n" not in refusal
    assert "DCT" in str(sharding_refusal("demo", "fsdp", 2))
    typo = sharding_refusal("ddp", "fsdb", 2)
    assert typo is not None and "'fsdb'" in typo and "replicate" in typo
    alone = sharding_refusal("ddp", "fsdp", 1)
    assert alone is not None and "--ranks-per-worker" in alone


# --- end to end through the command line ---------------------------------------------------------

FLAGS = (
    "train",
    "--workers", "2", "--ranks-per-worker", "2", "--steps", "4", "--eval-every", "4",
    "--eval-batches", "2", "--model.n-layer", "2", "--model.n-embd", "32", "--model.n-head", "2",
    "--model.block-size", "16", "--micro-batch-size", "2", "--progress", "False", "--plot", "False",
    "--seconds-per-microbatch", "0.01",
)  # fmt: skip


@pytest.mark.slow
def test_a_sharded_run_stops_resumes_and_exports_what_a_replicated_run_does(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    from _cli import lowcomm

    replicated, sharded = tmp_path / "replicated", tmp_path / "sharded"
    done = lowcomm(
        *FLAGS, "--method", "diloco", "--diloco.sync-every", "2", "--out", str(replicated)
    )
    assert done.returncode == 0, done.stderr
    common = (*FLAGS, "--method", "diloco", "--diloco.sync-every", "2", "--worker-sharding", "fsdp")
    stopped = lowcomm(
        *common, "--checkpoint-every", "2", "--stop-after", "2", "--out", str(sharded)
    )
    assert stopped.returncode == 0, stopped.stderr
    resumed = lowcomm(*common, "--resume", str(sharded), "--out", str(sharded))
    assert resumed.returncode == 0, resumed.stderr
    theirs_summary = json.loads((replicated / "summary.json").read_text())
    mine_summary = json.loads((sharded / "summary.json").read_text())
    assert mine_summary["final_val_loss"] == pytest.approx(
        theirs_summary["final_val_loss"], rel=1e-5
    )
    # per rank, P the parameters' bytes: replicated, parameters, gradients, anchor and outer
    # momentum whole (4P) and the AdamW moments split over the 2 ranks (P): 5P; sharded,
    # everything halved: (2 + 2 + 2)P / 2 = 3P (up to padding)
    rank_ratio = mine_summary["state_bytes_per_rank"] / theirs_summary["state_bytes_per_rank"]
    assert rank_ratio == pytest.approx(3 / 5, rel=0.02)
    worker = mine_summary["state_bytes_per_worker"] / mine_summary["state_bytes_per_rank"]
    assert worker == pytest.approx(2, rel=0.02)  # a sharded worker's is the sum of its ranks
    assert mine_summary["peak_memory_bytes_per_rank"] > mine_summary["state_bytes_per_rank"]
    # lowcomm plan --memory-model lowcomm prices those states (what its peak doubles)
    from lowcomm.plan import PlanConfig, lowcomm_state_bytes, method_options

    for summary, sharding in ((mine_summary, "fsdp"), (theirs_summary, "replicate")):
        plan = PlanConfig(method="diloco", workers=2, ranks_per_worker=2, worker_sharding=sharding)
        planned = lowcomm_state_bytes(plan, method_options(plan)[0].cost) * summary["num_params"]
        assert summary["state_bytes_per_rank"] == pytest.approx(planned, rel=0.02), sharding
    # FSDP's collectives are charged to the inner link: per step (one micro-batch) every
    # parameter is all-gathered for the forward, a block's again for its backward, and every
    # gradient reduce-scattered; at R = 2 each sends half of the fp32 bytes: between 1 and 1.5
    # model's bytes per step (the embeddings, in the root unit, are gathered once)
    mine_inner = mine_summary["levels"]["inner"]
    model_bytes = 4 * mine_summary["num_params"]
    per_step = mine_inner["bytes_sent_per_rank"] / mine_summary["steps"] / model_bytes
    assert 1.0 < per_step < 1.5, per_step
    assert mine_inner["exposed_comm_s"] > 0  # the clock waited for them
    # the outer link carries the same pseudo-gradients (replicated: each rank its 1/R slice)
    assert mine_summary["levels"]["outer"] == pytest.approx(theirs_summary["levels"]["outer"])
    # the export is whole (gathered from the shards) and the replicated run's model
    mine, theirs = (load_file(d / "model" / "model.safetensors") for d in (sharded, replicated))
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.allclose(mine[name], tensor, rtol=1e-4, atol=1e-6), name
    # each rank's checkpoint file holds its own shards: about half a replica's model
    held = []
    for run in (sharded, replicated):
        final = sorted((run / "checkpoints").glob("step-*"))[-1]
        rank0 = torch.load(final / "rank0.pt", weights_only=True)
        held.append(sum(t.numel() for t in rank0["model"].values()))
    assert held[0] < 0.6 * held[1]


@pytest.mark.slow
def test_a_sharded_bf16_mixed_run_all_gathers_bfloat16_parameters(tmp_path: Path) -> None:
    from _cli import lowcomm

    done = lowcomm(
        *FLAGS, "--method", "ddp", "--worker-sharding", "fsdp", "--precision", "bf16-mixed",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert math.isfinite(summary["final_val_loss"])
    # per step the all-gathers move bfloat16 parameters (half of float32's bytes), the
    # reduce-scatter float32 gradients: between 0.5 and 1 model's float32 bytes per rank (the
    # float32 run's: between 1 and 1.5, see above)
    model_bytes = 4 * summary["num_params"]
    inner = summary["levels"]["inner"]["bytes_sent_per_rank"]
    assert 0.5 < inner / summary["steps"] / model_bytes < 1.0


def test_the_command_line_refuses_what_does_not_shard_yet() -> None:
    from _cli import lowcomm

    refused = lowcomm(
        *FLAGS, "--method", "demo", "--worker-sharding", "fsdp", "--out", "/nonexistent/x"
    )
    assert refused.returncode == 2 and "--worker-sharding fsdp" in refused.stderr
    assert "demo" in refused.stderr and "Traceback" not in refused.stderr


def test_sharded_checkpoints_resume_on_other_workers_and_ranks(tmp_path: Path) -> None:
    from lowcomm.train import checkpoint

    config = TrainConfig(
        method="ddp",
        placement=PlacementConfig(workers=2, ranks_per_worker=2, worker_sharding="fsdp"),
    )
    written = checkpoint.fingerprint(config)
    for rank in range(4):
        checkpoint.write_rank_state(tmp_path, 2, rank, {"step": 2})
    checkpoint.commit_checkpoint(tmp_path, 2, 4, written)
    assert checkpoint.find_latest(tmp_path, 4, written)[0] == 2
    fewer = checkpoint.fingerprint(
        TrainConfig(
            method="ddp",
            placement=PlacementConfig(workers=1, ranks_per_worker=2, worker_sharding="fsdp"),
        )
    )
    assert checkpoint.find_latest(tmp_path, 2, fewer)[0] == 2  # re-sharded over the workers
    other_ranks = checkpoint.fingerprint(
        TrainConfig(
            method="ddp",
            placement=PlacementConfig(workers=1, ranks_per_worker=4, worker_sharding="fsdp"),
        )
    )
    assert checkpoint.find_latest(tmp_path, 4, other_ranks)[0] == 2  # slices re-cut
    # nor resumed replicated: another --worker-sharding is another run
    replicated = checkpoint.fingerprint(
        TrainConfig(
            method="ddp",
            placement=PlacementConfig(workers=2, ranks_per_worker=2),
        )
    )
    with pytest.raises(checkpoint.CheckpointError, match="worker_sharding='fsdp'"):
        checkpoint.find_latest(tmp_path, 4, replicated)


@pytest.mark.slow
def test_sharded_workers_resume_on_other_workers_and_ranks_as_replicated_workers_do(
    tmp_path: Path,
) -> None:
    """zero1, 2 workers x 2 ranks stopped after 3 of 4 steps, resumed on 1 worker x 4 ranks:
    the FSDP slices of each rank r joined over the workers (zero1's optimizer shards joined
    for the new worker count), then joined whole and cut again for 4 ranks; the same run as a
    replicated checkpoint resumed so (test_elastic.py has the rules' unit tests)."""
    from _cli import lowcomm

    runs = {}
    for sharding in ("replicate", "fsdp"):
        out = runs[sharding] = tmp_path / sharding
        stopped = lowcomm(
            *FLAGS, "--method", "zero1", "--worker-sharding", sharding, "--stop-after", "3",
            "--out", str(out),
        )  # fmt: skip
        assert stopped.returncode == 0, stopped.stderr
        resumed = lowcomm(
            "train", "--resume", str(out), "--workers", "1", "--ranks-per-worker", "4",
            "--out", str(out),
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
    _check_same_resume(runs["fsdp"], runs["replicate"])
    four = json.loads((runs["fsdp"] / "summary.json").read_text())
    assert four["ranks_per_worker"] == 4


def _check_same_resume(sharded: Path, replicated: Path) -> None:
    from safetensors.torch import load_file

    mine, theirs = (json.loads((d / "summary.json").read_text()) for d in (sharded, replicated))
    assert mine["workers"] == 1 and mine["membership_changes"] == theirs["membership_changes"]
    assert mine["final_val_loss"] == pytest.approx(theirs["final_val_loss"], rel=1e-5)
    exported = [load_file(d / "model" / "model.safetensors") for d in (sharded, replicated)]
    for name, tensor in exported[1].items():
        assert torch.allclose(exported[0][name], tensor, rtol=1e-4, atol=1e-6), name


def test_the_plan_prices_fsdp_traffic_and_memory_per_rank() -> None:
    from lowcomm.plan import PlanConfig, check_plan, make_plan

    common: dict[str, Any] = {"method": "diloco", "params": "1b", "workers": 4,
                              "ranks_per_worker": 4}  # fmt: skip
    replicated = make_plan(PlanConfig(**common))
    sharded = make_plan(PlanConfig(**common, worker_sharding="fsdp"))
    # every state sharded: per rank a quarter of the replica's (2 + 2 + 2 x 2 + 12) bytes per
    # parameter, where replicated ranks split only the AdamW moments
    assert sharded.memory_per_worker_bytes == pytest.approx(20e9)
    assert sharded.memory_per_rank_bytes == pytest.approx(5e9)
    assert replicated.memory_per_rank_bytes == replicated.memory_per_worker_bytes > 10e9
    # per step, two all-gathers of the fp32 parameters and a reduce-scatter of the gradients,
    # each sending 3/4 of the model per rank
    assert sharded.inner_bytes_per_rank_per_step == pytest.approx(3 * 0.75 * 4e9)
    assert sharded.outer_bytes_per_rank_per_step == replicated.outer_bytes_per_rank_per_step
    # bf16-mixed: the all-gathers move bfloat16 parameters, the reduce-scatter fp32 gradients
    mixed = make_plan(PlanConfig(**common, worker_sharding="fsdp", precision="bf16-mixed"))
    assert mixed.inner_bytes_per_rank_per_step == pytest.approx(0.75 * (2 * 2e9 + 4e9))
    with pytest.raises(ValueError, match="--worker-sharding fsdp: --method demo"):
        check_plan(PlanConfig(method="demo", workers=2, ranks_per_worker=2,
                              worker_sharding="fsdp"))  # fmt: skip
    with pytest.raises(ValueError, match="--ranks-per-worker 1 leaves nothing"):
        PlanConfig(method="ddp", worker_sharding="fsdp")
    # --memory-model lowcomm: a rank's float32 states (diloco: parameters, gradients, moments,
    # anchor and outer momentum: 24 bytes per parameter over 4 ranks) twice (the final
    # checkpoint copies them), FSDP's gathered block (float32 parameters and gradients of one
    # of 16 blocks) and the process
    lowcomm = make_plan(PlanConfig(**common, worker_sharding="fsdp", memory_model="lowcomm",
                                   n_layer=16, process_bytes=0.3e9))  # fmt: skip
    assert lowcomm.memory_per_rank_bytes == pytest.approx(0.3e9 + 2 * 6e9 + 8e9 / 16)
    replicated = make_plan(PlanConfig(**common, memory_model="lowcomm", process_bytes=0))
    assert replicated.memory_per_rank_bytes == pytest.approx(2 * (4 + 4 + 8 / 4 + 8) * 1e9)


def test_activation_checkpointing_recomputes_each_block_and_keeps_the_gradients() -> None:
    from _dist import global_batch
    from lowcomm.models.recompute import checkpoint_blocks

    plain, recomputed = tiny_gpt(), tiny_gpt()
    calls: list[int] = []
    for block in recomputed.blocks:
        forward = block.forward
        block.forward = lambda x, forward=forward: (calls.append(1), forward(x))[1]
    assert checkpoint_blocks(recomputed) == len(recomputed.blocks)
    x, y = global_batch(0, 1)
    for model in (plain, recomputed):
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
    assert len(calls) == 2 * len(recomputed.blocks)  # once more in the backward
    assert [name for name, _ in plain.named_parameters()] == [
        name for name, _ in recomputed.named_parameters()
    ]  # no wrapper level in the names (checkpoints, exports)
    for mine, theirs in zip(recomputed.parameters(), plain.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert torch.equal(mine.grad, theirs.grad)
    # a transformers Llama's decoder layers are its blocks (called with keyword arguments)
    plain, recomputed = tiny_llama(), tiny_llama()
    assert checkpoint_blocks(recomputed) == 2
    for model in (plain, recomputed):
        _, loss = model(x[:, :16], y[:, :16])
        assert loss is not None
        loss.backward()
    for mine, theirs in zip(recomputed.parameters(), plain.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert torch.equal(mine.grad, theirs.grad)
    with pytest.raises(ValueError, match="--activation-checkpointing: Linear has no list"):
        checkpoint_blocks(torch.nn.Linear(2, 2))
    config = TrainConfig(numerics=NumericsConfig(activation_checkpointing=True))
    config.model.family = "hf-llama"
    config.validate()


class _CountingComm:
    """Forwards to a communicator, noting the thread of every collective issued on it."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.threads: list[int] = []

    @property
    def rank(self) -> int:
        return int(self.raw.rank)

    @property
    def world_size(self) -> int:
        return int(self.raw.world_size)

    def all_reduce(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        import threading

        self.threads.append(threading.get_ident())
        return self.raw.all_reduce(tensor, **kwargs)

    def barrier(self) -> Any:
        return self.raw.barrier()


def _fsdp_charges_per_microbatch() -> dict[str, Any]:
    import threading

    from lowcomm.comm.base import CollectiveKind
    from lowcomm.comm.clock import VirtualClock
    from lowcomm.comm.emulated import NetworkComm
    from lowcomm.comm.network import NetworkProfile
    from lowcomm.comm.torch_comm import TorchComm
    from lowcomm.train.sharding import (
        ShardedFlatBuffers,
        charge_fsdp_collectives,
        shard_model,
        worker_mesh,
    )

    mesh = worker_mesh(1, R)
    counting = _CountingComm(TorchComm(mesh.get_group("ranks")))
    clock = VirtualClock(seconds_per_microbatch=0.1)
    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=1.0)
    inner = NetworkComm(counting, profile, clock)  # type: ignore[arg-type]
    model = shard_model(tiny_gpt(), mesh["ranks"])
    charge_fsdp_collectives(model, inner)
    flat = ShardedFlatBuffers(model, inner)
    steps = 2
    for step in range(steps):
        flat.zero_grads()
        for micro in range(MICROBATCHES):
            x, y = global_batch(step * MICROBATCHES + micro, R, per_rank=B)
            with clock.microbatch():  # (0.1 s of declared compute each)
                _, loss = model(x[:B], y[:B])
                assert loss is not None
                loss.backward()
        flat.sync_grads()
    return {
        "exchanges": len(counting.threads),
        "main_thread": all(t == threading.get_ident() for t in counting.threads),
        "steps": steps,
        "gathers": inner.calls_by_kind[CollectiveKind.ALL_GATHER],
        "scatters": inner.calls_by_kind[CollectiveKind.REDUCE_SCATTER],
        "modeled": inner.modeled_comm_s,
        "exposed": inner.exposed_comm_s,
        "now": clock.now(),
    }


def test_fsdp_collectives_are_charged_once_per_microbatch_from_the_main_thread() -> None:
    """FSDP's all-gathers and reduce-scatters are noted where FSDP issues them and charged
    from the main thread once per micro-batch: one launch-time exchange each, none inside
    FSDP's hooks; every one still charged in full and waited for, as if charged on the spot."""
    from lowcomm.launch import spawn_workers

    for result in spawn_workers(_fsdp_charges_per_microbatch, R):
        assert result["exchanges"] == result["steps"] * MICROBATCHES
        assert result["main_thread"]
        assert result["gathers"] > result["steps"] * MICROBATCHES  # several units per pass
        assert result["scatters"] >= result["steps"] * MICROBATCHES
        compute = 0.1 * result["steps"] * MICROBATCHES
        assert result["now"] == pytest.approx(compute + result["modeled"], rel=1e-12)
        assert result["exposed"] == pytest.approx(result["modeled"], rel=1e-12)


def _mesh_timeouts(timeout_s: float) -> list[float]:
    from lowcomm.train.sharding import worker_mesh

    mesh = worker_mesh(1, R, timeout_s=timeout_s)
    return [
        mesh.get_group(name)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for name in ("workers", "ranks")
    ]


def test_a_sharded_workers_mesh_groups_take_the_runs_collective_timeout() -> None:
    """The DeviceMesh's groups (FSDP's collectives, the method's) time out as the run's other
    groups do (--collective-timeout-s, with the process group's margin), not after torch's
    default."""
    from lowcomm.comm.torch_comm import process_group_timeout
    from lowcomm.launch import spawn_workers

    expected = process_group_timeout(7.0).total_seconds()
    for timeouts in spawn_workers(_mesh_timeouts, R, (7.0,)):
        assert timeouts == [expected, expected]


def _host_group_members() -> dict[str, Any]:
    import torch.distributed as dist

    from lowcomm.comm.base import Role
    from lowcomm.comm.clock import VirtualClock
    from lowcomm.comm.emulated import NetworkComm
    from lowcomm.comm.network import NetworkProfile
    from lowcomm.comm.torch_comm import TorchComm
    from lowcomm.train.sharding import host_groups, worker_mesh

    mesh = worker_mesh(M, R)
    ranks, workers = host_groups(mesh, 30.0)
    rank = dist.get_rank()
    clock = VirtualClock(seconds_per_microbatch=0.1)
    profile = NetworkProfile(name="t", bandwidth_gbps=1.0, latency_ms=1.0)
    inner = NetworkComm(TorchComm(mesh.get_group("ranks")), profile, clock, bookkeeping=ranks)
    tensor = torch.full((4,), float(rank))
    inner.all_reduce(tensor, op="sum", role=Role.GRADIENT).wait()
    return {
        "rank": rank,
        "ranks": dist.get_process_group_ranks(ranks._group),
        "workers": dist.get_process_group_ranks(workers._group),
        "sum": tensor.tolist(),
        "now": clock.now(),
        "modeled": inner.modeled_comm_s,
    }


def test_a_sharded_workers_host_groups_are_its_mesh_groups_on_gloo() -> None:
    """On a GPU the virtual clock agrees on launch times on Gloo groups of the mesh's own
    groups: this rank's worker's ranks and rank r of every worker."""
    from lowcomm.launch import spawn_workers

    for result in spawn_workers(_host_group_members, M * R):
        rank = result["rank"]
        worker, replica = divmod(rank, R)
        assert result["ranks"] == [worker * R + r for r in range(R)]
        assert result["workers"] == [w * R + replica for w in range(M)]
        assert result["sum"] == [float(sum(result["ranks"]))] * 4
        assert result["now"] == pytest.approx(result["modeled"], rel=1e-12)
