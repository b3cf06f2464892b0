"""Starting a run from an existing model: ``--init-from PATH``; and ``--model.config FILE``.

PATH is a lowcomm run directory (its ``model/`` is read), a lowcomm model directory, or a
local Hugging Face model directory (``config.json`` and weights). Only local paths are read:
nothing is downloaded. **The directory is the architecture**: its ``config.json`` is read with
``AutoConfig`` (any causal-LM model type the installed transformers supports) or, for a
lowcomm GPT, as its ``GPTConfig``; ``--model.*`` options given beside it must agree with it
(:meth:`Architecture.check_agrees` refuses the first that does not, naming both values).

Pre-flight (:func:`preflight_init_from`) reads the config and the weight files' headers,
never the weights: the names and shapes the model needs are compared with those of a model
built on the ``meta`` device. A worker then loads the weights straight into the model
(:meth:`Architecture.load`): transformers' ``from_pretrained``, which builds without
initialising, or a lowcomm GPT built on ``meta`` and given the loaded tensors, so one copy of
the weights is held while loading.
"""

from __future__ import annotations

import copy
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowcomm.models.base import CausalLM
from lowcomm.models.export import WEIGHTS_FILE
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.models.hf import (
    HFCausalLM,
    _import_transformers,
    causal_lm_types,
    config_value,
    load_pretrained,
    option_fields,
)
from lowcomm.models.options import GPT_FAMILY, HF_ONLY, ModelConfig, read_model_config

