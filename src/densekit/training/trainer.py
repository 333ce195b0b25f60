"""The one training loop every method runs through.

A task supplies the batches and the objective; the trainer supplies the rest: AdamW with warm-up and
linear decay, gradient accumulation and clipping, mixed precision, gradient averaging across
processes, checkpoints (atomic, resumable exactly), evaluation with the best model kept, a JSONL
log, a plot of the curves and a progress bar.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml

from densekit.io.artefact import read_manifest
from densekit.io.model_card import InputFacts, Score, TrainingFacts, add_training, input_size
from densekit.progress import progress_bar
from densekit.training import distributed
from densekit.training.checkpoint import checkpoints, load_checkpoint, prune_checkpoints, save_checkpoint
from densekit.training.config import CheckpointSection, OptimSection
from densekit.training.log import LOG_FILE, PLOT_FILE, Figure, TrainingLog, device_figure, plot_curves

log = logging.getLogger("densekit")

CHECKPOINTS = "checkpoints"
# a checkpoint redraws the training curves only this long after they were last drawn: drawing takes
# seconds, which a long run spends unnoticed and a short one (checkpoints seconds apart) many times over
PLOT_INTERVAL_S = 60.0
FINAL_MODEL = "model"
BEST_MODEL = "best"
# The command that makes each kind of run folder, for the cards of the models it exports.
COMMANDS = {"training run": "densekit train", "pre-training run": "densekit pretrain",
            "cross-encoder training run": "densekit train-cross-encoder"}  # fmt: skip


class TrainingTask(Protocol):
    """What a method gives the trainer."""

    module: torch.nn.Module

    def steps_per_epoch(self) -> int:
        """Global batches in one epoch."""

    def batch(self, epoch: int, step: int) -> Any:
        """This process's part of global batch `step` of `epoch`; the same every time it is asked."""

    def forward_backward(self, batch: Any, scale: float | torch.Tensor) -> dict[str, Figure]:
        """Back-propagate `scale` (a number, or fp16's loss scale as a 0-dim tensor) times the batch's
        loss; return the unscaled loss and other figures, as numbers or as `device_figure`s (which the
        trainer reads only when it logs)."""

    def export(self, path: Path) -> None:
        """Save the usable model (without training-only heads) to `path`, atomically."""


class StepHook(Protocol):
    """Work done at step boundaries (ANCE's switch to newer negatives); keeps its state in `state`."""

    def before_step(self, step: int, state: dict[str, Any]) -> dict[str, float]:
        """Called before step `step + 1` starts; returns figures to log with that step."""

    def close(self) -> None:
        """Release what the hook holds (processes, files) when training ends or fails."""


@dataclass
class EvaluationHook:
    """Runs on the main process every `every` steps (None: each epoch); `metric` picks the best."""

    evaluate: Callable[[], dict[str, float]]
    metric: str
    every: int | None = None


