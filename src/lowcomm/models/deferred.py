"""A model built on the ``meta`` device whose real initial values can be produced one tensor
at a time, exactly (bit for bit) as building it on the CPU would give them: a sharded worker's
start (``--worker-sharding fsdp``) without ever holding the whole model.

Under :class:`DeferredInit` (a dispatch mode), a model's construction runs its own code (its
constructors, its weight initialisation) unchanged, but every tensor it makes is on ``meta``.
What the CPU would have computed is kept in one of two forms, per storage:

* a **shadow**: small tensors (norm weights, biases, rotary frequencies: at most
  :data:`SHADOW_ELEMENTS` elements) are also computed for real, op by op, on CPU copies;
* a **recipe**: for a large tensor, the in-place operations that wrote it (``normal_``,
  ``uniform_``, ``zero_``, ``fill_``, ``copy_`` from a small tensor, ...) are recorded, each
  random one with the state of its generator just before it. The random stream is kept
  exact by running every random operation of a large tensor on a throw-away CPU tensor of
  its layout as it is recorded (one such tensor alive at a time), so the generator advances
  exactly as in a CPU build: later draws, and the state after the build, are the CPU
  build's.

:meth:`Deferred.rows` then gives any rows of any parameter or buffer: the shadow's, or the
recipe replayed on a fresh tensor of that storage (the generator set to each recorded state),
of which the rows are kept. A tensor written any other way (computed out of place from a
large tensor, or written by a large one) has no recipe, and the build says which
(:class:`NotDeferrable`): the caller builds the model whole instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from lowcomm.dispatch import PlainDispatchMode

#: Storages of at most this many elements are computed for real as the model is built.
SHADOW_ELEMENTS = 1 << 16

#: In-place operations that write every element of their target whatever it held before: a
#: recipe step of one of them over a whole storage makes the steps before it moot.
_OVERWRITES = frozenset(
    ("normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "exponential_", "cauchy_",
     "log_normal_", "geometric_")
)  # fmt: skip

META = torch.device("meta")


class NotDeferrable(ValueError):
    """A model whose initial values cannot be produced tensor by tensor (one line: which
    tensor and why)."""


@dataclass
class _Step:
    """One recorded in-place operation on a view of a large storage."""

    func: Any
    args: tuple[Any, ...]
    """The arguments after the target, small tensors as real values."""
    kwargs: dict[str, Any]
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    """(size, stride, storage offset) of the view written."""
    rng_state: torch.Tensor | None = None
    """The generator's state just before a random operation."""
    factory: bool = False
    """A factory (``args`` are all its arguments): its result is copied into the view."""


@dataclass
class _Storage:
    """What is known of one meta storage's real contents."""

    storage: Any
    """The meta storage (kept alive, so its key is not reused)."""
    numel: int
    dtype: torch.dtype
    shadow: torch.Tensor | None = None
    """The real contents, as a 1-D tensor over the storage (small storages)."""
    steps: list[_Step] | None = field(default_factory=list)
    """The recipe (large storages); None: written in a way that cannot be replayed."""
    why: str = ""


