"""Reading and writing the sentence-transformers layout (`modules.json`, `1_Pooling/`, prompts).

densekit saves this layout beside its own `densekit.json` so that `SentenceTransformer(path)` loads a
densekit model and gives the same embeddings; it reads it so that any sentence-transformers folder
works as a densekit encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from densekit.diagnostics import DataError, Problem
from densekit.models.checkpoint_files import read_json_file, read_json_object
from densekit.models.config import EncoderConfig
from densekit.models.projection import Projection, write_projection

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
_DENSE = "sentence_transformers.models.Dense"
# the modules densekit reads, in the order it applies them
_SUPPORTED_SUFFIXES = {
    "Transformer": _TRANSFORMER, "Pooling": _POOLING, "Dense": _DENSE, "Normalize": _NORMALIZE
}  # fmt: skip
_POOLING_NAMES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


def is_st_folder(path: Path) -> bool:
    """True when `path` holds a sentence-transformers `modules.json`."""
    return (Path(path) / "modules.json").is_file()


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path)


def _module_list(modules_file: Path) -> list[dict[str, Any]]:
    """The entries of `modules.json`: a list of objects."""
    modules = read_json_file(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise DataError([Problem(modules_file, None, "expected a JSON list of modules, each an object")])
    return modules


def _inside(folder: Path, relative: object, modules_file: Path) -> Path:
    """`folder / relative`, refused unless it is a folder inside `folder` (a module's `path` names one
    of the model's own subfolders, never a place elsewhere on disk)."""
    target = folder / str(relative)
    if Path(str(relative)).is_absolute() or not target.resolve().is_relative_to(folder.resolve()):
        message = f"module path {relative!r} leads outside {folder}; a module's path names a subfolder of it"
        raise DataError([Problem(modules_file, None, message)])
    return target


def read_st_folder(path: Path) -> tuple[Path, dict[str, Any]]:
    """The transformer's folder and the `EncoderConfig` fields a sentence-transformers folder sets."""
    path = Path(path)
    modules_file = path / "modules.json"
    modules = _module_list(modules_file)
    fields: dict[str, Any] = {"normalize": False}
    backbone = path
    for module in modules:
        kind = _kind(module, modules_file)
        folder = _inside(path, module.get("path", ""), modules_file)
        if kind == "Dense":
            continue  # its weights: `projection_folder`
        if kind == "Transformer":
            backbone = folder
        elif kind == "Pooling":
            fields["pooling"] = _pooling_mode(folder / "config.json")
            fields["include_prompt"] = bool(_read_json(folder / "config.json").get("include_prompt", True))
        else:
            fields["normalize"] = True
    st_config = backbone / "sentence_bert_config.json"
    if st_config.is_file():
        max_length = _read_json(st_config).get("max_seq_length")
        if max_length is not None and (type(max_length) is not int or max_length < 1):
            message = f"max_seq_length {max_length!r}: expected a whole number of tokens, 1 or more"
            raise DataError([Problem(st_config, None, message)])
        if max_length:
            fields["query_max_length"] = fields["passage_max_length"] = int(max_length)
    prompts_file = path / "config_sentence_transformers.json"
    if prompts_file.is_file():
        truncate_dim = _read_json(prompts_file).get("truncate_dim")
        if truncate_dim is not None:
            if type(truncate_dim) is not int or truncate_dim < 1:
                message = f"truncate_dim {truncate_dim!r}: expected a whole number of dimensions, 1 or more"
                raise DataError([Problem(prompts_file, None, message)])
            fields["dimensions"] = truncate_dim
        prompts = _read_json(prompts_file).get("prompts") or {}
        if not isinstance(prompts, dict) or not all(isinstance(v, str | None) for v in prompts.values()):
            raise DataError([Problem(prompts_file, None, "prompts: expected an object of texts by name")])
        if prompts.get("query"):
            fields["query_prefix"] = prompts["query"]
        passage_prompt = prompts.get("document") or prompts.get("passage")
        if passage_prompt:
            fields["passage_prefix"] = passage_prompt
    return backbone, fields


def _kind(module: dict[str, Any], modules_file: Path) -> str:
    """The kind of a `modules.json` entry (`Transformer`, `Pooling`, `Dense`, `Normalize`), refused when
    densekit cannot apply it."""
    kind = str(module.get("type", "")).rsplit(".", 1)[-1]
    if kind not in _SUPPORTED_SUFFIXES:
        message = (f"module {module.get('type')!r} is not supported; densekit reads Transformer, Pooling, "
                   "Dense and Normalize modules")  # fmt: skip
        raise DataError([Problem(modules_file, None, message)])
    return kind


def projection_folder(path: Path) -> Path | None:
    """The folder of the `Dense` module of a sentence-transformers folder (None without one); refused
    unless there is one, between the pooling and any normalisation, as densekit applies it."""
    modules_file = Path(path) / "modules.json"
    modules = _module_list(modules_file)
    kinds = [_kind(module, modules_file) for module in modules]
    if "Dense" not in kinds:
        return None
    order = list(_SUPPORTED_SUFFIXES)
    if kinds.count("Dense") > 1 or [order.index(k) for k in kinds] != sorted(order.index(k) for k in kinds):
        message = (f"modules {kinds}: densekit applies one Dense module, after the pooling and before "
                   "any normalisation")  # fmt: skip
        raise DataError([Problem(modules_file, None, message)])
    return _inside(Path(path), modules[kinds.index("Dense")].get("path", ""), modules_file)


def _pooling_mode(config_file: Path) -> str:
    config = _read_json(config_file)
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        modes = [key for key in _LEGACY_POOLING_KEYS if config.get(key)]
        modes = [_LEGACY_POOLING_KEYS[key] for key in modes] or ["mean"]
        modes = [{"last": "lasttoken"}.get(m, m) for m in modes]
    if len(modes) != 1 or modes[0] not in _POOLING_NAMES:
        raise DataError(
            [
                Problem(
                    config_file,
                    None,
                    f"pooling {modes} is not supported; densekit pools by cls, mean or last",
                )
            ]
        )
    return _POOLING_NAMES[modes[0]]


def write_st_files(
    path: Path, config: EncoderConfig, dimension: int, projection: Projection | None = None
) -> None:
    """Write the sentence-transformers description of a tied encoder saved at `path`, whose
    transformer makes `dimension`-wide token states, with its `projection` (a Dense module) if any."""
    path = Path(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": _TRANSFORMER},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": _POOLING},
    ]
    if projection is not None:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": _DENSE})
        write_projection(path / "2_Dense", projection)
    if config.normalize:
        folder = f"{len(modules)}_Normalize"
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": folder, "type": _NORMALIZE})
        (path / folder).mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2), encoding="utf-8")
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": dimension,
        "pooling_mode_cls_token": config.pooling == "cls",
        "pooling_mode_mean_tokens": config.pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": config.pooling == "last",
        "include_prompt": config.include_prompt,
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2), encoding="utf-8")
    # sentence-transformers has one length for all texts: the passages' (queries rarely reach it).
    st_config = {"max_seq_length": config.passage_max_length, "do_lower_case": False}
    (path / "sentence_bert_config.json").write_text(json.dumps(st_config, indent=2), encoding="utf-8")
    prompts = {"query": config.query_prefix, "document": config.passage_prefix}
    extra: dict[str, Any] = {
        "prompts": prompts,
        "default_prompt_name": None,
        "similarity_fn_name": "cosine" if config.normalize else "dot",
    }
    if config.dimensions is not None:
        extra["truncate_dim"] = config.dimensions
    (path / "config_sentence_transformers.json").write_text(json.dumps(extra, indent=2), encoding="utf-8")
