"""Adapter that lets a Hugging Face ``transformers`` causal LM be trained by lowcomm.

Models are always built from a config with random weights: nothing is downloaded and the hub
is never contacted. ``transformers`` is an optional extra, so it is imported lazily.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as functional
from torch import Tensor

from lowcomm.models.base import CausalLM

_MISSING_TRANSFORMERS = "the hf model family needs transformers: pip install 'lowcomm[hf]'"

HF_MODEL_TYPES = ("gpt2", "llama")
"""Model types :func:`build_hf_model` knows how to size."""


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(_MISSING_TRANSFORMERS) from error
    return transformers


class HFCausalLM(CausalLM):
    """Wrap ``AutoModelForCausalLM.from_config(config)`` behind lowcomm's model contract.

    Args:
        config: A ``transformers.PretrainedConfig`` for a causal LM architecture.

    Raises:
        ImportError: If ``transformers`` is not installed.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        transformers = _import_transformers()
        self.hf_config = config
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Compute logits and, given targets, the mean cross-entropy.

        The loss is computed here rather than by passing ``labels`` to the HF model, because
        HF shifts labels by one internally while lowcomm's targets are already the next tokens.

        Args:
            idx: Token ids, int64 of shape ``(B, T)``.
            targets: Next-token ids of shape ``(B, T)``, or None.

        Returns:
            ``(logits, loss)``: logits ``(B, T, V)``; loss is a scalar or None.
        """
        # use_cache=False: training never reuses key/value caches, and building them wastes memory.
        logits: Tensor = self.model(input_ids=idx, use_cache=False).logits  # (B, T, V)
        if targets is None:
            return logits, None
        loss = functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)
        )
        return logits, loss


def build_hf_model(
    name: str,
    vocab_size: int,
    block_size: int,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 256,
    dropout: float = 0.0,
) -> HFCausalLM:
    """Build a small randomly initialised HF causal LM of a given architecture.

    Args:
        name: Model type, one of ``"gpt2"`` or ``"llama"``.
        vocab_size: Number of token ids.
        block_size: Longest sequence (maximum positions).
        n_layer: Number of transformer blocks.
        n_head: Attention heads (must divide ``n_embd``).
        n_embd: Hidden size.
        dropout: Dropout probability (GPT-2 residual/embedding/attention; Llama attention).

    Returns:
        The wrapped model.

    Raises:
        ImportError: If ``transformers`` is not installed.
        ValueError: If ``name`` is not a supported model type or the sizes are inconsistent.
    """
    if name not in HF_MODEL_TYPES:
        raise ValueError(
            f"--model.family: unknown HF model type {name!r}; choose one of "
            f"{', '.join(HF_MODEL_TYPES)}"
        )
    if n_embd % n_head != 0:
        raise ValueError(
            f"--model.n-embd: {n_embd} is not divisible by --model.n-head={n_head}; "
            f"pick n_embd as a multiple of n_head"
        )
    transformers = _import_transformers()
    config: Any
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab_size,
            n_positions=block_size,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            # GPT-2's defaults point at id 50256, outside a small vocabulary; lowcomm marks
            # document ends in the data itself, so the model needs no special ids.
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=True,
        )
    else:
        if (n_embd // n_head) % 2 != 0:
            raise ValueError(
                f"--model.n-embd: hf-llama's rotary embedding needs an even head width, but "
                f"{n_embd} / --model.n-head={n_head} = {n_embd // n_head}; pick n_embd as a "
                f"multiple of {2 * n_head}"
            )
        # Llama's SwiGLU MLP has three matrices, so ~8/3 * hidden keeps the parameter count
        # close to a 4x GELU MLP; round up to a multiple of 64 for efficient matmuls.
        intermediate_size = 64 * -(-(8 * n_embd // 3) // 64)
        config = transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=n_embd,
            intermediate_size=intermediate_size,
            num_hidden_layers=n_layer,
            num_attention_heads=n_head,
            num_key_value_heads=n_head,
            max_position_embeddings=block_size,
            attention_dropout=dropout,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=True,
        )
    return HFCausalLM(config)
