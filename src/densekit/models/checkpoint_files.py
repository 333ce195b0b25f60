"""Loading a transformers checkpoint with densekit's own account of what was missing.

transformers prints a load report for every checkpoint whose weights do not fill the class asked for:
a sentence-transformers encoder loaded for masked-LM pre-training is called "corrupted" (it has no
MLM head, whose bias cannot be tied), and a pre-training export loaded as an encoder reports its
missing pooler, which densekit never uses. Its report is silenced for the load and the caller says
what matters, once, in densekit's log.

Before transformers reads a local folder, `check_model_files` refuses in one line what it would load
unsafely or fail on with a long traceback: a pickled checkpoint (unpickling runs code), a config.json
that is not a JSON object, custom code named without --trust-remote-code. `read_safetensors` reads a
module's own weights file, refusing a damaged one by name.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import safetensors.torch
import torch
import yaml
from pydantic import BaseModel, ValidationError
from safetensors import SafetensorError
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from densekit.diagnostics import DataError, Problem

CONFIG = "config.json"
MODEL_KINDS = ("model", "cross-encoder")  # the kinds of densekit folder that hold a transformers model
MAX_JSON_BYTES = 16 << 20  # a model's config.json is a few KB; one with 20k labels about 1 MB
# checkpoints torch.load unpickles; densekit never does (a pickle runs any code it names)
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_TOKENIZER_BYTES = 256 << 20  # the largest tokenizer.json on the hub is some 35 MB
ModelT = TypeVar("ModelT", bound=BaseModel)
_HEADER_LENGTH = 8  # a safetensors file starts with its JSON header's length, 8 bytes little-endian


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
    auto_class: type, path: str | Path, trust_remote_code: bool = False, **options: Any
) -> tuple[PreTrainedModel, LoadReport]:
    """`auto_class.from_pretrained(path, **options)` from safetensors only, without transformers' load
    report, and what it would report; a local folder is checked first (`check_model_files`)."""
    check_model_files(path, trust_remote_code)
    with _transformers_quiet():
        model, info = auto_class.from_pretrained(
            path, trust_remote_code=trust_remote_code, output_loading_info=True, use_safetensors=True,
            **options,
        )  # fmt: skip
    return model, LoadReport(sorted(info["missing_keys"]), sorted(info["unexpected_keys"]))


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(path)`, a local folder's JSON files checked first: transformers
    names neither the file nor the line of one that is not JSON."""
    folder = Path(path)
    if folder.is_dir():
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                read_json_object(folder / name, MAX_TOKENIZER_BYTES)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, source: str | Path) -> None:
    """Refuse a tokenizer that gives ids the model has no embedding for: the first text holding such a
    token would stop the run with an index error."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        message = f"its tokenizer has {len(tokenizer)} tokens and the model embeds {rows}: another model's?"
        raise DataError([Problem(Path(source), None, message)])


def read_json_file(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in `path`; `DataError` naming the file (and the line) when it is larger than
    `max_bytes`, not UTF-8 or not JSON."""
    size = path.stat().st_size
    if size > max_bytes:
        raise DataError([Problem(path, None, f"{size} bytes: larger than the {max_bytes} a JSON file "
                                             "of a model may have")])  # fmt: skip
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError([Problem(path, None, "not UTF-8 text")]) from None
    except json.JSONDecodeError as err:
        raise DataError([Problem(path, err.lineno, f"malformed JSON: {err.msg}")]) from None
    except RecursionError:
        raise DataError([Problem(path, None, "JSON nested too deeply")]) from None


