"""Method variants of a study: one method run with different options, under its own label.

``--methods`` takes method names and variants ``METHOD+TAG:KEY=VALUE[,KEY=VALUE...]``, e.g.
``diloco+muon:optim.name=muon`` or ``streaming_diloco+int4:diloco.quantization=int4``. A
variant runs METHOD with the study's training options and each KEY (a training option's
path, as after ``--train.``: ``diloco.outer-lr``, ``optim.lr``) set to VALUE; tables, figures
and run directories name it by its label ``METHOD+TAG``. Arguments may also hold several
comma-separated entries (``ddp,zero1``): a comma-separated piece of the form ``KEY=VALUE``
continues the options of the variant before it.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lowcomm.config import TrainConfig

#: Options a variant may not set: the study sets them for every run (the seed, the run
#: directory, the budget), or they are the study's own axes (one network, one clock, one
#: number of workers and steps for every method).
STUDY_OWNED = (
    "method", "seed", "out", "token_budget", "progress", "resume", "overwrite",
    "network", "clock", "steps", "workers", "calibration",
)  # fmt: skip

_TAG = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Variant:
    """One entry of ``--methods``: a method, the label it is shown under, its options."""

    method: str
    tag: str | None = None
    options: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        return self.method if self.tag is None else f"{self.method}+{self.tag}"

    def spec(self) -> str:
        """The ``--methods`` entry that gives this variant back."""
        pairs = ",".join(f"{key}={value}" for key, value in self.options)
        return self.label + (f":{pairs}" if pairs else "")

    def apply(self, config: TrainConfig) -> TrainConfig:
        """``config`` with this variant's method and options set."""
        from lowcomm.strategies import STRATEGIES
        from lowcomm.strategies.option_groups import group_members

        config = dataclasses.replace(config, method=self.method)
        members = group_members(STRATEGIES)
        for key, value in self.options:
            group = key.replace("-", "_").split(".")[0]
            if group in members and self.method not in members[group]:
                raise ValueError(
                    f"--methods: {self.spec()}: {self.method} does not read the {group}.* "
                    f"options (only {', '.join(members[group])} do); set an option of "
                    f"{self.method} instead"
                )
            config = _set_option(config, key, value, self.spec())
        return config


def split_entries(arguments: Sequence[str]) -> list[str]:
    """The entries of ``--methods``: each argument split at its commas, a ``KEY=VALUE`` piece
    (an ``=`` and no ``:``) joined back to the entry before it."""
    entries: list[str] = []
    for argument in arguments:
        for piece in (p.strip() for p in argument.split(",")):
            if not piece:
                continue
            if "=" in piece and ":" not in piece and entries and ":" in entries[-1]:
                entries[-1] += "," + piece
            else:
                entries.append(piece)
    return entries


def parse_variant(entry: str, known: Collection[str]) -> Variant:
    """One ``--methods`` entry (``METHOD``, ``METHOD+TAG`` or ``METHOD+TAG:KEY=VALUE,...``).

    Raises ValueError naming the entry, the rule and the fix."""
    head, _, tail = entry.partition(":")
    method, plus, tag = head.partition("+")
    method = method.strip()
    if method not in known:
        raise ValueError(
            f"--methods: {entry}: unknown method {method!r}; choose from "
            f"{', '.join(sorted(known))} or pass all"
        )
    if plus and not _TAG.fullmatch(tag):
        raise ValueError(
            f"--methods: {entry}: the tag after '+' must be letters, digits, '_', '.' or '-' "
            f"(it names the run directory), e.g. {method}+muon"
        )
    if tail and not plus:
        raise ValueError(
            f"--methods: {entry}: a method with options needs a tag to tell it apart, e.g. "
            f"{method}+mytag:{tail}"
        )
    options: list[tuple[str, str]] = []
    for pair in (p for p in tail.split(",") if p.strip()) if tail else ():
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            raise ValueError(
                f"--methods: {entry}: {pair!r} is not KEY=VALUE; write e.g. "
                f"{method}+{tag or 'tag'}:diloco.outer-lr=0.5"
            )
        options.append((key.strip(), value.strip()))
    if plus and tail == "" and ":" in entry:
        raise ValueError(f"--methods: {entry}: no KEY=VALUE after ':'; drop the ':'")
    return Variant(method, tag if plus else None, tuple(options))


