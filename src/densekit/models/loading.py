"""Loading a transformers checkpoint with densekit's own account of what was missing.

transformers prints a load report for every checkpoint whose weights do not fill the class asked for:
a sentence-transformers encoder loaded for masked-LM pre-training is called "corrupted" (it has no
MLM head, whose bias cannot be tied), and a pre-training export loaded as an encoder reports its
missing pooler, which densekit never uses. Its report is silenced for the load and the caller says
what matters, once, in densekit's log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel
from transformers.utils import logging as transformers_logging


@dataclass(frozen=True)
class LoadReport:
    """The model's weights the checkpoint lacked (newly initialised) and the checkpoint's tensors the
    model has no place for, sorted."""

    missing: list[str]
    unexpected: list[str]


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(level)


def load_pretrained(
    auto_class: type, path: str | Path, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, LoadReport]:
    """`auto_class.from_pretrained(path)` without transformers' load report, and what it would report."""
    with _transformers_quiet():
        model, info = auto_class.from_pretrained(
            path, trust_remote_code=trust_remote_code, output_loading_info=True
        )
    return model, LoadReport(sorted(info["missing_keys"]), sorted(info["unexpected_keys"]))
