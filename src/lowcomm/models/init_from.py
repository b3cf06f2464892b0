"""Starting a run from an existing model: ``--init-from PATH``.

PATH is a lowcomm run directory (its ``model/`` is read), a lowcomm model directory, or a
local Hugging Face model directory (``config.json`` and weights, read with
``from_pretrained(..., local_files_only=True)``). Only local paths are read: nothing is
downloaded. The run trains the model its own ``--model.*`` options describe; the weights must
fit it tensor for tensor (:func:`check_fits` names the first that does not). The embedding's
row count comes from the weights, so the tokenizer (the model's own ``tokenizer.json`` by
default, or ``--tokenizer``) may have at most that many tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lowcomm.models import ModelConfig, build_model
from lowcomm.models.base import CausalLM
from lowcomm.models.export import WEIGHTS_FILE
from lowcomm.models.hf import HFCausalLM, _import_transformers

#: Weight files a local HF model directory may hold (``from_pretrained`` reads any of them).
HF_WEIGHT_FILES = (
    WEIGHTS_FILE,
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

_GPT_FAMILY = "gpt"
_TIED = ("lm_head.weight", "token_embedding.weight")
"""The built-in GPT's output matrix is its token embedding; saved once, as the latter."""


class InitFromError(ValueError):
    """A model that cannot start this run (one line naming the option and the fix)."""


@dataclass
class InitialWeights:
    """The weights a run starts from."""

    directory: Path
    """The model directory read."""
    state: dict[str, torch.Tensor]
    """Named as the configured model's ``state_dict`` names them."""
    vocab_size: int
    """Rows of the token embedding."""
    family: str
    """The model family the weights belong to (``gpt``, ``hf-gpt2``, ...)."""

    @property
    def tokenizer(self) -> Path | None:
        """The model's own ``tokenizer.json``, when it has one."""
        path = self.directory / "tokenizer.json"
        return path if path.is_file() else None


def model_directory(path: Path) -> Path:
    """The directory of weights ``--init-from PATH`` names: ``PATH/model`` or ``PATH``.

    Raises:
        InitFromError: If PATH does not exist (a hub name), or holds no config and weights.
    """
    if not path.exists():
        raise InitFromError(
            f"--init-from: {str(path)!r} is not a local path; lowcomm reads only local "
            f"directories and downloads nothing: pass a finished run's OUT, its model/ "
            f"directory, or a local HF model directory (download a hub model first)"
        )
    for candidate in (path / "model", path):
        if (candidate / "config.json").is_file() and any(
            (candidate / name).is_file() for name in HF_WEIGHT_FILES
        ):
            return candidate
    raise InitFromError(
        f"--init-from: {path} holds no weights (no config.json with {WEIGHTS_FILE} or "
        f"pytorch_model.bin, here or in model/); pass a finished run's OUT, its model/ "
        f"directory, or a local HF model directory"
    )


def read_initial_weights(path: str | Path) -> InitialWeights:
    """Read the weights ``--init-from PATH`` names (on the CPU).

    Raises:
        InitFromError: If PATH is not a local model directory.
    """
    directory = model_directory(Path(path))
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    if config.get("lowcomm_family") == _GPT_FAMILY:
        from safetensors.torch import load_file

        state = load_file(str(directory / WEIGHTS_FILE))
        if _TIED[1] in state:
            state[_TIED[0]] = state[_TIED[1]]
        return InitialWeights(directory, state, int(config["vocab_size"]), _GPT_FAMILY)
    transformers = _import_transformers()
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    state = {f"model.{name}": tensor for name, tensor in hf.state_dict().items()}
    family = f"hf-{hf.config.model_type}"
    return InitialWeights(directory, state, int(hf.config.vocab_size), family)


def check_fits(model: torch.nn.Module, weights: InitialWeights, family: str) -> None:
    """Check that ``weights`` fit ``model`` tensor for tensor.

    Raises:
        InitFromError: Naming the first tensor missing, unexpected or of another shape.
    """
    if weights.family != family:
        raise InitFromError(
            f"--init-from: {weights.directory} holds a {weights.family} model but "
            f"--model.family is {family}; pass --model.family {weights.family}"
        )
    expected = model.state_dict()
    for name, tensor in expected.items():
        if name not in weights.state:
            raise InitFromError(
                f"--init-from: {weights.directory} has no tensor {name} that the configured "
                f"model needs; pass the --model.* options the saved model was trained with"
            )
        if tuple(weights.state[name].shape) != tuple(tensor.shape):
            raise InitFromError(
                f"--init-from: tensor {name} has shape {tuple(weights.state[name].shape)} in "
                f"{weights.directory} but {tuple(tensor.shape)} in the configured model; pass "
                f"the --model.* options the saved model was trained with"
            )
    extra = sorted(set(weights.state) - set(expected))
    if extra:
        raise InitFromError(
            f"--init-from: {weights.directory} has tensor {extra[0]} that the configured model "
            f"lacks; pass the --model.* options the saved model was trained with"
        )


def initial_model(config: ModelConfig, weights: InitialWeights) -> CausalLM:
    """The configured model (its embedding as large as the weights') holding ``weights``.

    Raises:
        InitFromError: If the weights do not fit it.
    """
    model = build_model(config, weights.vocab_size)
    check_fits(model, weights, config.family)
    target: torch.nn.Module = model.model if isinstance(model, HFCausalLM) else model
    prefix = "model." if isinstance(model, HFCausalLM) else ""
    state = {name.removeprefix(prefix): tensor for name, tensor in weights.state.items()}
    with torch.no_grad():
        target.load_state_dict(state, strict=True)
    return model


def tokenizer_vocab_size(path: str | Path) -> int:
    """Tokens of a ``tokenizer.json`` (the ``tokenizers`` package's format).

    Raises:
        InitFromError: If the file cannot be read as one.
    """
    import tokenizers

    try:
        return int(tokenizers.Tokenizer.from_file(str(path)).get_vocab_size())
    except Exception as error:  # the tokenizers package raises its own exception types
        raise InitFromError(
            f"--tokenizer: {path} is not a readable tokenizer.json ({str(error).strip()}); "
            f"pass a file saved by the tokenizers package (a model's tokenizer.json)"
        ) from None