def parse_methods(arguments: Sequence[str], known: Collection[str]) -> list[Variant]:
    """The variants ``--methods`` names (``all``: every known method, to which variants may
    be added), labels unique, each
    variant's options checked against a default configuration.

    Raises ValueError naming the entry, the rule and the fix."""
    entries = split_entries(arguments)
    if not entries:
        raise ValueError(
            f"--methods: no method given; choose from {', '.join(sorted(known))} or pass all"
        )
    variants = [
        variant
        for entry in entries
        for variant in (
            [Variant(method) for method in sorted(known)]
            if entry == "all"
            else [parse_variant(entry, known)]
        )
    ]
    labels = [variant.label for variant in variants]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(
            f"--methods: {', '.join(repeated)} given twice; give each once, or tell two runs "
            f"of one method apart by a tag (METHOD+TAG:KEY=VALUE)"
        )
    for variant in variants:
        variant.apply(TrainConfig())  # refuse a bad key or value before any run
    return variants


def _set_option(config: Any, key: str, text: str, entry: str) -> Any:
    from lowcomm.config import FLAT_KEYS

    path = key.replace("-", "_").split(".")
    if path[0] in STUDY_OWNED and len(path) == 1:
        raise ValueError(
            f"--methods: {entry}: {key} is set by the study for every run; give it once for "
            f"all (--{key.replace('_', '-')} or --train.{key.replace('_', '-')})"
        )
    if len(path) == 1 and path[0] in FLAT_KEYS:  # an option named as its flag is
        path = [FLAT_KEYS[path[0]], path[0]]
    return _set_path(config, path, text, key, entry)


def _set_path(obj: Any, path: list[str], text: str, key: str, entry: str) -> Any:
    name = path[0]
    names = [f.name for f in dataclasses.fields(obj)]
    if name not in names:
        raise ValueError(
            f"--methods: {entry}: {key} names no training option ({name!r} is not one of "
            f"{', '.join(n.replace('_', '-') for n in names)}); write the path as after "
            f"--train., e.g. diloco.outer-lr=0.5"
        )
    current = getattr(obj, name)
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise ValueError(f"--methods: {entry}: {key}: {name} has no sub-options")
        value = _set_path(current, path[1:], text, key, entry)
    elif dataclasses.is_dataclass(current):
        raise ValueError(
            f"--methods: {entry}: {key} is a group of options; set one of them, e.g. "
            f"{key}.{dataclasses.fields(current)[0].name.replace('_', '-')}=..."
        )
    else:
        annotation = typing.get_type_hints(type(obj))[name]
        try:
            value = convert(text, annotation)
        except ValueError as error:
            raise ValueError(f"--methods: {entry}: {key}: {text!r} {error}") from None
    try:
        return dataclasses.replace(obj, **{name: value})
    except ValueError as error:  # the option group's own check, which names the flag
        raise ValueError(f"--methods: {entry}: {error}") from None


def convert(text: str, annotation: Any) -> Any:
    """``text`` as a value of the option type ``annotation`` (str, int, float, bool, a
    Literal, ``X | None``, ``tuple[X, ...]`` written space-separated).

    Raises ValueError saying what the value must be."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if type(None) in arguments and text in ("None", "none"):
            return None
        problems = []
        for option in (a for a in arguments if a is not type(None)):
            try:
                return convert(text, option)
            except ValueError as error:
                problems.append(str(error))
        raise ValueError(" or ".join(problems) + (" or None" if type(None) in arguments else ""))
    if origin is Literal:
        for choice in arguments:
            if text == str(choice):
                return choice
        raise ValueError(f"must be one of {', '.join(str(a) for a in arguments)}")
    if origin is tuple:
        item = arguments[0]
        values = tuple(convert(part, item) for part in text.split())
        if arguments[-1] is not Ellipsis and len(values) != len(arguments):
            raise ValueError(f"must be {len(arguments)} values separated by spaces")
        return values
    return _convert_scalar(text, annotation)


def _convert_scalar(text: str, annotation: Any) -> Any:
    if annotation is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError("must be true or false")
    if annotation in (int, float):
        try:
            return annotation(text)
        except ValueError:
            raise ValueError(
                f"must be a{'n integer' if annotation is int else ' number'}"
            ) from None
    if annotation is str:
        return text
    raise ValueError(f"options of type {annotation} cannot be set in a variant")
