"""OpenAI's embeddings API on the service, called by the OpenAI client, and densekit's own client."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from densekit import Client
from densekit.client import ServiceError
from densekit.data.dataset import Dataset
from densekit.encoding.embed import embed_texts
from densekit.encoding.store import EmbeddingStore
from densekit.models import DenseEncoder
from densekit.models.dimensions import truncated
from densekit.retrieval.retriever import Retriever
from densekit.serving.app import create_app

from .conftest import CORPUS, QUERIES
from .service_fixtures import AUTH, TOKEN, client, serve_process

NAME = "tiny"


@pytest.fixture(scope="module")
def service(served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`densekit serve` over the served collection at float32, answering to NAME; its URL."""
    process, url = serve_process(
        served, tmp_path_factory.mktemp("service"), "--precision", "float32", "--served-model-name", NAME
    )
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _encoded(served) -> dict[str, np.ndarray]:
    """`densekit encode`'s vectors of the served collection (the fixture's embedding folder), by id."""
    _, index, _ = served
    store = EmbeddingStore.open(Path(index).parent / "emb")
    return dict(zip(store.ids(), np.concatenate([part.vectors() for part in store.parts]), strict=True))


def test_the_openai_clients_embeddings_equal_densekit_encodes(served, service: str, retriever: Retriever):
    documents = list(Dataset.open(served[0]).iter_corpus())
    openai_client = openai.OpenAI(base_url=f"{service}/v1", api_key=TOKEN)
    texts = [d.full_text for d in documents]
    # the client asks for base64 unless told otherwise; ask for both
    as_base64 = openai_client.embeddings.create(input=texts, model=f"{NAME}:passage")
    as_floats = openai_client.embeddings.create(input=texts, model=NAME, encoding_format="float")
    encoded = _encoded(served)
    for answer in (as_base64, as_floats):
        assert [item.index for item in answer.data] == list(range(len(texts)))
        got = np.array([item.embedding for item in answer.data], dtype=np.float32)
        expected = np.stack([encoded[d.id] for d in documents])
        np.testing.assert_allclose(got, expected, atol=1e-5)
    tokens = sum(len(ids) for ids in retriever.encoder.tokenize(texts, "passage"))
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == tokens
    assert as_floats.model == NAME

    queries = [q["text"] for q in QUERIES]
    one = openai_client.embeddings.create(input=queries[0], model=f"{NAME}:query")
    assert len(one.data) == 1
    np.testing.assert_allclose(one.data[0].embedding, retriever.encode_queries(queries[:1])[0], atol=1e-5)
    listed = {model.id for model in openai_client.models.list()}
    assert listed == {NAME, f"{NAME}:query", f"{NAME}:passage"}


def test_the_openai_clients_dimensions_cut_the_vectors_as_densekit_encode_dimensions_does(
    served, service: str
):
    _, _, model = served
    openai_client = openai.OpenAI(base_url=f"{service}/v1", api_key=TOKEN)
    texts = [d["text"] for d in CORPUS] + [q["text"] for q in QUERIES]
    full = DenseEncoder.load(model).eval()

    def embedded(kind: str, **request) -> np.ndarray:
        answer = openai_client.embeddings.create(input=texts, model=f"{NAME}:{kind}", **request)
        return np.array([item.embedding for item in answer.data], dtype=np.float32)

    for width in (16, 5):
        cut = DenseEncoder.load(model, dimensions=width).eval()  # as `densekit encode --dimensions` loads it
        for kind in ("passage", "query"):
            expected = embed_texts(cut, texts, kind)
            # the full vectors cut and normalised again, as the model normalises its own
            full_cut = truncated(embed_texts(full, texts, kind), width, normalize=True)
            for formats in ({}, {"encoding_format": "float"}):  # the client asks for base64 unless told
                got = embedded(kind, dimensions=width, **formats)
                assert got.shape == (len(texts), width)
                np.testing.assert_allclose(got, expected, atol=1e-6)
                np.testing.assert_allclose(got, full_cut, atol=1e-6)
                np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    own_width = embedded("passage", dimensions=32, encoding_format="float")
    np.testing.assert_allclose(own_width, embed_texts(full, texts, "passage"), atol=1e-6)


