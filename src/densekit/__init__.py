"""densekit: train, index, evaluate and serve dense text retrievers."""

from densekit.client import Client

__version__ = "0.1.0"
__all__ = ["Client"]
