"""The training log (one JSON object a line), which feeds the run's experiment trackers, and the plot of
its curves."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from densekit.io.atomic import atomic_file
from densekit.io.write_errors import naming
from densekit.plots import pyplot, save_png
from densekit.training.trackers import Tracker, open_trackers, scalars_of

LOG_FILE = "train_log.jsonl"
PLOT_FILE = "training_curves.png"
# A figure of a training step (a loss, the gradient norm): a number, or a 0-dim tensor not read yet
Figure = float | torch.Tensor


def device_figure(value: torch.Tensor) -> Figure:
    """A step's figure left on the device that computed it, in float64 as Python adds numbers (so sums
    of them equal the sums of their values), for the trainer to read at its next log line: reading a
    GPU's tensor waits for every kernel queued before it. Apple's MPS has no float64: read at once."""
    value = value.detach()
    return float(value) if value.device.type == "mps" else value.double()


class TrainingLog:
    """Appends records to `folder/train_log.jsonl` and passes each to the trackers `report_to` names
    (`densekit.training.trackers`); a resumed run first drops records past its step, and its trackers
    start from the records kept."""

    def __init__(
        self,
        folder: Path,
        resume_step: int | None = None,
        report_to: Sequence[str] = (),
        config_yaml: str = "",
    ):
        self.path = Path(folder) / LOG_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            kept = [r for r in self.records() if r.get("step", 0) <= resume_step]
            with atomic_file(self.path) as handle:
                handle.writelines(json.dumps(r) + "\n" for r in kept)
        self.trackers: list[Tracker] = open_trackers(report_to, self.path.parent, config_yaml)
        for tracker in self.trackers:
            tracker.replay(self.records())

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and log its scalars to each tracker. A record the disk cannot take is
        left out whole (no torn line for a resumed run to stop at), and the error names the log."""
        line = memoryview((json.dumps(record) + "\n").encode())
        with naming(self.path):
            descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                start = os.fstat(descriptor).st_size
                try:
                    while line:
                        line = line[os.write(descriptor, line) :]
                except OSError:
                    os.ftruncate(descriptor, start)
                    raise
            finally:
                os.close(descriptor)
        scalars = scalars_of(record)
        for tracker in self.trackers:
            tracker.log(int(record.get("step", 0)), scalars)

    def close(self, failed: bool = False) -> None:
        """Close the trackers; `failed` when the run stopped on an error."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(failed)

    def records(self) -> list[dict[str, Any]]:
        """Every record so far."""
        if not self.path.exists():
            return []
        return [
            json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()
        ]


def plot_curves(log_path: Path, output: Path, title: str = "training") -> Path | None:
    """Plot every numeric series of a training log against the step; None when there is nothing yet."""
    plt = pyplot()

    if not Path(log_path).is_file():
        return None
    records = [
        json.loads(line) for line in Path(log_path).read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    series: dict[str, tuple[list[float], list[float]]] = {}
    for record in records:
        step = record.get("step")
        for key, value in record.items():
            if key in ("step", "epoch", "elapsed_s") or not isinstance(value, int | float):
                continue
            xs, ys = series.setdefault(key, ([], []))
            xs.append(step)
            ys.append(value)
    if not series:
        return None
    names = sorted(series, key=lambda name: (not name.startswith("loss"), name))
    columns = min(3, len(names))
    rows = (len(names) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.2 * rows), squeeze=False)
    for axis, name in zip(axes.flat, names, strict=False):
        xs, ys = series[name]
        axis.plot(xs, ys, marker="." if len(xs) < 30 else None)
        axis.set_title(name)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(names) :]:
        axis.axis("off")
    figure.suptitle(title)
    return save_png(figure, output)
