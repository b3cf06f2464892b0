"""Where a model's transformer blocks are, found generically: the units a sharded worker
``fully_shard``-s one by one, ``--activation-checkpointing`` recomputes and ``--compile``
compiles.

The built-in GPT keeps them in ``blocks``; a ``transformers`` causal LM in a ``ModuleList`` of
its base model (``model.layers`` for Llama, Qwen or Mistral, ``transformer.h`` for GPT-2). Any
model is searched the same way: the ``ModuleList`` of modules of one class holding the most
parameters.

Tied parameters (an output matrix that is the token embedding) are one ``Parameter`` reached
under several names; :func:`tied_names` and :func:`retie` keep them one when a model's
parameters are replaced (``load_state_dict(assign=True)``).
"""

from __future__ import annotations

from torch import nn


def transformer_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The list of ``model``'s transformer blocks (None: it has no list of modules of one
    class): ``model.blocks`` when it is such a list, else the largest such list by
    parameters anywhere in ``model``."""
    own = getattr(model, "blocks", None)
    if _uniform(own):
        assert isinstance(own, nn.ModuleList)
        return own
    best: nn.ModuleList | None = None
    best_size = 0
    for module in model.modules():
        if not _uniform(module):
            continue
        assert isinstance(module, nn.ModuleList)
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = module, size
    return best


def _uniform(module: object) -> bool:
    """A non-empty ModuleList whose items are all of one class."""
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    return len({type(item) for item in module}) == 1


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter reached under more than one name (tied), grouped."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make every name of each group in ``groups`` (:func:`tied_names`) the first name's
    parameter again."""
    for names in groups:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, shared)


__all__ = ["retie", "tied_names", "transformer_blocks"]
