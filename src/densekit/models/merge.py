"""Folding a module of a kind that folds (LoRA, IA3, BitFit, a sparse difference...: those whose kind is
`mergeable`) into a full model that any transformers or sentence-transformers user loads, without
densekit or peft."""

from __future__ import annotations

import copy

from densekit.errors import InputError
from densekit.models.encoder import DenseEncoder, ModuleChoice
from densekit.models.modules.kind import MODULE_KINDS, kind_of


def merged_encoder(encoder: DenseEncoder, module: ModuleChoice) -> DenseEncoder:
    """A standalone encoder whose weights are the base's with `module` (a name on `encoder`, or `OWN`:
    its own) folded in; `encoder` and its base are left as they are."""
    held = encoder.module_named(module)
    if held is None:
        raise InputError("no module is given: there is nothing to merge")
    module = held
    kind = kind_of(module.spec)
    if not kind.mergeable:
        folding = ", ".join(name for name, other in MODULE_KINDS.items() if other.mergeable)
        raise InputError(
            f"module {module.name!r} is {module.spec.type}; only {folding} fold into the weights (the others "
            "add layers or inputs the base model does not have)"
        )
    query = kind.fold(module.query_tower, encoder.query_backbone)
    if module.query_tower is module.passage_tower:
        return DenseEncoder(query, encoder.tokenizer, encoder.config.model_copy(), source=encoder.source,
                            projection=copy.deepcopy(encoder.projection))  # fmt: skip
    passage = (
        copy.deepcopy(encoder.passage_backbone)
        if module.spec.towers == "query"
        else kind.fold(module.passage_tower, encoder.passage_backbone)
    )
    config = encoder.config.model_copy(update={"tied": False})
    return DenseEncoder(query, encoder.tokenizer, config, passage, source=encoder.source,
                        projection=copy.deepcopy(encoder.projection))  # fmt: skip
