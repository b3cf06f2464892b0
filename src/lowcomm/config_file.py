"""Config files for ``lowcomm train``: ``--config FILE`` reads one, ``--print-config`` writes one.

A file has the shape of :class:`lowcomm.config.TrainConfig`, the shape a run directory's
``config.json`` already has: the method as a top-level key (``method = "diloco"``), each
component as a table (``[model]``, ``[data]``, ``[optim]``, ``[schedule]``, ``[placement]``,
``[run]``, ``[comm]``, ``[numerics]``, ``[fault]``) and each method's options as the table of
its group (``[diloco]``). A file of the flat shape, with the options of ``[placement]`` to
``[fault]`` at the top level (``workers = 4``, as lowcomm wrote config.json before), is read
the same. TOML's dotted keys
(``diloco.sync_every = 50``) are the same tables; a key may be spelled with ``-`` or ``_``.
TOML has no null: the string ``"None"`` sets an option to None, as ``--option None`` does.

The file's values become the defaults that ``tyro`` parses the command line over, which is
how ``--resume DIR`` already reads a run's config.json (:meth:`TrainConfig.from_dict`), so a
flag given beside ``--config`` always wins. This module imports no torch until a file is
read (``lowcomm train`` starts its worker server before torch is imported).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

if TYPE_CHECKING:
    from lowcomm.config import TrainConfig

#: How a file spells None (TOML has no null); the command line's spelling.
NONE = "None"

#: The header --print-config writes above the options.
HEADER = (
    "# lowcomm train options: `lowcomm train --config FILE` reads them, flags given beside\n"
    "# --config override them. docs/config-files.md describes the format.\n"
)


class ConfigFileError(ValueError):
    """A config file that cannot be used: the message is one line naming the file and key."""


def config_path(given: str) -> Path:
    """The file ``--config`` names: the file itself, or a run directory's config.json."""
    path = Path(given).expanduser()
    return path / "config.json" if path.is_dir() else path


def read_raw(given: str) -> dict[str, Any]:
    """The file's contents as a dict (TOML, or JSON for a ``.json`` file), without checking
    its keys; imports no torch.

    Raises:
        ConfigFileError: a missing file or one that is not TOML (JSON).
    """
    path = config_path(given)
    try:
        text = path.read_text()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigFileError(
            f"--config {given}: cannot read {path} ({reason}); pass a TOML file "
            f"(`lowcomm train ... --print-config > run.toml` writes one) or a run directory"
        ) from None
    except UnicodeDecodeError as error:
        raise ConfigFileError(
            f"--config {given}: {path} is not text (byte {error.start} is not UTF-8); pass a "
            f"TOML file (`lowcomm train ... --print-config > run.toml` writes one)"
        ) from None
    if path.suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigFileError(f"--config {given}: not valid JSON ({error})") from None
    else:
        try:
            values = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigFileError(f"--config {given}: not valid TOML ({error})") from None
    if not isinstance(values, dict):
        raise ConfigFileError(f"--config {given}: holds no table of options")
    return values


def read_config(given: str) -> TrainConfig:
    """The :class:`TrainConfig` a config file describes (every option it leaves out at its
    default). A run's config.json is read as the options of a new run: its ``resume`` and
    ``overwrite`` (how that run was started, not what it trained) are dropped.

    Raises:
        ConfigFileError: an unknown key (named with the closest known one), a value of the
            wrong type (named with its key and the type wanted), or a value an option refuses.
    """
    from lowcomm.config import ConfigError, TrainConfig, nested

    try:
        values = nested(read_raw(given))  # a file of the flat shape too
    except ConfigError as error:
        raise ConfigFileError(f"--config {given}: {error}") from None
    run = values.get("run")
    if config_path(given).suffix == ".json" and isinstance(run, dict):
        # How that run was started, not what it trained: a rerun neither resumes it nor
        # clears its directory unless its own command line says so.
        run.pop("resume", None)
        run.pop("overwrite", None)
    checked = _checked(TrainConfig, values, given, prefix="")
    try:
        return TrainConfig.from_dict(checked)
    except ValueError as error:  # an option's own validation; it names the flag
        raise ConfigFileError(f"--config {given}: {error}") from None


def known_keys() -> list[str]:
    """Every key a config file may hold, dotted (``diloco.sync_every``)."""
    from lowcomm.config import TrainConfig

    return _keys(TrainConfig, "")


