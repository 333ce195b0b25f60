"""How an encoder turns token states into one vector, and how it prepares its inputs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

Pooling = Literal["cls", "mean", "last"]
TextSide = Literal["query", "passage"]
# how `densekit rotate` orders a model's dimensions: by the corpus's variance, or turned from there so
# that cut vectors rank as full-width ones do
RotationFit = Literal["variance", "ranking"]

CONFIG_FILE = "densekit.json"


def _widest_first(widths: list[int]) -> list[int]:
    if any(a <= b for a, b in itertools.pairwise(widths)):
        raise ValueError(f"{widths}: give the widths widest first, each once (as [384, 256, 128, 64])")
    return widths


# Widths of vectors, widest first (Matryoshka training's, and what a model records of them).
Widths = Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1), AfterValidator(_widest_first)]


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
    dimensions: int | None = Field(
        None,
        gt=0,
        description="keep the first N dimensions of each vector, normalised again where the model "
        "normalises (`densekit.models.dimensions`); none: all",
    )
    matryoshka_dims: Widths | None = Field(
        None, description="the widths the model was trained for with Matryoshka training; none: not recorded"
    )
    variance_ordered: bool = Field(
        False,
        description="its dimensions are ordered by `densekit rotate` on a corpus's vectors (by their "
        "variance, or by a ranking fit), so that its first N carry the most of them, for any N",
    )

    @model_serializer(mode="wrap")
    def _unset_widths_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The settings without `dimensions`, `matryoshka_dims` and `variance_ordered` where they are
        unset, as every record made before they existed holds them (an artefact's identity, a module's
        settings)."""
        settings = handler(self)
        for name in ("dimensions", "matryoshka_dims", "variance_ordered"):
            if settings.get(name) in (None, False):
                settings.pop(name, None)
        return settings

    def max_length(self, side: TextSide) -> int:
        """The token limit for `side` texts."""
        return self.query_max_length if side == "query" else self.passage_max_length

    def prefix(self, side: TextSide) -> str:
        """The text put before every `side` text."""
        return self.query_prefix if side == "query" else self.passage_prefix


@dataclass(frozen=True)
class EncoderOptions:
    """How an encoder is loaded: overrides of the settings its folder saved (None keeps the folder's), a
    module folder to put on it, and whether code shipped with the model may run. Every command that
    loads an encoder takes one (`densekit.cli.options.with_encoder_options` declares its options once),
    and `densekit.routing.model_or_route.load_model_or_route` loads with it."""

    pooling: Pooling | None = None
    normalize: bool | None = None
    query_max_length: int | None = None
    passage_max_length: int | None = None
    query_prefix: str | None = None
    passage_prefix: str | None = None
    dimensions: int | None = None
    module: Path | None = None
    trust_remote_code: bool = False

    def overrides(self) -> dict[str, Any]:
        """The encoder settings it overrides, by `EncoderConfig` field (None: keep the model's);
        `dimensions` only when set, so what records them (a run's identity) reads as before it existed."""
        names = ("pooling", "normalize", "query_max_length", "passage_max_length", "query_prefix",
                 "passage_prefix")  # fmt: skip
        widths = {} if self.dimensions is None else {"dimensions": self.dimensions}
        return {name: getattr(self, name) for name in names} | widths

    def given(self) -> list[str]:
        """The options set, as the command line names them (`--module`, `--pooling`...), the module first."""
        remote = self.trust_remote_code or None
        named = {"module": self.module, **self.overrides(), "trust_remote_code": remote}
        return [f"--{name.replace('_', '-')}" for name, value in named.items() if value is not None]
