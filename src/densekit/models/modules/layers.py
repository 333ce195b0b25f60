"""Finding the layers of a base a module's settings name, and their sizes, for every kind.

Layer patterns come from module files as well as configs: `regex` matches them under a deadline, as
Python's `re` cannot (`(.*)*x` would take it years on one layer name). Targets that match no layer, or
a layer the kind cannot adapt, are refused here in one line (peft would raise a long message of its
own, or warn and adapt nothing).
"""

from __future__ import annotations

import time
from typing import Any

import regex
import torch

from densekit.models.modules.kind import ModuleError

MATCH_SECONDS = 2.0


def matching(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """The submodules whose full name matches `pattern`, in the model's order; `ModuleError` when
    matching them takes more than `MATCH_SECONDS` (a pattern that backtracks without end)."""
    deadline = time.monotonic() + MATCH_SECONDS
    found = []
    for name, module in model.named_modules():
        try:
            if name and regex.fullmatch(pattern, name, timeout=max(deadline - time.monotonic(), 1e-3)):
                found.append((name, module))
        except TimeoutError:
            raise ModuleError(
                f"layer pattern {pattern!r} takes over {MATCH_SECONDS:g} s to match the model's layer names "
                "(it backtracks without end): write it without nested repetition"
            ) from None
    return found


def suffix_targets(base: torch.nn.Module, targets: list[str]) -> list[tuple[str, torch.nn.Module]]:
    """The layers peft adapts for a list of `target_modules`: a name equal to a target or ending in '.'
    and it."""
    wanted = set(targets)
    return [(name, module) for name, module in base.named_modules()
            if name in wanted or any(name.endswith("." + t) for t in wanted)]  # fmt: skip


def adaptable(spec: Any, field: str, layers: list[tuple[str, torch.nn.Module]]) -> list[tuple[int, int]]:
    """The weight shapes of `layers`, the layers a module's `field` names, as (outputs, inputs); refused
    when there are none or one has no weight of two dimensions or more (a linear layer's, an
    embedding's, a convolution's)."""
    if not layers:
        raise ModuleError(f"module {spec.name!r}: {field} {getattr(spec, field)!r} matches no layer of the "
                          "base")  # fmt: skip
    shapes = []
    for name, module in layers:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
            raise ModuleError(f"module {spec.name!r}: {field} {getattr(spec, field)!r} matches {name}, which "
                              f"no {spec.type} module adapts (it adapts linear layers)")  # fmt: skip
        shapes.append((weight.shape[0], weight[0].numel()))
    return shapes


def dimensions(base: torch.nn.Module) -> tuple[int, int]:
    """The base's hidden size and number of layers, as peft reads them from its config."""
    config = getattr(base, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or base.get_input_embeddings().embedding_dim)
    return hidden, int(getattr(config, "num_hidden_layers", 1) or 1)
