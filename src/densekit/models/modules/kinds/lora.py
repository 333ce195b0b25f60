"""LoRA (Hu et al., 2021): W x + (alpha / rank) B A x, B zero at the start; by peft."""

from __future__ import annotations

from typing import Any, Literal

import peft
import torch
from pydantic import Field

from densekit.models.modules.kind import (
    BERT_ATTENTION,
    BaseSpec,
    LayerName,
    ModuleError,
    register_module_kind,
)
from densekit.models.modules.layers import adaptable, suffix_targets
from densekit.models.modules.peft_kind import TASK, PeftKind


class LoraSpec(BaseSpec):
    """LoRA (Hu et al., 2021): W x + (alpha / rank) B A x, B zero at the start; by peft."""

    type: Literal["lora"] = "lora"
    rank: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[LayerName] = Field(
        default_factory=lambda: list(BERT_ATTENTION),
        min_length=1,
        max_length=1000,
        description="layer names, or the ends of them after a '.'",
    )


@register_module_kind
class LoraKind(PeftKind):
    """LoRA modules fold into the weights, and average across ranks exactly: the average's A stacks the
    modules' A matrices and its B their B matrices, each times its weight and scaling, so that its
    change B A is sum_i w_i s_i B_i A_i (peft's `add_weighted_adapter` with `combination_type="cat"`
    computes the same, but only among adapters inside one PeftModel, and densekit keeps each module in
    its own tower)."""

    spec = LoraSpec
    title = "LoRA"
    mergeable = True
    averages_across_settings = True
    size_setting = "rank"

    def config(self, spec: LoraSpec, base: torch.nn.Module | None = None) -> peft.PeftConfig:
        return peft.LoraConfig(
            r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
            target_modules=spec.target_modules, task_type=TASK,
        )  # fmt: skip

    def parameters(self, base: torch.nn.Module, spec: LoraSpec) -> int:
        return sum(spec.rank * (rows + columns) for rows, columns in
                   adaptable(spec, "target_modules", suffix_targets(base, spec.target_modules)))  # fmt: skip

    def average(self, encoder: Any, sources: list[Any], weights: list[float], specs: list[Any]) -> Any:
        """A LoRA of rank r1 + r2 + ... (scaling 1) whose change is the weighted average of the
        modules' changes; they need the same target modules and towers, any ranks."""
        first = specs[0]
        if any(set(s.target_modules) != set(first.target_modules) or s.towers != first.towers for s in specs):
            raise ModuleError("LoRA modules average only with the same target modules and towers")
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
