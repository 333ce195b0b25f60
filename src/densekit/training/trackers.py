"""Experiment trackers (TensorBoard, MLflow, Weights & Biases) that the training log feeds.

A run's `report_to` names the trackers; each is an optional extra (`pip install 'densekit[tensorboard]'`)
imported only when named. Every record the run writes to `train_log.jsonl` reaches each tracker as the
same scalars at the same step, and the run's config is logged once, when the tracker opens.

A resumed run drops the log's records past its checkpoint; its trackers then start over from the log
as it is kept (TensorBoard's folder is made again, MLflow's and W&B's run is a new one holding the kept
history, the MLflow run of the earlier start deleted), so no step is ever in a tracker twice and a
tracker named only on resume still holds the whole run. Only an MLflow run this very folder made is
deleted: a copy of a run folder resumed against the same tracking store leaves its original's run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from densekit.errors import SettingError, StateError
from densekit.io.atomic import write_text_atomic

log = logging.getLogger("densekit")
TrackerName = Literal["tensorboard", "mlflow", "wandb"]
# The package each tracker needs, and the extra that installs it.
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
TENSORBOARD_FOLDER = "tensorboard"
MLFLOW_FOLDER = "mlruns"
MLFLOW_RUN_FILE = "mlflow-run.json"
WANDB_FOLDER = "wandb"
# What the trackers write in a run folder (a run's `--overwrite` removes these with the rest).
TRACKER_ENTRIES = (TENSORBOARD_FOLDER, MLFLOW_FOLDER, MLFLOW_RUN_FILE, WANDB_FOLDER)
EXPERIMENT = "densekit"
FOLDER_TAG = "densekit.run_folder"  # an MLflow run's tag: the random id of the run folder that made it
SKIPPED_KEYS = ("step",)


def check_installed(names: Iterable[str]) -> None:
    """Raise a one-line `RuntimeError` naming the extra to install for the first tracker whose package
    is missing; called before a run touches its folder."""
    for name in names:
        package, extra = PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise StateError(f"report_to {name} needs the {package} package: pip install 'densekit[{extra}]'")


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a log record, but its step (the x axis) and booleans."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in SKIPPED_KEYS and isinstance(value, int | float) and not isinstance(value, bool)
    }


def flat_settings(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as `section.key` -> its value as text (lists and nulls as JSON)."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(flat_settings(value, name))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat


class Tracker(ABC):
    """One experiment tracker of a run."""

    @abstractmethod
    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record `scalars` at `step`."""

    @abstractmethod
    def close(self, failed: bool = False) -> None:
        """Flush and close; `failed` when the run stopped on an error."""

    def replay(self, records: Sequence[dict[str, Any]]) -> None:
        """Log a resumed run's kept records, in order."""
        for record in records:
            self.log(int(record.get("step", 0)), scalars_of(record))


