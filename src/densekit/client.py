"""A Python client of `densekit serve`: search, documents, embeddings, with the service's errors raised
as `ServiceError` and its 429 and 503 answers retried after the delay the service asks for."""

from __future__ import annotations

import base64
import binascii
import email.utils
import math
import re
import time
from datetime import datetime, timezone
from typing import Any, Literal
from urllib.parse import quote

import httpx
import numpy as np
from pydantic import BaseModel, ValidationError

from densekit.errors import DensekitError
from densekit.retrieval.hit import Hit

RETRIED = (429, 503)  # overload and request timeout: the service says when to come back
_DETAIL_CHARS = 300  # of a reason the service gave, in a `ServiceError`
_TOKEN = re.compile(r"[\x20-\x7e]+")  # what an HTTP header carries as it is: printable ASCII


class ServiceError(DensekitError, RuntimeError):
    """A request the service refused or failed: its status code (0 where no answer came: the service
    could not be reached, or the URL is not one) and the reason, on one line."""

    def __init__(self, status: int, detail: str, url: str):
        detail = _one_line(detail)
        super().__init__(f"{url}: {status}: {detail}")
        self.status, self.detail = status, detail


class ClientSettingError(DensekitError, ValueError):
    """A setting of `Client` it cannot work with, refused when the client is made."""


class _HitIn(BaseModel):
    """One hit as the service sends it."""

    id: str
    score: float
    title: str | None = None
    text: str | None = None


class _SearchAnswer(BaseModel):
    results: list[list[_HitIn]]


class _EmbeddingIn(BaseModel):
    embedding: str
    index: int


class _EmbeddingsAnswer(BaseModel):
    data: list[_EmbeddingIn]


