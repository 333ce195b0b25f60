"""IA3 (Liu et al., 2022): learned vectors rescale keys, values and the feed-forward's inner activations,
ones at the start; by peft."""

from __future__ import annotations

from typing import Literal

import peft
import torch
from pydantic import Field

from densekit.models.modules.kind import BERT_FFN_OUT, BaseSpec, LayerPattern, register_module_kind
from densekit.models.modules.layers import adaptable, matching
from densekit.models.modules.peft_kind import TASK, PeftKind, named_exactly


class Ia3Spec(BaseSpec):
    """IA3 (Liu et al., 2022): learned vectors rescale keys, values and the feed-forward's inner
    activations, ones at the start; by peft."""

    type: Literal["ia3"] = "ia3"
    target_modules: LayerPattern = Field(
        r".*\.(key|value)|" + BERT_FFN_OUT, description="a regular expression"
    )
    feedforward_modules: LayerPattern = Field(BERT_FFN_OUT, description="targets whose input is rescaled")


@register_module_kind
class Ia3Kind(PeftKind):
    """IA3 modules fold into the weights; their patterns are given to peft as the layer names they match
    (`named_exactly`) and saved as the spec gives them."""

    spec = Ia3Spec
    title = "IA3"
    mergeable = True
    saved_as_given = ("target_modules", "feedforward_modules")

    def config(self, spec: Ia3Spec, base: torch.nn.Module | None = None) -> peft.PeftConfig:
        return peft.IA3Config(
            target_modules=named_exactly(base, spec.target_modules),
            feedforward_modules=named_exactly(base, spec.feedforward_modules), task_type=TASK,
        )  # fmt: skip

    def parameters(self, base: torch.nn.Module, spec: Ia3Spec) -> int:
        targets = matching(base, spec.target_modules)
        return sum(rows + columns for rows, columns in adaptable(spec, "target_modules", targets))