#: Weight files a local HF model directory may hold (``from_pretrained`` reads any of them).
HF_WEIGHT_FILES = (
    WEIGHTS_FILE,
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

_TIED = ("lm_head.weight", "token_embedding.weight")
"""The built-in GPT's output matrix is its token embedding; saved once, as the latter."""


class InitFromError(ValueError):
    """A model that cannot start this run (one line naming the option and the fix)."""


def _flag(option: str) -> str:
    return f"--model.{option.replace('_', '-')}"


@dataclass
class Architecture:
    """A model's architecture as a config.json describes it (no weights)."""

    source: Path
    """The config.json read."""
    family: str
    """``gpt`` or ``hf-<model_type>``."""
    values: dict[str, Any]
    """The file's content."""
    hf_config: Any = None
    """The transformers config (HF families)."""
    gpt_config: GPTConfig | None = None
    """The GPT's config (the built-in family)."""

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding."""
        if self.gpt_config is not None:
            return self.gpt_config.vocab_size
        return int(self.hf_config.vocab_size)

    @property
    def positions(self) -> int | None:
        """The longest sequence the model takes (None: its config names none)."""
        if self.gpt_config is not None:
            return self.gpt_config.block_size
        field = option_fields(self.hf_config)["positions"]
        value = None if field is None else getattr(self.hf_config, field)
        return None if value is None else int(value)

    def option(self, name: str) -> Any:
        """What the ``--model.<name>`` option is for this model (None: it has no such field)."""
        if self.gpt_config is None:
            return config_value(self.hf_config, name)
        if name == "family":
            return GPT_FAMILY
        return None if name in HF_ONLY else getattr(self.gpt_config, name)

    def check_agrees(self, config: ModelConfig, flag: str) -> None:
        """Refuse a ``--model.*`` option given that disagrees with this architecture, and a
        ``--model.block-size`` above its positions.

        Raises:
            InitFromError: naming the option, both values and the fix.
        """
        where = f"the model {flag} {self.source} describes"
        for name, given in config.given().items():
            loaded = self.option(name)
            if loaded is None:
                raise InitFromError(
                    f"{_flag(name)}: {given!r}, but {where} ({self.family}) has no such field; "
                    f"drop {_flag(name)} ({flag} is the architecture)"
                )
            if name == "rope_theta" or name == "dropout":
                same = float(given) == float(loaded)
            else:
                same = given == loaded
            if not same:
                raise InitFromError(
                    f"{_flag(name)}: {given!r} disagrees with {where}, which has {loaded!r}; "
                    f"drop {_flag(name)} ({flag} is the architecture) or pass {loaded!r}"
                )
        positions = self.positions
        if positions is not None and config.block_size > positions:
            raise InitFromError(
                f"--model.block-size: {config.block_size} exceeds the {positions} positions of "
                f"{where}; pass --model.block-size {positions} or less"
            )

    def check_vocabulary(self, tokens: int, what: str) -> None:
        """Refuse a tokenizer of more tokens than the embedding has rows.

        Raises:
            InitFromError: naming both sizes.
        """
        if tokens > self.vocab_size:
            raise InitFromError(
                f"--tokenizer: {what} has {tokens} tokens but the model's embedding in "
                f"{self.source} has {self.vocab_size} rows (larger ids would index past it); "
                f"pass the tokenizer the model was trained with"
            )

    def build(self) -> CausalLM:
        """The model with fresh random weights, on the current default device."""
        if self.gpt_config is not None:
            return GPT(self.gpt_config)
        return HFCausalLM(self.hf_config)

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the tensors a weight file must hold (each tied tensor once),
        from the model built on the ``meta`` device (no memory)."""
        with torch.device("meta"):
            model = self.build()
        if isinstance(model, GPT):  # its output matrix is saved as the token embedding
            return {
                name: tuple(tensor.shape)
                for name, tensor in model.state_dict().items()
                if name != _TIED[0]
            }
        assert isinstance(model, HFCausalLM)
        parameters = dict(model.model.named_parameters())  # each shared (tied) tensor once
        return {name: tuple(tensor.shape) for name, tensor in parameters.items()}

    def load(self, directory: Path) -> CausalLM:
        """The model holding ``directory``'s weights (float32), loaded without first building
        a randomly initialised copy.

        Raises:
            ValueError: If a weight is missing or of another shape.
        """
        if self.gpt_config is None:
            return load_pretrained(directory, self.hf_config)
        from safetensors.torch import load_file

        with torch.device("meta"):
            model = GPT(self.gpt_config)
        state = load_file(str(directory / WEIGHTS_FILE))
        state[_TIED[0]] = state[_TIED[1]]
        model.load_state_dict(state, strict=True, assign=True)
        model.lm_head.weight = model.token_embedding.weight  # tied again after assign
        return model


def architecture_from_file(path: Path, config: ModelConfig, flag: str) -> Architecture:
    """Read the architecture a config.json describes, and check the options given beside it.

    Raises:
        InitFromError: If the file describes no causal LM, or an option disagrees with it.
    """
    values = read_model_config(path)
    if values.get("lowcomm_family") == GPT_FAMILY:
        from dataclasses import fields

        names = {field.name for field in fields(GPTConfig)}
        architecture = Architecture(
            path,
            GPT_FAMILY,
            values,
            gpt_config=GPTConfig(**{k: v for k, v in values.items() if k in names}),
        )
    else:
        model_type = values.get("model_type")
        types = causal_lm_types()
        if model_type not in types:
            raise InitFromError(
                f"{flag}: {path} has model_type {model_type!r}, not a causal-LM model type of "
                f"the installed transformers; pass a causal LM's directory (e.g. llama, qwen2, "
                f"mistral, gemma, gpt2), or upgrade transformers"
            )
        hf_config = _import_transformers().AutoConfig.from_pretrained(str(path))
        architecture = Architecture(path, f"hf-{model_type}", values, hf_config=hf_config)
    architecture.check_agrees(config, flag)
    return architecture


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


@dataclass
class InitialModel:
    """What ``--init-from PATH`` names, checked: its directory and architecture."""

    directory: Path
    """The model directory read."""
    architecture: Architecture
    """Its config."""

    @property
    def tokenizer(self) -> Path | None:
        """The model's own ``tokenizer.json``, when it has one."""
        path = self.directory / "tokenizer.json"
        return path if path.is_file() else None

    def load(self) -> CausalLM:
        """The model with the directory's weights (on the CPU)."""
        return self.architecture.load(self.directory)


def preflight_init_from(path: str | Path, config: ModelConfig) -> InitialModel:
    """Check what ``--init-from PATH`` names against the run's model options, reading its
    config.json and its weight files' headers only.

    Raises:
        InitFromError: If PATH holds no model, an option disagrees with it, or its weights do
            not fit its config.
    """
    directory = model_directory(Path(path).expanduser())
    architecture = architecture_from_file(directory / "config.json", config, "--init-from")
    if config.config is not None:
        _check_same_config(Path(config.config), architecture)
    _check_weights(directory, architecture)
    return InitialModel(directory, architecture)


# --- a sharded start: each rank reads its own rows --------------------------------------------


def sharded_refusal(initial: InitialModel) -> str | None:
    """Why ``--worker-sharding fsdp`` cannot read ``initial``'s weights slice by slice (one
    line), or None."""
    directory = initial.directory
    if stored_shapes(directory) is None:
        return (
            f"--init-from: {directory} has no safetensors weights (pytorch_model.bin), which "
            f"--worker-sharding fsdp reads slice by slice; save the model with "
            f"save_pretrained(DIR, safe_serialization=True), or pass --worker-sharding replicate"
        )
    hf_config = initial.architecture.hf_config
    if hf_config is not None and _converted_on_load(hf_config.model_type):
        return (
            f"--init-from: transformers renames or fuses the tensors of a {hf_config.model_type} "
            f"model while loading it, so --worker-sharding fsdp cannot read its slices from "
            f"{directory}; pass --worker-sharding replicate"
        )
    return None


@dataclass
class CheckpointRows:
    """Rows of a model's tensors read from a model directory's safetensors files, only those
    rows (``safe_open(...).get_slice``), cast to float32; a tensor the files do not hold (a
    non-persistent buffer such as rotary frequencies) is the deferred build's
    (``computed``). ``elements_read`` counts what was read from the files."""

    directory: Path
    keys: dict[str, tuple[str, str]]
    """Model tensor name -> (file, tensor name in the file)."""
    computed: Any
    """The :class:`~lowcomm.models.deferred.Deferred` of the model built on meta."""
    elements_read: int = 0
    _files: dict[str, Any] = field(default_factory=dict)

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if name not in self.keys:
            return self.computed.rows(name, start, stop)  # type: ignore[no-any-return]
        file, key = self.keys[name]
        if file not in self._files:
            from safetensors import safe_open

            self._files[file] = safe_open(str(self.directory / file), framework="pt")
        tensor_slice = self._files[file].get_slice(key)
        rows = tensor_slice[start:stop] if tensor_slice.get_shape() else tensor_slice[:]
        self.elements_read += rows.numel()
        return rows.to(torch.float32)  # type: ignore[no-any-return]


def sliced_start(initial: InitialModel) -> tuple[CausalLM, CheckpointRows]:
    """The model of ``initial`` built on ``meta`` (float32, its buffers computed alongside,
    the random stream left as it was: a worker that loads the weights draws nothing), and
    where each of its tensors' rows are read.

    Raises:
        InitFromError: a tensor of the model is neither in the files nor computable.
    """
    from lowcomm.models.blocks import tied_names
    from lowcomm.models.deferred import build_deferred

    architecture = initial.architecture
    if architecture.hf_config is None:
        model, deferred = build_deferred(architecture.build, draw=False)
        prefixes: tuple[str, ...] = ("",)
    else:
        config = copy.deepcopy(architecture.hf_config)
        config.dtype = torch.float32  # (as load_pretrained loads it)
        model, deferred = build_deferred(lambda: HFCausalLM(config), draw=False)
        prefixes = ("model.", f"model.{_base_prefix(architecture)}.")
    stored = _stored_files(initial.directory)
    tied = {name: group for group in tied_names(model) for name in group}
    keys: dict[str, tuple[str, str]] = {}
    for name in deferred.tensors:
        candidates = [
            other.removeprefix(prefix) for other in tied.get(name, [name]) for prefix in prefixes
        ]
        found = next((key for key in [name, *candidates] if key in stored), None)
        if found is not None:
            keys[name] = (stored[found], found)
        elif not deferred.shadowed(name):
            raise InitFromError(
                f"--init-from: {initial.directory} has no tensor {name} that its config.json's "
                f"model needs; pass a complete model directory (config.json and every weight file)"
            )
    return model, CheckpointRows(initial.directory, keys, deferred)


def _stored_files(directory: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file of ``directory`` that holds it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    return {name: WEIGHTS_FILE for name in _header_shapes(directory / WEIGHTS_FILE)}


def _check_same_config(given: Path, architecture: Architecture) -> None:
    values = read_model_config(given)
    ignored = {"transformers_version", "dtype", "torch_dtype", "_name_or_path"}
    for key in sorted(set(values) | set(architecture.values)):
        if key in ignored or values.get(key) == architecture.values.get(key):
            continue
        raise InitFromError(
            f"--model.config: {given} differs from --init-from's {architecture.source} ({key}: "
            f"{values.get(key)!r} vs {architecture.values.get(key)!r}); drop --model.config "
            f"(the model directory is the architecture)"
        )


def _check_weights(directory: Path, architecture: Architecture) -> None:
    """Every tensor the architecture needs is in the weight files, with its shape (headers
    only)."""
    stored = stored_shapes(directory)
    if stored is None:
        return  # pytorch_model.bin without safetensors: from_pretrained checks while loading
    prefix = ""
    if architecture.hf_config is not None:
        if _converted_on_load(architecture.hf_config.model_type):
            return  # transformers renames or fuses its tensors while loading; the load checks
        prefix = f"{_base_prefix(architecture)}."
    for name, shape in architecture.expected_tensors().items():
        found = name if name in stored else name.removeprefix(prefix)
        if found not in stored:
            raise InitFromError(
                f"--init-from: {directory} has no tensor {name} that its config.json's model "
                f"needs; pass a complete model directory (config.json and every weight file)"
            )
        if stored[found] != shape:
            raise InitFromError(
                f"--init-from: tensor {name} has shape {stored[found]} in {directory} but "
                f"{shape} in the model its config.json describes; pass a directory whose "
                f"weights and config.json belong together"
            )


def _base_prefix(architecture: Architecture) -> str:
    transformers = _import_transformers()
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(architecture.hf_config)]
    return str(getattr(model_class, "base_model_prefix", "model"))


def _converted_on_load(model_type: str) -> bool:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    return get_checkpoint_conversion_mapping(model_type) is not None  # type: ignore[no-untyped-call]


def stored_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor names and shapes of a model directory's safetensors files, read from their
    headers (None: the directory has no safetensors weights)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        shapes.update(_header_shapes(directory / name))
    return shapes


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """A safetensors file's tensor shapes: an 8-byte little-endian header length, then the
    JSON header; the tensor data after it is not read."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise InitFromError(
            f"--init-from: {path} is not a readable safetensors file ({error}); pass a model "
            f"directory written by save_pretrained"
        ) from None
    return {
        name: tuple(int(size) for size in entry["shape"])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def tokenizer_vocab_size(path: str | Path) -> int:
    """Tokens of a ``tokenizer.json`` (the ``tokenizers`` package's format), added tokens
    included.

    Raises:
        InitFromError: If the file cannot be read as one.
    """
    import tokenizers

    try:
        return int(tokenizers.Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True))
    except Exception as error:  # the tokenizers package raises its own exception types
        raise InitFromError(
            f"--tokenizer: {path} is not a readable tokenizer.json ({str(error).strip()}); "
            f"pass a file saved by the tokenizers package (a model's tokenizer.json)"
        ) from None
