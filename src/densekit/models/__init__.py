"""Dense encoders over Hugging Face and sentence-transformers model folders.

The names load on first use, so that importing `densekit.models.config` (as the command line does for
its options) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from densekit.models.config import EncoderConfig
    from densekit.models.encoder import DenseEncoder
    from densekit.models.hub import resolve_model_path

__all__ = ["DenseEncoder", "EncoderConfig", "resolve_model_path"]
_WHERE = {"DenseEncoder": "encoder", "EncoderConfig": "config", "resolve_model_path": "hub"}


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"densekit.models.{_WHERE[name]}"), name)
