"""Dense encoders over Hugging Face and sentence-transformers model folders."""

from densekit.models.config import EncoderConfig
from densekit.models.encoder import DenseEncoder
from densekit.models.hub import resolve_model_path

__all__ = ["DenseEncoder", "EncoderConfig", "resolve_model_path"]
