"""Running a recipe: resolve placeholders and overrides, run each step unless it is already done.

A recipe is YAML: free sections of values (`data`, `model`, ...) that strings refer to as
`{data.path}` (and `{out}`, the output folder), and `steps`, an ordered mapping of named steps, each
with a `type` (mine, train, encode, index, search, bm25, evaluate) and its parameters. Any value can be
overridden as `dotted.key=value` (`data.path=/some/beir/folder`, `steps.round1.config.optim.epochs=2`).

Each finished step leaves `OUT/.steps/<name>.json` recording its resolved parameters. A step whose
record matches is skipped; one started but not finished (killed) runs again and resumes where it can;
one whose parameters changed has its outputs removed and runs from scratch, and so do the steps after
it. The last evaluate step's scores are written to `OUT/metrics.json`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from densekit.configuration import apply_overrides, read_yaml
from densekit.data.diagnostics import DataError, Problem
from densekit.io.atomic import write_text_atomic
from densekit.recipes.steps import STEP_TYPES, EvaluateStep, Step, TrainerStep, describe
from densekit.training import distributed

log = logging.getLogger("densekit")

MARKERS = ".steps"
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][\w.]*)\}")
_RESERVED = {"description", "expected", "steps"}


def _lookup(context: dict[str, Any], dotted: str, where: str) -> Any:
    node: Any = context
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{where}: unknown placeholder {{{dotted}}}")
        node = node[part]
    return node


def resolve(value: Any, context: dict[str, Any], where: str = "recipe") -> Any:
    """`value` with every `{dotted.name}` replaced from `context`; a lone placeholder keeps its type."""
    if isinstance(value, dict):
        return {k: resolve(v, context, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, context, where) for v in value]
    if not isinstance(value, str):
        return value
    for _ in range(10):
        whole = _PLACEHOLDER.fullmatch(value)
        if whole:
            value = _lookup(context, whole.group(1), where)
            if not isinstance(value, str):
                return resolve(value, context, where)
            continue
        replaced = _PLACEHOLDER.sub(lambda m: str(_lookup(context, m.group(1), where)), value)
        if replaced == value:
            return value
        value = replaced
    raise ValueError(f"{where}: placeholders refer to each other in a loop")


def load_recipe(path: Path, output: Path, overrides: list[str]) -> tuple[dict[str, Any], dict[str, Step]]:
    """The recipe's resolved tree and its steps, validated, in order."""
    tree = apply_overrides(read_yaml(path), overrides)
    steps_tree = tree.get("steps")
    if not isinstance(steps_tree, dict) or not steps_tree:
        raise DataError([Problem(Path(path), None, "a recipe needs a mapping of named steps under `steps`")])
    context = {k: v for k, v in tree.items() if k not in _RESERVED}
    context["out"] = str(output)
    steps = {}
    for name, raw in steps_tree.items():
        resolved = resolve(raw, context, f"steps.{name}")
        step_type = STEP_TYPES.get(resolved.get("type")) if isinstance(resolved, dict) else None
        if step_type is None:
            raise DataError(
                [Problem(Path(path), None, f"steps.{name}: type must be one of {', '.join(STEP_TYPES)}")]
            )
        try:
            steps[name] = step_type.model_validate(resolved)
        except ValidationError as err:
            problems = [
                Problem(Path(path), None, f"steps.{name}.{'.'.join(map(str, e['loc']))}: {e['msg']}")
                for e in err.errors()
            ]
            raise DataError(problems) from None
        if isinstance(steps[name], TrainerStep):
            # check the run's own config now, not when the steps before it are done
            try:
                steps[name].validated()
            except DataError as err:
                raise DataError(
                    [Problem(Path(path), None, f"steps.{name}.config.{p.message}") for p in err.problems]
                ) from None
    return tree, steps


def _same(recorded: str, described: str) -> bool:
    """Whether recorded parameters equal the step's, whatever the order of their keys."""
    return yaml.safe_load(recorded) == yaml.safe_load(described)


def run_recipe(
    path: Path,
    output: Path,
    overrides: list[str] | None = None,
    device: str = "auto",
    show_progress: bool = True,
) -> dict[str, float]:
    """Run every step not yet done; returns the final evaluation."""
    if distributed.world_size() > 1:
        raise RuntimeError(
            "run recipes in one process; launch multi-process training with torchrun densekit train"
        )
    output = Path(output)
    _, steps = load_recipe(path, output, overrides or [])
    markers = output / MARKERS
    markers.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        output / "recipe.yaml",
        Path(path).read_text(encoding="utf-8") + "\n# overrides: " + json.dumps(overrides or []) + "\n",
    )
    timings: dict[str, float] = {}
    upstream_ran = False
    for name, step in steps.items():
        described = describe(step)
        done, started = markers / f"{name}.json", markers / f"{name}.started"
        record = json.loads(done.read_text(encoding="utf-8")) if done.is_file() else None
        if record is not None and _same(record["parameters"], described) and not upstream_ran:
            log.info("step %s: already done", name)
            timings[name] = record["seconds"]
            continue
        began_as = started.read_text(encoding="utf-8") if started.is_file() else None
        if record is not None or (began_as is not None and (not _same(began_as, described) or upstream_ran)):
            log.info("step %s: its parameters or inputs changed; starting it over", name)
            _remove(step.outputs())
        done.unlink(missing_ok=True)
        write_text_atomic(started, described)
        log.info("step %s (%s)", name, step.type)  # type: ignore[attr-defined]
        begun = time.perf_counter()
        step.run(device, show_progress)  # type: ignore[attr-defined]
        timings[name] = round(time.perf_counter() - begun, 1)
        write_text_atomic(done, json.dumps({"parameters": described, "seconds": timings[name]}, indent=2))
        started.unlink(missing_ok=True)
        upstream_ran = True
    write_text_atomic(output / "timings.json", json.dumps(timings, indent=2) + "\n")
    evaluations = [s for s in steps.values() if isinstance(s, EvaluateStep)]
    if not evaluations:
        return {}
    metrics = json.loads(Path(evaluations[-1].output).read_text(encoding="utf-8"))
    write_text_atomic(output / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    return metrics


def _remove(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
