"""Saving a trained model as ``OUT/model/`` and loading it back.

Two layouts, one per kind of model:

* HF families (``hf-gpt2``, ``hf-llama``): ``save_pretrained`` output (``config.json`` and
  ``model.safetensors``) plus the tokenizer files of ``PreTrainedTokenizerFast``, so that
  ``transformers.AutoModelForCausalLM.from_pretrained(path)`` and
  ``transformers.PreTrainedTokenizerFast.from_pretrained(path)`` load it without lowcomm.
* the built-in GPT: ``model.safetensors`` (the ``safetensors`` package), ``config.json``
  (``{"lowcomm_family": "gpt", ...GPTConfig fields}``) and ``tokenizer.json``; load it with
  :func:`load_model`.

The directory is written atomically: everything goes to a temporary sibling directory which
is renamed into place, so an interrupted write leaves no half-written model that loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from lowcomm.models.base import CausalLM
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.models.hf import HFCausalLM, _import_transformers, load_pretrained, quiet_progress

WEIGHTS_FILE = "model.safetensors"
"""The weights file of either layout."""

_GPT_FAMILY = "gpt"
_TIED = "lm_head.weight"
"""The built-in GPT's output matrix, tied to (and saved as) the token embedding."""


class NoModelError(ValueError):
    """A path that holds no saved model (no config.json with weights beside it)."""


def save_model(
    model: torch.nn.Module,
    directory: Path,
    tokenizer_path: Path | None,
    end_of_text: str | None = None,
    tokenizer_source: str | Path | None = None,
) -> None:
    """Write ``model`` (a :class:`GPT` or :class:`HFCausalLM`) and its tokenizer to
    ``directory`` atomically, replacing what was there.

    An HF model keeps its config (only the weights change; they are saved in float32, which
    config.json states). Its tokenizer: when ``tokenizer_source`` (the run's ``--tokenizer``)
    has a Hugging Face tokenizer_config.json beside it, that tokenizer's files, copied as
    they are; otherwise ``tokenizer_path`` saved as a ``PreTrainedTokenizerFast`` declaring
    ``end_of_text`` (the token the run placed after every document) as its eos_token.

    Raises:
        TypeError: If ``model`` is neither a built-in GPT nor an HF model.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp"))
    try:
        _write(model, temporary, tokenizer_path, end_of_text)
        if isinstance(model, HFCausalLM) and tokenizer_source is not None:
            copy_tokenizer_files(Path(tokenizer_source).expanduser(), temporary)
        os.chmod(temporary, 0o755)
        _replace_directory(temporary, directory)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _write(
    model: torch.nn.Module, directory: Path, tokenizer_path: Path | None, end_of_text: str | None
) -> None:
    if isinstance(model, HFCausalLM):
        # A copy with plain tensors: a method's parameters may be views into one flat buffer,
        # which safetensors would take for shared storage.
        transformers = _import_transformers()
        _state_float32(model.model.config)
        with quiet_progress():
            model.model.save_pretrained(
                directory, state_dict=_plain_state(model.model), safe_serialization=True
            )
        if tokenizer_path is not None:
            tokenizer = transformers.PreTrainedTokenizerFast(
                tokenizer_file=str(tokenizer_path), eos_token=end_of_text
            )
            tokenizer.save_pretrained(directory)
    elif isinstance(model, GPT):
        from safetensors.torch import save_file

        # The output matrix is the token embedding (tied): stored once.
        state = _plain_state(model)
        del state[_TIED]
        save_file(state, str(directory / WEIGHTS_FILE))
        config = {"lowcomm_family": _GPT_FAMILY, **dataclasses.asdict(model.config)}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, directory / "tokenizer.json")
    else:
        raise TypeError(f"cannot save a {type(model).__name__}: not a GPT or HF model")
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as separate contiguous CPU tensors; a tensor shared by several names
    (tied embeddings) stays one tensor."""
    copies: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in copies:
            copies[key] = tensor.detach().cpu().clone().contiguous()
        state[name] = copies[key]
    return state


def _state_float32(config: Any) -> None:
    """Say in the config that the weights are float32."""
    config.dtype = torch.float32


#: The files of a Hugging Face tokenizer that a model directory carries.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip


def copy_tokenizer_files(tokenizer: Path, directory: Path) -> bool:
    """Copy a Hugging Face tokenizer (``tokenizer`` is its tokenizer.json; the other files lie
    beside it) into ``directory`` as they are, replacing the files saved there. Nothing
    happens (False) without a tokenizer_config.json beside it: a bare tokenizer.json."""
    source = tokenizer.parent
    if not (source / "tokenizer_config.json").is_file() or not tokenizer.is_file():
        return False
    for name in TOKENIZER_FILES:
        (directory / name).unlink(missing_ok=True)
    shutil.copyfile(tokenizer, directory / "tokenizer.json")
    for name in TOKENIZER_FILES[1:]:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
    return True


def _replace_directory(temporary: Path, directory: Path) -> None:
    """Rename ``temporary`` to ``directory``; an old ``directory`` is moved aside first and
    removed afterwards (a directory cannot be renamed over a non-empty one)."""
    old: Path | None = None
    if directory.exists():
        old = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.old"))
        old.rmdir()
        os.replace(directory, old)
    os.replace(temporary, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def model_directory(path: Path) -> Path:
    """The model directory ``path`` names: itself, or a run directory's ``model/``.

    Raises:
        NoModelError: If neither holds a config.json and weights.
    """
    for candidate in (path / "model", path):
        if (candidate / "config.json").is_file() and (candidate / WEIGHTS_FILE).is_file():
            return candidate
    raise NoModelError(
        f"{path}: no saved model here (expected config.json and {WEIGHTS_FILE}, or a run "
        f"directory whose model/ holds them); pass the OUT of a finished lowcomm run or its "
        f"model/ directory"
    )


def load_model(path: str | Path, device: str | torch.device = "cpu") -> CausalLM:
    """Load a model saved by a lowcomm run.

    Args:
        path: A run directory (its ``model/`` is read) or a model directory.
        device: Where to put the parameters.

    Returns:
        The model in evaluation mode: a :class:`GPT` or an :class:`HFCausalLM`, called as
        ``model(idx, targets) -> (logits, loss)``.

    Raises:
        NoModelError: If ``path`` holds no saved model.
    """
    directory = model_directory(Path(path))
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    model: CausalLM
    if config.get("lowcomm_family") == _GPT_FAMILY:
        from safetensors.torch import load_file

        fields = {field.name for field in dataclasses.fields(GPTConfig)}
        model = GPT(GPTConfig(**{k: v for k, v in config.items() if k in fields}))
        missing, unexpected = model.load_state_dict(
            load_file(str(directory / WEIGHTS_FILE)), strict=False
        )
        if missing != [_TIED] or unexpected:
            raise NoModelError(
                f"{directory}: the weights do not fit the config (missing {missing}, "
                f"unexpected {unexpected}); save the model again with a finished lowcomm run"
            )
    else:
        transformers = _import_transformers()
        model = load_pretrained(directory, transformers.AutoConfig.from_pretrained(directory))
    return model.to(device).eval()


def load_tokenizer(path: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` saved beside a model (``tokenizer.json``), or None."""
    tokenizer_file = model_directory(Path(path)) / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(tokenizer_file))
