"""How large a module of a spec would be on a base, worked out from the spec and the base's layers before
any of it is allocated, so that a module file or config asking for rank 10^9 is refused at once rather
than taking every byte of memory.

A module adapts a frozen base with few parameters; one holding more than its whole base is refused.
Targets that match no layer, or a layer the kind cannot adapt, are refused here too, in one line (peft
would raise a long message of its own, or warn and adapt nothing).
"""

from __future__ import annotations

from typing import Any

import torch

from densekit.models.modules.own_kinds import matching
from densekit.models.modules.specs import (
    AdapterSpec,
    Ia3Spec,
    LoraSpec,
    ModuleError,
    PrefixSpec,
    PromptSpec,
)


def lora_targets(base: torch.nn.Module, spec: LoraSpec) -> list[tuple[str, torch.nn.Module]]:
    """The layers LoRA adapts, as peft matches them: a name equal to a target or ending in '.' and it."""
    targets = set(spec.target_modules)
    return [(name, module) for name, module in base.named_modules()
            if name in targets or any(name.endswith("." + t) for t in targets)]  # fmt: skip


def _adaptable(spec: Any, field: str, layers: list[tuple[str, torch.nn.Module]]) -> list[tuple[int, int]]:
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


def _dimensions(base: torch.nn.Module) -> tuple[int, int]:
    """The base's hidden size and number of layers, as peft reads them from its config."""
    config = getattr(base, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or base.get_input_embeddings().embedding_dim)
    return hidden, int(getattr(config, "num_hidden_layers", 1) or 1)


def module_parameters(base: torch.nn.Module, spec: Any) -> int:
    """How many parameters a module of `spec` would add to `base` (its tensors' entries), and the
    setting that sizes it; raises `ModuleError` for targets that match nothing it can adapt."""
    if isinstance(spec, LoraSpec):
        return sum(spec.rank * (rows + columns) for rows, columns in
                   _adaptable(spec, "target_modules", lora_targets(base, spec)))  # fmt: skip
    if isinstance(spec, Ia3Spec):
        targets = matching(base, spec.target_modules)
        return sum(rows + columns for rows, columns in _adaptable(spec, "target_modules", targets))
    hidden, layers = _dimensions(base)
    if isinstance(spec, PromptSpec):
        return spec.virtual_tokens * hidden
    if isinstance(spec, PrefixSpec):
        if spec.projection:  # an embedding, then hidden -> hidden -> every layer's keys and values
            return spec.virtual_tokens * hidden + hidden * (hidden + 1) + (hidden + 1) * layers * 2 * hidden
        return spec.virtual_tokens * layers * 2 * hidden
    if isinstance(spec, AdapterSpec):
        outputs = _adaptable(spec, "ffn_output", matching(base, spec.ffn_output))
        return sum(spec.bottleneck * (2 * rows + 1) + rows for rows, _ in outputs)
    return 0  # BitFit and sparse differences change a share of the base's own tensors, no more


def check_module_size(base: torch.nn.Module, spec: Any) -> None:
    """Refuse, before anything is allocated, a module of `spec` that would hold more parameters than
    `base` itself, or more virtual tokens than the base has positions."""
    positions = getattr(getattr(base, "config", None), "max_position_embeddings", None)
    virtual = spec.virtual_tokens if isinstance(spec, PromptSpec | PrefixSpec) else 0
    if isinstance(positions, int) and virtual >= positions:
        raise ModuleError(f"module {spec.name!r}: virtual_tokens {spec.virtual_tokens}; the base reads "
                          f"{positions} positions, which they share with the text")  # fmt: skip
    count = module_parameters(base, spec)
    limit = sum(p.numel() for p in base.parameters())
    if count > limit:
        knob = {"lora": "rank", "prefix": "virtual_tokens", "prompt": "virtual_tokens",
                "adapter": "bottleneck"}.get(spec.type, "its settings")  # fmt: skip
        raise ModuleError(
            f"module {spec.name!r}: a {spec.type} module with {knob} {getattr(spec, knob, '')} would hold "
            f"{count:,} parameters, more than its whole base ({limit:,}); lower {knob}"
        )
