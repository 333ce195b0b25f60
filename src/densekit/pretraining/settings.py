"""The settings every pre-training run has, whatever its objective: the starting model, the corpus, the
masking and the optimiser. `densekit.pretraining.config.PretrainConfig` adds each objective's section."""

from __future__ import annotations

from pydantic import Field

from densekit.training.config import OptimSection, RunConfig, Section


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


class PretrainSettings(RunConfig):
    """What every pre-training run sets; the objective its `method` names reads its own section too."""

    method: str = "condenser"
    model: PretrainModelSection = PretrainModelSection()
    data: PretrainDataSection
    masking: MaskingSection = MaskingSection()
    optim: OptimSection = OptimSection(learning_rate=1e-4, batch_size=32)

    def input_paths(self) -> dict[str, str]:
        """The starting model and the corpus."""
        return {"model.path": self.model.path, "data.path": self.data.path}
