"""The Retriever, the document store and the HTTP service over them."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from densekit.cli.main import app
from densekit.data.dataset import Dataset
from densekit.data.trec import read_run
from densekit.diagnostics import Diagnostics
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.runtimes import use_backend
from densekit.encoding.store import EmbeddingStore
from densekit.index import IndexSpec, build_index
from densekit.models import DenseEncoder
from densekit.retrieval.documents import store_path
from densekit.retrieval.retriever import Retriever
from densekit.serving.app import create_app
from densekit.serving.batcher import MicroBatcher

from .conftest import CORPUS, QUERIES
from .service_fixtures import AUTH, TOKEN, client, free_port, headless_chromium, serve_process
from .test_outputs import cli


def test_the_retriever_gives_the_search_commands_run(served, retriever: Retriever, tmp_path: Path):
    data, index, model = served
    args = ["search", str(model), str(index), str(data), "-o", str(tmp_path / "run.trec"), "--k", "5",
            "--no-progress", "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    from_command = read_run(tmp_path / "run.trec", Diagnostics())
    queries, _ = Dataset.open(data).split_queries("test")
    in_process = retriever.search_run(queries, 5)
    assert list(from_command) == list(in_process)
    for query in queries:
        assert list(from_command[query]) == list(in_process[query])
        assert list(from_command[query].values()) == pytest.approx(list(in_process[query].values()), abs=1e-6)


def test_hits_carry_the_documents_texts_from_the_store(retriever: Retriever):
    [hits] = retriever.search(QUERIES[1]["text"], k=len(CORPUS))
    by_id = {d["_id"]: d for d in CORPUS}
    assert sorted(h.id for h in hits) == sorted(by_id)
    for hit in hits:
        assert (hit.title, hit.text) == (by_id[hit.id]["title"], by_id[hit.id]["text"])
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_the_store_is_rebuilt_when_the_corpus_changes(served, make_beir, tmp_path: Path):
    from densekit.retrieval.documents import open_document_store

    data = make_beir()
    path = tmp_path / "x.documents.sqlite"
    assert open_document_store(Dataset.open(data), path).get("d1").title == "Cats"
    changed = [dict(d, title="Felines") if d["_id"] == "d1" else d for d in CORPUS]
    data = make_beir(corpus=changed)
    assert open_document_store(Dataset.open(data), path).get("d1").title == "Felines"


def test_the_service_gives_the_retrievers_hits(retriever: Retriever):
    texts = [q["text"] for q in QUERIES]
    with client(retriever) as http:
        response = http.post("/search", json={"query": texts, "k": 4}, headers=AUTH)
        single = http.post("/search", json={"query": texts[0], "k": 4}, headers=AUTH)
    assert response.status_code == 200, response.text
    expected = retriever.search(texts, k=4)
    for served_hits, own in zip(response.json()["results"], expected, strict=True):
        assert [h["id"] for h in served_hits] == [h.id for h in own]
        assert [h["score"] for h in served_hits] == pytest.approx([h.score for h in own], abs=1e-6)
        assert [h["text"] for h in served_hits] == [h.text for h in own]
    alone, batched = single.json()["results"][0], response.json()["results"][0]
    assert [(h["id"], h["text"]) for h in alone] == [(h["id"], h["text"]) for h in batched]
    # the last float32 bit of a score may change with the batch (exact_search)
    assert [h["score"] for h in alone] == pytest.approx([h["score"] for h in batched], abs=1e-6)


def test_documents_by_id_and_the_services_info(retriever: Retriever):
    with client(retriever) as http:
        found = http.get("/documents/d4", headers=AUTH)
        missing = http.get("/documents/nowhere", headers=AUTH)
        info = http.get("/info", headers=AUTH).json()
    assert found.json()["title"] == "Python"
    assert missing.status_code == 404 and "nowhere" in missing.json()["detail"]
    assert (info["dimension"], info["documents"], info["index"]["type"]) == (32, len(CORPUS), "flat")


def test_every_route_but_health_and_the_page_needs_the_token(retriever: Retriever):
    with client(retriever) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            assert http.post("/search", json={"query": "x"}, headers=headers).status_code == 401
            assert http.get("/documents/d1", headers=headers).status_code == 401
            assert http.get("/info", headers=headers).status_code == 401
        assert http.post("/search", json={"query": "x"}, headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"query": "x", "k": 6}, 422, "k=6"),
        ({"query": ["a", "b", "c"]}, 422, "3 queries"),
        ({"query": "y" * 41}, 422, "41 characters"),
        ({"query": "   "}, 422, "empty"),
        ({"query": "z" * 300}, 413, "request body over 200 bytes"),
        ({"query": "x", "extra": 1}, 422, "extra"),
    ],
)
def test_each_limit_gets_its_status_and_the_next_good_request_is_answered(retriever, body, status, says):
    with client(retriever, max_k=5, max_queries=2, max_query_chars=40, max_body_bytes=200) as http:
        refused = http.post("/search", json=body, headers=AUTH)
        assert refused.status_code == status
        assert says in json.dumps(refused.json())
        assert http.post("/search", json={"query": "cats", "k": 2}, headers=AUTH).status_code == 200


def test_a_body_without_a_declared_length_is_held_to_the_limit_too(retriever: Retriever):
    def chunks():
        yield b'{"query": "'
        yield b"w" * 500
        yield b'"}'

    with client(retriever, max_body_bytes=200) as http:
        refused = http.post("/search", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert refused.status_code == 413


def test_concurrent_requests_share_encoding_batches_and_get_their_own_hits(retriever: Retriever):
    texts = [q["text"] for q in QUERIES] * 4
    alone = retriever.search(texts, k=3)

    async def many() -> tuple[list, int]:
        batcher = MicroBatcher(max_batch=64, max_wait_ms=200)
        await batcher.start()
        answers = await asyncio.gather(*(batcher.search(retriever, [t], 3) for t in texts))
        await batcher.stop()
        return answers, batcher.batches

    answers, batches = asyncio.run(many())
    assert batches < len(texts)  # 16 requests, gathered into fewer encoding batches
    for [hits], own in zip(answers, alone, strict=True):
        assert [h.id for h in hits] == [h.id for h in own]
        assert [h.score for h in hits] == pytest.approx([h.score for h in own], abs=1e-5)


def test_sigterm_lets_requests_in_flight_finish_then_the_service_exits(served, tmp_path: Path):
    # a long wait for company keeps a request in flight when SIGTERM arrives
    process, url = serve_process(served, tmp_path, "--max-wait-ms", "1500")
    try:
        with httpx.Client(timeout=30) as http:
            import threading

            answers: list[httpx.Response] = []
            thread = threading.Thread(
                target=lambda: answers.append(
                    http.post(f"{url}/search", json={"query": "cats"}, headers=AUTH)
                )
            )
            thread.start()
            time.sleep(0.5)
            process.send_signal(signal.SIGTERM)
            thread.join(timeout=30)
        assert answers and answers[0].status_code == 200
        assert answers[0].json()["results"][0]
        # uvicorn ends by re-raising the signal it caught, as a service manager expects
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()


def test_a_bad_index_is_an_error_before_the_port_opens(served, tmp_path: Path, capsys):
    _, _, model = served
    (tmp_path / "not-an-index").mkdir()
    port = free_port()
    code, err, _ = cli(capsys, "serve", model, tmp_path / "not-an-index", "--port", port)
    assert code == 2
    assert "not-an-index" in err and "not an index folder" in err
    with socket.socket() as probe:  # nothing listens on the port
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_without_a_token_it_serves_only_on_loopback(served, capsys, monkeypatch):
    _, index, model = served
    monkeypatch.delenv("DENSEKIT_API_KEY", raising=False)
    code, err, _ = cli(capsys, "serve", model, index, "--host", "0.0.0.0")
    assert code == 2 and "--api-key-file" in err


def test_the_document_store_sits_beside_the_index(served, retriever: Retriever):
    _, index, _ = served
    assert retriever.documents is not None and retriever.documents.path == store_path(index)
    assert store_path(index).name == "index.documents.sqlite"


@pytest.mark.browser
def test_the_search_page_in_a_real_browser_shows_the_first_hit(served, retriever: Retriever, tmp_path: Path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    browser = headless_chromium(tmp_path / "profile")
    process, url = serve_process(served, tmp_path)
    try:
        query = QUERIES[1]["text"]
        browser.get(url + "/")
        browser.find_element(By.ID, "token").send_keys("wrong")
        browser.find_element(By.ID, "query").send_keys(query)
        browser.find_element(By.ID, "go").click()
        status = WebDriverWait(browser, 30).until(
            expected_conditions.text_to_be_present_in_element((By.ID, "status"), "401")
        )
        assert status
        token = browser.find_element(By.ID, "token")
        token.clear()
        token.send_keys(TOKEN)
        browser.find_element(By.ID, "go").click()
        first = WebDriverWait(browser, 30).until(
            expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "li.hit"))
        )
        [expected] = retriever.search(query, k=10)
        assert first.get_attribute("data-id") == expected[0].id
        assert expected[0].title in first.text and expected[0].id in first.text
        assert "ms (search)" in browser.find_element(By.ID, "status").text
        assert len(browser.find_elements(By.CSS_SELECTOR, "li.hit")) == len(expected)
    finally:
        browser.quit()
        process.terminate()
        process.wait(timeout=30)


HOSTILE_TITLE = '<script>window.injected = 1</script><img src="x" onerror="window.injected = 2"><b>bold</b>'


@pytest.mark.browser
def test_the_search_page_shows_markup_in_a_document_as_text(make_beir, tiny_st_model: Path, tmp_path: Path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    corpus = [{"_id": "evil", "title": HOSTILE_TITLE, "text": "<i>cats</i> & dogs </li></ol><h1>big</h1>"}]
    data = make_beir(corpus=corpus, qrels={"test": [("q1", "evil", 1)]})
    encode_corpus(DenseEncoder.load(tiny_st_model), Dataset.open(data), tmp_path / "emb", show_progress=False)
    build_index(EmbeddingStore.open(tmp_path / "emb"), IndexSpec(), tmp_path / "index", show_progress=False)
    browser = headless_chromium(tmp_path / "profile")
    process, url = serve_process((data, tmp_path / "index", tiny_st_model), tmp_path)
    try:
        browser.get(url + "/")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "query").send_keys("cats")
        browser.find_element(By.ID, "go").click()
        hit = WebDriverWait(browser, 30).until(
            expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "li.hit"))
        )
        assert hit.find_element(By.CLASS_NAME, "title").text == HOSTILE_TITLE
        assert hit.find_element(By.CLASS_NAME, "snippet").text == corpus[0]["text"]
        assert browser.execute_script("return window.injected") is None
        for tag in ("script", "img", "b", "i", "h1"):
            assert browser.find_elements(By.CSS_SELECTOR, f"#results {tag}") == []
    finally:
        browser.quit()
        process.terminate()
        process.wait(timeout=30)


def test_threads_sharing_a_retriever_get_what_each_would_alone(retriever: Retriever):
    from concurrent.futures import ThreadPoolExecutor

    texts = [q["text"] for q in QUERIES] * 6
    alone = [retriever.search(t, k=3)[0] for t in texts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda t: retriever.search(t, k=3)[0], texts))
    assert [[h.id for h in hits] for hits in together] == [[h.id for h in hits] for hits in alone]
    assert not retriever.encoder.training


def test_one_service_serves_several_modules_each_with_its_own_index(served, tmp_path: Path):
    from .test_modules import put_module

    data, _, model = served
    encoder = DenseEncoder.load(model).eval()
    indexes = {}
    for name, seed in (("first", 1), ("second", 2)):
        put_module(encoder, "lora", name, seed=seed)
        encode_corpus(encoder, Dataset.open(data), tmp_path / f"emb-{name}", show_progress=False)
        build_index(
            EmbeddingStore.open(tmp_path / f"emb-{name}"), IndexSpec(), tmp_path / name, show_progress=False
        )
        indexes[name] = tmp_path / name
    retrievers = []
    for name in ("first", "second"):
        retrievers.append(Retriever.over(encoder, indexes[name], data, module=name))
    texts = [q["text"] for q in QUERIES]
    expected = {}
    for retriever in retrievers:
        expected[retriever.module] = retriever.search(texts, k=4)
    assert expected["first"] != expected["second"]
    with TestClient(create_app(retrievers, TOKEN)) as http:
        for module in ("second", "first", None):
            body = {"query": texts, "k": 4, **({"module": module} if module else {})}
            response = http.post("/search", json=body, headers=AUTH)
            assert response.status_code == 200, response.text
            own = expected[module or "first"]
            assert [[h["id"] for h in hits] for hits in response.json()["results"]] == [
                [h.id for h in hits] for hits in own
            ]
        unknown = http.post("/search", json={"query": "x", "module": "third"}, headers=AUTH)
        assert unknown.status_code == 422 and "'first', 'second'" in unknown.json()["detail"]
        assert set(http.get("/info", headers=AUTH).json()["modules"]) == {"second"}


@pytest.mark.parametrize("backend", ["onnx", "openvino"])
def test_the_service_answers_through_an_export_as_torch_does(served, retriever: Retriever, backend: str):
    pytest.importorskip(backend)
    data, index, model = served
    exported = Retriever.open(str(model), index, corpus=data, device="cpu")
    use_backend(exported.encoder, backend, "float32", ["query"])
    texts = [q["text"] for q in QUERIES]
    with client(exported) as http:
        response = http.post("/search", json={"query": texts, "k": 8}, headers=AUTH)
        assert http.get("/info", headers=AUTH).json()["backend"] == backend
    assert response.status_code == 200, response.text
    for served_hits, own in zip(response.json()["results"], retriever.search(texts, k=8), strict=True):
        # every document comes back; a random model's scores nearly tie, so compare them by id
        assert {h["id"]: pytest.approx(h["score"], abs=1e-4) for h in served_hits} == {
            h.id: h.score for h in own
        }


def test_the_service_encodes_queries_at_the_precision_it_was_given(retriever: Retriever):
    texts = [q["text"] for q in QUERIES]
    bf16 = retriever.hits(retriever.encode_queries(texts, precision="bf16"), 8)
    float32 = retriever.hits(retriever.encode_queries(texts), 8)
    assert [[h.score for h in hits] for hits in bf16] != [[h.score for h in hits] for hits in float32]
    with TestClient(create_app(retriever, TOKEN, precision="bf16")) as http:
        response = http.post("/search", json={"query": texts, "k": 8}, headers=AUTH)
        assert http.get("/info", headers=AUTH).json()["query_precision"] == "bf16"
    assert response.status_code == 200, response.text
    for served_hits, own in zip(response.json()["results"], bf16, strict=True):
        assert {h["id"]: h["score"] for h in served_hits} == {
            h.id: pytest.approx(h.score, abs=1e-6) for h in own
        }


def test_serve_refuses_a_precision_its_backend_lacks(served, capsys):
    _, index, model = served
    code, err, _ = cli(capsys, "serve", model, index, "--backend", "onnx", "--precision", "bf16")
    assert code == 2 and "--backend onnx runs float32 or int8, not bf16" in err
    code, err, _ = cli(capsys, "serve", model, index, "--backend", "openvino", "--precision", "int8")
    assert code == 2 and "is calibrated on a corpus's texts, and serve encodes queries" in err
    code, err, _ = cli(capsys, "serve", model, index, "--precision", "fp16", "--device", "cpu")
    assert code == 2 and "fp16 needs a GPU" in err


def test_serve_picks_bf16_only_where_the_cpu_computes_it(served, tmp_path: Path):
    from densekit.device import fastest_precision

    cpu = torch.device("cpu")
    assert fastest_precision(cpu, {"avx2", "avx512f", "avx512_bf16"})[0] == "bf16"
    assert fastest_precision(cpu, {"avx2", "amx_bf16"})[0] == "bf16"
    assert fastest_precision(cpu, {"avx2", "avx512f", "avx512_vnni"})[0] == "float32"
    process, url = serve_process(served, tmp_path)  # --precision auto, the default
    try:
        info = httpx.get(f"{url}/info", headers=AUTH, timeout=30).json()
    finally:
        process.terminate()
        process.wait(timeout=30)
    chosen, reason = fastest_precision(cpu)
    assert (info["query_precision"], info["precision_reason"]) == (chosen, f"auto: {reason}")
    assert info["backend"] == "torch"


def test_serve_refuses_a_queue_smaller_than_one_request(served, capsys):
    _, index, model = served
    code, err, _ = cli(capsys, "serve", model, index, "--max-queued", "16")
    assert code == 2 and "--max-queued 16 is below --max-queries 64" in err


def test_serve_mmap_index_maps_the_index_and_answers_as_one_read_in(served, retriever, tmp_path: Path):
    process, url = serve_process(served, tmp_path, "--mmap-index", "--precision", "float32")
    texts = [q["text"] for q in QUERIES]
    try:
        info = httpx.get(f"{url}/info", headers=AUTH, timeout=30).json()
        answer = httpx.post(f"{url}/search", json={"query": texts, "k": 4}, headers=AUTH, timeout=30).json()
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert info["index"]["memory_mapped"] is True and retriever.index.mmap is False
    for served_hits, own in zip(answer["results"], retriever.search(texts, k=4), strict=True):
        assert [h["id"] for h in served_hits] == [h.id for h in own]
        assert [h["score"] for h in served_hits] == pytest.approx([h.score for h in own], abs=1e-6)
