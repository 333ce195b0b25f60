"""A BERT-style checkpoint as a backbone plus an MLM head, and the encoder exported after pre-training."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForMaskedLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from densekit.errors import InputError
from densekit.models.checkpoint_files import load_pretrained
from densekit.models.config import EncoderConfig
from densekit.models.encoder import DenseEncoder
from densekit.models.hub import locate_model
from densekit.pretraining.masking import IGNORE

log = logging.getLogger("densekit")

HEAD_PREFIXES = ("cls.", "lm_head.")


class MaskedLanguageModel(torch.nn.Module):
    """A transformer backbone and the MLM head that predicts tokens from its states."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, source: str):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.source = source
        head = getattr(model, "cls", None) or getattr(model, "lm_head", None)
        if head is None:
            raise InputError(f"{source}: pre-training needs a BERT-style masked-LM head (`cls` or `lm_head`)")
        self.head = head

    @classmethod
    def load(cls, name_or_path: str, trust_remote_code: bool = False) -> MaskedLanguageModel:
        """Load a checkpoint as a masked-LM model.

        Where the checkpoint has no MLM head, the new one is tied to the word embeddings (logged at
        INFO: that is expected of a bare encoder); any other weight the checkpoint lacks is named in
        one warning. Like `from_pretrained`, the model starts in eval mode.
        """
        path = locate_model(name_or_path)
        model, report = load_pretrained(AutoModelForMaskedLM, path, trust_remote_code)
        lacking = report.missing
        embeddings = model.get_input_embeddings().weight
        own_head = {  # the head's weights but the decoder, which is the word embeddings themselves
            name for name, tensor in model.named_parameters(remove_duplicate=False)
            if name.startswith(HEAD_PREFIXES) and tensor is not embeddings
        }  # fmt: skip
        if own_head and own_head <= set(lacking):
            lacking = [k for k in lacking if not k.startswith(HEAD_PREFIXES)]
            log.info("%s has no MLM head; initialised a new one tied to the word embeddings", name_or_path)
        if lacking:
            log.warning(
                "%s lacks weights pre-training needs; they start from random values: %s",
                name_or_path, ", ".join(lacking),
            )  # fmt: skip
        if report.unexpected:
            log.debug("%s: weights pre-training does not use: %s", name_or_path, ", ".join(report.unexpected))
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, str(name_or_path))

    @property
    def backbone(self) -> PreTrainedModel:
        """The transformer without its head: what the retriever keeps."""
        return self.model.base_model

    @property
    def hidden_size(self) -> int:
        """Width of the token states."""
        return int(self.model.config.hidden_size)

    def mlm_loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the head's predictions at labelled positions (the head runs only there)."""
        chosen = labels != IGNORE
        if not chosen.any():
            return hidden.sum() * 0.0
        logits = self.head(hidden[chosen])
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(logits, labels[chosen], reduction="sum")

    def export(self, path: Path, max_length: int) -> None:
        """Save the backbone as a densekit encoder with CLS pooling, without any pre-training head."""
        config = EncoderConfig(
            pooling="cls", normalize=False, query_max_length=64, passage_max_length=max_length
        )
        DenseEncoder(self.backbone, self.tokenizer, config, source=self.source).save(path)


def init_like_bert(module: torch.nn.Module, std: float) -> None:
    """Initialise fresh layers as BERT does: normal(0, std) weights, zero biases, unit layer norms."""
    for child in module.modules():
        if isinstance(child, torch.nn.Linear):
            torch.nn.init.normal_(child.weight, std=std)
            if child.bias is not None:
                torch.nn.init.zeros_(child.bias)
        elif isinstance(child, torch.nn.LayerNorm):
            torch.nn.init.ones_(child.weight)
            torch.nn.init.zeros_(child.bias)
        elif isinstance(child, torch.nn.MultiheadAttention):
            torch.nn.init.normal_(child.in_proj_weight, std=std)
            torch.nn.init.zeros_(child.in_proj_bias)