def _parameter_groups(module: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, parameter in module.named_parameters():
        if not parameter.requires_grad:
            continue
        (no_decay if parameter.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(
            parameter
        )
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def fused_on(device: torch.device) -> dict[str, bool]:
    """AdamW's options on `device`: on a GPU its fused kernel (one launch for every parameter, where the
    default runs several per group of tensors); elsewhere torch's default."""
    return {"fused": True} if device.type == "cuda" else {}


def linear_schedule(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """Learning-rate factor: linear warm-up from 0, then linear decay to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


class Trainer:
    """Trains `task` under `optim`, writing checkpoints, logs and models under `output`."""

    def __init__(
        self,
        task: TrainingTask,
        optim: OptimSection,
        checkpoint: CheckpointSection,
        output: Path,
        config_yaml: str,
        log_every: int = 10,
        evaluation: EvaluationHook | None = None,
        show_progress: bool = True,
        hooks: list[StepHook] | None = None,
        report_to: Sequence[str] = (),
    ):
        self.task = task
        self.report_to = list(report_to)
        self.optim = optim
        self.checkpoint = checkpoint
        self.output = Path(output)
        self.config_yaml = config_yaml
        self.log_every = log_every
        self.evaluation = evaluation
        self.hooks = hooks or []
        self.show_progress = show_progress and distributed.is_main()
        self.device = next(task.module.parameters()).device
        self.parameters = [p for p in task.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            _parameter_groups(task.module, optim.weight_decay), lr=optim.learning_rate,
            **fused_on(self.device),
        )  # fmt: skip
        self.micro_per_epoch = task.steps_per_epoch()
        steps_per_epoch = max(1, self.micro_per_epoch // optim.grad_accumulation)
        self.total_steps = optim.max_steps or max(1, math.ceil(optim.epochs * steps_per_epoch))
        self.steps_per_epoch = steps_per_epoch
        warmup = round(optim.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, linear_schedule(self.total_steps, warmup)
        )
        self.scaler = torch.amp.GradScaler("cuda") if optim.precision == "fp16" else None
        self.state: dict[str, Any] = {"step": 0, "elapsed_s": 0.0, "best": None, "best_step": None}
        self._run_facts: TrainingFacts | None = None
        self._plotted_at = time.monotonic()

    @property
    def checkpoint_root(self) -> Path:
        """Where checkpoints go."""
        return self.output / CHECKPOINTS

    def resume(self) -> bool:
        """Continue from the newest checkpoint under the output folder, if there is one."""
        found = checkpoints(self.checkpoint_root)
        if not found:
            return False
        self.state = load_checkpoint(
            found[-1], self.task.module, self.optimizer, self.scheduler, self.device, self.scaler
        )
        log.info("resuming from %s (step %d of %d)", found[-1], self.state["step"], self.total_steps)
        return True

    def _position(self, micro_step: int) -> tuple[int, int]:
        return divmod(micro_step, self.micro_per_epoch)

    def _one_step(self) -> dict[str, Figure]:
        """One optimizer step; its figures (the task's, the gradient norm) stay where they were computed
        until the log line reads them (`device_figure`), so that a step never waits for the GPU."""
        accumulation = self.optim.grad_accumulation
        self.optimizer.zero_grad(set_to_none=True)
        figures: dict[str, Figure] = {}
        # fp16's loss scale as a tensor on the device: get_scale() would read it, waiting for the GPU
        loss_scale = self.scaler.scale(torch.ones((), device=self.device)) if self.scaler is not None else 1.0
        for micro in range(accumulation):
            epoch, index = self._position(self.state["step"] * accumulation + micro)
            result = self.task.forward_backward(self.task.batch(epoch, index), loss_scale / accumulation)
            for key, value in result.items():
                figures[key] = figures.get(key, 0.0) + value / accumulation
        distributed.average_gradients(self.parameters)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        limit = self.optim.max_grad_norm or float("inf")
        grad_norm = device_figure(torch.nn.utils.clip_grad_norm_(self.parameters, limit))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        figures = {key: distributed.all_reduce_mean(value) for key, value in figures.items()}
        return {**figures, "grad_norm": grad_norm}

    def train(self, resume: bool = False) -> dict[str, Any]:
        """Run to the last step and export the final model; returns the trainer state."""
        resumed = self.resume() if resume else False
        resume_step = self.state["step"] if resumed else None
        training_log = (
            TrainingLog(self.output, resume_step, self.report_to, self.config_yaml)
            if distributed.is_main()
            else None
        )
        started = time.perf_counter() - self.state["elapsed_s"]
        self.task.module.train()
        failed = True
        try:
            self._loop(training_log, started)
            failed = False
        finally:
            for hook in self.hooks:
                hook.close()
            if training_log is not None:
                training_log.close(failed)
        if distributed.is_main():
            self.task.export(self.output / FINAL_MODEL)
            self._describe_run(self.output / FINAL_MODEL, training_log, None)
            self._plot_curves()
        distributed.barrier()
        return self.state

    def _plot_curves(self) -> None:
        plot_curves(self.output / LOG_FILE, self.output / PLOT_FILE, title=str(self.output))
        self._plotted_at = time.monotonic()

    def _loop(self, training_log: TrainingLog | None, started: float) -> None:
        """Steps to the end; each log line holds the means over the steps since the last one (the
        losses, the gradient norm) and the hooks' latest figures (ANCE's version and gap)."""
        window_start, window_sums, window_steps = time.perf_counter(), {}, 0
        with progress_bar(
            "training", self.total_steps, self.show_progress, completed=self.state["step"]
        ) as advance:
            while self.state["step"] < self.total_steps:
                boundary: dict[str, float] = {}
                for hook in self.hooks:
                    boundary.update(hook.before_step(self.state["step"], self.state))
                for key, value in self._one_step().items():
                    window_sums[key] = window_sums.get(key, 0.0) + value
                self.state["step"] += 1
                self.state["elapsed_s"] = time.perf_counter() - started
                window_steps += 1
                step = self.state["step"]
                if training_log is not None and (step % self.log_every == 0 or step == self.total_steps):
                    means = {key: float(value) / window_steps for key, value in window_sums.items()}
                    # read after the figures: on a GPU, that is when the window's steps have finished
                    seconds = time.perf_counter() - window_start
                    self.state["elapsed_s"] = time.perf_counter() - started
                    examples = window_steps * self.optim.batch_size * self.optim.grad_accumulation
                    training_log.write(
                        {"step": step, "epoch": round(step / self.steps_per_epoch, 4), **means, **boundary,
                         "lr": self.scheduler.get_last_lr()[0], "examples_per_s": examples / seconds,
                         "elapsed_s": round(self.state["elapsed_s"], 2)}
                    )  # fmt: skip
                    window_start, window_sums, window_steps = time.perf_counter(), {}, 0
                if self._evaluation_due(step):
                    self._evaluate(step, training_log)
                if step % self.checkpoint.every == 0 or step == self.total_steps:
                    self._save_checkpoint()
                advance(1)

    def _evaluation_due(self, step: int) -> bool:
        if self.evaluation is None:
            return False
        every = self.evaluation.every or self.steps_per_epoch
        return step % every == 0 or step == self.total_steps

    def _evaluate(self, step: int, training_log: TrainingLog | None) -> None:
        if distributed.is_main():
            self.task.module.eval()
            scores = self.evaluation.evaluate()
            self.task.module.train()
            value = scores[self.evaluation.metric]
            log.info("step %d: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
            training_log.write({"step": step, **{f"eval/{k}": v for k, v in scores.items()}})
            if self.state["best"] is None or value > self.state["best"]:
                self.state["best"], self.state["best_step"] = value, step
                self.task.export(self.output / BEST_MODEL)
                self._describe_run(self.output / BEST_MODEL, training_log, step)
        distributed.barrier()

    def _describe_run(self, model: Path, training_log: TrainingLog, step: int | None) -> None:
        """Add the run (its command, config, inputs and the scores of evaluation `step`, or of the last
        evaluation when None) to the card of the model it exported."""
        try:
            self._add_run_to_card(model, training_log, step)
        except Exception as err:  # the card only describes the model, which is saved already
            log.warning("%s: the model card was not completed (%s)", model / "README.md", err)

    def _add_run_to_card(self, model: Path, training_log: TrainingLog, step: int | None) -> None:
        if self._run_facts is None:
            manifest = read_manifest(self.output)
            if manifest is None:
                return
            digests, paths = manifest.identity.get("inputs", {}), manifest.about.get("inputs", {})
            inputs = [InputFacts(key, str(path), str(digests.get(key, "")), input_size(path))
                      for key, path in paths.items()]  # fmt: skip
            command = COMMANDS.get(manifest.kind, manifest.kind)
            self._run_facts = TrainingFacts(command, self.config_yaml, inputs)
        evaluations = [r for r in training_log.records() if any(k.startswith("eval/") for k in r)]
        chosen = [r for r in evaluations if step is None or r["step"] == step][-1:]
        config = yaml.safe_load(self.config_yaml) or {}
        collection = Path(str(config.get("data", {}).get("path", ""))).name
        split = str(config.get("eval", {}).get("split"))
        command = self._run_facts.command
        scores = [
            Score(key.removeprefix("eval/"), value, collection, split, record["step"], command)
            for record in chosen
            for key, value in record.items()
            if key.startswith("eval/")
        ]
        add_training(model, dataclasses.replace(self._run_facts, scores=scores))

    def _save_checkpoint(self) -> None:
        if distributed.is_main():
            folder = self.checkpoint_root / f"step-{self.state['step']:08d}"
            save_checkpoint(
                folder, self.task.module, self.optimizer, self.scheduler, self.state,
                self.config_yaml, self.task.export, self.device, self.scaler,
            )  # fmt: skip
            prune_checkpoints(self.checkpoint_root, self.checkpoint.keep)
            if time.monotonic() - self._plotted_at >= PLOT_INTERVAL_S:
                self._plot_curves()
        distributed.barrier()
