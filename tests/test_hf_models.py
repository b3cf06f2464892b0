"""Any Hugging Face causal LM in and out: tiny random models of five families,
built with transformers and saved with save_pretrained here, go --init-from -> 4 steps of
diloco on 2 workers -> OUT/model/ -> transformers alone; refusals; the chunked loss."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as functional

from _cli import lowcomm

transformers = pytest.importorskip("transformers", reason="the HF families need transformers")

from lowcomm.config import PlacementConfig, RunConfig  # noqa: E402
from lowcomm.data import DataConfig, prepare_corpus  # noqa: E402
from lowcomm.models import ModelConfig, build_model  # noqa: E402
from lowcomm.models import loss as loss_module  # noqa: E402
from lowcomm.models.export import load_model  # noqa: E402
from lowcomm.models.hf import HFCausalLM  # noqa: E402
from lowcomm.models.loss import chunked_cross_entropy  # noqa: E402

#: `lowcomm train` flags of the runs here: 2 workers, 16-token blocks, micro-batches of 2.
RUN = (
    "--workers", "2", "--model.block-size", "16", "--micro-batch-size", "2",
    "--eval-every", "100", "--eval-batches", "2", "--progress", "False", "--plot", "False",
    "--seconds-per-microbatch", "0.01",
)  # fmt: skip
DILOCO = ("--method", "diloco", "--steps", "4", "--diloco.sync-every", "2")

FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gpt2")


def _config(family: str, vocab_size: int) -> Any:
    """A tiny config of each family, in the shapes modern models use."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64, "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": None,
    }  # fmt: skip
    if family == "llama":  # grouped-query attention, untied head, another rope base
        return transformers.LlamaConfig(
            **common, num_key_value_heads=2, intermediate_size=48, tie_word_embeddings=False,
            rope_theta=1e5,
        )  # fmt: skip
    if family == "qwen2":  # q/k/v projections with bias
        return transformers.Qwen2Config(**common, num_key_value_heads=2, intermediate_size=48)
    if family == "mistral":
        return transformers.MistralConfig(**common, num_key_value_heads=2, intermediate_size=48)
    if family == "gemma":  # one key-value head, head width not hidden / heads, tied
        return transformers.GemmaConfig(
            **common, num_key_value_heads=1, intermediate_size=48, head_dim=16
        )
    return transformers.GPT2Config(
        vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family saved with save_pretrained and the bundled corpus's tokenizer (as a
    PreTrainedTokenizerFast); the embeddings have 7 rows more than the tokenizer's tokens, as
    real models pad theirs."""
    corpus = prepare_corpus(DataConfig(micro_batch_size=2))
    root = tmp_path_factory.mktemp("hf")
    directories = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            _config(family, corpus.vocab_size + 7)
        )
        directory = root / family
        model.save_pretrained(directory)
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(corpus.tokenizer_path), eos_token="<|endoftext|>"
        )
        tokenizer.save_pretrained(directory)
        directories[family] = directory
    return directories


def _refusal(*args: str) -> str:
    """The one line a refused `lowcomm train` prints (exit 2, no worker started)."""
    result = lowcomm("train", *RUN, "--steps", "2", *args)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowcomm: error: "), result.stderr[-3000:]
    assert "workers connected" not in result.stdout
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_goes_in_trains_and_comes_out_for_transformers_alone(
    family: str, saved_models: dict[str, Path], tmp_path: Path
) -> None:
    source, out = saved_models[family], tmp_path / "run"
    # GPT-2's dropout draws from the process-global generator: its workers are processes.
    done = lowcomm(
        "train", *RUN, *DILOCO, "--init-from", str(source), "--out", str(out),
        processes=family == "gpt2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    exported = out / "model"

    # The architecture and config are the source's; only the weights changed (float32, said).
    mine, theirs = (json.loads((d / "config.json").read_text()) for d in (exported, source))
    assert mine.pop("dtype") == "float32"
    theirs.pop("dtype", None)
    assert mine == theirs
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (source / name).read_bytes()
    before = transformers.AutoModelForCausalLM.from_pretrained(source)
    after = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert type(after) is type(before)
    assert not all(
        torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters(), strict=True)
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert len(tokenizer) == len(transformers.AutoTokenizer.from_pretrained(source))

    # transformers' logits equal lowcomm's on the same weights and tokens.
    ours = load_model(out)
    idx = torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = after.eval()(input_ids=idx).logits
        logits, _ = ours(idx)
    assert logits is not None
    assert (logits - expected).abs().max().item() <= 1e-5

    # `lowcomm eval` equals transformers' loss on the same batches (the run's validation).
    _check_eval_equals_transformers(out, after)


def _check_eval_equals_transformers(out: Path, hf: Any) -> None:
    from lowcomm.config import TrainConfig
    from lowcomm.data import validation_batches
    from lowcomm.use import EvalConfig, evaluate

    run = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
    batches = validation_batches(
        prepare_corpus(run.data), seq_len=run.model.block_size,
        batch_size=run.data.micro_batch_size, num_batches=run.run.eval_batches,
    )  # fmt: skip
    losses = []
    with torch.no_grad():
        for inputs, targets in batches:
            logits = hf(input_ids=inputs).logits
            losses.append(float(functional.cross_entropy(logits.flatten(0, 1), targets.flatten())))
    result = evaluate(EvalConfig(path=str(out)))
    assert result["batches"] == len(losses)
    assert abs(result["val_loss"] - sum(losses) / len(losses)) <= 1e-5


@pytest.mark.slow
def test_a_run_from_a_model_resumes_after_the_model_is_gone(
    saved_models: dict[str, Path], tmp_path: Path
) -> None:
    """The run keeps the model's config.json (and tokenizer files) beside its checkpoints:
    the resumed run rebuilds the same architecture from them. (That a resume continues
    exactly is tests/test_resume.py's.)"""
    source, out = tmp_path / "llama", tmp_path / "run"
    shutil.copytree(saved_models["llama"], source)
    done = lowcomm(
        "train", *RUN, *DILOCO, "--init-from", str(source), "--out", str(out),
        "--stop-after", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["model"]["config"] == str(
        source / "config.json"
    )
    shutil.rmtree(source)
    resumed = lowcomm("train", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "is gone; resuming with the run's copy" in resumed.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.config.num_key_value_heads == 2 and not model.config.tie_word_embeddings
    assert (out / "model" / "tokenizer_config.json").is_file()


def test_a_disagreeing_option_and_a_directory_without_weights_are_refused(
    saved_models: dict[str, Path], tmp_path: Path
) -> None:
    source = saved_models["qwen2"]
    line = _refusal("--init-from", str(source), "--model.n-layer", "3", "--out", str(tmp_path))
    assert f"--model.n-layer: 3 disagrees with the model --init-from {source}" in line
    assert "which has 2" in line

    no_weights = tmp_path / "no-weights"
    shutil.copytree(source, no_weights)
    (no_weights / "model.safetensors").unlink()
    line = _refusal("--init-from", str(no_weights), "--out", str(tmp_path / "run"))
    assert f"--init-from: {no_weights} holds no weights" in line

    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(source, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    line = _refusal("--init-from", str(no_tokenizer), "--out", str(tmp_path / "run"))
    assert f"--init-from: {no_tokenizer} has no tokenizer.json; pass --tokenizer FILE" in line


def test_the_pre_flight_reads_no_weights(saved_models: dict[str, Path], tmp_path: Path) -> None:
    """Only config.json and the safetensors header are read: a weight file whose tensor data
    is cut off passes pre-flight, one whose shapes disagree with config.json does not."""
    from lowcomm.models.init_from import InitFromError, preflight_init_from

    source = tmp_path / "gpt2"
    shutil.copytree(saved_models["gpt2"], source)
    weights = source / "model.safetensors"
    length = int.from_bytes(weights.read_bytes()[:8], "little")
    weights.write_bytes(weights.read_bytes()[: 8 + length])  # the header alone
    checked = preflight_init_from(source, ModelConfig(block_size=16))
    assert checked.architecture.family == "hf-gpt2"
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    with pytest.raises(InitFromError, match=r"tensor .*wte.weight has shape \(\d+, 32\)"):
        preflight_init_from(source, ModelConfig(block_size=16))


def test_from_scratch_any_family_takes_the_modern_shape_options(tmp_path: Path) -> None:
    options = ModelConfig(
        family="hf-qwen2", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_width=96,
        rope_theta=5e5, tie_embeddings=False, block_size=16,
    )  # fmt: skip
    model = build_model(options, vocab_size=100)
    assert isinstance(model, HFCausalLM)
    config = model.hf_config
    assert (config.model_type, config.num_key_value_heads, config.intermediate_size) == (
        "qwen2", 2, 96,
    )  # fmt: skip
    assert config.rope_parameters["rope_theta"] == 5e5 and not config.tie_word_embeddings
    assert model.model.model.layers[0].self_attn.k_proj.weight.shape == (16, 32)

    # A whole config.json describes the same model; options beside it must agree.
    file = tmp_path / "config.json"
    config.to_json_file(file)
    same = build_model(ModelConfig(config=str(file), block_size=16), vocab_size=100)
    assert {k: tuple(v.shape) for k, v in same.state_dict().items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()
    }
    with pytest.raises(ValueError, match=r"--model.n-kv-head: 4 disagrees .* which has 2"):
        build_model(ModelConfig(config=str(file), n_kv_head=4, block_size=16), vocab_size=100)
    with pytest.raises(ValueError, match=r"--model.n-kv-head: the built-in gpt family has no"):
        build_model(ModelConfig(n_kv_head=2), vocab_size=100)  # the default family
    with pytest.raises(ValueError, match=r"--model.n-kv-head: --model.family hf-gpt2 has no"):
        build_model(ModelConfig(family="hf-gpt2", n_kv_head=2), vocab_size=100)
    with pytest.raises(ValueError, match=r"--model.n-kv-head: 3 does not divide --model.n-head=4"):
        build_model(ModelConfig(family="hf-llama", n_kv_head=3), vocab_size=100)


def test_the_chunked_loss_equals_the_unchunked_loss_and_its_gradient() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(1000, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1000, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 1000, (37,), generator=generator)

    def gradients(loss: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad(loss, (hidden, weight, bias)))

    whole = functional.cross_entropy(functional.linear(hidden, weight, bias), targets)
    chunked = chunked_cross_entropy(hidden, weight, targets, bias, chunk_elements=5 * 1000)
    assert abs(chunked.item() - whole.item()) <= 1e-6
    for mine, reference in zip(gradients(chunked), gradients(whole), strict=True):
        assert (mine - reference).abs().max().item() <= 1e-6


@pytest.mark.parametrize("family", ["gpt", "hf-gpt2", "hf-llama"])
def test_a_model_with_a_large_vocabulary_takes_the_chunked_path_with_the_same_loss(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(family=family, n_layer=1, n_head=2, n_embd=16, block_size=8), vocab_size=300
    )
    idx, targets = torch.randint(0, 300, (2, 8)), torch.randint(0, 300, (2, 8))
    logits, whole = model(idx, targets)
    assert logits is not None and whole is not None
    expected = torch.autograd.grad(whole, list(model.parameters()))
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 3 * 300)  # 3 rows per chunk
    logits, chunked = model(idx, targets)
    assert logits is None and chunked is not None  # the (B, T, V) logits were never whole
    assert abs(chunked.item() - whole.item()) <= 1e-6
    for mine, reference in zip(
        torch.autograd.grad(chunked, list(model.parameters())), expected, strict=True
    ):
        assert (mine - reference).abs().max().item() <= 1e-6


def test_softcapped_logits_keep_the_one_piece_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2 caps its logits after the output layer: the check on two tokens sees that the
    logits are not the output layer's alone, and the loss is the full model's."""
    config = transformers.Gemma2Config(
        vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, intermediate_size=32, final_logit_softcapping=0.5,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HFCausalLM(config)
    idx, targets = torch.randint(0, 300, (2, 8)), torch.randint(0, 300, (2, 8))
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 3 * 300)
    logits, loss = model(idx, targets)
    assert logits is not None and loss is not None
    reference = model.model(input_ids=idx).logits
    expected = functional.cross_entropy(reference.flatten(0, 1), targets.flatten())
    assert abs(loss.item() - expected.item()) <= 1e-6


@pytest.mark.benchmark  # (two runs of 4 processes: ~30 s; tests/test_sharding.py checks the
# sharded start from a saved model, and what each rank reads, in its one spawn)
def test_a_sharded_run_from_a_model_equals_the_replicated_run(
    saved_models: dict[str, Path], tmp_path: Path
) -> None:
    """--init-from under --worker-sharding fsdp: each rank reads its own rows of the
    safetensors file (tests/test_sharding.py counts them); the run is the replicated one."""
    for sharding in ("fsdp", "replicate"):
        done = lowcomm(
            "train", *RUN, *DILOCO, "--ranks-per-worker", "2", "--worker-sharding", sharding,
            "--init-from", str(saved_models["llama"]), "--out", str(tmp_path / sharding),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    mine, theirs = (json.loads((tmp_path / s / "summary.json").read_text()) for s in
                    ("fsdp", "replicate"))  # fmt: skip
    assert mine["final_val_loss"] == pytest.approx(theirs["final_val_loss"], rel=1e-5)
    exported = [tmp_path / s / "model" for s in ("fsdp", "replicate")]
    assert sorted(p.name for p in exported[0].iterdir()) == sorted(
        p.name for p in exported[1].iterdir()
    )
    configs = [json.loads((d / "config.json").read_text()) for d in exported]
    assert configs[0] == configs[1]
    from safetensors.torch import load_file

    weights = [load_file(d / "model.safetensors") for d in exported]
    for name, tensor in weights[1].items():
        assert torch.allclose(weights[0][name], tensor, rtol=1e-4, atol=1e-5), name


def test_a_sharded_run_refuses_weights_it_cannot_slice(
    saved_models: dict[str, Path], tmp_path: Path
) -> None:
    pickled = tmp_path / "pickled"
    shutil.copytree(saved_models["llama"], pickled)
    (pickled / "model.safetensors").unlink()
    model = transformers.AutoModelForCausalLM.from_pretrained(saved_models["llama"])
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    from lowcomm.config import ConfigError, TrainConfig
    from lowcomm.launch.init_check import check_init_from

    config = TrainConfig(
        placement=PlacementConfig(ranks_per_worker=2, worker_sharding="fsdp"),
        run=RunConfig(init_from=str(pickled)),
    )
    config.model.block_size = 16
    with pytest.raises(ConfigError) as refused:
        check_init_from(config)
    line = str(refused.value)
    assert f"--init-from: {pickled} has no safetensors weights" in line and "\n" not in line
    assert "--worker-sharding replicate" in line
