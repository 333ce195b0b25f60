"""How the service answers what refuses a request: one table (`ERRORS`) of each exception it raises or
lets FastAPI raise, with its status and what it says, from which every exception handler is registered
(`register`); and the error's shape, densekit's `{"detail": ...}` or OpenAI's under `/v1/`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.utils import is_body_allowed_for_status_code
from starlette.exceptions import HTTPException

from densekit.models.dimensions import DimensionsError
from densekit.retrieval.documents import DocumentsUnavailable
from densekit.retrieval.retriever import IndexChanged
from densekit.serving import openai_api
from densekit.serving.batcher import Overloaded, TimedOut, Unencodable
from densekit.serving.checks import LimitError, bounded_problems, shortened

OPENAI_PREFIX = "/v1/"


def _no_headers(_: Any) -> dict[str, str] | None:
    return None


def _retry_after(err: Any) -> dict[str, str]:
    return {"Retry-After": str(err.retry_after)}


def _described(problems: list[dict[str, Any]]) -> str:
    """Validation problems on one line, as OpenAI's error message holds them."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in problems)


@dataclass(frozen=True)
class ErrorAnswer:
    """How one kind of exception is answered: `status` (None: the exception's own `status_code`), the
    `detail` of densekit's shape (a message, or the validation problems), the `message` of OpenAI's
    (None: the detail as text) and the `headers` it carries."""

    status: int | None = None
    detail: Callable[[Any], Any] = str
    message: Callable[[Any], str] | None = None
    headers: Callable[[Any], dict[str, str] | None] = field(default=_no_headers)

    def response(self, path: str, err: Any) -> Response:
        """The answer to a request for `path` that raised `err`."""
        status = self.status if self.status is not None else err.status_code
        detail = self.detail(err)
        message = self.message(err) if self.message is not None else None
        return error_response(path, detail, status, self.headers(err), message)


ERRORS: dict[type[Exception], ErrorAnswer] = {
    LimitError: ErrorAnswer(422),  # a limit passed, or a module or domain not served
    Unencodable: ErrorAnswer(422),  # a text the tokenizer refused
    openai_api.UnknownModel: ErrorAnswer(404),
    DimensionsError: ErrorAnswer(400),  # `dimensions` above the vectors served, or not trained for
    Overloaded: ErrorAnswer(429, headers=_retry_after),  # the queue is full: come back then
    TimedOut: ErrorAnswer(503, headers=_retry_after),  # not answered within --request-timeout
    IndexChanged: ErrorAnswer(503),  # a mapped index file changed under the service
    DocumentsUnavailable: ErrorAnswer(503),
    # 401, 404, 405, 413 while reading: their own status and headers
    HTTPException: ErrorAnswer(detail=lambda err: err.detail, headers=lambda err: err.headers),
    RequestValidationError: ErrorAnswer(422, detail=lambda err: bounded_problems(err.errors()),
                                        message=lambda err: _described(bounded_problems(err.errors()))),
}  # fmt: skip


def register(app: FastAPI) -> None:
    """Answer every exception of `ERRORS` as the table says."""
    for kind, answer in ERRORS.items():
        app.add_exception_handler(kind, _handler(answer))


def _handler(answer: ErrorAnswer) -> Callable[[Request, Exception], Any]:
    async def handle(request: Request, err: Exception) -> Response:
        return answer.response(request.url.path, err)

    return handle


def error_response(path: str, detail: Any, status: int, headers: dict[str, str] | None = None,
                   message: str | None = None) -> Response:  # fmt: skip
    """The error answer to a request for `path`: OpenAI's shape under /v1/ (`message`, or `detail` as
    text), densekit's elsewhere (`{"detail": detail}`); a message cut to a bounded length, and no body
    where the status allows none."""
    if not is_body_allowed_for_status_code(status):
        return Response(status_code=status, headers=headers)
    if path.startswith(OPENAI_PREFIX):
        text = shortened(message if message is not None else str(detail))
        return JSONResponse(openai_api.error_body(text, status), status_code=status, headers=headers)
    return JSONResponse({"detail": shortened(detail) if isinstance(detail, str) else detail},
                        status_code=status, headers=headers)  # fmt: skip