def read_json_object(path: Path, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """`read_json_file`, which must hold a JSON object."""
    value = read_json_file(path, max_bytes)
    if not isinstance(value, dict):
        raise DataError([Problem(path, None, f"a JSON {type(value).__name__} where an object is expected")])
    return value


def validated_file(path: Path, model: type[ModelT]) -> ModelT:
    """The JSON object in `path` as `model`; each invalid value is named with the file and the line of
    its key (as config files' are), never as pydantic's dump."""
    from densekit.configuration import key_lines, validate_config

    value = read_json_object(path)
    try:
        return model.model_validate(value)
    except ValidationError:
        pass
    try:
        lines = key_lines(path)  # JSON is YAML, which knows where each key is
    except (yaml.YAMLError, DataError):
        lines = {}
    return validate_config(value, model, path, (), lines)


def check_artefact_kind(path: str | Path, wanted: str, hints: dict[str, str] | None = None) -> None:
    """Refuse, naming what it is, a folder densekit made as something other than a model (a module,
    a route, an index, embeddings, a training run...) where `wanted` (words: "a model folder") is
    expected; `hints` adds what to do, by kind."""
    from densekit.io.artefact import read_manifest

    folder = Path(path)
    if not folder.is_dir():
        return
    manifest = read_manifest(folder)
    kind = "module" if (folder / "densekit-module.json").is_file() else manifest.kind if manifest else None
    if kind is None or kind in MODEL_KINDS:
        return
    hint = (hints or {}).get(kind)
    if hint is None and kind.endswith("run") and (folder / "model").is_dir():
        hint = f"its model is {folder / 'model'}"
    raise DataError([Problem(folder, None, f"a densekit {kind} folder, not {wanted}"
                                           + (f": {hint}" if hint else ""))])  # fmt: skip


def check_model_files(path: str | Path, trust_remote_code: bool = False) -> None:
    """Refuse a local model folder that transformers would load unsafely or fail on at length: no
    readable config.json, code named by its `auto_map` without `trust_remote_code`, weights only in
    pickled files, or no weights. A hub id (no such folder) is left to transformers."""
    folder = Path(path)
    if not folder.is_dir():
        return
    config_file = folder / CONFIG
    if not config_file.is_file():
        raise DataError([Problem(folder, None, f"not a model folder: it has no {CONFIG} (every Hugging "
                                               "Face model folder has one)")])  # fmt: skip
    config = read_json_object(config_file)
    if config.get("auto_map") and not trust_remote_code and not _known_model_type(config.get("model_type")):
        named = ", ".join(sorted(str(v) for v in dict(config["auto_map"]).values()))
        raise DataError([Problem(config_file, None, f"auto_map names code shipped with the model ({named}) "
                                                    "for its model_type; densekit runs it only with "
                                                    "--trust-remote-code")])  # fmt: skip
    if any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p for pattern in PICKLED for p in folder.glob(pattern))
    if pickled:
        raise DataError([Problem(pickled[0], None, "a pickled PyTorch checkpoint, and the folder has no "
                                                   ".safetensors weights: densekit never unpickles a file "
                                                   "(it can run any code); convert it to safetensors where "
                                                   "you trust it (transformers' save_pretrained writes "
                                                   "model.safetensors)")])  # fmt: skip
    raise DataError([Problem(folder, None, "no model weights: no .safetensors file")])


def _known_model_type(model_type: object) -> bool:
    """Whether transformers has its own classes for `model_type` (and so ignores `auto_map`)."""
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def read_safetensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; `DataError` naming it when it is truncated, its header is
    damaged (safetensors checks every tensor's dtype, shape and bytes) or a float tensor holds NaN or
    an infinity (every vector it makes would)."""
    path = Path(path)
    size = path.stat().st_size
    if size < _HEADER_LENGTH:
        raise DataError([Problem(path, None, f"truncated: {size} bytes, too few for a safetensors file")])
    with path.open("rb") as handle:
        header = int.from_bytes(handle.read(_HEADER_LENGTH), "little")
    if header > size - _HEADER_LENGTH:
        raise DataError([Problem(path, None, f"truncated or damaged: its header is said to take {header} "
                                             f"bytes, and the file holds {size - _HEADER_LENGTH} after "
                                             "the length")])  # fmt: skip
    try:
        state = safetensors.torch.load_file(str(path), device=device)
    except (SafetensorError, ValueError, RuntimeError) as err:
        reason = " ".join(str(err).split())
        raise DataError([Problem(path, None, f"not a readable safetensors file: {reason}")]) from None
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DataError([Problem(path, None, f"tensor {name!r} holds NaN or infinite values")])
    return state
