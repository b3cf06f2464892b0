"""Adapter that lets any Hugging Face ``transformers`` causal LM be trained by lowcomm.

Nothing is downloaded and the hub is never contacted: a model is built from a config (random
weights, :func:`hf_config` sizes one from lowcomm's ``--model.*`` options for any causal-LM
``model_type`` transformers knows) or loaded from a local directory
(:func:`load_pretrained`). ``transformers`` is an optional extra, so it is imported lazily.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lowcomm.models.base import CausalLM
from lowcomm.models.loss import chunked_cross_entropy, fits_one_chunk, next_token_loss

_MISSING_TRANSFORMERS = "the hf model families need transformers: pip install 'lowcomm[hf]'"

HF_MODEL_TYPES = ("gpt2", "llama")
"""Model types of the built-in HF families (``--model.family hf-gpt2``, ``hf-llama``); any
causal-LM type of transformers is accepted through :func:`causal_lm_types`."""

#: Config attributes holding a dropout probability (``--model.dropout`` sets those a type has).
DROPOUT_FIELDS = (
    "resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout",
    "embedding_dropout", "residual_dropout", "dropout",
)  # fmt: skip

#: Config attributes holding the MLP width, by the names the model types use.
MLP_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff")


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(_MISSING_TRANSFORMERS) from error
    return transformers


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Without transformers' progress bars (a worker's output is lowcomm's own)."""
    logging = _import_transformers().utils.logging
    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def causal_lm_types() -> tuple[str, ...]:
    """Every ``model_type`` the installed transformers has a causal-LM class for."""
    _import_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


