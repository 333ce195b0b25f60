"""What one service serves, made once by `create_app` and shared by its route modules (`routes`)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI
from fastapi.params import Depends as Dependency
from fastapi.security import HTTPBearer

from densekit.device import Precision
from densekit.errors import InputError
from densekit.retrieval.retriever import Retriever
from densekit.serving import openai_api
from densekit.serving.batcher import MicroBatcher, default_workers
from densekit.serving.bearer import BearerToken
from densekit.serving.checked_route import CheckedRoute
from densekit.serving.checks import LimitError, shown
from densekit.serving.direct_route import DirectRoute
from densekit.serving.metrics import ServiceMetrics
from densekit.serving.settings import Batching, Limits


class SearchService:
    """The retrievers served (one, or several sharing one encoder, each with its own module and index;
    the first answers requests that name no module), the model names of the embeddings API, the limits,
    the micro-batcher that encodes under `precision`'s autocast (chosen for `precision_reason`), the
    metrics, and the bearer token with the route classes that check it before a body is read."""

    def __init__(self, retrievers: Retriever | list[Retriever], api_key: str | None, limits: Limits,
                 batching: Batching, precision: Precision, model_name: str | None, open_metrics: bool,
                 precision_reason: str | None) -> None:  # fmt: skip
        self.served = [retrievers] if isinstance(retrievers, Retriever) else list(retrievers)
        self.by_module = {r.module: r for r in self.served}
        if len(self.by_module) != len(self.served):
            raise InputError("two retrievers of the same module: serve each module once")
        self.retriever = retriever = self.served[0]
        self.limits, self.batching, self.precision = limits, batching, precision
        self.precision_reason, self.open_metrics = precision_reason, open_metrics
        self.embedding_names = openai_api.served_names(model_name or retriever.encoder.source, self.served)
        self.metrics = metrics = ServiceMetrics()
        self.batcher = batcher = MicroBatcher(
            batching.max_batch, batching.max_wait_ms, precision, limits.max_queued, limits.request_timeout_s,
            metrics.observe_batch, batching.encode_batch, batching.workers or default_workers(retriever),
        )  # fmt: skip
        metrics.queued.set_function(lambda: batcher.queued)
        metrics.documents.set(len(retriever.documents) if retriever.documents is not None else 0)
        for each in self.served:
            metrics.index_vectors.labels(str(each.module or "")).set(each.index.rows)
        token = BearerToken(api_key)
        # the token is checked before a body is read (`CheckedRoute`); HTTPBearer, which checks nothing
        # here, describes it in the API's description
        self.authorised: list[Dependency] = [Depends(HTTPBearer(auto_error=False))]
        self.checked = functools.partial(CheckedRoute, check=token.check)
        # the two routes that answer under load: FastAPI's handling of the requests it would accept, skipped
        self.direct = functools.partial(DirectRoute, admits=token.as_written, check=token.check)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """The micro-batcher's workers, for as long as the app runs."""
        await self.batcher.start()
        yield
        await self.batcher.stop()

    def retriever_of(self, module: str | None) -> Retriever:
        """The retriever of `module` (None: the default one); one not served is a `LimitError`."""
        chosen = self.retriever if module is None else self.by_module.get(module)
        if chosen is None:
            names = ", ".join(repr(name) for name in self.by_module if name is not None) or "none"
            raise LimitError(f"module {shown(module)} is not served here (modules served: {names})")
        return chosen

    def info(self) -> dict:
        """The model, the width of its vectors served (`dimension`), the `--dimensions` they are cut to
        (None: none) and the widths the model was trained for (`matryoshka_dims`, None: not recorded),
        the module and index that answer by default, the other modules served, the documents, the
        precision texts are encoded at and why, the embeddings API's model names, the limits, the
        batching and the threads the model computes on."""
        retriever = self.retriever
        runtime = retriever.encoder.runtime
        return {
            "model": retriever.encoder.source,
            "dimension": retriever.encoder.dimension,
            "dimensions": retriever.encoder.config.dimensions,
            "matryoshka_dims": retriever.encoder.config.matryoshka_dims,
            "active_module": retriever.module,
            "route": None if retriever.route is None else retriever.route.spec.model_dump(),
            "index": _index_info(retriever),
            "modules": {str(r.module): _index_info(r) for r in self.served[1:]},
            "documents": len(retriever.documents) if retriever.documents is not None else None,
            "documents_unavailable": retriever.documents.unavailable if retriever.documents else None,
            "query_precision": runtime.precision if runtime is not None else self.precision,
            "precision_reason": self.precision_reason,
            "backend": runtime.backend if runtime is not None else "torch",
            "embedding_models": openai_api.model_list(self.embedding_names),
            "limits": self.limits.model_dump(),
            "batching": self.batching.model_dump() | {"workers": self.batcher.workers},
            "threads": self.batcher.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        }


def _index_info(retriever: Retriever) -> dict:
    index = retriever.index
    return {
        "type": index.meta.get("backend", index.spec.type),
        "rows": index.rows,
        "folder": str(index.folder),
        "memory_mapped": getattr(index, "mmap", False),
    }