def test_a_matryoshka_model_serves_only_the_widths_it_was_trained_for(served):
    data, index, model = served
    encoder = DenseEncoder.load(model).eval()
    # what loading a model of Matryoshka training gives (tests/test_matryoshka.py)
    encoder.config = encoder.config.model_copy(update={"matryoshka_dims": [32, 16, 8]})
    with TestClient(create_app(Retriever.over(encoder, index, data), TOKEN, model_name=NAME)) as http:

        def embed(dimensions: int):
            body = {"input": ["a", "b"], "model": NAME, "dimensions": dimensions}
            return http.post("/v1/embeddings", json=body, headers=AUTH)

        untrained, trained, above = embed(12), embed(8), embed(64)
        info = http.get("/info", headers=AUTH).json()
    assert untrained.status_code == 400
    message = f"dimensions 12: model '{NAME}' was trained (Matryoshka) for 32, 16, 8 dimensions; choose one "
    message += "of those"
    assert untrained.json()["error"] == {
        "message": message, "type": "invalid_request_error", "param": None, "code": None
    }  # fmt: skip
    assert trained.status_code == 200
    assert [len(item["embedding"]) for item in trained.json()["data"]] == [8, 8]
    assert above.status_code == 400 and "choose 32 or fewer" in above.json()["error"]["message"]
    assert (info["dimension"], info["dimensions"], info["matryoshka_dims"]) == (32, None, [32, 16, 8])


def test_the_openai_client_hears_each_refusal_in_its_own_shape(service: str):
    openai_client = openai.OpenAI(base_url=f"{service}/v1", api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.NotFoundError, match=f"'nope' is not served here .*'{NAME}:query'"):
        openai_client.embeddings.create(input="x", model="nope")
    with pytest.raises(openai.UnprocessableEntityError, match="token ids are not accepted"):
        openai_client.embeddings.create(input=[[101, 102]], model=NAME)
    with pytest.raises(openai.BadRequestError, match=f"^.*dimensions 33: model '{NAME}' makes 32-dimensional "
                       "vectors; choose 32 or fewer"):  # fmt: skip
        openai_client.embeddings.create(input="x", model=NAME, dimensions=33)
    with pytest.raises(openai.UnprocessableEntityError, match="dimensions=0: ask for 1 to 32"):
        openai_client.embeddings.create(input="x", model=NAME, dimensions=0)
    with pytest.raises(openai.UnprocessableEntityError, match="input 1 is empty"):
        openai_client.embeddings.create(input=["x", " "], model=NAME)
    with pytest.raises(openai.AuthenticationError, match="bearer token"):
        openai.OpenAI(base_url=f"{service}/v1", api_key="wrong").embeddings.create(input="x", model=NAME)


def test_embeddings_are_held_to_the_search_limits(served, retriever: Retriever):
    name = str(served[2])
    with client(retriever, max_queries=2, max_query_chars=10, max_input_chars=40) as http:

        def embed(body: dict):
            return http.post("/v1/embeddings", json=body, headers=AUTH)

        too_many = embed({"input": ["a", "b", "c"], "model": name})
        too_long = embed({"input": "y" * 41, "model": name})
        unknown_field = embed({"input": "a", "model": name, "extra": 1})
        past_the_query_limit = embed({"input": "y" * 40, "model": name})  # a passage is longer than a query
    assert too_many.status_code == 422 and "3 inputs: send 1 to 2" in too_many.json()["error"]["message"]
    assert too_long.status_code == 422 and "41 characters" in too_long.json()["error"]["message"]
    assert unknown_field.status_code == 422 and "extra" in unknown_field.json()["error"]["message"]
    assert past_the_query_limit.status_code == 200