class HFCausalLM(CausalLM):
    """Wrap a transformers causal LM behind lowcomm's model contract.

    Args:
        config: A ``transformers.PretrainedConfig`` for a causal LM architecture.
        model: The model to wrap (e.g. loaded by :func:`load_pretrained`); None builds
            ``AutoModelForCausalLM.from_config(config)`` with random weights.

    Raises:
        ImportError: If ``transformers`` is not installed.
    """

    def __init__(self, config: Any, model: Any | None = None) -> None:
        super().__init__()
        self.hf_config = config
        if model is None:
            model = _import_transformers().AutoModelForCausalLM.from_config(config)
        self.model = model
        self._plain_head: bool | None = None
        """Whether the logits are exactly the output layer applied to the base model's last
        hidden state (checked once, on the first loss that needs chunking)."""

    def forward(
        self, idx: Tensor, targets: Tensor | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """Compute logits and, given targets, the mean cross-entropy.

        The loss is computed here rather than by passing ``labels`` to the HF model, because
        HF shifts labels by one internally while lowcomm's targets are already the next tokens.
        With a vocabulary too large for one chunk of logits
        (:func:`lowcomm.models.loss.fits_one_chunk`), and an architecture whose logits are
        the output layer applied to the last hidden state, the loss is computed chunk by
        chunk and the logits returned are None.

        Args:
            idx: Token ids, int64 of shape ``(B, T)``.
            targets: Next-token ids of shape ``(B, T)``, or None.

        Returns:
            ``(logits, loss)``: logits ``(B, T, V)`` (or None, see above); loss is a scalar
            or None.
        """
        vocab_size = int(self.model.get_output_embeddings().weight.size(0))
        if targets is not None and not fits_one_chunk(idx.numel(), vocab_size):
            if self._plain_head is None:
                self._plain_head = self._check_plain_head(idx)
            if self._plain_head:
                hidden = self._base_hidden(idx)  # (B, T, H)
                head = self.model.get_output_embeddings()
                return None, chunked_cross_entropy(hidden, head.weight, targets, head.bias)
        # use_cache=False: training never reuses key/value caches, and building them wastes memory.
        logits: Tensor = self.model(input_ids=idx, use_cache=False).logits  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, next_token_loss(logits, targets)

    def _base_hidden(self, idx: Tensor) -> Tensor:
        output = self.model.base_model(input_ids=idx, use_cache=False)
        hidden: Tensor = output.last_hidden_state
        return hidden

    def _check_plain_head(self, idx: Tensor) -> bool:
        """Whether the full model's logits equal the output layer on the base model's last
        hidden state, on two tokens (so softcapped or scaled logits, as Gemma 2 or Granite
        compute them, keep the one-piece loss)."""
        base, head = self.model.base_model, self.model.get_output_embeddings()
        if base is self.model or head is None or idx.device.type == "meta":
            return False
        probe = idx[:1, :2]
        training = self.model.training
        self.model.eval()  # no dropout: the two paths must see the same activations
        try:
            with torch.no_grad():
                full = self.model(input_ids=probe, use_cache=False).logits.float()
                hidden = getattr(base(input_ids=probe, use_cache=False), "last_hidden_state", None)
                if hidden is None or tuple(hidden.shape[:2]) != tuple(probe.shape):
                    return False
                mine = head(hidden).float()
        finally:
            self.model.train(training)
        if mine.shape != full.shape:
            return False
        scale = max(1.0, float(full.abs().max()))
        return bool((mine - full).abs().max() <= 1e-5 * scale)


def option_fields(config: Any) -> dict[str, str | None]:
    """The config attributes behind lowcomm's shape options for one HF config (None where the
    model type has none)."""

    def first(*names: str) -> str | None:
        return next((name for name in names if hasattr(config, name)), None)

    return {
        "n_layer": first("num_hidden_layers"),
        "n_head": first("num_attention_heads"),
        "n_embd": first("hidden_size"),
        "n_kv_head": first("num_key_value_heads"),
        "mlp_width": first(*MLP_FIELDS),
        "tie_embeddings": first("tie_word_embeddings"),
        "positions": first("max_position_embeddings", "n_positions", "max_seq_len"),
    }


def rope_theta(config: Any) -> float | None:
    """The rotary base of an HF config (transformers 5 keeps it in ``rope_parameters``), or
    None for a model without rotary embeddings."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict):
        if "rope_theta" in parameters:
            return float(parameters["rope_theta"])
        for inner in parameters.values():  # per attention kind (Gemma 3)
            if isinstance(inner, dict) and "rope_theta" in inner:
                return float(inner["rope_theta"])
    value = getattr(config, "rope_theta", None)
    return None if value is None else float(value)


def config_value(config: Any, option: str) -> Any:
    """What one of lowcomm's ``--model.*`` options is in an HF config (None: it has none)."""
    if option == "rope_theta":
        return rope_theta(config)
    if option == "family":
        return f"hf-{config.model_type}"
    if option == "dropout":
        values = [getattr(config, name) for name in DROPOUT_FIELDS if hasattr(config, name)]
        return values[0] if values and all(value == values[0] for value in values) else None
    field = option_fields(config).get(option)
    value = None if field is None else getattr(config, field)
    if option == "n_kv_head" and value is None:
        return getattr(config, "num_attention_heads", None)  # multi-head attention
    if option == "mlp_width" and value is None and field == "n_inner":
        return 4 * int(config.hidden_size)  # GPT-2's default
    return value


def hf_config(
    model_type: str,
    *,
    vocab_size: int,
    block_size: int,
    n_layer: int,
    n_head: int,
    n_embd: int,
    n_kv_head: int | None = None,
    mlp_width: int | None = None,
    rope_theta: float | None = None,
    tie_embeddings: bool = True,
    dropout: float = 0.0,
) -> Any:
    """A from-scratch config of any causal-LM ``model_type`` sized by lowcomm's options.

    Defaults: key-value heads = query heads; MLP width 64 * ceil(8 n_embd / 3 / 64) for
    llama, 4 n_embd for gpt2, and for other types their default config's ratio of MLP width
    to hidden size times n_embd, rounded up to a multiple of 64; the type's default rope base;
    tied embeddings; a head width of n_embd / n_head; no bos/eos/pad ids (lowcomm marks
    document ends in the data).

    Raises:
        ValueError: naming the option a model type has no field for, or a shape it refuses.
    """
    transformers = _import_transformers()
    defaults = transformers.AutoConfig.for_model(model_type)
    fields = option_fields(defaults)
    _check_config_options(
        model_type,
        defaults,
        n_head=n_head,
        n_embd=n_embd,
        n_kv_head=n_kv_head,
        mlp_width=mlp_width,
        rope_theta=rope_theta,
    )
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": n_embd, "num_hidden_layers": n_layer,
        "num_attention_heads": n_head, "tie_word_embeddings": tie_embeddings,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }  # fmt: skip
    if fields["positions"] is not None:
        kwargs[fields["positions"]] = block_size
    if fields["n_kv_head"] is not None:
        kwargs["num_key_value_heads"] = n_head if n_kv_head is None else n_kv_head
    width = mlp_width if mlp_width is not None else _default_mlp_width(model_type, defaults, n_embd)
    if fields["mlp_width"] is not None and width is not None:
        kwargs[fields["mlp_width"]] = width
    if hasattr(defaults, "head_dim"):
        kwargs["head_dim"] = n_embd // n_head
    if rope_theta is not None:
        kwargs["rope_theta"] = rope_theta
    for name in DROPOUT_FIELDS:
        if hasattr(defaults, name) and isinstance(getattr(defaults, name), float):
            kwargs[name] = dropout
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def _check_config_options(
    model_type: str,
    defaults: Any,
    *,
    n_head: int,
    n_embd: int,
    n_kv_head: int | None,
    mlp_width: int | None,
    rope_theta: float | None,
) -> None:
    """Refuse an option ``model_type``'s config has no field for, or an odd rotary head width."""
    fields = option_fields(defaults)
    family = f"--model.family hf-{model_type}"
    for option, given in (("n_kv_head", n_kv_head), ("mlp_width", mlp_width)):
        if given is not None and fields[option] is None:
            raise ValueError(
                f"--model.{option.replace('_', '-')}: {family} has no such field in its config; "
                f"drop the option, or describe the model with --model.config FILE"
            )
    if _rope_of(defaults) is None:
        if rope_theta is not None:
            raise ValueError(
                f"--model.rope-theta: {family} has no rotary embedding; drop the option"
            )
    elif (n_embd // n_head) % 2 != 0:
        raise ValueError(
            f"--model.n-embd: {family}'s rotary embedding needs an even head width, but "
            f"{n_embd} / --model.n-head={n_head} = {n_embd // n_head}; pick n_embd as a "
            f"multiple of {2 * n_head}"
        )


def _rope_of(config: Any) -> float | None:
    return rope_theta(config)


def _default_mlp_width(model_type: str, defaults: Any, n_embd: int) -> int | None:
    if model_type == "llama":
        # SwiGLU has three matrices, so ~8/3 * hidden keeps the parameter count close to a 4x
        # GELU MLP; rounded up to a multiple of 64 for efficient matmuls.
        return 64 * -(-(8 * n_embd // 3) // 64)
    field = option_fields(defaults)["mlp_width"]
    default = None if field is None else getattr(defaults, field)
    if not isinstance(default, int):
        return None  # the type's own rule (GPT-2: n_inner None means 4 * hidden)
    ratio = default / int(defaults.hidden_size)
    return 64 * math.ceil(ratio * n_embd / 64)


def build_hf_model(
    name: str,
    vocab_size: int,
    block_size: int,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 256,
    dropout: float = 0.0,
    **shape: Any,
) -> HFCausalLM:
    """Build a small randomly initialised HF causal LM of a given model type.

    Args:
        name: Model type (``gpt2``, ``llama``, ``qwen2``, ...: :func:`causal_lm_types`).
        vocab_size: Number of token ids.
        block_size: Longest sequence (maximum positions).
        n_layer: Number of transformer blocks.
        n_head: Attention heads (must divide ``n_embd``).
        n_embd: Hidden size.
        dropout: Dropout probability (every dropout field the type's config has).
        **shape: ``n_kv_head``, ``mlp_width``, ``rope_theta``, ``tie_embeddings`` of
            :func:`hf_config`.

    Returns:
        The wrapped model.

    Raises:
        ImportError: If ``transformers`` is not installed.
        ValueError: If ``name`` is not a causal-LM type or the sizes are inconsistent.
    """
    check_hf_shape(name, n_head=n_head, n_embd=n_embd, n_kv_head=shape.get("n_kv_head"))
    config = hf_config(
        name, vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
        n_embd=n_embd, dropout=dropout, **shape,
    )  # fmt: skip
    return HFCausalLM(config)


def check_hf_shape(name: str, *, n_head: int, n_embd: int, n_kv_head: int | None) -> None:
    """Refuse an unknown model type or head counts that do not divide.

    Raises:
        ValueError: naming the option, the value and the fix.
    """
    types = causal_lm_types()
    if name not in types:
        close = [t for t in types if name in t or t in name][:5]
        hint = f" (close: {', '.join('hf-' + t for t in close)})" if close else ""
        raise ValueError(
            f"--model.family: hf-{name} is not a causal-LM model type of the installed "
            f"transformers{hint}; pass gpt or hf-<model_type>, e.g. hf-llama, hf-qwen2, "
            f"hf-mistral, hf-gemma, hf-gpt2"
        )
    if n_embd % n_head != 0:
        raise ValueError(
            f"--model.n-embd: {n_embd} is not divisible by --model.n-head={n_head}; "
            f"pick n_embd as a multiple of n_head"
        )
    if n_kv_head is not None and (n_kv_head < 1 or n_head % n_kv_head != 0):
        raise ValueError(
            f"--model.n-kv-head: {n_kv_head} does not divide --model.n-head={n_head}; each "
            f"key-value head serves n_head / n_kv_head query heads, so pass a divisor of "
            f"{n_head}"
        )


def load_pretrained(directory: Path, config: Any) -> HFCausalLM:
    """Load a local HF model directory's weights in float32 (lowcomm's master precision),
    directly into the model transformers builds without initialising it (one copy).

    Raises:
        ValueError: If a weight the model needs is missing or of another shape.
    """
    transformers = _import_transformers()
    major = int(transformers.__version__.split(".")[0])
    dtype_kw = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
    with quiet_progress():
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            directory, config=config, local_files_only=True, output_loading_info=True, **dtype_kw
        )
    missing = list(info.get("missing_keys", [])) + list(info.get("mismatched_keys", []))
    if missing:
        raise ValueError(
            f"{directory} does not hold every weight of its model ({missing[0]} is missing or "
            f"of another shape); pass a complete model directory"
        )
    return HFCausalLM(model.config, model)
