"""The model options (``--model.*``) and the config.json reader: what describes a model
before one is built (no model code imported here, so every models module can use it)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowcomm.models.gpt import check_shape

MODEL_FAMILIES = ("gpt", "hf-gpt2", "hf-llama")
"""The first families; ``--model.family`` takes ``gpt`` or ``hf-<model_type>`` for any
causal-LM model type of the installed transformers (:func:`lowcomm.models.hf.causal_lm_types`)."""

#: From-scratch values of the options left unset (None).
DEFAULTS: dict[str, Any] = {
    "family": "gpt", "n_layer": 4, "n_head": 4, "n_embd": 256, "dropout": 0.0,
    "tie_embeddings": True,
}  # fmt: skip

#: Options only HF families have (the built-in GPT has none of these fields).
HF_ONLY = ("n_kv_head", "mlp_width", "rope_theta", "tie_embeddings")

#: The options that describe the architecture (compared with a loaded config).
SHAPE_OPTIONS = ("family", "n_layer", "n_head", "n_embd", "dropout", *HF_ONLY)

GPT_FAMILY = "gpt"
"""The built-in GPT's family name (and the ``lowcomm_family`` of its config.json)."""


@dataclass
class ModelConfig:
    """Which model to train and how large it is. With --init-from the model directory is the
    architecture: options given then must agree with its config (refused otherwise)."""

    family: str | None = None
    """Model family: gpt (built-in nanoGPT-style) or hf-<model_type> for any causal-LM model
    type of the installed transformers (hf-llama, hf-qwen2, hf-mistral, hf-gemma, hf-gpt2, ...;
    needs transformers). Default: gpt, or the --init-from model's."""

    n_layer: int | None = None
    """Number of transformer blocks (default 4)."""

    n_head: int | None = None
    """Attention heads per block; must divide n_embd (default 4)."""

    n_embd: int | None = None
    """Hidden size, the width of the residual stream (default 256)."""

    n_kv_head: int | None = None
    """hf-* families: key-value heads (grouped-query attention); must divide n_head
    (default: n_head)."""

    mlp_width: int | None = None
    """hf-* families: width of the MLP (default: hf-llama 64 * ceil(8 n_embd / 3 / 64),
    hf-gpt2 4 n_embd, others their default config's ratio to the hidden size, rounded up to
    a multiple of 64)."""

    rope_theta: float | None = None
    """hf-* families with rotary embeddings: the rotary base (default: the type's)."""

    tie_embeddings: bool | None = None
    """hf-* families: share the token embedding with the output layer (default True)."""

    config: str | None = None
    """A whole config.json describing the model (an HF model's, or a lowcomm run's
    model/config.json); its vocab_size is the embedding's size. Options given beside it must
    agree with it. With --init-from, set to the model's config.json."""

    block_size: int = 128
    """Sequence length in tokens used for training and evaluation (at most the model's
    positions)."""

    dropout: float | None = None
    """Dropout probability (default 0.0)."""

    def __post_init__(self) -> None:
        family = self.family
        if family is not None and family != GPT_FAMILY and not family.startswith("hf-"):
            raise ValueError(
                f"--model.family: unknown family {family!r}; pass gpt or hf-<model_type> "
                f"(e.g. {', '.join(MODEL_FAMILIES[1:])}, hf-qwen2, hf-mistral, hf-gemma)"
            )
        sizes = {
            name: getattr(self, name)
            for name in ("n_layer", "n_kv_head", "mlp_width")
            if getattr(self, name) is not None
        }
        # Divisibility only between values given: with --init-from the others are the model's.
        # (A given 0 is checked as given: `0 or 1` would pass it.)
        n_head = 1 if self.n_head is None else self.n_head
        check_shape(
            dropout=self.dropout or 0.0,
            n_head=n_head,
            n_embd=self.n_embd if self.n_head is not None and self.n_embd is not None else n_head,
            block_size=self.block_size,
            **sizes,
        )
        if self.n_embd is not None and self.n_embd < 1:
            check_shape(dropout=0.0, n_embd=self.n_embd, n_head=1)
        if self.rope_theta is not None and not (
            self.rope_theta > 0 and math.isfinite(self.rope_theta)
        ):
            raise ValueError(
                f"--model.rope-theta: {self.rope_theta} is not a positive number; pass a "
                f"rotary base such as 10000"
            )
        if family == GPT_FAMILY:
            self.refuse_hf_options()
        if self.config is not None and not str(self.config).strip():
            raise ValueError("--model.config: '' is an empty path; pass a config.json or omit it")

    def refuse_hf_options(self) -> None:
        """Refuse an option only hf-* families have, for the built-in GPT.

        Raises:
            ValueError: naming the first such option given.
        """
        given = [name for name in HF_ONLY if getattr(self, name) is not None]
        if given:
            raise ValueError(
                f"--model.{given[0].replace('_', '-')}: the built-in gpt family has no such "
                f"option; pick an hf-* family (e.g. --model.family hf-llama) or drop it"
            )

    def value(self, name: str) -> Any:
        """An option's value, its from-scratch default where unset."""
        given = getattr(self, name)
        return DEFAULTS.get(name) if given is None else given

    def given(self) -> dict[str, Any]:
        """The shape options set (not None)."""
        return {
            name: getattr(self, name) for name in SHAPE_OPTIONS if getattr(self, name) is not None
        }


def read_model_config(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict.

    Raises:
        ValueError: naming --model.config when the file is not a JSON object.
    """
    try:
        values = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"--model.config: {path} is not a readable config.json ({error}); pass a model's "
            f"config.json"
        ) from None
    if not isinstance(values, dict):
        raise ValueError(f"--model.config: {path} is not a JSON object; pass a model's config.json")
    return values
