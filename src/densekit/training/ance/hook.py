"""The trainer's side of ANCE: switch to the newest negatives at step boundaries, keep an inferencer alive."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from densekit.training import distributed
from densekit.training.ance.versions import NegativeVersions
from densekit.training.config import AnceSection
from densekit.training.contrastive import ContrastiveTask

log = logging.getLogger("densekit")


class AnceHook:
    """Before each step: take a newer published version if there is one, and log the async gap.

    The gap is the number of steps between the checkpoint a version was made from and the current
    step. The version in use is kept in the trainer's state, so a resumed run starts from the same
    version it had. With a local inferencer, a dead one is reported and started again, at most
    `max_restarts` times; training goes on with the last version meanwhile.
    """

    def __init__(self, task: ContrastiveTask, output: Path, settings: AnceSection):
        self.task = task
        self.output = Path(output)
        self.settings = settings
        self.versions = NegativeVersions(self.output)
        self.current: int | None = None
        self.made_at_step = 0
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.log_file = self.versions.root / "inferencer.log"

    def inferencer_command(self) -> list[str]:
        """How the local inferencer is started."""
        command = [
            sys.executable,
            "-m",
            "densekit",
            "ance-infer",
            str(self.output),
            "--watch-parent",
            "--no-progress",
        ]
        if self.settings.threads:
            command += ["--threads", str(self.settings.threads)]
        return command

    def _start_inferencer(self) -> None:
        with self.log_file.open("a", encoding="utf-8") as handle:
            self.process = subprocess.Popen(
                self.inferencer_command(), stdout=handle, stderr=subprocess.STDOUT
            )

    def _watch_inferencer(self) -> None:
        if self.process is None or self.process.poll() is None:
            return
        code = self.process.returncode
        if self.restarts >= self.settings.max_restarts:
            if self.restarts == self.settings.max_restarts:
                log.warning(
                    "the ANCE inferencer exited (code %s) and was restarted %d times already; training "
                    "goes on with version %s (see %s)", code, self.restarts, self.current, self.log_file,
                )  # fmt: skip
                self.restarts += 1
            return
        self.restarts += 1
        log.warning(
            "the ANCE inferencer exited (code %s); training goes on with version %s; restarting it "
            "(%d of %d, see %s)",
            code, self.current, self.restarts, self.settings.max_restarts, self.log_file,
        )  # fmt: skip
        self._start_inferencer()

    def _first_call(self, state: dict[str, Any]) -> None:
        if distributed.is_main():
            self.versions.stop_file.unlink(missing_ok=True)
            if self.versions.latest() is None:
                self.versions.publish(0, self.task.examples, {"checkpoint_step": 0, "source": "data.train"})
        distributed.barrier()
        start = state.get("ance_version", 0)
        self._switch(start, state["step"], resumed="ance_version" in state)
        if self.settings.inferencer == "local" and distributed.is_main():
            self._start_inferencer()

    def _switch(self, version: int, step: int, resumed: bool = False) -> None:
        examples, meta = self.versions.load(version)
        self.task.set_examples(examples)
        self.current = version
        self.made_at_step = int(meta.get("checkpoint_step", 0))
        how = "resuming with" if resumed else "switching to"
        log.info("step %d: %s ANCE version %d (from step %d)", step, how, version, self.made_at_step)

    def before_step(self, step: int, state: dict[str, Any]) -> dict[str, float]:
        """Take the newest version, if newer, before step `step + 1`."""
        if self.current is None:
            self._first_call(state)
        newest = [self.versions.latest() if distributed.is_main() else None]
        if distributed.world_size() > 1:
            dist.broadcast_object_list(newest, src=0)
        if distributed.is_main():
            self._watch_inferencer()
        if newest[0] is not None and newest[0] > self.current:
            self._switch(newest[0], step)
        state["ance_version"] = self.current
        return {"ance_version": float(self.current), "ance_async_gap": float(step - self.made_at_step)}

    def close(self) -> None:
        """Tell inferencers to stop, and stop the local one."""
        if not distributed.is_main():
            return
        self.versions.stop_file.touch()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
