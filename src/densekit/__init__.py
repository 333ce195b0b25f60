"""densekit: train, index, evaluate and serve dense text retrievers."""

__version__ = "0.1.0"
