"""How an encoder turns token states into one vector, and how it prepares its inputs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Pooling = Literal["cls", "mean", "last"]
TextKind = Literal["query", "passage"]

CONFIG_FILE = "densekit.json"


class EncoderConfig(BaseModel):
    """Saved as `densekit.json` beside the weights; every field can be overridden at load time.

    Defaults are those of DPR-style retrievers (CLS pooling, inner product); a sentence-transformers
    folder brings its own pooling, normalisation, length and prompts instead.
    """

    model_config = ConfigDict(extra="forbid")

    pooling: Pooling = "cls"
    normalize: bool = False
    query_max_length: int = Field(64, gt=0)
    passage_max_length: int = Field(256, gt=0)
    query_prefix: str = ""
    passage_prefix: str = ""
    tied: bool = Field(True, description="one backbone for queries and passages, or two towers")
    include_prompt: bool = Field(
        True, description="whether the prefix's tokens count in mean and last-token pooling (as in ST)"
    )

    def max_length(self, kind: TextKind) -> int:
        """The token limit for `kind` texts."""
        return self.query_max_length if kind == "query" else self.passage_max_length

    def prefix(self, kind: TextKind) -> str:
        """The text put before every `kind` text."""
        return self.query_prefix if kind == "query" else self.passage_prefix