def _closest(key: str) -> list[str]:
    """The known key closest to ``key``, if one is close: an option of a flat component
    misspelled at the top level (``stpes``) is matched by its own name and named with its
    table (``run.steps``)."""
    from lowcomm.config import FLAT_KEYS

    close = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.6)
    if "." not in key:
        flat = difflib.get_close_matches(key, list(FLAT_KEYS), n=1, cutoff=0.6)
        if flat and (not close or _ratio(key, flat[0]) > _ratio(key, close[0])):
            close = [f"{FLAT_KEYS[flat[0]]}.{flat[0]}"]
    return close


def _ratio(key: str, known: str) -> float:
    return difflib.SequenceMatcher(None, key, known.rsplit(".", 1)[-1]).ratio()


def _keys(kind: type[Any], prefix: str) -> list[str]:
    hints = typing.get_type_hints(kind)
    keys: list[str] = []
    for field in dataclasses.fields(kind):
        if not field.init:
            continue
        hint = hints[field.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            keys += _keys(hint, f"{prefix}{field.name}.")
        else:
            keys.append(prefix + field.name)
    return keys


def _checked(kind: type[Any], values: dict[str, Any], given: str, prefix: str) -> dict[str, Any]:
    """``values`` with every key known to ``kind`` (``-`` read as ``_``) and every value of
    its field's type (a TOML integer for a float made a float, ``"None"`` made None)."""
    hints = typing.get_type_hints(kind)
    fields = {field.name: field for field in dataclasses.fields(kind) if field.init}
    checked: dict[str, Any] = {}
    for raw_key, value in values.items():
        name = raw_key.replace("-", "_")
        key = prefix + name
        if name not in fields:
            close = _closest(key)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigFileError(
                f"--config {given}: unknown key {key}{hint}; `lowcomm train --help` lists the "
                f"options, docs/config-files.md the file's keys"
            )
        if name in checked:
            raise ConfigFileError(
                f"--config {given}: {key} is given twice (as {raw_key} and with the other "
                f"spelling); give it once"
            )
        wanted = hints[name]
        if isinstance(wanted, type) and dataclasses.is_dataclass(wanted):
            if not isinstance(value, dict):
                inner = {field.name for field in dataclasses.fields(wanted)}
                option = name if name in inner else "<option>"  # [data]'s data, the --data
                raise ConfigFileError(
                    f"--config {given}: {key} = {_toml_value(value)} is not a table; {key}'s "
                    f"options go in a [{key}] table (or as {key}.{option} = ...)"
                )
            checked[name] = _checked(wanted, value, given, prefix=f"{key}.")
            continue
        try:
            checked[name] = _value(value, wanted)
        except _WrongType:
            field = fields[name]
            default = (
                field.default_factory()  # type: ignore[misc]
                if field.default_factory is not dataclasses.MISSING
                else field.default
            )
            example = "" if default is None else f"; e.g. {key} = {_toml_value(default)}"
            raise ConfigFileError(
                f"--config {given}: {key} = {_toml_value(value)} is not {_described(wanted)}"
                f"{example}"
            ) from None
    return checked


class _WrongType(Exception):
    """A value that is not of the type its field wants."""


def _value(value: Any, wanted: Any) -> Any:
    """``value`` as field type ``wanted`` takes it, or :class:`_WrongType`."""
    origin = typing.get_origin(wanted)
    arguments = typing.get_args(wanted)
    if origin is typing.Union or origin is types.UnionType:
        if type(None) in arguments and (value is None or value == NONE):
            return None
        for option in arguments:
            if option is type(None):
                continue
            try:
                return _value(value, option)
            except _WrongType:
                continue
        raise _WrongType
    if origin is Literal:
        if isinstance(value, str) and value in arguments:
            return value
        raise _WrongType
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _WrongType
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return tuple(_value(item, arguments[0]) for item in value)
        if len(value) != len(arguments):
            raise _WrongType
        return tuple(_value(item, kind) for item, kind in zip(value, arguments, strict=True))
    if wanted is bool:
        if isinstance(value, bool):
            return value
        raise _WrongType
    if wanted is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _WrongType
    if wanted is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _WrongType
    if wanted is str:
        if isinstance(value, str):
            return value
        raise _WrongType
    return value  # a type this reader does not check: the option's own validation does


def _described(wanted: Any) -> str:
    """What a field of type ``wanted`` takes, in words."""
    origin = typing.get_origin(wanted)
    arguments = typing.get_args(wanted)
    if origin is typing.Union or origin is types.UnionType:
        words = [_described(option) for option in arguments if option is not type(None)]
        if type(None) in arguments:
            words.append(f'"{NONE}"')
        return " or ".join(words)
    if origin is Literal:
        return "one of " + ", ".join(f'"{choice}"' for choice in arguments)
    if origin is tuple:
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return f"a list of {_plural(arguments[0])}"
        return f"a list of {len(arguments)} {_plural(arguments[0])}"
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    return names.get(wanted, str(wanted))


def _plural(wanted: Any) -> str:
    return {int: "whole numbers", float: "numbers", str: "strings", bool: "booleans"}.get(
        wanted, str(wanted)
    )


def _toml_value(value: Any) -> str:
    """``value`` as it is written in TOML (a string quoted, a tuple as a list)."""
    import tomli_w

    if value is None:
        return f'"{NONE}"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return tomli_w.dumps({"x": value}).strip()[len("x = ") :]


def to_toml(config: TrainConfig) -> str:
    """The TOML of ``config``, which :func:`read_config` reads back to an equal config: every
    option, but the option groups of methods other than ``config.method`` (which it does not
    read; a flag of one is refused) and the options that are None by default and now."""
    import tomli_w

    from lowcomm.strategies import STRATEGIES
    from lowcomm.strategies.option_groups import option_groups

    defaults = type(config)().to_dict()
    own = STRATEGIES[config.method].options_field if config.method in STRATEGIES else None
    others = set(option_groups(STRATEGIES)) - {own}
    values = {key: value for key, value in config.to_dict().items() if key not in others}
    text = tomli_w.dumps(_writable(values, defaults))
    # tomli-w puts an array's items on lines of their own; the options' arrays are a few
    # numbers, read best on one line.
    return HEADER + _ARRAY.sub(lambda found: _one_line(found.group(0)), text)


#: An array tomli-w wrote over several lines, one scalar item a line.
_ARRAY = re.compile(r"\[\n(?:    [^\n\[\]]*,\n)+\]")


def _one_line(array: str) -> str:
    items = [line.strip().rstrip(",") for line in array.splitlines()[1:-1]]
    return "[" + ", ".join(items) + "]"


def _writable(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``values`` as TOML holds them: None as ``"None"`` where the default is not None (and
    left out where it is), tuples as lists, tables after the plain keys."""
    plain: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(value, dict):
            tables[key] = _writable(value, default if isinstance(default, dict) else {})
        elif value is None:
            if default is not None:
                plain[key] = NONE
        else:
            plain[key] = list(value) if isinstance(value, tuple) else value
    return {**plain, **tables}


def other_groups_set(config: TrainConfig, given: str) -> None:
    """Refuse a file whose option group of another method than ``config.method`` holds
    values other than its defaults: the method would ignore them, as it would the flags
    (which the command line refuses).

    Raises:
        ConfigFileError: naming the group, its methods and the method run.
    """
    from lowcomm.strategies import STRATEGIES
    from lowcomm.strategies.option_groups import group_members, option_groups

    if config.method not in STRATEGIES:
        return  # validate() names the unknown method
    own = STRATEGIES[config.method].options_field
    members = group_members(STRATEGIES)
    for group, options in option_groups(STRATEGIES).items():
        if group == own or getattr(config, group) == options():
            continue
        methods = ", ".join(members[group])
        raise ConfigFileError(
            f"--config {given}: [{group}] holds options of {methods}, not of method "
            f"{config.method}, which would ignore them; drop the [{group}] table or set its "
            f"options to their defaults"
        )


def peek(given: str, component: str, key: str) -> Any:
    """The value of ``key`` in the ``component`` table of the file (or at its top level, as a
    file of the flat shape holds it), or None where the file cannot be read or lacks it (read
    before torch is imported: :func:`read_config` reports the problems)."""
    try:
        values = read_raw(given)
    except ConfigFileError:
        return None
    table = values.get(component)
    for place in (table if isinstance(table, dict) else {}, values):
        for spelling in (key, key.replace("_", "-")):
            if spelling in place:
                return place[spelling]
    return None
