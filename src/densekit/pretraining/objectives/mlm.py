"""Plain masked language modelling on the backbone's last layer: the baseline objective."""

from __future__ import annotations

import torch

from densekit.pretraining.backbone import MaskedLanguageModel
from densekit.pretraining.base import PretrainTask, register_objective
from densekit.pretraining.corpus import TokenizedCorpus
from densekit.pretraining.settings import PretrainSettings


@register_objective
class MLMTask(PretrainTask):
    """Loss = MLM(last layer), averaged over the masked tokens."""

    name = "mlm"

    def __init__(self, mlm: MaskedLanguageModel, corpus: TokenizedCorpus, config: PretrainSettings):
        super().__init__(mlm, corpus, config, mlm)

    def losses(self, batch: dict[str, torch.Tensor], masked: float) -> dict[str, torch.Tensor]:
        """The MLM loss of the last layer."""
        states = self.mlm.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return {"mlm": self.mlm.mlm_loss_sum(states.last_hidden_state, batch["labels"]) / masked}
