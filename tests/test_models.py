"""Tests for lowcomm.models: the built-in GPT and the Hugging Face adapter."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch
import torch.nn.functional as functional

from lowcomm.models import GPT, CausalLM, GPTConfig, ModelConfig, build_hf_model, build_model

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)


def test_default_gpt_has_3_to_6_million_parameters() -> None:
    model = build_model(ModelConfig(), vocab_size=2048)
    assert isinstance(model, GPT)
    assert isinstance(model, CausalLM)
    assert 3_000_000 <= model.num_parameters() <= 6_000_000
    # Tied weights: the output head is the embedding matrix, counted once.
    assert model.lm_head.weight is model.token_embedding.weight
    all_elements = sum(parameter.numel() for parameter in model.state_dict().values())
    assert model.num_parameters() == all_elements - 2048 * 256


def test_gpt_init_scales_residual_projections() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8))
    expected = 0.02 / math.sqrt(2 * 8)
    residual = model.get_submodule("blocks.0.mlp.proj")
    plain = model.get_submodule("blocks.0.mlp.expand")
    assert isinstance(residual, torch.nn.Linear)
    assert isinstance(plain, torch.nn.Linear)
    residual_std = residual.weight.std().item()
    plain_std = plain.weight.std().item()
    assert residual_std == pytest.approx(expected, rel=0.05)
    assert plain_std == pytest.approx(0.02, rel=0.05)


def test_forward_shapes() -> None:
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, TINY.vocab_size)
    assert loss is None
    logits, loss = model(idx, torch.randint(0, TINY.vocab_size, (3, 10)))
    assert loss is not None
    assert loss.shape == ()


def test_initial_loss_is_close_to_uniform() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(), vocab_size=2048)
    idx = torch.randint(0, 2048, (4, 64))
    targets = torch.randint(0, 2048, (4, 64))
    with torch.no_grad():
        _, loss = model(idx, targets)
    assert loss is not None
    assert abs(loss.item() - math.log(2048)) < 0.5


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(0, TINY.vocab_size, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % TINY.vocab_size
    with torch.no_grad():
        original_logits, _ = model(idx)
        changed_logits, _ = model(changed)
    torch.testing.assert_close(original_logits[:, :7], changed_logits[:, :7])
    assert not torch.allclose(original_logits[:, 7:], changed_logits[:, 7:])


def test_overfits_a_fixed_batch() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, TINY.vocab_size, (4, 16))
    targets = torch.randint(0, TINY.vocab_size, (4, 16))
    losses = []
    for _ in range(20):
        _, loss = model(idx, targets)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_rejects_sequences_longer_than_block_size() -> None:
    model = GPT(TINY)
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_embd": 100, "n_head": 3}, r"--model.n-embd: 100 is not divisible by --model.n-head=3"),
        ({"n_layer": 0}, r"--model.n-layer: 0 is not a positive integer"),
        ({"n_head": 0}, r"--model.n-head: 0 is not a positive integer"),
        ({"n_head": 0, "n_embd": 8}, r"--model.n-head: 0 is not a positive integer"),
        ({"block_size": -1}, r"--model.block-size"),
        ({"dropout": 1.0}, r"--model.dropout: 1.0 is outside \[0, 1\)"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_family() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape("--model.family: unknown family 'foo'; pass gpt or hf-<model_type>"),
    ):
        ModelConfig(family="foo")


def test_hf_family_without_transformers_explains_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A None entry in sys.modules makes `import transformers` raise ImportError.
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'lowcomm\[hf\]'"):
        build_model(ModelConfig(family="hf-gpt2"), vocab_size=64)


@pytest.mark.parametrize("family", ["hf-gpt2", "hf-llama"])
def test_hf_adapter_forward_and_unshifted_loss(family: str) -> None:
    pytest.importorskip("transformers", reason="the HF adapter needs the optional transformers")
    torch.manual_seed(0)
    config = ModelConfig(family=family, n_layer=2, n_head=2, n_embd=32, block_size=16)
    model = build_model(config, vocab_size=64).eval()
    assert isinstance(model, CausalLM)
    idx = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 64)
    assert loss is not None
    assert loss.shape == ()
    manual = functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
    torch.testing.assert_close(loss, manual)
    # HF's own loss shifts labels by one; ours must not, so the two differ.
    with torch.no_grad():
        shifted = model.get_submodule("model")(input_ids=idx, labels=targets).loss
    assert not torch.allclose(loss, shifted)
    assert abs(loss.item() - math.log(64)) < 0.5
    # Gradients flow to every parameter.
    model.train()
    _, loss = model(idx, targets)
    assert loss is not None
    loss.backward()
    assert all(parameter.grad is not None for parameter in model.parameters())


def test_build_hf_model_rejects_unknown_type() -> None:
    pytest.importorskip("transformers", reason="the HF adapter needs the optional transformers")
    with pytest.raises(ValueError, match=r"hf-lama is not a causal-LM model type.*hf-llama"):
        build_hf_model("lama", vocab_size=64, block_size=16)


# --- dropout from the worker's generator ------------------------------------------------------


def _dropout_loss(model: GPT, generator: torch.Generator | None) -> torch.Tensor:
    from lowcomm.models.gpt import drawing_from, dropout_modules

    tokens = torch.arange(2 * TINY.block_size).reshape(2, -1) % TINY.vocab_size
    with drawing_from(dropout_modules(model), generator):
        _, loss = model(tokens, tokens)
    assert loss is not None
    return loss


def test_dropout_draws_its_masks_from_the_bound_generator_alone() -> None:
    """Two workers of one process each bind their own generator: the same state gives the
    same masks whatever the process-global generator does, and the global one is untouched."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY.__dict__, "dropout": 0.1}))
    first = _dropout_loss(model, torch.Generator().manual_seed(5))
    torch.rand(7)  # moves the global generator, not the bound one
    again = _dropout_loss(model, torch.Generator().manual_seed(5))
    assert torch.equal(first, again)
    torch.manual_seed(123)
    global_state = torch.get_rng_state()
    other = _dropout_loss(model, torch.Generator().manual_seed(6))
    assert torch.equal(torch.get_rng_state(), global_state)
    assert not torch.equal(first, other)  # other masks
    model.eval()
    assert not torch.equal(first, _dropout_loss(model, None))  # dropout dropped something


def test_activation_checkpointing_replays_the_bound_generators_masks() -> None:
    """The recomputed block draws the forward's masks from the worker's generator: the
    gradients and the generator's final state equal a run without recomputation."""
    from lowcomm.models.recompute import checkpoint_blocks

    torch.manual_seed(0)
    plain = GPT(GPTConfig(**{**TINY.__dict__, "dropout": 0.1}))
    recomputed = GPT(GPTConfig(**{**TINY.__dict__, "dropout": 0.1}))
    recomputed.load_state_dict(plain.state_dict())
    checkpoint_blocks(recomputed)
    results = []
    for model in (plain, recomputed):
        generator = torch.Generator().manual_seed(9)
        _dropout_loss(model, generator).backward()  # type: ignore[no-untyped-call]
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((grads, generator.get_state()))
    (plain_grads, plain_state), (recomputed_grads, recomputed_state) = results
    assert torch.equal(plain_state, recomputed_state)
    for a, b in zip(plain_grads, recomputed_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