class Client:
    """Calls a densekit service at `url` (e.g. `http://127.0.0.1:8000`) with its bearer `token`.

    A 429 (busy) or 503 (request timed out) is retried up to `retries` times, each after the service's
    `Retry-After` (at most `max_wait` seconds); any other refusal, an answer that is not the service's
    (not JSON, or not of the shape asked for), a redirect, a timeout (`timeout` seconds) or a service that
    cannot be reached raises `ServiceError` at once; so does a `url` that is not an http(s) URL with a host,
    or holds a user name or password (which httpx would send in place of the token), when the client is
    made (status 0). A token an HTTP header cannot carry (a line break, a control character, non-ASCII
    text), a `timeout` that is not a number of seconds above 0, a `max_wait` below 0 and `retries` that
    are not a whole number from 0 are a `ClientSettingError` (a `ValueError`) when the client is made.
    `http` replaces the HTTP client (an `httpx.Client`, such as FastAPI's TestClient); the token goes only
    to `url`'s host."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        max_wait: float = 30.0,
        http: httpx.Client | None = None,
    ):
        _check_settings(timeout, retries, max_wait)
        if token and not _TOKEN.fullmatch(token):
            raise ClientSettingError("token: holds a line break, a control character or non-ASCII text, "
                                     "which an HTTP header cannot carry: give the token alone")  # fmt: skip
        self.url = _service_url(url)
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
        answer = self._shaped(_SearchAnswer, self._call("POST", "/search", body), "/search")
        return [[Hit(**hit.model_dump()) for hit in hits] for hits in answer.results]

    def document(self, doc_id: str) -> Hit:
        """A document of the served corpus by id (score 0); `ServiceError` 404 for an unknown id. The id
        is sent escaped, so any id (one holding `/`, `?`, `#`, `%` or spaces) names only itself."""
        path = f"/documents/{_path_segment(doc_id)}"
        return Hit(**self._shaped(_HitIn, self._call("GET", path), path).model_dump())

    def embed(
        self,
        texts: list[str],
        side: Literal["query", "passage"] = "passage",
        model: str | None = None,
        domain: str | None = None,
    ) -> np.ndarray:
        """The vectors the service gives `texts` as queries or passages, float32 (len(texts), dimension);
        `model` names a served module (default: the service's model), `domain` the queries' domain
        for a service of a fixed route."""
        if model is None:
            if self._model is None:
                models = self.info().get("embedding_models")
                if not isinstance(models, list) or not models or not isinstance(models[0], str):
                    raise ServiceError(200, "/info names no embedding models", f"{self.url}/info")
                self._model = models[0]
            model = self._model
        name = f"{model}:{side}" + (f"@{domain}" if domain is not None else "")
        body = {"input": texts, "model": name, "encoding_format": "base64"}
        answer = self._shaped(_EmbeddingsAnswer, self._call("POST", "/v1/embeddings", body), "/v1/embeddings")
        return _vectors(answer, len(texts), f"{self.url}/v1/embeddings")

    def info(self) -> dict:
        """The service's model, modules, index, documents, precision and limits."""
        answer = self._call("GET", "/info")
        if not isinstance(answer, dict):
            raise ServiceError(200, f"unexpected answer: {_one_line(repr(answer))}", f"{self.url}/info")
        return answer

    def health(self) -> bool:
        """Whether the service answers."""
        try:
            return self._http.get(f"{self.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        url = f"{self.url}{path}"
        for attempt in range(self.retries + 1):
            response = self._send(method, url, body)
            if response.status_code not in RETRIED or attempt == self.retries:
                break
            time.sleep(min(self.max_wait, _retry_after(response)))
        if response.is_redirect:
            where = response.headers.get("Location", "elsewhere")
            reason = f"redirected to {where}: give the service's own URL"
            raise ServiceError(response.status_code, reason, url)
        if response.status_code != 200:
            raise ServiceError(response.status_code, _detail(response), url)
        try:
            return response.json()
        except ValueError:
            raise ServiceError(200, f"the answer is not JSON: {response.text!r}", url) from None

    def _send(self, method: str, url: str, body: dict | None) -> httpx.Response:
        """One request; what stops an answer coming is a `ServiceError` of status 0."""
        try:
            return self._http.request(method, url, json=body, headers=self._headers)
        except httpx.TimeoutException as err:
            reason = f"no answer within the timeout ({str(err) or type(err).__name__})"
            raise ServiceError(0, reason, url) from None
        except (httpx.HTTPError, httpx.InvalidURL) as err:
            reason = str(err) or type(err).__name__
            raise ServiceError(0, f"the service cannot be reached: {reason}", url) from None

    def _shaped(self, shape: type[BaseModel], answer: Any, path: str) -> Any:
        """`answer` read as `shape`, or a `ServiceError` saying what it lacks."""
        try:
            return shape.model_validate(answer)
        except ValidationError as err:
            problem = err.errors()[0]
            where = ".".join(str(p) for p in problem["loc"]) or "the answer"
            reason = f"unexpected answer: {where}: {problem['msg']}"
            raise ServiceError(200, reason, f"{self.url}{path}") from None


def _check_settings(timeout: object, retries: object, max_wait: object) -> None:
    """Refuse settings the client cannot work with: httpx took a timeout of 0 as one passed at once (a
    service "that cannot be reached") and raised its own ValueError for -1 or NaN at the first request."""

    def number(value: object) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

    if not (number(timeout) and timeout > 0):  # type: ignore[operator]
        raise ClientSettingError(f"timeout={timeout!r}: give a number of seconds above 0")
    if not (number(max_wait) and max_wait >= 0):  # type: ignore[operator]
        raise ClientSettingError(f"max_wait={max_wait!r}: give a number of seconds, 0 or more")
    if not (isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0):
        raise ClientSettingError(f"retries={retries!r}: give a whole number, 0 or more")


def _service_url(url: str) -> str:
    """`url` without a trailing slash, once it is an http(s) URL with a host and no query or fragment."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as err:
        raise ServiceError(0, f"not a URL: {err}", str(url)) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ServiceError(0, "not an http(s) URL with a host: give e.g. http://127.0.0.1:8000", url)
    if parsed.userinfo:  # httpx would send them as Basic authorisation, in place of the bearer token
        shown = str(parsed.copy_with(userinfo=b""))  # the password left out of the message
        raise ServiceError(0, "the URL holds a user name or password, which would be sent in place of the "
                           "token: give the URL without them, and the token as `token`", shown)  # fmt: skip
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ServiceError(0, f"port {parsed.port}: a port is 1 to 65535", url)
    if parsed.query or parsed.fragment:
        raise ServiceError(0, "give the service's URL without a query or fragment", url)
    return url.rstrip("/")


def _path_segment(doc_id: str) -> str:
    """`doc_id` escaped as one path segment: every reserved character percent-encoded, and a whole `.`
    or `..` too (which URL normalisation would otherwise resolve as the folder or its parent)."""
    escaped = quote(doc_id, safe="")
    return escaped.replace(".", "%2E") if escaped in (".", "..") else escaped


def _vectors(answer: _EmbeddingsAnswer, count: int, url: str) -> np.ndarray:
    """The float32 rows of an embeddings answer, one per text in order, checked to be whole and alike."""
    if sorted(item.index for item in answer.data) != list(range(count)):
        raise ServiceError(200, f"{len(answer.data)} embeddings, not one each for {count} texts", url)
    rows = []
    for item in sorted(answer.data, key=lambda item: item.index):
        try:
            raw = base64.b64decode(item.embedding, validate=True)
        except (binascii.Error, ValueError):
            raise ServiceError(200, f"embedding {item.index} is not base64", url) from None
        if len(raw) % 4:
            raise ServiceError(200, f"embedding {item.index}: {len(raw)} bytes, not whole float32s", url)
        rows.append(np.frombuffer(raw, dtype="<f4"))
    if len({len(row) for row in rows}) > 1:
        raise ServiceError(200, f"embeddings of several sizes: {sorted({len(row) for row in rows})}", url)
    return np.stack(rows) if rows else np.empty((0, 0), dtype=np.float32)


def _retry_after(response: httpx.Response) -> float:
    """The seconds a 429 or 503 asks the client to wait: its Retry-After in seconds or as an HTTP date,
    never below 0; 1 when it says neither (or NaN)."""
    value = response.headers.get("Retry-After", "1").strip()
    try:
        seconds = float(value)
    except ValueError:
        seconds = _seconds_until(value)
    return 1.0 if math.isnan(seconds) else max(0.0, seconds)


def _seconds_until(date: str) -> float:
    """Seconds from now until an HTTP date, or NaN for text that is none."""
    try:
        when = email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError, IndexError):
        return math.nan
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return (when - datetime.now(timezone.utc)).total_seconds()


def _detail(response: httpx.Response) -> str:
    """The reason an error response gives, in densekit's shape or OpenAI's."""
    try:
        body = response.json()
    except ValueError:
        return response.text or response.reason_phrase
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    if isinstance(body, dict) and "detail" in body:
        return body["detail"] if isinstance(body["detail"], str) else str(body["detail"])
    return response.text


def _one_line(text: str) -> str:
    """`text` on one line of at most _DETAIL_CHARS characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= _DETAIL_CHARS else f"{line[:_DETAIL_CHARS]}... ({len(line)} characters)"
