"""`densekit serve --dimensions N`: the service encodes queries and `/v1/embeddings` inputs cut to N
dimensions, as `densekit encode --dimensions N` encoded its index's passages, and refuses an index of
another width."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from densekit.data.dataset import Dataset
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.embed import embed_texts
from densekit.encoding.store import EmbeddingStore
from densekit.index import IndexSpec, build_index
from densekit.models import DenseEncoder
from densekit.retrieval.retriever import Retriever

from .conftest import CORPUS, QUERIES
from .service_fixtures import AUTH, serve_process
from .test_outputs import cli

WIDTH = 16  # of the tiny model's 32


@pytest.fixture(scope="module")
def cut_index(served, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A flat index of the served collection's passages cut to WIDTH dimensions, as `densekit encode
    --dimensions WIDTH` and `densekit index` make it."""
    data, _, model = served
    root = tmp_path_factory.mktemp("cut")
    encoder = DenseEncoder.load(model, dimensions=WIDTH)
    encode_corpus(encoder, Dataset.open(data), root / "emb", show_progress=False)
    build_index(EmbeddingStore.open(root / "emb"), IndexSpec(), root / "index", show_progress=False)
    return root / "index"


@pytest.fixture(scope="module")
def cut_service(served, cut_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`densekit serve --dimensions WIDTH` over `cut_index`, at float32; its URL."""
    data, _, model = served
    process, url = serve_process((data, cut_index, model), tmp_path_factory.mktemp("service"),
                                 "--dimensions", str(WIDTH), "--precision", "float32")  # fmt: skip
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serve_dimensions_searches_an_index_of_that_width_as_the_retriever_does(
    served, cut_index: Path, cut_service: str
):
    data, _, model = served
    texts = [q["text"] for q in QUERIES]
    info = httpx.get(f"{cut_service}/info", headers=AUTH, timeout=30).json()
    answer = httpx.post(f"{cut_service}/search", json={"query": texts, "k": 4}, headers=AUTH, timeout=30)
    assert answer.status_code == 200, answer.text
    retriever = Retriever.over(DenseEncoder.load(model, dimensions=WIDTH).eval(), cut_index, data)
    for got, own in zip(answer.json()["results"], retriever.search(texts, k=4), strict=True):
        assert [hit["id"] for hit in got] == [hit.id for hit in own]
        np.testing.assert_allclose([hit["score"] for hit in got], [hit.score for hit in own], atol=1e-5)
    assert (info["dimension"], info["dimensions"], info["matryoshka_dims"]) == (WIDTH, WIDTH, None)


def test_serve_dimensions_embeds_at_its_width_and_narrower_ones(served, cut_service: str):
    _, _, model = served
    texts = [d["text"] for d in CORPUS[:4]]

    def embed(**request) -> httpx.Response:
        body = {"input": texts, "model": f"{model}:query", **request}
        return httpx.post(f"{cut_service}/v1/embeddings", json=body, headers=AUTH, timeout=30)

    def vectors(answer: httpx.Response) -> np.ndarray:
        assert answer.status_code == 200, answer.text
        return np.array([item["embedding"] for item in answer.json()["data"]])

    own, narrower, above = embed(), embed(dimensions=8), embed(dimensions=32)
    expected = embed_texts(DenseEncoder.load(model, dimensions=WIDTH).eval(), texts, "query")
    np.testing.assert_allclose(vectors(own), expected, atol=1e-6)
    expected = embed_texts(DenseEncoder.load(model, dimensions=8).eval(), texts, "query")
    np.testing.assert_allclose(vectors(narrower), expected, atol=1e-6)
    assert above.status_code == 400
    assert above.json()["error"]["message"] == (
        f"dimensions 32: model '{model}:query' (served with --dimensions {WIDTH}) makes {WIDTH}-dimensional "
        f"vectors; choose {WIDTH} or fewer"
    )


def test_serve_refuses_an_index_of_another_width_in_one_line_naming_dimensions(served, cut_index, capsys):
    _, full_index, model = served
    code, err, _ = cli(capsys, "serve", model, full_index, "--dimensions", str(WIDTH), "--device", "cpu")
    assert code == 2
    assert f"{WIDTH}-dimensional vectors (--dimensions {WIDTH}); {full_index} holds 32-dimensional" in err
    assert err.endswith("search it without --dimensions")
    code, err, _ = cli(capsys, "serve", model, cut_index, "--device", "cpu")
    assert code == 2
    assert f"{cut_index} holds {WIDTH}-dimensional ones: search it with --dimensions {WIDTH}" in err
