"""OpenAI's embeddings API: `POST /v1/embeddings` and `GET /v1/models` (shapes and names: `openai_api`)."""

from __future__ import annotations

from fastapi import FastAPI

from densekit.models.dimensions import truncated
from densekit.serving import openai_api
from densekit.serving.checks import check_domain, check_texts
from densekit.serving.openai_api import EmbeddingsRequest, EmbeddingsResponse
from densekit.serving.responses import FastJSON
from densekit.serving.service import SearchService


def add_routes(app: FastAPI, service: SearchService) -> None:
    """`/v1/embeddings` (a direct route) and `/v1/models`, behind the token."""
    limits, names = service.limits, service.embedding_names

    async def embeddings(request: EmbeddingsRequest) -> EmbeddingsResponse:
        """OpenAI's embeddings API: `model` is a name from `/v1/models`, whose suffix `:query` or
        `:passage` says how the inputs are encoded (as passages without one); `dimensions`, a width to
        cut the vectors to, normalised again where the model normalises."""
        texts = openai_api.request_texts(request)
        chosen = openai_api.resolve_model(request.model, names)
        check_texts(texts, limits.max_queries, limits.max_input_chars, "input", "inputs")
        encoder = chosen.retriever.encoder
        width = openai_api.requested_width(request.dimensions, request.model, encoder)
        if chosen.side == "query":
            check_domain(chosen.retriever, chosen.domain)
        found = await service.batcher.embed(chosen.retriever, texts, chosen.side, chosen.domain)
        vectors = found.vectors
        if width is not None:
            vectors = truncated(vectors, width, encoder.config.normalize)
        body = openai_api.embeddings_body(vectors, found.tokens, request.model, request.encoding_format)
        # the shape of EmbeddingsResponse, built as it is sent (as `responses.search_response`)
        return FastJSON(body)  # type: ignore[return-value]

    app.router.add_api_route("/v1/embeddings", embeddings, methods=["POST"],
                             dependencies=service.authorised, response_model=EmbeddingsResponse,
                             route_class_override=service.direct)  # fmt: skip

    def models() -> dict:
        """The model names `/v1/embeddings` answers to, in OpenAI's list shape."""
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "densekit"}
                for name in openai_api.model_list(names)]  # fmt: skip
        return {"object": "list", "data": data}

    app.router.add_api_route("/v1/models", models, methods=["GET"], dependencies=service.authorised,
                             route_class_override=service.checked)  # fmt: skip