class TensorBoardTracker(Tracker):
    """Event files under `RUN/tensorboard`, written by torch's SummaryWriter; the config as text."""

    def __init__(self, folder: Path, config_yaml: str):
        from torch.utils.tensorboard import SummaryWriter

        logdir = folder / TENSORBOARD_FOLDER
        shutil.rmtree(logdir, ignore_errors=True)  # densekit's own: made again from the kept log
        self.writer = SummaryWriter(log_dir=str(logdir))
        self.writer.add_text("config", _as_markdown_code(config_yaml), global_step=0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


def _as_markdown_code(text: str) -> str:
    """TensorBoard renders text summaries as Markdown: indent the YAML so it shows as code."""
    return "\n".join("    " + line for line in text.splitlines())


def mlflow_name(key: str) -> str:
    """A log key as MLflow accepts a metric or parameter name (letters, digits, `_ - . / space`):
    `eval/nDCG@10` becomes `eval/nDCG_10`."""
    return re.sub(r"[^\w\-. /]", "_", key)


class MlflowTracker(Tracker):
    """A run in MLflow's tracking store through its client: the store of `MLFLOW_TRACKING_URI` when set,
    else a local file store in `RUN/mlruns`. Each start or resume makes a new MLflow run and deletes the
    one the previous start made (its id kept in `RUN/mlflow-run.json`) when this very folder made it:
    the record names the folder (its file system's device and inode, which a copy does not share) and
    a random id of the folder's, which the MLflow run carries as its `densekit.run_folder` tag. The
    config is the run's parameters (`section.key`) and its `config.yaml` artifact."""

    def __init__(self, folder: Path, config_yaml: str, run_name: str):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (folder / MLFLOW_FOLDER).resolve().as_uri()
            # MLflow 3 keeps its file store working but refuses it unless asked for; a store in the run
            # folder needs no server or database. A user's own setting wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        record = folder / MLFLOW_RUN_FILE
        folder_id = self._delete_earlier(record, uri)
        tags = {FOLDER_TAG: folder_id}
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        here = {"folder": _this_folder(folder), "folder_id": folder_id}
        write_text_atomic(record, json.dumps({"tracking_uri": uri, "run_id": self.run_id, **here}))
        self._log_config(config_yaml)

    def _delete_earlier(self, record: Path, uri: str) -> str:
        """Delete the MLflow run an earlier start of this run made in the same store (the new one holds
        its kept history again), when this very folder made it; returns the folder's random id (a new
        one for a copy, or a folder whose record is an older densekit's)."""
        from mlflow.exceptions import MlflowException

        earlier = _read_record(record)
        folder_id = earlier.get("folder_id")
        own = earlier.get("folder") == _this_folder(record.parent) and isinstance(folder_id, str)
        folder_id = folder_id if own else uuid.uuid4().hex
        if earlier.get("tracking_uri") != uri:
            return folder_id
        run_id = str(earlier.get("run_id"))
        with contextlib.suppress(MlflowException):
            if own and self.client.get_run(run_id).data.tags.get(FOLDER_TAG) == folder_id:
                self.client.delete_run(run_id)
                return folder_id
        log.info("%s names MLflow run %s, which this folder did not make (it is a copy, or the run is an "
                 "older densekit's): that run is left as it is", record, run_id)  # fmt: skip
        return folder_id

    def _log_config(self, config_yaml: str) -> None:
        from mlflow.entities import Param

        settings = flat_settings(yaml.safe_load(config_yaml) or {})
        params = [Param(mlflow_name(key), value[:6000]) for key, value in settings.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.client.log_text(self.run_id, config_yaml, "config.yaml")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = _milliseconds()
        metrics = [Metric(mlflow_name(key), value, now, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _read_record(record: Path) -> dict[str, Any]:
    """`mlflow-run.json` as an earlier start wrote it; empty when there is none or it is unreadable."""
    try:
        earlier = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return earlier if isinstance(earlier, dict) else {}


def _this_folder(folder: Path) -> str:
    """The run folder itself, as its file system knows it (a copy of it is another)."""
    stat = folder.stat()
    return f"{stat.st_dev}:{stat.st_ino}"


def _milliseconds() -> int:
    return int(time.time() * 1000)


class WandbTracker(Tracker):
    """A Weights & Biases run through `wandb.init` (its own settings apply: `WANDB_MODE=offline`,
    `WANDB_PROJECT`), its files in `RUN/wandb`; each start or resume is a new W&B run, and an offline
    run's folder of an earlier start is removed."""

    def __init__(self, folder: Path, config_yaml: str, run_name: str):
        import wandb

        root = folder / WANDB_FOLDER
        for earlier in root.glob("offline-run-*"):
            shutil.rmtree(earlier, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", EXPERIMENT),
            name=run_name,
            dir=str(folder),
            config=yaml.safe_load(config_yaml) or {},
            reinit="create_new",
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def open_trackers(names: Sequence[str], folder: Path, config_yaml: str) -> list[Tracker]:
    """The trackers `names` asks for, opened on the run in `folder` with its config; a tracker that
    fails to open closes those opened before it."""
    folder = Path(folder)
    opened: list[Tracker] = []
    try:
        for name in dict.fromkeys(names):
            opened.append(_open(name, folder, config_yaml))
    except BaseException:
        for tracker in opened:
            tracker.close(failed=True)
        raise
    return opened


def _open(name: str, folder: Path, config_yaml: str) -> Tracker:
    """Open one tracker; its library's own errors (a W&B login missing, a tracking server down) become
    one line naming the tracker."""
    if name not in PACKAGES:
        raise SettingError(f"report_to {name!r}: choose among {', '.join(PACKAGES)}")
    try:
        if name == "tensorboard":
            return TensorBoardTracker(folder, config_yaml)
        if name == "mlflow":
            return MlflowTracker(folder, config_yaml, folder.resolve().name)
        return WandbTracker(folder, config_yaml, folder.resolve().name)
    except Exception as err:  # each library has errors of its own; all of them stop the run the same way
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise StateError(f"report_to {name}: the tracker did not start: {reason}") from err
