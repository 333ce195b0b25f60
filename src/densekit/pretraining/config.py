"""Every option of a pre-training run, in one YAML file; any of them overridable as `section.key=value`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from densekit.training.config import OptimSection, RunConfig, Section

Method = Literal["mlm", "condenser", "cocondenser", "retromae"]


class PretrainModelSection(Section):
    """The BERT-style checkpoint to start from."""

    path: str = "sentence-transformers/all-MiniLM-L6-v2"
    max_length: int = Field(256, gt=2, description="tokens per sequence, special tokens included")
    trust_remote_code: bool = False


class PretrainDataSection(Section):
    """The raw corpus: a BEIR or MS MARCO-style folder, or a text file with one document a line."""

    path: str


class MaskingSection(Section):
    """Whole-word masking for the MLM losses (80% [MASK], 10% random token, 10% unchanged)."""

    ratio: float = Field(0.15, gt=0, lt=1, description="share of tokens masked (RetroMAE's encoder: 0.3)")


class CondenserSection(Section):
    """Condenser: a head over [late CLS; early token states]."""

    skip_from: int = Field(3, ge=1, description="the early states come from the output of this layer")
    head_layers: int = Field(2, ge=1)
    late_mlm_weight: float = Field(1.0, ge=0, description="weight of the MLM loss on the late output")


class CoCondenserSection(Section):
    """coCondenser's corpus-level span contrast."""

    span_min: int = Field(32, ge=4, description="fewest tokens in a span (special tokens excluded)")
    span_max: int = Field(128, ge=4)
    temperature: float = Field(1.0, gt=0)
    contrastive_weight: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> CoCondenserSection:
        if self.span_min > self.span_max:
            raise ValueError("span_min is larger than span_max")
        return self


class RetroMAESection(Section):
    """RetroMAE's decoder."""

    decoding: Literal["enhanced", "basic"] = "enhanced"
    visible_ratio: float = Field(0.5, gt=0, lt=1, description="enhanced: share of positions each row sees")
    decoder_mask_ratio: float = Field(0.5, gt=0, lt=1, description="basic: share of decoder tokens masked")


class PretrainConfig(RunConfig):
    """A pre-training run."""

    method: Method = "condenser"
    model: PretrainModelSection = PretrainModelSection()
    data: PretrainDataSection
    masking: MaskingSection = MaskingSection()
    condenser: CondenserSection = CondenserSection()
    cocondenser: CoCondenserSection = CoCondenserSection()
    retromae: RetroMAESection = RetroMAESection()
    optim: OptimSection = OptimSection(learning_rate=1e-4, batch_size=32)

    def input_paths(self) -> dict[str, str]:
        """The starting model and the corpus."""
        return {"model.path": self.model.path, "data.path": self.data.path}

    @model_validator(mode="after")
    def _grad_cache_for_cocondenser(self) -> PretrainConfig:
        if self.grad_cache.enabled and self.method != "cocondenser":
            raise ValueError("grad_cache applies to cocondenser's contrastive loss only")
        return self

    @model_validator(mode="after")
    def _spans_fit_the_sequence(self) -> PretrainConfig:
        if self.method == "cocondenser" and self.cocondenser.span_max + 2 > self.model.max_length:
            raise ValueError("cocondenser.span_max + 2 special tokens exceed model.max_length")
        return self
