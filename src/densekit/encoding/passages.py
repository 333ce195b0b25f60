"""Long documents: FirstP encodes a document's first tokens (truncation, the default); MaxP splits it
into passages, indexes each, and scores the document by its best passage."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from densekit.data.records import Document, Run

if TYPE_CHECKING:
    from densekit.models.encoder import DenseEncoder

PASSAGE_MARK = "#p"


class MaxPSettings(BaseModel):
    """How documents are cut into passages."""

    model_config = ConfigDict(extra="forbid")

    stride: int | None = Field(None, gt=0, description="tokens between passage starts (default: no overlap)")
    depth_factor: int = Field(10, gt=0, description="passages retrieved per document wanted")


class PassageSplitter:
    """Cuts a document's text into windows that fit the encoder's passage length with its title."""

    def __init__(self, encoder: DenseEncoder, settings: MaxPSettings):
        self.tokenizer = encoder.tokenizer
        self.length = encoder.config.passage_max_length
        self.prefix = encoder.config.passage_prefix
        self.settings = settings

    def __call__(self, document: Document) -> list[Document]:
        """The passages of `document`, with ids `<doc id>#p<k>`; each keeps the document's title."""
        header = len(self.tokenizer(f"{self.prefix}{document.title} ", add_special_tokens=False)["input_ids"])
        window = max(16, self.length - self.tokenizer.num_special_tokens_to_add() - header)
        stride = self.settings.stride or window
        encoded = self.tokenizer(document.text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        passages = []
        start = 0
        while True:
            end = min(start + window, len(offsets))
            text = document.text[offsets[start][0] : offsets[end - 1][1]] if offsets else document.text
            passages.append(Document(f"{document.id}{PASSAGE_MARK}{len(passages)}", text, document.title))
            if end >= len(offsets):
                return passages
            start += stride

    def split_all(self, documents: Iterable[Document]) -> Iterator[Document]:
        """Every passage of every document, in order."""
        for document in documents:
            yield from self(document)


def document_of(passage_id: str) -> str:
    """The document a passage id belongs to."""
    return passage_id.rsplit(PASSAGE_MARK, 1)[0]


def best_passage_run(passage_run: Run, k: int) -> Run:
    """A document run from a passage run: each document scored by its best passage, top `k` kept."""
    run: Run = {}
    for query_id, ranked in passage_run.items():
        best: dict[str, float] = {}
        for passage_id, score in ranked.items():
            doc_id = document_of(passage_id)
            if doc_id not in best or score > best[doc_id]:
                best[doc_id] = score
        run[query_id] = dict(sorted(best.items(), key=lambda pair: -pair[1])[:k])
    return run
