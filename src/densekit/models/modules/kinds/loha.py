"""LoHa (Hyeon-Woo et al., 2022; LyCORIS): W x + (alpha / rank) ((B1 A1) ⊙ (B2 A2)) x, a change of higher
rank than LoRA's for the same parameters, one factor's B zero at the start; by peft."""

from __future__ import annotations

from typing import Literal

import peft
import torch
from pydantic import Field

from densekit.models.modules.kind import BERT_ATTENTION, BaseSpec, LayerName, register_module_kind
from densekit.models.modules.layers import adaptable, suffix_targets
from densekit.models.modules.peft_kind import TASK, PeftKind


class LohaSpec(BaseSpec):
    """LoHa (Hyeon-Woo et al., 2022): the Hadamard product of two low-rank changes; by peft."""

    type: Literal["loha"] = "loha"
    rank: int = Field(8, gt=0, description="the rank of each of the two factors")
    alpha: float = Field(8.0, gt=0)
    rank_dropout: float = Field(0.0, ge=0, lt=1, description="dropout of each rank in training")
    module_dropout: float = Field(0.0, ge=0, lt=1, description="dropout of the whole change in training")
    target_modules: list[LayerName] = Field(
        default_factory=lambda: list(BERT_ATTENTION),
        min_length=1,
        max_length=1000,
        description="layer names, or the ends of them after a '.'",
    )


@register_module_kind
class LohaKind(PeftKind):
    """LoHa modules fold into the weights (peft merges them). Two rank-r factors per target matrix hold
    as many parameters as a LoRA of rank 2r: the defaults (rank 8) match LoRA's (rank 16)."""

    spec = LohaSpec
    title = "LoHa"
    mergeable = True
    size_setting = "rank"

    def config(self, spec: LohaSpec, base: torch.nn.Module | None = None) -> peft.PeftConfig:
        return peft.LoHaConfig(
            r=spec.rank, alpha=spec.alpha, rank_dropout=spec.rank_dropout, module_dropout=spec.module_dropout,
            target_modules=spec.target_modules, task_type=TASK,
        )  # fmt: skip

    def parameters(self, base: torch.nn.Module, spec: LohaSpec) -> int:
        return sum(2 * spec.rank * (rows + columns) for rows, columns in
                   adaptable(spec, "target_modules", suffix_targets(base, spec.target_modules)))  # fmt: skip
