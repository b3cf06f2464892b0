"""The option groups of the registered methods (``--acco.*``, ``--local.*``, ...), read from
each strategy's declaration (``options_field`` and its constructor's options class).

Kept apart from :mod:`lowcomm.strategies.declaration`, which every strategy imports: this module
reads the registry (:mod:`lowcomm.strategies`), which imports every strategy.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Annotated, TypeVar

if TYPE_CHECKING:
    from lowcomm.strategies.base import Strategy


def option_groups(strategies: dict[str, type[Strategy]]) -> dict[str, type]:
    """The option group name -> options class of the registered methods, in discovery order.

    Raises:
        TypeError: when two methods put different options classes under one group name.
    """
    from lowcomm.strategies import options_class

    groups: dict[str, type] = {}
    for name, cls in strategies.items():
        group = cls.options_field
        kind = options_class(cls)
        if group is None or kind is None:
            continue
        if groups.setdefault(group, kind) is not kind:
            raise TypeError(
                f"method {name!r} declares options group {group!r} with {kind.__name__}, but "
                f"another method of that group uses {groups[group].__name__}"
            )
    return groups


def group_members(strategies: dict[str, type[Strategy]]) -> dict[str, list[str]]:
    """The option group name -> the methods that read it."""
    members: dict[str, list[str]] = {}
    for name, cls in strategies.items():
        if cls.options_field is not None:
            members.setdefault(cls.options_field, []).append(name)
    return members


_C = TypeVar("_C", bound=type)


def with_method_options(kind: _C) -> _C:
    """Class decorator, applied before ``@dataclass``: add one field per declared option group
    (``acco: AccoOptions``, ...), defaulting to the options class's defaults, documented for
    ``--help`` by the names of the methods that read it. ``TrainConfig`` and ``PlanConfig`` both
    use it, so both take the same ``--<group>.<option>`` flags with the same defaults."""
    import tyro

    from lowcomm.strategies import STRATEGIES

    members = group_members(STRATEGIES)
    annotations = inspect.get_annotations(kind)
    for group, options in option_groups(STRATEGIES).items():
        names = members[group]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        help_text = f"Options of {listed}."
        annotations[group] = Annotated[options, tyro.conf.arg(help=help_text)]  # type: ignore[valid-type]
        setattr(kind, group, dataclasses.field(default_factory=options))
    kind.__annotations__ = annotations
    return kind
