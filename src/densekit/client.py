"""A Python client of `densekit serve`: search, documents, embeddings, with the service's errors raised
as `ServiceError` and its 429 and 503 answers retried after the delay the service asks for."""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import httpx
import numpy as np

from densekit.retrieval.hit import Hit

RETRIED = (429, 503)  # overload and request timeout: the service says when to come back


class ServiceError(RuntimeError):
    """A request the service refused or failed: its status code and the reason it gave."""

    def __init__(self, status: int, detail: str, url: str):
        super().__init__(f"{url}: {status}: {detail}")
        self.status, self.detail = status, detail


class Client:
    """Calls a densekit service at `url` (e.g. `http://127.0.0.1:8000`) with its bearer `token`.

    A 429 (busy) or 503 (request timed out) is retried up to `retries` times, each after the service's
    `Retry-After` (at most `max_wait` seconds); any other refusal raises `ServiceError` at once. `http`
    replaces the HTTP client (an `httpx.Client`, such as FastAPI's TestClient)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        max_wait: float = 30.0,
        http: httpx.Client | None = None,
    ):
        if retries < 0:
            raise ValueError(f"retries {retries} must be >= 0")
        self.url = url.rstrip("/")
        self.retries, self.max_wait = retries, max_wait
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = http if http is not None else httpx.Client(timeout=timeout)
        self._headers = headers
        self._model: str | None = None  # the service's model name, asked once

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    def search(
        self, queries: str | list[str], k: int = 10, module: str | None = None, domain: str | None = None
    ) -> list[list[Hit]]:
        """Ranked hits for each query (a single text is a list of one), by `module` (default: the
        service's first) or, through a fixed route, for `domain`."""
        body: dict[str, Any] = {"query": queries, "k": k}
        if module is not None:
            body["module"] = module
        if domain is not None:
            body["domain"] = domain
        answer = self._call("POST", "/search", body)
        return [[Hit(**hit) for hit in hits] for hits in answer["results"]]

    def document(self, doc_id: str) -> Hit:
        """A document of the served corpus by id (score 0); `ServiceError` 404 for an unknown id."""
        return Hit(**self._call("GET", f"/documents/{doc_id}"))

    def embed(
        self, texts: list[str], kind: Literal["query", "passage"] = "passage", model: str | None = None
    ) -> np.ndarray:
        """The vectors the service gives `texts` as queries or passages, float32 (len(texts), dimension);
        `model` names a served module (default: the service's model)."""
        if model is None:
            if self._model is None:
                self._model = self.info()["embedding_models"][0]
            model = self._model
        body = {"input": texts, "model": f"{model}:{kind}", "encoding_format": "base64"}
        data = self._call("POST", "/v1/embeddings", body)["data"]
        rows = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in data]
        return np.stack(rows) if rows else np.empty((0, 0), dtype=np.float32)

    def info(self) -> dict:
        """The service's model, modules, index, documents, precision and limits."""
        return self._call("GET", "/info")

    def health(self) -> bool:
        """Whether the service answers."""
        try:
            return self._http.get(f"{self.url}/health").status_code == 200
        except httpx.TransportError:
            return False

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        for attempt in range(self.retries + 1):
            response = self._http.request(method, f"{self.url}{path}", json=body, headers=self._headers)
            if response.status_code not in RETRIED or attempt == self.retries:
                break
            time.sleep(min(self.max_wait, _retry_after(response)))
        if response.status_code != 200:
            raise ServiceError(response.status_code, _detail(response), f"{self.url}{path}")
        return response.json()


def _retry_after(response: httpx.Response) -> float:
    """The seconds a 429 or 503 asks the client to wait (1 when it does not say in seconds)."""
    try:
        return max(0.0, float(response.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


def _detail(response: httpx.Response) -> str:
    """The reason an error response gives, in densekit's shape or OpenAI's."""
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    if isinstance(body, dict) and "detail" in body:
        return body["detail"] if isinstance(body["detail"], str) else str(body["detail"])
    return response.text
