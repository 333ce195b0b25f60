"""Aggregation by parameters: one module whose weights are a weighted average of several modules'.

LoRA modules average their weight changes exactly: the result is a LoRA of rank r1 + r2 + ... whose A
stacks the modules' A matrices and whose B stacks their B matrices, each times its weight and scaling, so
that its change B A equals sum_i w_i s_i B_i A_i, the weighted average of the merged models (peft's
`add_weighted_adapter` with `combination_type="cat"` computes the same, but only among adapters inside
one PeftModel, and densekit keeps each module in its own tower). Every other kind averages each of its
tensors, which needs the modules to have the same settings (and a sparse difference the same
positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import peft
import torch

from densekit.models.encoder import DenseEncoder
from densekit.models.modules.module import EncoderModule, sparse_positions
from densekit.models.modules.specs import LoraSpec, SparseDiffSpec


def average_modules(
    encoder: DenseEncoder, names: Sequence[str], weights: Sequence[float], new_name: str
) -> EncoderModule:
    """Put on `encoder` a module called `new_name` that is the `weights`-weighted average (weights sum to
    1) of the modules called `names`; the active module is left as it was."""
    if len(names) != len(weights) or len(names) < 2:
        raise ValueError(f"{len(names)} modules and {len(weights)} weights: give two or more of each, paired")
    if any(w < 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise ValueError(f"weights {list(weights)} must be non-negative and sum to 1")
    for name in names:
        encoder.require_module(name)
    sources = [encoder.attached[name] for name in names]
    specs = [module.spec.model_copy(update={"name": new_name}) for module in sources]
    active = encoder.active
    try:
        if all(isinstance(spec, LoraSpec) for spec in specs):
            return _average_lora(encoder, sources, list(weights), specs)
        if any(spec != specs[0] for spec in specs):
            kinds = ", ".join(f"{m.name} ({m.spec.type})" for m in sources)
            raise ValueError(f"modules {kinds} differ in their settings; only LoRA modules of different "
                             "settings average (their weight changes add up)")  # fmt: skip
        indices = None
        if isinstance(specs[0], SparseDiffSpec):
            indices = _same_sparse_positions(sources)
        averaged = encoder.new_module(specs[0], indices)
        with torch.no_grad():
            for place, tower in averaged.towers().items():
                parts = [module.towers()[place].own_parameters() for module in sources]
                for key, parameter in tower.own_parameters().items():
                    parameter.copy_(sum(w * part[key] for w, part in zip(weights, parts, strict=True)))
        return averaged
    finally:
        encoder.active = active


def _average_lora(
    encoder: DenseEncoder, sources: list[EncoderModule], weights: list[float], specs: list[LoraSpec]
) -> EncoderModule:
    first = specs[0]
    if any(set(s.target_modules) != set(first.target_modules) or s.towers != first.towers for s in specs):
        raise ValueError("LoRA modules average only with the same target modules and towers")
    rank = sum(spec.rank for spec in specs)
    spec = first.model_copy(update={"rank": rank, "alpha": float(rank)})
    averaged = encoder.new_module(spec)  # scaling alpha / rank = 1
    for place, tower in averaged.towers().items():
        states = [peft.get_peft_model_state_dict(m.towers()[place].model) for m in sources]
        combined = {}
        for key in peft.get_peft_model_state_dict(tower.model):
            if ".lora_A." in key:
                combined[key] = torch.cat([state[key] for state in states], dim=0)
            elif ".lora_B." in key:
                combined[key] = torch.cat(
                    [w * (s.alpha / s.rank) * state[key]
                     for w, s, state in zip(weights, specs, states, strict=True)], dim=1,
                )  # fmt: skip
        peft.set_peft_model_state_dict(tower.model, combined)
    return averaged


def _same_sparse_positions(sources: list[EncoderModule]) -> dict[str, dict[str, torch.Tensor]]:
    """The positions of sparse differences, which must be the same in every module."""
    first = sources[0]
    indices = {}
    for place, tower in first.towers().items():
        positions = sparse_positions(tower.own_state())
        for other in sources[1:]:
            theirs = sparse_positions(other.towers()[place].own_state())
            if positions.keys() != theirs.keys() or any(
                not torch.equal(v, theirs[k]) for k, v in positions.items()
            ):
                raise ValueError(f"sparse differences {first.name!r} and {other.name!r} change other "
                                 "positions; they average only on the same ones")  # fmt: skip
        indices["query" if place == "." else place] = positions
    return indices
