"""OpenAI's embeddings API (`POST /v1/embeddings`, `GET /v1/models`), the one the OpenAI client,
LangChain and LlamaIndex call: its request and response shapes, its error shape, and the model names
that choose a served module and whether inputs are queries or passages."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

from densekit.errors import DensekitError
from densekit.models.dimensions import check_dimensions
from densekit.models.encoder import DenseEncoder
from densekit.retrieval.retriever import Retriever
from densekit.serving.checks import LimitError, only_a_number, shown

KINDS = ("query", "passage")  # the suffixes of a model name: `<model>:query`, `<model>:passage`
DOMAIN_MARK = "@"  # `<model>:query@<domain>`: queries of that domain, for a fixed route
TOKEN_IDS_REFUSED = (
    "input: token ids are not accepted, send texts (LangChain: OpenAIEmbeddings(..., "
    "check_embedding_ctx_length=False))"
)


class EmbeddingsRequest(BaseModel):
    """OpenAI's request: `input` one text or a list; `model` a name from `GET /v1/models`, its suffix
    `:query` or `:passage` saying how the inputs are encoded (passages without one); `encoding_format`
    float or base64 (little-endian float32); `dimensions` a width to cut the vectors to (`requested_width`);
    `user` ignored."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("dimensions", mode="before")
    @classmethod
    def _a_number(cls, value: object) -> object:
        return only_a_number(value)


class EmbeddingOut(BaseModel):
    """One input's vector, as a list of floats or base64 of its float32 bytes."""

    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class Usage(BaseModel):
    """Tokens the inputs took, special tokens included, after truncation."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    """OpenAI's response: one entry per input, in order."""

    object: Literal["list"] = "list"
    data: list[EmbeddingOut]
    model: str
    usage: Usage


@dataclass(frozen=True)
class ServedName:
    """What a model name of the request resolves to: the retriever whose encoder (and module) encodes,
    whether inputs are queries or passages, and, for a fixed route's queries, their domain."""

    retriever: Retriever
    side: Literal["query", "passage"]
    domain: str | None = None


class UnknownModel(DensekitError, LookupError):
    """A model name the service does not serve."""


def served_names(model_name: str, retrievers: list[Retriever]) -> dict[str, ServedName]:
    """Every model name the service answers to, and what each means: `model_name` for the default
    retriever (the first) and each module's name for its own, each alone (passages) and with `:passage`
    and `:query`. A fixed route's queries need a domain, so it answers to `:query@DOMAIN` for each of
    its domains, and to `:query` alone only when it has a fallback."""
    bases = {model_name: retrievers[0]}
    for retriever in retrievers:
        if retriever.module is not None:
            bases.setdefault(retriever.module, retriever)
    names: dict[str, ServedName] = {}
    for base, retriever in bases.items():
        for name, served in _names_of(base, retriever):
            names.setdefault(name, served)
    return names


def _names_of(base: str, retriever: Retriever) -> list[tuple[str, ServedName]]:
    """The model names of one base name."""
    passages = ServedName(retriever, "passage")
    names = [(base, passages)]
    route = retriever.route
    if route is None or not route.strategy.takes_domains or route.spec.fallback is not None:
        names.append((f"{base}:query", ServedName(retriever, "query")))
    if route is not None and route.strategy.takes_domains:
        names += [(f"{base}:query{DOMAIN_MARK}{domain}", ServedName(retriever, "query", domain))
                  for domain in route.spec.domains]  # fmt: skip
    return [*names, (f"{base}:passage", passages)]


def resolve_model(name: str, names: dict[str, ServedName]) -> ServedName:
    """What the model name `name` means; one not listed by `model_list` is an `UnknownModel`."""
    if name in names:
        return names[name]
    listed = ", ".join(repr(n) for n in model_list(names))
    raise UnknownModel(f"model {shown(name)} is not served here (models: {listed})")


def model_list(names: dict[str, ServedName]) -> list[str]:
    """Every model name a request may give, suffixed ones included."""
    return list(names)


def request_texts(request: EmbeddingsRequest) -> list[str]:
    """The request's inputs as a list of texts; token ids are refused (`LimitError`)."""
    if isinstance(request.input, str):
        return [request.input]
    if any(not isinstance(item, str) for item in request.input):
        raise LimitError(TOKEN_IDS_REFUSED)
    return list(request.input)  # type: ignore[arg-type]


def requested_width(dimensions: int | None, model: str, encoder: DenseEncoder) -> int | None:
    """The width to cut the vectors of `encoder` to for a request's `dimensions` of the model name
    `model` (None: as they are), as `--dimensions` cuts them (`densekit.models.dimensions.truncated`).
    A width below 1 is a `LimitError`, as a `k` below 1 is; one above the vectors served (the model's,
    or the service's `--dimensions`), or one a Matryoshka model was not trained for, a
    `DimensionsError` (400). A narrower width of a model that records no Matryoshka training is served
    without the warning `--dimensions` logs: OpenAI's answer has no place for one, its clients read no
    header, and a log line per request would flood the log; `/info` says instead which widths the model
    was trained for (`matryoshka_dims`, None where it records none)."""
    if dimensions is None:
        return None
    if dimensions < 1:
        raise LimitError(f"dimensions={shown(dimensions)}: ask for 1 to {encoder.dimension}")
    served = encoder.config.dimensions
    source = f"model {shown(model)}" + (f" (served with --dimensions {served})" if served else "")
    return check_dimensions(dimensions, encoder.dimension, encoder.config.matryoshka_dims, source,
                            setting="dimensions", warn=False)  # fmt: skip


def embeddings_body(
    vectors: np.ndarray, tokens: int, model: str, encoding_format: Literal["float", "base64"]
) -> dict:
    """OpenAI's response for `vectors` (one row per input), in the shape of `EmbeddingsResponse`, as plain
    JSON values: a response model returned instead would be validated again, float by float, before
    being written."""
    rows = np.asarray(vectors, dtype="<f4")
    if encoding_format == "base64":
        embeddings: list = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        embeddings = rows.tolist()
    data = [{"object": "embedding", "embedding": embedding, "index": number}
            for number, embedding in enumerate(embeddings)]  # fmt: skip
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def error_body(message: str, status: int) -> dict:
    """OpenAI's error shape, which its clients read the message from."""
    kinds = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
    kind = kinds.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
