"""Models lowcomm can train: a built-in small GPT and an adapter for HF causal LMs.

Every model is a :class:`CausalLM`: ``model(idx, targets) -> (logits, loss)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowcomm.models.base import CausalLM
from lowcomm.models.gpt import GPT, GPTConfig, check_shape
from lowcomm.models.hf import HF_MODEL_TYPES, HFCausalLM, build_hf_model

MODEL_FAMILIES = ("gpt", "hf-gpt2", "hf-llama")
"""Values accepted by :attr:`ModelConfig.family`."""


@dataclass
class ModelConfig:
    """Which model to train and how large it is."""

    family: str = "gpt"
    """Model family: gpt (built-in nanoGPT-style), hf-gpt2 or hf-llama (need transformers)."""

    n_layer: int = 4
    """Number of transformer blocks."""

    n_head: int = 4
    """Attention heads per block; must divide n_embd."""

    n_embd: int = 256
    """Hidden size (width of the residual stream)."""

    block_size: int = 128
    """Sequence length in tokens used for training and evaluation."""

    dropout: float = 0.0
    """Dropout probability."""

    def __post_init__(self) -> None:
        if self.family not in MODEL_FAMILIES:
            raise ValueError(
                f"--model.family: unknown family {self.family!r}; choose one of "
                f"{', '.join(MODEL_FAMILIES)}"
            )
        check_shape(
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            block_size=self.block_size,
            dropout=self.dropout,
        )


def build_model(config: ModelConfig, vocab_size: int) -> CausalLM:
    """Build a freshly initialised model.

    Args:
        config: Family and size of the model.
        vocab_size: Number of token ids (use the vocabulary size the tokenizer actually has).

    Returns:
        The model, on CPU, in training mode.

    Raises:
        ValueError: If ``vocab_size`` is not positive.
        ImportError: If an ``hf-*`` family is requested without transformers installed.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size: {vocab_size} is not positive; pass the tokenizer's size")
    if config.family == "gpt":
        return GPT(
            GPTConfig(
                n_layer=config.n_layer,
                n_head=config.n_head,
                n_embd=config.n_embd,
                block_size=config.block_size,
                vocab_size=vocab_size,
                dropout=config.dropout,
            )
        )
    return build_hf_model(
        config.family.removeprefix("hf-"),
        vocab_size=vocab_size,
        block_size=config.block_size,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        dropout=config.dropout,
    )


__all__ = [
    "GPT",
    "HF_MODEL_TYPES",
    "MODEL_FAMILIES",
    "CausalLM",
    "GPTConfig",
    "HFCausalLM",
    "ModelConfig",
    "build_hf_model",
    "build_model",
]
