"""densekit: train, index, evaluate and serve dense text retrievers."""

from densekit.client import Client
from densekit.version import __version__

__all__ = ["Client", "__version__"]
