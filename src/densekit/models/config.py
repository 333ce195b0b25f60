"""How an encoder turns token states into one vector, and how it prepares its inputs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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


@dataclass(frozen=True)
class EncoderOptions:
    """How an encoder is loaded: overrides of the settings its folder saved (None keeps the folder's), a
    module folder to put on it, and whether code shipped with the model may run. Every command that
    loads an encoder takes one (`densekit.cli.options.with_encoder_options` declares its options once),
    and `densekit.routing.loading.load_model_or_route` loads with it."""

    pooling: Pooling | None = None
    normalize: bool | None = None
    query_max_length: int | None = None
    passage_max_length: int | None = None
    query_prefix: str | None = None
    passage_prefix: str | None = None
    module: Path | None = None
    trust_remote_code: bool = False

    def overrides(self) -> dict[str, Any]:
        """The encoder settings it overrides, by `EncoderConfig` field (None: keep the model's)."""
        names = ("pooling", "normalize", "query_max_length", "passage_max_length", "query_prefix",
                 "passage_prefix")  # fmt: skip
        return {name: getattr(self, name) for name in names}

    def given(self) -> list[str]:
        """The options set, as the command line names them (`--module`, `--pooling`...), the module first."""
        remote = self.trust_remote_code or None
        named = {"module": self.module, **self.overrides(), "trust_remote_code": remote}
        return [f"--{name.replace('_', '-')}" for name, value in named.items() if value is not None]
