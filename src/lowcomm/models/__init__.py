"""Models lowcomm can train: a built-in small GPT and any HF causal LM.

Every model is a :class:`CausalLM`: ``model(idx, targets) -> (logits, loss)``.
"""

from __future__ import annotations

from pathlib import Path

from lowcomm.models.base import CausalLM
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.models.hf import HF_MODEL_TYPES, HFCausalLM, build_hf_model
from lowcomm.models.options import (
    DEFAULTS,
    GPT_FAMILY,
    HF_ONLY,
    MODEL_FAMILIES,
    ModelConfig,
    read_model_config,
)


def build_model(config: ModelConfig, vocab_size: int) -> CausalLM:
    """Build a freshly initialised model.

    Args:
        config: Family and size of the model (or a whole config.json: ``config.config``).
        vocab_size: Number of token ids (use the vocabulary size the tokenizer actually has;
            with ``config.config`` the file's vocab_size is kept and must be at least this).

    Returns:
        The model, on the current default device, in training mode.

    Raises:
        ValueError: If ``vocab_size`` is not positive or the options do not describe a model.
        ImportError: If an ``hf-*`` family is requested without transformers installed.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size: {vocab_size} is not positive; pass the tokenizer's size")
    if config.config is not None:
        from lowcomm.models.init_from import architecture_from_file

        architecture = architecture_from_file(Path(config.config), config, "--model.config")
        architecture.check_vocabulary(vocab_size, "the tokenizer")
        return architecture.build()
    family = config.value("family")
    if family == GPT_FAMILY:
        config.refuse_hf_options()  # (the family may be the default, unset)
        return GPT(
            GPTConfig(
                n_layer=config.value("n_layer"),
                n_head=config.value("n_head"),
                n_embd=config.value("n_embd"),
                block_size=config.block_size,
                vocab_size=vocab_size,
                dropout=config.value("dropout"),
            )
        )
    return build_hf_model(
        family.removeprefix("hf-"),
        vocab_size=vocab_size,
        block_size=config.block_size,
        n_layer=config.value("n_layer"),
        n_head=config.value("n_head"),
        n_embd=config.value("n_embd"),
        dropout=config.value("dropout"),
        n_kv_head=config.n_kv_head,
        mlp_width=config.mlp_width,
        rope_theta=config.rope_theta,
        tie_embeddings=config.value("tie_embeddings"),
    )


__all__ = [
    "DEFAULTS",
    "GPT",
    "GPT_FAMILY",
    "HF_MODEL_TYPES",
    "HF_ONLY",
    "MODEL_FAMILIES",
    "CausalLM",
    "GPTConfig",
    "HFCausalLM",
    "ModelConfig",
    "build_hf_model",
    "build_model",
    "read_model_config",
]
