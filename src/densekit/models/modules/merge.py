"""Folding a LoRA, IA3, BitFit or sparse-difference module into a full model that any transformers or
sentence-transformers user loads, without densekit or peft."""

from __future__ import annotations

import copy

import torch

from densekit.models.encoder import DenseEncoder
from densekit.models.modules.own_kinds import folded_backbone
from densekit.models.modules.peft_kinds import merged_backbone
from densekit.models.modules.specs import MERGEABLE_TYPES, PEFT_TYPES
from densekit.models.modules.tower import Tower


def _folded(module_type: str, tower: Tower, base: torch.nn.Module) -> torch.nn.Module:
    """peft folds its own kinds; densekit's parametrised ones are added into a copy of the base."""
    return merged_backbone(tower) if module_type in PEFT_TYPES else folded_backbone(tower, base)


def merged_encoder(encoder: DenseEncoder) -> DenseEncoder:
    """A standalone encoder whose weights are the base's with the active module folded in; `encoder`
    and its base are left as they are."""
    module = encoder.module
    if module is None:
        raise ValueError("no module is active: there is nothing to merge")
    if module.spec.type not in MERGEABLE_TYPES:
        raise ValueError(
            f"module {module.name!r} is {module.spec.type}; only {', '.join(MERGEABLE_TYPES)} fold into the "
            "weights (the others add layers or inputs the base model does not have)"
        )
    query = _folded(module.spec.type, module.query_tower, encoder.query_backbone)
    if module.query_tower is module.passage_tower:
        return DenseEncoder(query, encoder.tokenizer, encoder.config.model_copy(), source=encoder.source)
    passage = (
        copy.deepcopy(encoder.passage_backbone)
        if module.spec.towers == "query"
        else _folded(module.spec.type, module.passage_tower, encoder.passage_backbone)
    )
    config = encoder.config.model_copy(update={"tied": False})
    return DenseEncoder(query, encoder.tokenizer, config, passage, source=encoder.source)
