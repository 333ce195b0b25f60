"""A run's output folder: which run it holds, and whether this one may start, continue or replace it.

The folder's manifest records the run's identity: its config (less the keys a resume may change) and
the digests of its inputs (the starting model's files, the collection, the training examples). A
command that finds a folder of another run refuses it, naming the keys that differ; one that finds
this very run continues it with `--resume`, starts it again with `--overwrite`, and otherwise stops.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from densekit.data.dataset import input_fingerprint
from densekit.errors import SettingError
from densekit.io.artefact import read_manifest, write_folder_manifest
from densekit.io.atomic import atomic_file, remove_dead_temporaries, write_text_atomic
from densekit.io.outputs import OutputError, claim_folder, clear_folder
from densekit.io.readme import CARD_FILE, user_readme
from densekit.models.hub import resolve_model_path
from densekit.training.checkpoint import checkpoints
from densekit.training.config import RunConfig
from densekit.training.log import LOG_FILE, PLOT_FILE
from densekit.training.trackers import TRACKER_ENTRIES
from densekit.training.trainer import BEST_MODEL, CHECKPOINTS, FINAL_MODEL

log = logging.getLogger("densekit")

CONFIG_FILE = "config.yaml"
# What a run writes in its folder; `--overwrite` removes these and nothing else.
RUN_ENTRIES = (
    CONFIG_FILE, CHECKPOINTS, FINAL_MODEL, BEST_MODEL, LOG_FILE, PLOT_FILE, "ance", *TRACKER_ENTRIES
)  # fmt: skip


def _users_readmes(output: Path) -> dict[str, bytes]:
    """The READMEs of the user's own in the run's model folders, which `--overwrite` keeps."""
    readmes = {}
    for name in (FINAL_MODEL, BEST_MODEL):
        readme = user_readme(output / name) if output.is_dir() else None
        if readme is not None:
            readmes[name] = readme.read_bytes()
    return readmes


def _put_back(output: Path, readmes: dict[str, bytes]) -> None:
    """Write the kept READMEs back, each alone in its model folder until the run saves the model there
    (the save keeps it)."""
    for name, text in readmes.items():
        with atomic_file(output / name / CARD_FILE, "wb", encoding=None) as handle:
            handle.write(text)


def _drop(tree: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.get(part, {})
    tree.pop(last, None)


def run_identity(config: RunConfig) -> dict[str, Any]:
    """The config without the keys a resume may change or that only name inputs, and the inputs'
    digests (so a moved collection still matches and an edited one does not)."""
    settings = config.model_dump(mode="json")
    paths = config.input_paths()
    for key in (*config.RESUMABLE_CHANGES, *paths):
        _drop(settings, key)
    inputs = {key: input_fingerprint(resolve_model_path(path) if key == "model.path" else path)
              for key, path in paths.items()}  # fmt: skip
    return {"config": settings, "inputs": inputs}


def _less_newer_defaults(fresh: dict[str, Any], saved: dict[str, Any], set_here: Any) -> dict[str, Any]:
    """`fresh` without the settings a run made by an earlier densekit does not record (they did not exist
    then) that are at their defaults here, and with those it records as null that this densekit leaves
    out when unset, so a new option does not stop an old run from resuming."""
    set_here = set_here if isinstance(set_here, dict) else {}
    kept = {key: None for key, value in saved.items() if value is None and key not in fresh}
    for key, value in fresh.items():
        if key not in saved:
            if key in set_here:
                kept[key] = value  # set here: a real difference
            continue
        if isinstance(value, dict) and isinstance(saved[key], dict):
            value = _less_newer_defaults(value, saved[key], set_here.get(key, {}))
        kept[key] = value
    return kept


def prepare_run_folder(
    output: Path, kind: str, config: RunConfig, config_yaml: str, resume: bool | None, overwrite: bool
) -> bool:
    """Make `output` ready for a `kind` run of `config`; returns True when the run continues there.

    `resume`: True continues this run (a warning when there is none yet), False refuses a folder
    that holds it already, None (recipes) continues it if it is there and starts it otherwise.
    """
    if resume and overwrite:
        raise SettingError("--resume continues a run and --overwrite starts it again: give one of them")
    output = Path(output)
    identity = run_identity(config)
    inputs = [resolve_model_path(p) if k == "model.path" else p for k, p in config.input_paths().items()]
    made = read_manifest(output) if output.is_dir() else None
    compared = identity
    if made is not None and made.kind == kind and "config" in made.identity:
        set_here = config.model_dump(mode="json", exclude_defaults=True)
        older = _less_newer_defaults(identity["config"], made.identity["config"], set_here)
        compared = {**identity, "config": older}
    readmes = _users_readmes(output) if overwrite else {}
    state = claim_folder(output, kind, compared, inputs, overwrite, RUN_ENTRIES)
    if state == "matching" and overwrite:
        clear_folder(output, RUN_ENTRIES)
        state = "new"
    if state == "matching" and resume is False:
        found = checkpoints(output / CHECKPOINTS)
        where = f"its newest checkpoint is {found[-1].name}" if found else "it has no checkpoint yet"
        raise OutputError(
            f"{output} already holds this {kind} ({where}); pass --resume to continue it or --overwrite "
            "to start it again"
        )
    if state == "new":
        if resume:
            log.warning("%s holds no %s to resume; starting a new one", output, kind)
        output.mkdir(parents=True, exist_ok=True)
        write_folder_manifest(output, kind, identity, {"inputs": config.input_paths()})
        _put_back(output, readmes)
    write_text_atomic(output / CONFIG_FILE, config_yaml)
    for leftover in remove_dead_temporaries(output / CHECKPOINTS):
        log.info("removed %s, left by a killed checkpoint write", leftover.name)
    return state == "matching"