def _key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def _geometry(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(tensor.size()), tuple(tensor.stride()), int(tensor.storage_offset())


def _view(
    base: torch.Tensor, geometry: tuple[tuple[int, ...], tuple[int, ...], int]
) -> torch.Tensor:
    size, stride, offset = geometry
    return base.as_strided(size, stride, offset)


def _storage_numel(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes()) // tensor.element_size()


class _Workspace:
    """One reusable CPU buffer for the whole tensors made one at a time (a fresh allocation
    each would leave the process's heap holding about the whole model: freed blocks of
    different sizes are not returned)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def view(
        self, geometry: tuple[tuple[int, ...], tuple[int, ...], int], dtype: torch.dtype
    ) -> torch.Tensor:
        """A tensor of ``dtype`` with ``geometry`` (size, stride, storage offset) over the
        buffer (grown to fit; its previous contents are not kept)."""
        size, stride, offset = geometry
        extent = offset + 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True) if n)
        nbytes = extent * torch.empty(0, dtype=dtype).element_size()
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(0, dtype=torch.uint8)  # (freed before the larger one)
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).as_strided(size, stride, offset)


class DeferredInit(PlainDispatchMode):
    """Build a model on ``meta`` while keeping what the CPU would hold (module docstring).

    ``shadow_elements``: the size up to which a storage is computed for real."""

    def __init__(self, shadow_elements: int = SHADOW_ELEMENTS, *, draw: bool = True) -> None:
        super().__init__()
        self.shadow_elements = shadow_elements
        self.draw = draw
        """Draw a large tensor's random numbers on a scratch tensor as they are recorded (so
        the stream goes on as on the CPU); False where its values come from elsewhere (a
        checkpoint) and the stream is restored after the build."""
        self.storages: dict[int, _Storage] = {}
        self._adopted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Real tensors from outside the build (by id): the tensor and its meta twin."""
        self._scratch = _Workspace()

    # --- the dispatch ----------------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors and not any(t.is_meta for t in tensors):
            # Real tensors from outside the build (torch.tensor(data)): as on the CPU.
            return func(*args, **kwargs)
        for tensor in tensors:
            if not tensor.is_meta:
                self._adopt(tensor)
        shadowed = all(self._shadow(t) is not None for t in tensors)
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(): a value is read
            if not shadowed:
                raise NotDeferrable("the build reads the value of a tensor it cannot compute")
            return self._run_real(func, args, kwargs)
        meta_args, meta_kwargs = tree_map(self._to_meta, (args, kwargs))
        if not tensors and "device" in _argument_names(func):
            meta_kwargs["device"] = META
        out = func(*meta_args, **meta_kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        new = [t for t in outputs if _key(t) not in self.storages]
        small = all(_storage_numel(t) <= self.shadow_elements for t in new)
        written = _written(func, args, kwargs)
        if shadowed and small:
            real = self._run_real(func, args, kwargs)
            self._keep_shadows(out, real)
            return out if outputs else real
        self._record(func, args, kwargs, written, new)
        return out

    def _adopt(self, tensor: torch.Tensor) -> None:
        """A real tensor from outside the build: its contents are its own shadow."""
        if id(tensor) in self._adopted:
            return
        meta = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=META)
        entry = _Storage(meta.untyped_storage(), _storage_numel(meta), tensor.dtype)
        entry.shadow = torch.zeros(entry.numel, dtype=tensor.dtype)
        _view(entry.shadow, _geometry(meta)).copy_(tensor.detach())
        self.storages[_key(meta)] = entry
        self._adopted[id(tensor)] = (tensor, meta)  # (the tensor kept: its id is not reused)

    def _to_meta(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not value.is_meta:
            return self._adopted[id(value)][1]
        return value

    def _entry(self, tensor: torch.Tensor) -> _Storage | None:
        return self.storages.get(_key(self._to_meta(tensor)))

    def _shadow(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The real values of (a view of) a tensor of the build, where they are kept."""
        entry = self._entry(tensor)
        if entry is None or entry.shadow is None:
            return None
        return _view(entry.shadow, _geometry(self._to_meta(tensor)))

    def _run_real(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def real(value: Any) -> Any:
            return self._shadow(value) if isinstance(value, torch.Tensor) else value

        real_args, real_kwargs = tree_map(real, (args, kwargs))
        return func(*real_args, **real_kwargs)

    def _keep_shadows(self, out: Any, real: Any) -> None:
        """Record the real outputs of an op as the shadows of its new meta outputs."""
        metas, reals = tree_flatten(out)[0], tree_flatten(real)[0]
        for meta, value in zip(metas, reals, strict=True):
            if not isinstance(meta, torch.Tensor) or _key(meta) in self.storages:
                continue
            entry = _Storage(meta.untyped_storage(), _storage_numel(meta), meta.dtype)
            if _geometry(meta) != _geometry(value) or value.device.type == "meta":
                entry.steps, entry.why = None, f"{value.shape} computed with another layout"
            else:
                whole = value.untyped_storage().nbytes() // value.element_size()
                entry.shadow = value.detach().as_strided((whole,), (1,), 0)
            self.storages[_key(meta)] = entry

    def _record(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        written: list[torch.Tensor], new: list[torch.Tensor],
    ) -> None:  # fmt: skip
        """An op that is not computed for real: a recipe step of the storage it writes, or
        the start of a new storage's recipe (a factory), or a storage that cannot be made."""
        factory = not [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for tensor in new:
            entry = _Storage(tensor.untyped_storage(), _storage_numel(tensor), tensor.dtype)
            self.storages[_key(tensor)] = entry
            if not factory:
                entry.steps, entry.why = None, f"computed by {func} from a large tensor"
            elif _is_random(func) or not func.__name__.startswith("empty"):
                entry.steps = [self._step(func, args, kwargs, tensor, factory=True)]
        for tensor in written:
            found = self._entry(tensor)
            assert found is not None
            entry = found
            rest = args[1:] if args and args[0] is tensor else None
            small = rest is not None and all(
                self._shadow(t) is not None
                for t in tree_flatten((rest, kwargs))[0]
                if isinstance(t, torch.Tensor)
            )
            if entry.steps is None or not small or entry.shadow is not None:
                why = entry.why or f"written by {func} from a tensor it cannot compute"
                entry.steps, entry.shadow, entry.why = None, None, why
                continue
            step = self._step(func, tree_map(self._real_value, rest), kwargs, tensor)
            whole = _geometry(tensor) == ((entry.numel,), (1,), 0) or (
                tensor.is_contiguous() and tensor.numel() == entry.numel
            )
            if whole and func.__name__.split(".")[0] in _OVERWRITES:
                entry.steps = []
            entry.steps.append(step)

    def _real_value(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            shadow = self._shadow(value)
            assert shadow is not None
            return shadow.clone()
        return value

    def _step(
        self, func: Any, rest: tuple[Any, ...], kwargs: dict[str, Any], target: torch.Tensor,
        *, factory: bool = False,
    ) -> _Step:  # fmt: skip
        """A recipe step; a random one records its generator's state, then draws on a
        throw-away tensor of the target's layout so the generator moves as on the CPU."""
        state = None
        if _is_random(func) and self.draw:
            generator = kwargs.get("generator") or torch.default_generator
            state = generator.get_state()
            if factory:
                func(*rest, **{**kwargs, "device": torch.device("cpu")})
            else:  # (the target's strides, so the draws follow the same path)
                geometry = (tuple(target.size()), tuple(target.stride()), 0)
                func(self._scratch.view(geometry, target.dtype), *rest, **kwargs)
        real_kwargs = {**kwargs, "device": torch.device("cpu")} if factory else kwargs
        return _Step(func, rest, real_kwargs, _geometry(target), state, factory)


def _argument_names(func: Any) -> set[str]:
    return {argument.name for argument in func._schema.arguments}


def _is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes in place (its arguments marked mutable in its schema)."""
    written: list[torch.Tensor] = []
    for index, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


@dataclass
class Deferred:
    """A model built under :class:`DeferredInit`: its meta tensors by name and what makes
    their values."""

    tensors: dict[str, torch.Tensor]
    """Every parameter (each tied one under each of its names) and buffer, on meta."""
    storages: dict[int, _Storage]
    generator_state: torch.Tensor
    """The default generator's state after the build (a CPU build's)."""
    workspace: _Workspace = field(default_factory=_Workspace)
    """Where a large tensor is made whole (one at a time)."""

    def check(self) -> None:
        """Raise :class:`NotDeferrable` naming the first tensor whose values cannot be made."""
        for name, tensor in self.tensors.items():
            entry = self.storages.get(_key(tensor))
            if not tensor.is_meta:
                continue  # (real: made from data, torch.tensor(...))
            if entry is None:
                raise NotDeferrable(f"{name} was made outside the deferred build")
            if entry.shadow is None and entry.steps is None:
                raise NotDeferrable(f"{name} is {entry.why}")

    def shadowed(self, name: str) -> bool:
        """Whether tensor ``name`` was computed for real as the model was built (a small
        one), or made from data outside it."""
        tensor = self.tensors[name]
        if not tensor.is_meta:
            return True
        entry = self.storages.get(_key(tensor))
        return entry is not None and entry.shadow is not None

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (of dim 0) of tensor ``name`` as a CPU build makes it: at most
        one whole tensor is made for it, and freed."""
        tensor = self.tensors[name]
        if not tensor.is_meta:
            return _rows(tensor.detach(), start, stop).clone()
        entry = self.storages[_key(tensor)]
        geometry = _geometry(tensor)
        if entry.shadow is not None:
            return _rows(_view(entry.shadow, geometry), start, stop).clone()
        assert entry.steps is not None
        base = self.workspace.view(((entry.numel,), (1,), 0), entry.dtype)
        state = torch.default_generator.get_state()
        try:
            for step in entry.steps:
                _replay(step, base)
        finally:
            torch.default_generator.set_state(state)
        return _rows(_view(base, geometry), start, stop).clone()


def _rows(tensor: torch.Tensor, start: int, stop: int | None) -> torch.Tensor:
    return tensor if tensor.dim() == 0 else tensor[start:stop]


def _replay(step: _Step, base: torch.Tensor) -> None:
    generator = step.kwargs.get("generator") or torch.default_generator
    if step.rng_state is not None:
        generator.set_state(step.rng_state)
    target = _view(base, step.geometry)
    if step.factory:
        target.copy_(step.func(*step.args, **step.kwargs))
    else:
        step.func(target, *step.args, **step.kwargs)


def build_deferred(
    build: Any, shadow_elements: int = SHADOW_ELEMENTS, *, draw: bool = True
) -> tuple[Any, Deferred]:
    """Run ``build()`` (a function returning a model) under :class:`DeferredInit`: the model
    on ``meta`` and what makes its values. ``draw=False``: the large tensors' values will
    come from elsewhere (their random draws are neither made nor replayable, and the
    default generator is left as it was before the build).

    Raises:
        NotDeferrable: a tensor of the model cannot be made tensor by tensor (or the build
            read the value of one), in one line (only with ``draw``).
    """
    mode = DeferredInit(shadow_elements, draw=draw)
    state = torch.default_generator.get_state()
    with mode:
        model = build()
    if not draw:
        torch.default_generator.set_state(state)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    deferred = Deferred(tensors, mode.storages, torch.default_generator.get_state())
    if draw:
        deferred.check()
    return model, deferred


__all__ = ["SHADOW_ELEMENTS", "Deferred", "DeferredInit", "NotDeferrable", "build_deferred"]


#: The random in-place initialisations: on ``meta`` they have no kernel of their own, and
#: their Python decomposition imports torch's compiler stack.
_RANDOM_FILLS = frozenset(
    ("normal_", "uniform_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_",
     "bernoulli_")
)  # fmt: skip


#: Factories of a tensor like another, filled: for shapes, an empty one does.
_FILLED_LIKE = frozenset(
    ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like")
)  # fmt: skip


class ShapesOnly(PlainDispatchMode):
    """Build a model (and a method over it) on ``meta`` for its shapes alone (pre-flight's
    checks): every tensor made is on ``meta``, a random initialisation returns its target
    untouched, and a filled copy of a tensor's shape or a concatenation is left empty.

    (``with torch.device("meta")`` would do the first, but its first use imports torch's
    compiler stack, about 3 s of every command's start; so do the Python meta kernels of a
    random fill, a filled copy and a concatenation.)"""

    def __torch_dispatch__(  # type: ignore[override]
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = META
        args = tree_map(_meta_twin, args)
        kwargs = tree_map(_meta_twin, kwargs)
        target = args[0] if args else None
        name = func.overloadpacket.__name__
        if isinstance(target, torch.Tensor) and name in _RANDOM_FILLS:
            return target
        if isinstance(target, torch.Tensor) and name in _FILLED_LIKE:  # (a Python meta kernel)
            dtype = kwargs.get("dtype") or target.dtype
            return torch.empty(target.shape, dtype=dtype, device=META)
        if name == "cat":  # (a Python meta kernel)
            return _cat_shape(*args, **kwargs)
        return func(*args, **kwargs)


def _cat_shape(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """An empty meta tensor of ``torch.cat(tensors, dim)``'s shape and type."""
    shaped = [t for t in tensors if t.shape != (0,)]  # (cat skips these legacy empties)
    dim = dim % shaped[0].dim()
    size = list(shaped[0].shape)
    size[dim] = sum(t.shape[dim] for t in shaped)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in shaped))
    return torch.empty(size, dtype=dtype, device=META)


def _meta_twin(value: Any) -> Any:
    """A real tensor met while building for shapes (a constant made on the CPU): on meta."""
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return value.to(META)
    return value
