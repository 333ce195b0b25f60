"""How large a module of a spec would be on a base, worked out from the spec and the base's layers before
any of it is allocated (each kind's `parameters`), so that a module file or config asking for rank 10^9
is refused at once rather than taking every byte of memory.

A module adapts a frozen base with few parameters; one holding more than its whole base is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from densekit.models.modules.kind import ModuleError, kind_of


def check_module_size(base: torch.nn.Module, spec: Any) -> None:
    """Refuse, before anything is allocated, a module of `spec` that would hold more parameters than
    `base` itself, or more virtual tokens than the base has positions."""
    kind = kind_of(spec)
    positions = getattr(getattr(base, "config", None), "max_position_embeddings", None)
    virtual = kind.virtual_positions(spec)
    if isinstance(positions, int) and virtual >= positions:
        raise ModuleError(f"module {spec.name!r}: virtual_tokens {spec.virtual_tokens}; the base reads "
                          f"{positions} positions, which they share with the text")  # fmt: skip
    count = kind.parameters(base, spec)
    limit = sum(p.numel() for p in base.parameters())
    if count > limit:
        knob = kind.size_setting or "its settings"
        raise ModuleError(
            f"module {spec.name!r}: a {spec.type} module with {knob} {getattr(spec, knob, '')} would hold "
            f"{count:,} parameters, more than its whole base ({limit:,}); lower {knob}"
        )