def test_a_served_module_is_an_embeddings_model_of_its_own(served, tmp_path: Path):
    from densekit.encoding.corpus import encode_corpus
    from densekit.index import IndexSpec, build_index

    from .test_modules import put_module

    data, index, model = served
    encoder = DenseEncoder.load(model).eval()
    put_module(encoder, "lora", "extra", seed=3)
    encode_corpus(encoder, Dataset.open(data), tmp_path / "emb", show_progress=False)
    build_index(EmbeddingStore.open(tmp_path / "emb"), IndexSpec(), tmp_path / "index", show_progress=False)
    module_retriever = Retriever.over(encoder, tmp_path / "index", data)
    base_retriever = Retriever.over(encoder, index, data, module=None)
    texts = [d["text"] for d in CORPUS[:3]]
    with TestClient(create_app([base_retriever, module_retriever], TOKEN, model_name="base")) as http:
        by_module = http.post("/v1/embeddings", json={"input": texts, "model": "extra:passage"}, headers=AUTH)
        by_base = http.post("/v1/embeddings", json={"input": texts, "model": "base"}, headers=AUTH)
    module_vectors = np.array([item["embedding"] for item in by_module.json()["data"]])
    base_vectors = np.array([item["embedding"] for item in by_base.json()["data"]])
    for vectors, module in ((module_vectors, "extra"), (base_vectors, None)):
        np.testing.assert_allclose(vectors, embed_texts(encoder, texts, "passage", module=module), atol=1e-5)
    assert np.abs(module_vectors - base_vectors).max() > 1e-3


def test_base64_holds_the_float32_bytes_of_the_float_answer(retriever: Retriever, served):
    name = str(served[2])
    with client(retriever) as http:
        body = {"input": ["cats", "dogs"], "model": f"{name}:query"}
        floats = http.post("/v1/embeddings", json=body, headers=AUTH).json()
        packed = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}, headers=AUTH).json()
    for plain, encoded in zip(floats["data"], packed["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.asarray(plain["embedding"], dtype=np.float32).tolist()


def test_densekits_client_searches_and_embeds_as_the_retriever_does(service: str, served, retriever):
    texts = [q["text"] for q in QUERIES]
    with Client(service, TOKEN) as densekit_client:
        assert densekit_client.health()
        hits = densekit_client.search(texts, k=3)
        vectors = densekit_client.embed(texts[:2], side="query")
        document = densekit_client.document("d4")
        with pytest.raises(ServiceError, match="404: no document 'nowhere'"):
            densekit_client.document("nowhere")
    expected = retriever.search(texts, k=3)
    assert [[h.id for h in row] for row in hits] == [[h.id for h in row] for row in expected]
    np.testing.assert_allclose(
        [[h.score for h in row] for row in hits], [[h.score for h in row] for row in expected], atol=1e-5
    )
    np.testing.assert_allclose(vectors, retriever.encode_queries(texts[:2]), atol=1e-5)
    assert document.title == "Python"
    with Client(service, "wrong") as stranger, pytest.raises(ServiceError, match="401: missing or wrong"):
        stranger.search("x")


def test_the_client_retries_a_busy_service_as_told_then_gives_up(retriever: Retriever):
    from prometheus_client.parser import text_string_to_metric_families

    # one text may wait, so two in one request are refused every time
    with client(retriever, max_queued=1) as http:
        busy = Client("http://testserver", TOKEN, retries=2, max_wait=0.01, http=http)
        with pytest.raises(ServiceError, match="429: the service is busy"):
            busy.search(["a", "b"])
        scraped = http.get("/metrics", headers=AUTH).text
    refused = [
        sample.value
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
        if sample.name == "densekit_requests_total" and sample.labels["status"] == "429"
    ]
    assert refused == [3.0]  # the first try and two retries
