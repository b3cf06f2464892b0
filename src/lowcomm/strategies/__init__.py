"""Strategies: one file per paper family. Nothing here imports ``torch.distributed``.

To add a method: write a :class:`Strategy` subclass with a ``name`` in a module of this
package and list it in that module's ``METHODS`` tuple; every module here is scanned, so
``lowcomm train --method NAME`` and ``lowcomm plan --method NAME`` pick it up with no other
change to the code (``README.md`` here lists what else a new method needs: an exported
options class, a regression pin, tests). The class is the method's one declaration
(docs/ADDING_A_METHOD.md): its options (a ``kw_only`` dataclass, the type of the
constructor's ``options``, in the group named by ``options_field``: a field of that name is
added to :class:`lowcomm.config.TrainConfig` and :class:`lowcomm.plan.PlanConfig`), its
planner ``cost`` model, its ``hierarchical_refusal``, the collective dtypes it supports, the
options that quantize its exchange, its options for a short run (``lowcomm selftest``) and
whether it takes a variable number of micro-batches (:mod:`lowcomm.strategies.declaration`).
The registry checks each declaration here, so a wrong one fails at import, naming the method
and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
import typing

from torch import nn

from lowcomm.comm.base import Comm
from lowcomm.strategies.base import (
    Closure,
    MicroBatchResult,
    StepStats,
    Strategy,
    StrategyContext,
)
from lowcomm.strategies.ddp import DDP
from lowcomm.strategies.declaration import COMM_DTYPES
from lowcomm.strategies.zero1 import ZeRO1


def _discover() -> dict[str, type[Strategy]]:
    found: dict[str, type[Strategy]] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for cls in getattr(module, "METHODS", ()):
            if cls.name in found and found[cls.name] is not cls:
                raise RuntimeError(f"two strategies are named {cls.name!r}")
            check_declaration(cls)
            found[cls.name] = cls
    return found


def check_declaration(cls: type[Strategy]) -> None:
    """Check what ``cls`` declares about itself against its options class and the values
    ``--comm-dtype`` takes.

    Raises:
        TypeError: naming the method, the declaration and the fix.
    """
    where = f"{cls.__name__} (method {getattr(cls, 'name', '?')!r})"
    unknown = sorted(set(cls.comm_dtypes) - set(COMM_DTYPES))
    if "fp32" not in cls.comm_dtypes or unknown:
        raise TypeError(
            f"{where}: comm_dtypes {cls.comm_dtypes} must hold fp32 and only values of "
            f"--comm-dtype ({', '.join(COMM_DTYPES)})"
        )
    if set(cls.comm_dtypes) != set(COMM_DTYPES) and not cls.comm_dtype_refusal:
        raise TypeError(
            f"{where}: comm_dtypes leaves out {sorted(set(COMM_DTYPES) - set(cls.comm_dtypes))}; "
            f"declare comm_dtype_refusal, the reason a user is given"
        )
    kind = options_class(cls)
    fields = set() if kind is None else {f.name for f in dataclasses.fields(kind)}
    named = {
        "quick_options": tuple(cls.quick_options),
        "quantized_exchange": ()
        if cls.quantized_exchange is None
        else cls.quantized_exchange.option_names(),
    }
    for declaration, names in named.items():
        missing = [name for name in names if name not in fields]
        if missing:
            owner = "it has no options class" if kind is None else f"{kind.__name__} has no"
            raise TypeError(
                f"{where}: {declaration} names {', '.join(missing)}, but {owner} such field; "
                f"name fields of the options class its constructor takes"
            )


def strategy_class(name: str) -> type[Strategy]:
    """Look up a strategy by its ``--method`` name.

    Raises:
        ValueError: naming the unknown method and the available ones.
    """
    if name not in STRATEGIES:
        close = difflib.get_close_matches(
            name.lower().replace("-", "_"), STRATEGIES, n=1, cutoff=0.6
        )
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(
            f"--method: unknown method {name!r}; {hint}choose one of "
            f"{', '.join(sorted(STRATEGIES))}"
        )
    return STRATEGIES[name]


def options_class(cls: type[Strategy]) -> type | None:
    """The options dataclass a strategy's constructor takes (its ``options`` argument), or
    None for a method without options."""
    if cls.options_field is None:
        return None
    hint = typing.get_type_hints(cls.__init__).get("options")
    for candidate in typing.get_args(hint) or (hint,):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    raise TypeError(f"{cls.__name__}.__init__ has no dataclass-typed options argument")


def method_options(cls: type[Strategy], options_source: object) -> object | None:
    """The options ``cls`` is built with, read from ``options_source`` (a
    :class:`lowcomm.config.TrainConfig` or :class:`lowcomm.plan.PlanConfig`: the attribute
    named by ``options_field``); None for a method without options."""
    return None if cls.options_field is None else getattr(options_source, cls.options_field)


def comm_dtype_problem(method: str, comm_dtype: str) -> str | None:
    """The one-line refusal of ``--comm-dtype comm_dtype`` with ``method`` (None: supported),
    from the method's declaration (``comm_dtypes``, ``comm_dtype_refusal``)."""
    cls = strategy_class(method)
    if comm_dtype in cls.comm_dtypes:
        return None
    return (
        f"--comm-dtype: {comm_dtype} with --method {method}: {cls.comm_dtype_refusal}; use "
        f"--comm-dtype {' or '.join(cls.comm_dtypes)}"
    )


def build_strategy(
    method: str, model: nn.Module, comm: Comm, context: StrategyContext, options_source: object
) -> Strategy:
    """Construct ``method``, handing it its family's options read from ``options_source``
    (a :class:`lowcomm.config.TrainConfig`: the attribute named by ``options_field``)."""
    cls = strategy_class(method)
    options = method_options(cls, options_source)
    if options is None:
        return cls(model, comm, context)
    return cls(model, comm, context, options=options)  # type: ignore[call-arg]


#: Every registered method by name, each declaration checked (discovered once, at import).
STRATEGIES: dict[str, type[Strategy]] = _discover()

__all__ = [
    "DDP",
    "STRATEGIES",
    "Closure",
    "MicroBatchResult",
    "StepStats",
    "Strategy",
    "StrategyContext",
    "ZeRO1",
    "build_strategy",
    "check_declaration",
    "comm_dtype_problem",
    "method_options",
    "options_class",
    "strategy_class",
]
