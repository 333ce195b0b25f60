"""RetroMAE (Xiao et al., 2022): rebuild the input from its sentence embedding with a weak decoder.

The encoder reads the input masked at about 0.3 (encoder MLM loss); its CLS state h is the sentence
embedding. A one-layer decoder rebuilds the text from h:

- enhanced decoding: a query stream H1 = [h + p_i] attends to a content stream H2 = [h; e(x_i) + p_i]
  of the unmasked tokens, where row i sees a random share of the positions, never its own and always
  h; the loss covers every token;
- basic decoding: the decoder reads [h; e(x~_i) + p_i] with x~ masked at about 0.5 and predicts the
  masked tokens.

Total = decoder loss + encoder MLM. The decoder is dropped afterwards.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from densekit.pretraining.backbone import MaskedLanguageModel, init_like_bert
from densekit.pretraining.base import PretrainTask, Row, labelled_count, register_objective
from densekit.pretraining.corpus import TokenizedCorpus
from densekit.pretraining.masking import IGNORE, decoder_visibility
from densekit.pretraining.sequences import pad
from densekit.pretraining.settings import PretrainSettings
from densekit.training.config import Section


class RetroMAESection(Section):
    """RetroMAE's decoder."""

    decoding: Literal["enhanced", "basic"] = "enhanced"
    visible_ratio: float = Field(0.5, gt=0, lt=1, description="enhanced: share of positions each row sees")
    decoder_mask_ratio: float = Field(0.5, gt=0, lt=1, description="basic: share of decoder tokens masked")


class TwoStreamLayer(torch.nn.Module):
    """One post-norm Transformer layer whose queries and keys/values come from different streams.

    Written with torch's MultiheadAttention because a BERT layer (transformers) draws queries, keys
    and values from one sequence, and enhanced decoding needs them apart.
    """

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        intermediate: int,
        dropout: float,
        attention_dropout: float,
        eps: float,
    ):
        super().__init__()
        self.heads = heads
        self.attention = torch.nn.MultiheadAttention(
            hidden_size, heads, dropout=attention_dropout, batch_first=True
        )
        self.attention_norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        self.feed_forward = torch.nn.Sequential(
            torch.nn.Linear(hidden_size, intermediate),
            torch.nn.GELU(),
            torch.nn.Linear(intermediate, hidden_size),
        )
        self.output_norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, query: torch.Tensor, content: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """`query` rows attend to the `content` positions `visible` (batch, rows, positions) allows."""
        blocked = (~visible).repeat_interleave(self.heads, dim=0)
        attended, _ = self.attention(query, content, content, attn_mask=blocked, need_weights=False)
        states = self.attention_norm(query + self.dropout(attended))
        return self.output_norm(states + self.dropout(self.feed_forward(states)))


class RetroMAE(torch.nn.Module):
    """Encoder (the backbone, with its MLM head) and the one-layer decoder."""

    def __init__(self, mlm: MaskedLanguageModel, settings: RetroMAESection):
        super().__init__()
        config = mlm.model.config
        self.mlm = mlm
        self.settings = settings
        self.decoder = TwoStreamLayer(
            config.hidden_size, config.num_attention_heads, config.intermediate_size,
            config.hidden_dropout_prob, config.attention_probs_dropout_prob, config.layer_norm_eps,
        )  # fmt: skip
        init_like_bert(self.decoder, config.initializer_range)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed encoder MLM loss and summed decoder loss."""
        encoded = self.mlm.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        states = encoded.last_hidden_state
        encoder_loss = self.mlm.mlm_loss_sum(states, batch["labels"])
        sentence = states[:, 0]
        embeddings = self.mlm.backbone.embeddings
        content = embeddings(input_ids=batch["decoder_input_ids"])
        content = torch.cat([sentence[:, None], content[:, 1:]], dim=1)
        width = content.shape[1]
        if self.settings.decoding == "enhanced":
            positions = torch.arange(1, width, device=content.device)
            query = sentence[:, None] + embeddings.position_embeddings(positions)[None]
            decoded = self.decoder(query, content, batch["decoder_visible"])
            return encoder_loss, self.mlm.mlm_loss_sum(decoded, batch["decoder_labels"][:, 1:])
        visible = (batch["attention_mask"] > 0)[:, None, :].expand(-1, width, -1)
        decoded = self.decoder(content, content, visible)
        return encoder_loss, self.mlm.mlm_loss_sum(decoded, batch["decoder_labels"])


@register_objective
class RetroMAETask(PretrainTask):
    """Loss = encoder MLM (averaged over its masked tokens) + decoder loss (averaged over its targets)."""

    name = "retromae"
    settings = RetroMAESection
    module: RetroMAE

    def __init__(self, mlm: MaskedLanguageModel, corpus: TokenizedCorpus, config: PretrainSettings):
        super().__init__(mlm, corpus, config, RetroMAE(mlm, config.retromae))

    def row(self, ids: np.ndarray, word_ids: np.ndarray, rng: np.random.Generator) -> Row:
        """The encoder's row, plus the decoder's input and targets: with enhanced decoding the whole
        text, every token but the first (its place is the sentence embedding's) a target; with basic
        decoding the text masked again at `decoder_mask_ratio`."""
        row = super().row(ids, word_ids, rng)
        settings = self.config.retromae
        if settings.decoding == "basic":
            row["decoder_input_ids"], row["decoder_labels"] = self.sequences.mask(
                ids, word_ids, settings.decoder_mask_ratio, rng
            )
        else:
            row["decoder_input_ids"] = ids
            row["decoder_labels"] = np.where(np.arange(len(ids)) == 0, IGNORE, ids)
        row["rng"] = rng  # draws the decoder's attention once the batch's width is known
        return row

    def collate(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        """The encoder's tensors, the decoder's, and each row's enhanced-decoding attention mask."""
        batch = super().collate(rows)
        width = batch["input_ids"].shape[1]
        batch["decoder_input_ids"] = pad([r["decoder_input_ids"] for r in rows], self.sequences.pad_id)
        batch["decoder_labels"] = pad([r["decoder_labels"] for r in rows], IGNORE)
        batch["decoder_visible"] = torch.from_numpy(
            np.stack(
                [
                    decoder_visibility(r["length"], width, self.config.retromae.visible_ratio, r["rng"])
                    for r in rows
                ]
            )
        )
        return batch

    def losses(self, batch: dict[str, torch.Tensor], masked: float) -> dict[str, torch.Tensor]:
        """The encoder's MLM loss and the decoder's loss."""
        encoder_sum, decoder_sum = self.module(batch)
        decoded = labelled_count(batch["decoder_labels"])
        return {"mlm_encoder": encoder_sum / masked, "decoder": decoder_sum / decoded}
