"""Aggregation by parameters: one module whose weights are a weighted average of several modules'.

Each kind averages its own modules (`ModuleKind.average`): LoRA modules average their weight changes
exactly, whatever their ranks (a LoRA of rank r1 + r2 + ...); every other kind averages each of its
tensors, which needs the modules to have the same settings (and a sparse difference the same
positions). Modules of different kinds do not average.
"""

from __future__ import annotations

from collections.abc import Sequence

from densekit.errors import InputError
from densekit.models.encoder import DenseEncoder
from densekit.models.modules.kind import kind_of, settings_differ
from densekit.models.modules.module import EncoderModule


def average_modules(
    encoder: DenseEncoder, names: Sequence[str], weights: Sequence[float], new_name: str
) -> EncoderModule:
    """Put on `encoder` a module called `new_name` that is the `weights`-weighted average (weights sum to
    1) of the modules called `names`; the encoder's own module is left as it was."""
    if len(names) != len(weights) or len(names) < 2:
        raise InputError(f"{len(names)} modules and {len(weights)} weights: give two or more of each, paired")
    if any(w < 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise InputError(f"weights {list(weights)} must be non-negative and sum to 1")
    for name in names:
        encoder.require_module(name)
    sources = [encoder.attached[name] for name in names]
    specs = [module.spec.model_copy(update={"name": new_name}) for module in sources]
    kind = kind_of(specs[0])
    if any(kind_of(spec) is not kind for spec in specs):
        raise InputError(settings_differ(sources))
    return kind.average(encoder, sources, list(weights), specs)
