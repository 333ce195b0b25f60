"""Bottleneck adapters (Houlsby et al., 2019; He et al., 2022), which peft does not provide: forward hooks
on the tower's own copies of every layer's feed-forward block."""

from __future__ import annotations

import threading
from typing import Literal

import torch
from pydantic import Field
from transformers import PreTrainedModel

from densekit.models.modules.kind import (
    BERT_FFN_IN,
    BERT_FFN_OUT,
    BaseSpec,
    LayerPattern,
    ModuleError,
    Positions,
    register_module_kind,
)
from densekit.models.modules.layers import adaptable, matching
from densekit.models.modules.own_kind import OwnKind
from densekit.models.modules.tower import Tower, freeze, shared_copy


class AdapterSpec(BaseSpec):
    """A bottleneck adapter (Houlsby et al., 2019; He et al., 2022) in every layer's feed-forward block:
    up(act(down(h))), the up-projection zero at the start. Sequential: on the feed-forward output;
    parallel: on its input, added to its output."""

    type: Literal["adapter"] = "adapter"
    placement: Literal["sequential", "parallel"] = "sequential"
    bottleneck: int = Field(64, gt=0, description="the adapter's inner size")
    scaling: float = Field(1.0, gt=0)
    ffn_input: LayerPattern = Field(
        BERT_FFN_IN, description="regular expression naming the feed-forward's first layer"
    )
    ffn_output: LayerPattern = Field(
        BERT_FFN_OUT, description="regular expression naming its last linear layer"
    )


class Bottleneck(torch.nn.Module):
    """up(relu(down(x))) times `scaling`, with the up-projection zero so it adds nothing at the start."""

    def __init__(self, inputs: int, outputs: int, size: int, scaling: float):
        super().__init__()
        self.down = torch.nn.Linear(inputs, size)
        self.up = torch.nn.Linear(size, outputs)
        torch.nn.init.zeros_(self.up.weight)
        torch.nn.init.zeros_(self.up.bias)
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's addition for `x`."""
        return self.scaling * self.up(torch.relu(self.down(x)))


@register_module_kind
class AdapterKind(OwnKind):
    """Adapters add layers the base has none of: they do not fold into its weights."""

    spec = AdapterSpec
    title = "adapter"
    size_setting = "bottleneck"

    def build(self, base: PreTrainedModel, spec: AdapterSpec, positions: Positions | None = None) -> Tower:
        """A tower of `base` with an adapter after (sequential) or beside (parallel) each feed-forward
        block; the base's tensors are frozen."""
        freeze(base)
        model = shared_copy(base)
        parts = torch.nn.ModuleDict()
        _add_adapters(model, spec, parts)
        return Tower(model, base, parts)

    def parameters(self, base: torch.nn.Module, spec: AdapterSpec) -> int:
        outputs = adaptable(spec, "ffn_output", matching(base, spec.ffn_output))
        return sum(spec.bottleneck * (2 * rows + 1) + rows for rows, _ in outputs)


def _add_adapters(model: torch.nn.Module, spec: AdapterSpec, parts: torch.nn.ModuleDict) -> None:
    outputs = matching(model, spec.ffn_output)
    if not outputs:
        raise ModuleError(f"no layer of the model matches ffn_output {spec.ffn_output!r}")
    for name, layer in outputs:
        if not isinstance(getattr(layer, "out_features", None), int):
            raise ModuleError(f"ffn_output {spec.ffn_output!r} matches {name}, which is no linear layer")
    if spec.placement == "sequential":
        for i, (_, layer) in enumerate(outputs):
            adapter = Bottleneck(layer.out_features, layer.out_features, spec.bottleneck, spec.scaling)
            parts[f"adapter_{i}"] = adapter
            layer.register_forward_hook(lambda _m, _i, out, a=adapter: out + a(out))
        return
    inputs = matching(model, spec.ffn_input)
    if len(inputs) != len(outputs):
        raise ModuleError(
            f"ffn_input {spec.ffn_input!r} matches {len(inputs)} layers, ffn_output {len(outputs)}"
        )
    for i, ((name, first), (_, last)) in enumerate(zip(inputs, outputs, strict=True)):
        adapter = Bottleneck(_in_features(name, first), last.out_features, spec.bottleneck, spec.scaling)
        parts[f"adapter_{i}"] = adapter
        held = _HeldInput()
        first.register_forward_pre_hook(lambda _m, args, held=held: held.keep(args[0]))
        last.register_forward_hook(lambda _m, _i, out, a=adapter, held=held: out + a(held.take()))


class _HeldInput:
    """The feed-forward block's input, kept from its first layer to its last for a parallel adapter:
    one per thread, since threads encoding with the same tower at once each pass their own batch."""

    def __init__(self) -> None:
        self._local = threading.local()

    def keep(self, x: torch.Tensor) -> None:
        """Hold `x` for this thread's `take`."""
        self._local.x = x

    def take(self) -> torch.Tensor:
        """The input this thread kept last, no longer held."""
        x = self._local.x
        del self._local.x
        return x


def _in_features(name: str, module: torch.nn.Module) -> int:
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is None:
        raise ModuleError(f"ffn_input matches {name}, which holds no linear layer")
    return linear.in_features
