"""The service under test: in-process (a TestClient) or as its own `densekit serve` process, over the
`served` collection and `retriever` fixtures of conftest."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from densekit.retrieval.retriever import Retriever
from densekit.serving.app import Limits, create_app
from densekit.serving.http_server import Server, server_config

if TYPE_CHECKING:
    import uvicorn

    from densekit.serving.connections import ConnectionLimits

TOKEN = "s3cret-token"


def client(retriever: Retriever, **limits) -> TestClient:
    """The service over `retriever` with the test token and `limits`, in this process."""
    return TestClient(create_app(retriever, TOKEN, Limits(**limits)))


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(served, tmp_path: Path, *extra: str, token: bool = True,
                  preexec_fn: Callable[[], None] | None = None) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """`densekit serve` over the `served` collection with the test token (unless not `token`) and `extra`
    options, in its own process (`preexec_fn` run in it before it starts), once /health answers; returns
    the process and the service's URL."""
    data, index, model = served
    (tmp_path / "key").write_text(TOKEN + "\n")
    port = free_port()
    key = ["--api-key-file", str(tmp_path / "key")] if token else []
    command = [sys.executable, "-m", "densekit", "serve", str(model), str(index), "--corpus", str(data),
               "--port", str(port), *key, "--device", "cpu", *extra]  # fmt: skip
    environment = {name: value for name, value in os.environ.items() if name != "DENSEKIT_API_KEY"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment, preexec_fn=preexec_fn)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            if process.poll() is not None:
                raise AssertionError(process.stdout.read()) from None
            time.sleep(0.1)
    process.kill()
    raise AssertionError("the service did not start")


# Document ids a URL path cannot carry as they are.
ODD_IDS = ["a/b", "a//b", "d1?x=1", "../info", "x/../d1", "100%", "a%2Fb", "c#1", "ünïcødé", "..", ".", "d1"]


def odd_ids_collection(root: Path, model: Path) -> tuple[Path, Path]:
    """A collection whose documents have ODD_IDS, and its flat index by `model`: (data, index)."""
    from densekit.data.dataset import Dataset
    from densekit.encoding.corpus import encode_corpus
    from densekit.encoding.store import EmbeddingStore
    from densekit.index import IndexSpec, build_index
    from densekit.models import DenseEncoder

    from .conftest import write_beir

    corpus = [{"_id": doc_id, "title": f"title of {doc_id}", "text": f"text {n}"}
              for n, doc_id in enumerate(ODD_IDS)]  # fmt: skip
    data = write_beir(root / "data", corpus=corpus, qrels={"test": [("q1", "d1", 1)]})
    encode_corpus(DenseEncoder.load(model), Dataset.open(data), root / "emb", show_progress=False)
    build_index(EmbeddingStore.open(root / "emb"), IndexSpec(), root / "index", show_progress=False)
    return data, root / "index"


@contextlib.contextmanager
def in_thread(app: FastAPI, limits: ConnectionLimits | None = None) -> Iterator[str]:
    """`app` served by uvicorn from a thread of this process on a free port, for what only a real
    server shows (its HTTP parser, raw paths, connections), with the connection `limits` given (or
    `serve`'s): its URL."""
    port = free_port()
    with running(server_config(app, "127.0.0.1", port, limits)):  # as `densekit serve` runs it
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def running(config: uvicorn.Config) -> Iterator[None]:
    """A uvicorn server with `config`, run from a thread of this process as `serve` runs it, until the
    block ends."""
    server = Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(300):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.02)
    if not server.started:
        raise AssertionError("uvicorn did not start")
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def headless_chromium(profile: Path, *extra_arguments: str, log_requests: bool = False):
    """Headless chromium through selenium (a fresh profile in `profile`), with `extra_arguments` and,
    with `log_requests`, a performance log of every request it sends; where the browser is missing, a
    skip saying what to install, or a failure in CI (`CI=true`), where .ci/run installs it."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        import pytest

        missing = "the browser test needs Debian's chromium and chromium-driver (apt install them)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{missing}: CI installs them, so their absence is a fault of the CI set-up")
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # this machine has no network: chromium's own background connections are turned off, not refused
    arguments = ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,900",
                 "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                 *extra_arguments]  # fmt: skip
    for argument in arguments:
        options.add_argument(argument)
    if log_requests:
        options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)
