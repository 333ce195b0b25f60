"""Condenser (Gao & Callan, 2021): make the late CLS carry what the early layers left to predict.

The backbone's token states after layer `skip_from` (early) and its last CLS state (late) feed a head
of fresh Transformer layers, which must predict the masked tokens from `[late CLS; early states]`: what
the early states lack has to come through the CLS. Loss = MLM(head) + weight x MLM(late output). The
head is dropped afterwards; the backbone is the retriever.
"""

from __future__ import annotations

import torch
from pydantic import Field

from densekit.errors import InputError
from densekit.pretraining.backbone import MaskedLanguageModel, init_like_bert
from densekit.pretraining.base import PretrainTask, register_objective
from densekit.pretraining.corpus import TokenizedCorpus
from densekit.pretraining.settings import PretrainSettings
from densekit.training.config import Section


class CondenserSection(Section):
    """Condenser: a head over [late CLS; early token states]."""

    skip_from: int = Field(3, ge=1, description="the early states come from the output of this layer")
    head_layers: int = Field(2, ge=1)
    late_mlm_weight: float = Field(1.0, ge=0, description="weight of the MLM loss on the late output")


class CondenserHead(torch.nn.Module):
    """Fresh Transformer layers over the late CLS followed by the early token states."""

    def __init__(
        self, hidden_size: int, heads: int, intermediate: int, dropout: float, eps: float, layers: int
    ):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                hidden_size,
                heads,
                intermediate,
                dropout,
                activation="gelu",
                layer_norm_eps=eps,
                batch_first=True,
            )
            for _ in range(layers)
        )

    def forward(
        self, late_cls: torch.Tensor, early: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """States of `[late CLS; early[1:]]` after the head's layers."""
        states = torch.cat([late_cls[:, None], early[:, 1:]], dim=1)
        padding = attention_mask == 0
        for layer in self.layers:
            states = layer(states, src_key_padding_mask=padding)
        return states


class Condenser(torch.nn.Module):
    """A masked language model with a Condenser head; coCondenser adds a span contrast on top."""

    def __init__(self, mlm: MaskedLanguageModel, settings: CondenserSection):
        super().__init__()
        config = mlm.model.config
        if not 0 < settings.skip_from < config.num_hidden_layers:
            raise InputError(
                f"condenser.skip_from must be between 1 and {config.num_hidden_layers - 1} for this "
                f"{config.num_hidden_layers}-layer model, got {settings.skip_from}"
            )
        self.mlm = mlm
        self.settings = settings
        self.head = CondenserHead(
            config.hidden_size, config.num_attention_heads, config.intermediate_size,
            config.hidden_dropout_prob, config.layer_norm_eps, settings.head_layers,
        )  # fmt: skip
        init_like_bert(self.head, config.initializer_range)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Summed MLM losses of the head and of the late output, and the late CLS states."""
        output = self.mlm.backbone(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True
        )
        late = output.last_hidden_state
        early = output.hidden_states[self.settings.skip_from]
        head_states = self.head(late[:, 0], early, attention_mask)
        return self.mlm.mlm_loss_sum(head_states, labels), self.mlm.mlm_loss_sum(late, labels), late[:, 0]

    def late_cls(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The late CLS states alone (for the first pass of gradient caching)."""
        return self.mlm.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]


@register_objective
class CondenserTask(PretrainTask):
    """Loss = MLM(head) + late_mlm_weight x MLM(late output), each averaged over the masked tokens."""

    name = "condenser"
    settings = CondenserSection
    module: Condenser

    def __init__(self, mlm: MaskedLanguageModel, corpus: TokenizedCorpus, config: PretrainSettings):
        super().__init__(mlm, corpus, config, Condenser(mlm, config.condenser))

    def losses(self, batch: dict[str, torch.Tensor], masked: float) -> dict[str, torch.Tensor]:
        """The head's and the late output's MLM losses."""
        return self.condenser_losses(batch, masked)[0]

    def condenser_losses(
        self, batch: dict[str, torch.Tensor], masked: float
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The two MLM losses and the late CLS states they came with."""
        head_sum, late_sum, cls = self.module(batch["input_ids"], batch["attention_mask"], batch["labels"])
        return {"mlm_head": head_sum / masked, "mlm_late": late_sum / masked}, cls

    def loss_weights(self, for_gradient: bool) -> dict[str, float]:
        """The late output's MLM weight."""
        return {"mlm_late": self.config.condenser.late_mlm_weight}
