"""densekit: train, index, evaluate and serve dense text retrievers.

The names load on first use, so that importing any module of densekit (`densekit.errors`, the ground
floor, or the command line's entry) runs only what that module imports: not the HTTP client, httpx,
numpy and pydantic that `Client` needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from densekit.client import Client
    from densekit.version import __version__

__all__ = ["Client", "__version__"]
_WHERE = {"Client": "client", "__version__": "version"}


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"densekit.{_WHERE[name]}"), name)
