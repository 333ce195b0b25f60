"""OpenAI's embeddings API (`POST /v1/embeddings`, `GET /v1/models`), the one the OpenAI client,
LangChain and LlamaIndex call: its request and response shapes, its error shape, and the model names
that choose a served module and whether inputs are queries or passages."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from densekit.retrieval.retriever import Retriever

KINDS = ("query", "passage")  # the suffixes of a model name: `<model>:query`, `<model>:passage`
DEFAULT_KIND = "passage"
TOKEN_IDS_REFUSED = (
    "input: token ids are not accepted, send texts (LangChain: OpenAIEmbeddings(..., "
    "check_embedding_ctx_length=False))"
)


class EmbeddingsRequest(BaseModel):
    """OpenAI's request: `input` one text or a list; `model` a name from `GET /v1/models`, its suffix
    `:query` or `:passage` saying how the inputs are encoded (passages without one); `encoding_format`
    float or base64 (little-endian float32); `dimensions` the model's own, if given; `user` ignored."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


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
    and whether inputs are queries or passages."""

    retriever: Retriever
    kind: Literal["query", "passage"]


class UnknownModel(LookupError):
    """A model name the service does not serve."""


def served_names(model_name: str, retrievers: list[Retriever]) -> dict[str, Retriever]:
    """Base names the service answers to: `model_name` for the default retriever (the first), and the
    name of each module served for its own."""
    names = {model_name: retrievers[0]}
    for retriever in retrievers:
        if retriever.module is not None:
            names.setdefault(retriever.module, retriever)
    return names


def resolve_model(name: str, names: dict[str, Retriever]) -> ServedName:
    """The retriever and input kind of `name`: a base name, or one with a `:query` or `:passage` suffix."""
    base, sep, suffix = name.rpartition(":")
    if sep and suffix in KINDS and base in names:
        return ServedName(names[base], suffix)  # type: ignore[arg-type]
    if name in names:
        return ServedName(names[name], DEFAULT_KIND)  # type: ignore[arg-type]
    listed = ", ".join(repr(n) for n in model_list(names))
    raise UnknownModel(f"model {name!r} is not served here (models: {listed})")


def model_list(names: dict[str, Retriever]) -> list[str]:
    """Every model name a request may give, suffixed ones included."""
    return [full for base in names for full in (base, *(f"{base}:{kind}" for kind in KINDS))]


def request_texts(request: EmbeddingsRequest) -> list[str]:
    """The request's inputs as a list of texts; token ids are refused."""
    if isinstance(request.input, str):
        return [request.input]
    if any(not isinstance(item, str) for item in request.input):
        raise ValueError(TOKEN_IDS_REFUSED)
    return list(request.input)  # type: ignore[arg-type]


def embeddings_response(
    vectors: np.ndarray, tokens: int, model: str, encoding_format: Literal["float", "base64"]
) -> EmbeddingsResponse:
    """OpenAI's response for `vectors` (one row per input)."""
    data = []
    for number, row in enumerate(np.asarray(vectors, dtype="<f4")):
        if encoding_format == "base64":
            data.append(EmbeddingOut(embedding=base64.b64encode(row.tobytes()).decode("ascii"), index=number))
        else:
            data.append(EmbeddingOut(embedding=row.tolist(), index=number))
    return EmbeddingsResponse(data=data, model=model, usage=Usage(prompt_tokens=tokens, total_tokens=tokens))


def error_body(message: str, status: int) -> dict:
    """OpenAI's error shape, which its clients read the message from."""
    kinds = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
    kind = kinds.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
