"""What each kind of module is, with its settings: the `modules:` section of a training config."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import regex
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

Towers = Literal["shared", "separate", "query"]
MAX_PATTERN_CHARS = 1000  # a regular expression naming layers; BERT's longest default is 48 characters


class ModuleError(ValueError):
    """A module that does not fit the encoder it is put on."""


def _layer_pattern(pattern: str) -> str:
    """A regular expression naming layers, refused when it is too long or does not compile."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"a layer pattern of {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    try:
        regex.compile(pattern)
    except regex.error as err:
        raise ValueError(f"{pattern!r} is not a regular expression ({err})") from None
    return pattern


LayerPattern = Annotated[str, AfterValidator(_layer_pattern)]
LayerName = Annotated[str, Field(min_length=1, max_length=MAX_PATTERN_CHARS)]

# BERT's module names (all-MiniLM-L6-v2, Contriever, coCondenser...); other architectures name theirs
BERT_ATTENTION = ["query", "key", "value", "attention.output.dense"]
BERT_FFN_IN = r"encoder\.layer\.\d+\.intermediate"
BERT_FFN_OUT = r"encoder\.layer\.\d+\.output\.dense"


class BaseSpec(BaseModel):
    """What every module has: a name and whether queries and passages share it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("module", description="the name the encoder activates it by")
    towers: Towers = Field(
        "shared",
        description="shared: one module for queries and passages; separate: one each; query: queries only, "
        "passages encoded by the base (modules routed per query share one passage index)",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # no '.': torch holds modules by name, and a dotted name is a path to it
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}", name):
            raise ValueError(f"{name!r}: a module name is 1 to 100 letters, digits, '_' and '-'")
        return name


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


class Ia3Spec(BaseSpec):
    """IA3 (Liu et al., 2022): learned vectors rescale keys, values and the feed-forward's inner
    activations, ones at the start; by peft."""

    type: Literal["ia3"] = "ia3"
    target_modules: LayerPattern = Field(
        r".*\.(key|value)|" + BERT_FFN_OUT, description="a regular expression"
    )
    feedforward_modules: LayerPattern = Field(BERT_FFN_OUT, description="targets whose input is rescaled")


class PrefixSpec(BaseSpec):
    """Prefix tuning (Li and Liang, 2021): learned keys and values before every layer's; by peft."""

    type: Literal["prefix"] = "prefix"
    virtual_tokens: int = Field(20, gt=0)
    projection: bool = Field(False, description="reparameterise the prefix through a two-layer MLP")


class PromptSpec(BaseSpec):
    """Prompt tuning (Lester et al., 2021): learned input embeddings before the text's; by peft."""

    type: Literal["prompt"] = "prompt"
    virtual_tokens: int = Field(20, gt=0)


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


class BitFitSpec(BaseSpec):
    """BitFit (Ben Zaken et al., 2022): only biases train (a learned change to each, zero at the start)."""

    type: Literal["bitfit"] = "bitfit"


class SparseDiffSpec(BaseSpec):
    """A sparse difference (Guo et al., 2021; Ansell et al., 2022): a change to a fixed share of the
    weights, chosen as the entries with the largest accumulated gradient magnitude over the first
    `selection_batches` training batches."""

    type: Literal["sparse_diff"] = "sparse_diff"
    density: float = Field(0.01, gt=0, le=1, description="share of each chosen weight matrix's entries")
    selection_batches: int = Field(4, gt=0)
    target_modules: LayerPattern = Field(
        r"encoder\.layer\.\d+\..*\.(query|key|value|dense)", description="a regular expression"
    )


ModuleSpec = Annotated[
    LoraSpec | Ia3Spec | PrefixSpec | PromptSpec | AdapterSpec | BitFitSpec | SparseDiffSpec,
    Field(discriminator="type"),
]
PEFT_TYPES = ("lora", "ia3", "prefix", "prompt")
MERGEABLE_TYPES = ("lora", "ia3", "bitfit", "sparse_diff")
