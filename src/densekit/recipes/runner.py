"""Running a recipe: resolve placeholders and overrides, run each step unless it is already done.

A recipe is YAML: free sections of values (`data`, `model`, ...) that strings refer to as
`{data.path}` (and `{out}`, the output folder), and `steps`, an ordered mapping of named steps, each
with a `type` (mine, train, train_cross_encoder, score, encode, index, search, bm25, rerank, fuse,
evaluate; merge_examples, route, average, generate, benchmark, table) and its parameters. Any value can be
overridden as `dotted.key=value` (`data.path=/some/beir/folder`, `steps.round1.config.optim.epochs=2`).

Each finished step leaves `OUT/.steps/<name>.json` recording its resolved parameters and the digests
of its inputs' content (collections, models, runs, embeddings). A step whose record matches is
skipped; one started but not finished (killed) runs again and resumes where it can; one whose
parameters or inputs changed runs from scratch, and so do the steps after it: its outputs that
densekit made are replaced, and an output that densekit did not make is refused, never removed.
Overrides must name keys the recipe has (or a step's parameters, which are validated). The last
evaluate step's scores are written to `OUT/metrics.json`, and set beside the recipe's `expected` ones only
when that evaluation is of the collection they were measured on (`expected.measured_on.digest`, see
`collection_digest`); otherwise a line says they are not compared, and why. The runs steps write carry
the step's name as their tag.

A recipe is refused, before any step runs, when a step writes outside OUT (`..`, an absolute path, a
link out of it) unless the user passes `allow_outside_out` (`densekit run --allow-outside-out`), or over
the run's own record (`recipe.yaml`, `.steps`, ...), or where another step writes. Step names are plain
words (they name the markers' files), and placeholders expand to at most `MAX_RESOLVED` characters and
values per step (the YAML itself is bounded by `densekit.configuration`).
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from densekit.configuration import (
    COMMAND_LINE,
    ConfigError,
    YamlProblem,
    apply_overrides,
    key_lines,
    parse_yaml,
    read_yaml,
    split_override,
    validate_config,
)
from densekit.data.dataset import Dataset, input_fingerprint
from densekit.device import resolve_device
from densekit.diagnostics import DataError, Problem
from densekit.errors import SettingError, StateError
from densekit.io.artefact import MANIFEST, read_manifest, write_folder_manifest
from densekit.io.atomic import TEMPORARY, write_text_atomic
from densekit.io.lock import holding
from densekit.io.outputs import claim_folder
from densekit.models.hub import resolve_model_path
from densekit.recipes.module_steps import MODULE_STEP_TYPES
from densekit.recipes.steps import STEP_TYPES, EvaluateStep, Step, TrainerStep, describe
from densekit.training import distributed

log = logging.getLogger("densekit")

MARKERS = ".steps"
KIND = "recipe run"
# What a recipe run writes in its folder beside its steps' outputs (which carry their own manifests).
RECIPE_ENTRIES = (MARKERS, "recipe.yaml", "timings.json", "metrics.json")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][\w.]*)\}")
_RESERVED = {"description", "expected", "steps"}
_STEP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,99}")
_MANIFEST_NAME = re.compile(r"\..+\.densekit\.json")  # a file output's manifest (`artefact.sidecar`)
ALL_STEP_TYPES = {**STEP_TYPES, **MODULE_STEP_TYPES}
# The characters and values one step's placeholders may expand to; a step of the shipped recipes needs
# about a thousand, and placeholders naming placeholders could otherwise grow without bound.
MAX_RESOLVED = 1_000_000
# How far a score may move from the recipe's `expected` one, on the collection it was measured on, before
# the difference is a warning: a run on other hardware or library versions moves it by a few thousandths.
EXPECTED_TOLERANCE = 0.01


class _Budget:
    """What resolving one value may still make, in characters of strings and values of lists and
    mappings."""

    def __init__(self) -> None:
        self.left = MAX_RESOLVED

    def spend(self, amount: int, where: str) -> None:
        """Count `amount` made at `where`; raise past the limit."""
        self.left -= amount
        if self.left < 0:
            limit = f"more than {MAX_RESOLVED} characters and values"
            raise SettingError(f"{where}: placeholders expand to {limit}")


def _lookup(context: dict[str, Any], dotted: str, where: str) -> Any:
    node: Any = context
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise SettingError(f"{where}: unknown placeholder {{{dotted}}}")
        node = node[part]
    return node


def resolve(
    value: Any,
    context: dict[str, Any],
    where: str = "recipe",
    _budget: _Budget | None = None,
    _within: tuple[str, ...] = (),
) -> Any:
    """`value` with every `{dotted.name}` replaced from `context`; a lone placeholder keeps its type.
    A placeholder met again inside its own value is a loop, and the whole may expand to at most
    `MAX_RESOLVED` characters and values (`_within` and `_budget` carry both down the recursion)."""
    budget = _budget if _budget is not None else _Budget()
    if isinstance(value, dict):
        budget.spend(1 + len(value), where)
        return {k: resolve(v, context, f"{where}.{k}", budget, _within) for k, v in value.items()}
    if isinstance(value, list):
        budget.spend(1 + len(value), where)
        return [resolve(v, context, where, budget, _within) for v in value]
    if not isinstance(value, str):
        budget.spend(1, where)
        return value

    def replacement(match: re.Match) -> str:
        text = str(_lookup(context, match.group(1), where))
        budget.spend(len(text), where)
        return text

    for _ in range(10):
        whole = _PLACEHOLDER.fullmatch(value)
        if whole:
            if whole.group(1) in _within:
                break
            _within = (*_within, whole.group(1))
            value = _lookup(context, whole.group(1), where)
            if not isinstance(value, str):
                return resolve(value, context, where, budget, _within)
            continue
        replaced = _PLACEHOLDER.sub(replacement, value)
        if replaced == value:
            budget.spend(len(value), where)
            return value
        value = replaced
    raise SettingError(f"{where}: placeholders refer to each other in a loop")


def _check_override_keys(path: Path, tree: dict[str, Any], overrides: list[str]) -> None:
    """Refuse an override that names no key of the recipe: a typo would otherwise change nothing."""
    steps = tree.get("steps") if isinstance(tree.get("steps"), dict) else {}
    for override in overrides:
        parts = split_override(override)[0]
        if parts[0] == "steps":
            if len(parts) < 3 or parts[1] not in steps:
                raise SettingError(
                    f"override {override!r}: {Path(path).name} has no step {'.'.join(parts[:2])!r} "
                    f"(its steps: {', '.join(steps)})"
                )
            continue  # a step's keys are checked against its parameters
        node: Any = tree
        for depth, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                known = ", ".join(_dotted_keys(tree, exclude={"steps"}))
                raise SettingError(
                    f"override {override!r}: {Path(path).name} has no key {'.'.join(parts[: depth + 1])!r}"
                    f" (its keys: {known})"
                )
            node = node[part]


def _take_appended_steps(output: Path, identity: dict[str, Any]) -> None:
    """Let a run continue under a recipe that only adds steps after its own (an evaluation, say): the
    run's record then names the new steps too. Any other change of steps is left for `claim_folder` to
    refuse."""
    made = read_manifest(output) if output.is_dir() else None
    if made is None or made.kind != KIND or made.identity == identity:
        return
    before, now = list(made.identity.get("steps", {}).items()), list(identity["steps"].items())
    if len(before) < len(now) and now[: len(before)] == before:
        added = ", ".join(name for name, _ in now[len(before) :])
        log.info("the recipe adds steps after the %d of the run in %s: %s", len(before), output, added)
        write_folder_manifest(output, KIND, identity, made.about)


def _dotted_keys(tree: dict[str, Any], prefix: str = "", exclude: set[str] = frozenset()) -> list[str]:
    keys = []
    for key, value in tree.items():
        if key in exclude:
            continue
        name = f"{prefix}{key}"
        keys.extend(_dotted_keys(value, f"{name}.") if isinstance(value, dict) else [name])
    return keys


def _validated(
    model: type[BaseModel], tree: dict, path: Path, where: str, overrides: list[str], lines: dict
) -> BaseModel:
    """`tree` as `model`; an invalid key is blamed on its command-line override or on its line of the
    recipe, named from the recipe's top (`where` is the tree's place in it)."""
    try:
        return validate_config(tree, model, path, overrides, lines)
    except DataError as err:
        override, named = "command-line override ", f"command-line override {where}."
        problems = [
            Problem(p.path, p.line, p.message.replace(override, named, 1) if p.path == COMMAND_LINE
                    else f"{where}.{p.message}")
            for p in err.problems
        ]  # fmt: skip
        shown = [p.message if p.path == COMMAND_LINE else str(p) for p in problems]
        raise ConfigError(problems, shown) from None


def load_recipe(
    path: Path, output: Path, overrides: list[str], allow_outside_out: bool = False
) -> tuple[dict[str, Any], dict[str, Step]]:
    """The recipe's resolved tree and its steps, validated, in order; with their outputs checked (see
    `check_outputs`)."""
    tree = read_yaml(path)
    lines = key_lines(path)
    _check_expected_section(path, tree.get("expected"), lines)
    if "out" in tree:
        message = "out is the output folder (--out): a recipe cannot set it; give this section another name"
        raise DataError([Problem(Path(path), lines.get(("out",)), message)])
    _check_override_keys(path, tree, overrides)
    tree = apply_overrides(tree, overrides)
    steps_tree = tree.get("steps")
    if not isinstance(steps_tree, dict) or not steps_tree:
        raise DataError([Problem(Path(path), None, "a recipe needs a mapping of named steps under `steps`")])
    context = {k: v for k, v in tree.items() if k not in _RESERVED}
    context["out"] = str(output)
    steps = {}
    step_lines = [line for key, line in lines.items() if len(key) == 2 and key[0] == "steps"]
    for position, (name, raw) in enumerate(steps_tree.items()):
        line = step_lines[position] if position < len(step_lines) else None
        steps[name] = _load_step(path, name, raw, context, overrides, lines, line)
    check_outputs(path, steps, output, allow_outside_out, lines)
    return tree, steps


def _load_step(
    path: Path,
    name: Any,
    raw: Any,
    context: dict[str, Any],
    overrides: list[str],
    lines: dict,
    line: int | None,
) -> Step:
    """One step of the recipe, resolved and validated; `line` is its name's line."""
    if not isinstance(name, str) or not _STEP_NAME.fullmatch(name):
        message = f"step name {name!r}: use letters, digits, - and _ (up to 100), not - first"
        raise DataError([Problem(Path(path), line, message)])
    try:
        resolved = resolve(raw, context, f"steps.{name}")
    except ValueError as err:
        raise DataError([Problem(Path(path), line, str(err))]) from None
    step_type = resolved.get("type") if isinstance(resolved, dict) else None
    if not isinstance(step_type, str) or step_type not in ALL_STEP_TYPES:
        raise DataError(
            [Problem(Path(path), line, f"steps.{name}: type must be one of {', '.join(ALL_STEP_TYPES)}")]
        )
    prefix = ("steps", name)
    step_lines = {key[2:]: n for key, n in lines.items() if key[:2] == prefix}
    inside = f"steps.{name}."
    step_overrides = [o.removeprefix(inside) for o in overrides if o.startswith(inside)]
    step = _validated(ALL_STEP_TYPES[step_type], resolved, path, f"steps.{name}", step_overrides, step_lines)
    step._name = name  # type: ignore[attr-defined]
    if isinstance(step, TrainerStep):
        # check the run's own config now, not when the steps before it are done
        config_lines = {key[1:]: n for key, n in step_lines.items() if key[:1] == ("config",)}
        config_overrides = [o.removeprefix("config.") for o in step_overrides if o.startswith("config.")]
        _validated(step.config_type, {"device": "auto", **step.config}, path,
                   f"steps.{name}.config", config_overrides, config_lines)  # fmt: skip
    return step


def check_outputs(
    path: Path, steps: dict[str, Step], output: Path, allow_outside_out: bool, lines: dict
) -> None:
    """Refuse, before any step runs, a step writing outside `output` (after `..` and links; unless
    `allow_outside_out`), onto `output` itself or the run's own record, or where another step writes."""
    root = Path(output).resolve()
    written: dict[Path, str] = {}
    problems = []
    for name, step in steps.items():
        line = lines.get(("steps", name, "output"), lines.get(("steps", name)))
        for target in step.outputs():
            problem = _output_problem(Path(target).resolve(), root, allow_outside_out, written, name)
            problem = problem or _input_problem(Path(target).resolve(), step)
            if problem:
                problems.append(Problem(Path(path), line, f"steps.{name}.output: {target} {problem}"))
            written.setdefault(Path(target).resolve(), name)
    if problems:
        raise DataError(problems)


def _input_problem(target: Path, step: Step) -> str | None:
    """Why `target` would write over one of the step's own inputs, or None."""
    for given in step.inputs():
        source = Path(given).resolve()
        if source == target or source.is_relative_to(target):
            return f"is, or holds, {given}, an input of the step: write it elsewhere"
    return None


def _output_problem(
    target: Path, root: Path, allow_outside_out: bool, written: dict[Path, str], name: str
) -> str | None:
    """Why a step may not write `target` (resolved), or None."""
    if target == root:
        return "is --out itself: name a path inside it"
    if not target.is_relative_to(root):
        if allow_outside_out:
            return None if target not in written else f"is written by step {written[target]} too"
        return f"is outside --out ({root}); pass --allow-outside-out to let the recipe write there"
    first = target.relative_to(root).parts[0]
    if first in (*RECIPE_ENTRIES, MANIFEST):
        return f"is the run's own record ({first}): name another path"
    if _MANIFEST_NAME.fullmatch(target.name) or TEMPORARY.match(target.name):
        return "is a name densekit keeps for its manifests and temporary files: name another path"
    for other, step in written.items():
        if other == target:
            return f"is written by step {step} too"
        if target.is_relative_to(other) or other.is_relative_to(target):
            return f"is inside what step {step} writes, or holds it"
    return None


def check_steps_device(path: Path, steps: dict[str, Step], device: str) -> None:
    """Refuse, before any step runs, a recipe with a step that `device` cannot run (fp16 on a CPU)."""
    target, lines = resolve_device(device), key_lines(path)
    problems = []
    for name, step in steps.items():
        try:
            step.check_device(target)
        except ValueError as err:
            problems.append(Problem(Path(path), lines.get(("steps", name)), f"steps.{name}: {err}"))
    if problems:
        raise DataError(problems)


def step_record(step: Step) -> dict[str, Any]:
    """What a step's markers record: its resolved parameters and the digests of its inputs."""
    inputs = {path: input_fingerprint(resolve_model_path(path)) for path in step.inputs()}
    return {"parameters": describe(step), "inputs": inputs}


def _same(recorded: dict[str, Any] | None, record: dict[str, Any]) -> bool:
    """Whether a marker records this very step: equal parameters (whatever the order of their keys; a
    setting recorded as null equals one left out, as settings added later are when unset) and inputs of
    the same content."""
    if recorded is None:
        return False
    try:
        parameters = (parse_yaml(str(recorded.get("parameters"))), parse_yaml(record["parameters"]))
    except YamlProblem:
        return False
    same_parameters = _without_nulls(parameters[0]) == _without_nulls(parameters[1])
    return same_parameters and recorded.get("inputs") == record["inputs"]


def _without_nulls(value: Any) -> Any:
    """`value` with every mapping's null-valued keys left out, at any depth."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _read_marker(path: Path) -> dict[str, Any] | None:
    """A step's marker, or None when there is none; a marker damaged by hand (not a JSON object) counts
    as none, so the step runs again."""
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        marker = None
    if not isinstance(marker, dict):
        log.warning("%s is not a step marker densekit wrote; the step runs again", path)
        return None
    return marker


@holding("output")
def run_recipe(
    path: Path,
    output: Path,
    overrides: list[str] | None = None,
    device: str = "auto",
    show_progress: bool = True,
    overwrite: bool = False,
    allow_outside_out: bool = False,
) -> dict[str, float]:
    """Run every step not yet done; returns the final evaluation.

    `output` must be new, empty, or a run of a recipe with the same steps, or with steps added after
    them (continued); one of another recipe is replaced only with `overwrite`, and a folder densekit did
    not make never. Steps write only inside `output` unless `allow_outside_out`.
    """
    if distributed.world_size() > 1:
        raise StateError(
            "run recipes in one process; launch multi-process training with torchrun densekit train"
        )
    output = Path(output)
    tree, steps = load_recipe(path, output, overrides or [], allow_outside_out)
    check_steps_device(path, steps, device)
    identity = {"steps": {name: step.type for name, step in steps.items()}}  # type: ignore[attr-defined]
    _take_appended_steps(output, identity)
    if claim_folder(output, KIND, identity, [path], overwrite, RECIPE_ENTRIES) == "new":
        output.mkdir(parents=True, exist_ok=True)
        write_folder_manifest(output, KIND, identity, {"recipe": str(path)})
    markers = output / MARKERS
    markers.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        output / "recipe.yaml",
        Path(path).read_text(encoding="utf-8") + "\n# overrides: " + json.dumps(overrides or []) + "\n",
    )
    timings: dict[str, float] = {}
    upstream_ran = False
    for name, step in steps.items():
        record = step_record(step)
        done, started = markers / f"{name}.json", markers / f"{name}.started"
        finished = _read_marker(done)
        if _same(finished, record) and not upstream_ran:
            log.info("step %s: already done", name)
            timings[name] = finished.get("seconds", 0.0)  # type: ignore[union-attr]
            continue
        began = _read_marker(started)
        # a step that never ran here has nothing to start over; one that did is redone when its
        # parameters changed, or when a step before it ran again (its inputs may differ)
        ran_before = finished is not None or began is not None
        start_over = ran_before and (finished is not None or upstream_ran or not _same(began, record))
        if start_over:
            log.info("step %s: its parameters or inputs changed; starting it over", name)
        done.unlink(missing_ok=True)
        write_text_atomic(started, json.dumps(record, indent=2))
        log.info("step %s (%s)", name, step.type)  # type: ignore[attr-defined]
        begun = time.perf_counter()
        step.run(device, show_progress, start_over)  # type: ignore[attr-defined]
        timings[name] = round(time.perf_counter() - begun, 1)
        write_text_atomic(done, json.dumps({**record, "seconds": timings[name]}, indent=2))
        started.unlink(missing_ok=True)
        upstream_ran = True
    write_text_atomic(output / "timings.json", json.dumps(timings, indent=2) + "\n")
    evaluations = [s for s in steps.values() if isinstance(s, EvaluateStep)]
    if not evaluations:
        return {}
    metrics = json.loads(Path(evaluations[-1].output).read_text(encoding="utf-8"))
    write_text_atomic(output / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    for line in expected_lines(tree.get("expected"), evaluations[-1], metrics, overrides or []):
        log.log(line[0], "%s", line[1])
    return metrics


def collection_digest(data: Path | str, split: str) -> str:
    """One digest of a collection's corpus, queries and `split`'s judgements: what a recipe's `expected`
    scores record of the collection they were measured on (`measured_on.digest`). For the test split it
    is the digest the quickstart recognises collections by."""
    dataset = Dataset.open(data)
    files = [dataset.corpus_path, dataset.queries_path(split), dataset.qrels_path(split)]
    return dataset.digest_files(files)


def _check_expected_section(path: Path, expected: Any, lines: dict) -> None:
    """Refuse an `expected` section that is not measure names with scores and, optionally, `measured_on`
    with the collection's name and digest."""
    if expected is None:
        return
    where = Path(path), lines.get(("expected",))
    if not isinstance(expected, dict):
        raise DataError([Problem(*where, "expected: give measure: score pairs, e.g. {nDCG@10: 0.73}")])
    for measure, score in expected.items():
        if measure == "measured_on":
            if not (isinstance(score, dict) and isinstance(score.get("digest"), str)):
                message = "expected.measured_on: give {collection: NAME, digest: sha256:...}"
                raise DataError([Problem(*where, message)])
        elif isinstance(score, bool) or not isinstance(score, int | float):
            raise DataError([Problem(*where, f"expected.{measure}: {score!r} is not a score")])


def expected_lines(
    expected: dict[str, Any] | None, evaluation: EvaluateStep, metrics: dict[str, float], overrides: list[str]
) -> list[tuple[int, str]]:
    """What the console says of the recipe's `expected` scores, as (logging level, line): each beside the
    run's when the last evaluation is of the collection they were measured on (its `measured_on.digest`),
    a warning where one differs by more than EXPECTED_TOLERANCE; otherwise one line saying they are not
    compared, and why."""
    if not expected:
        return []
    scores = {k: float(v) for k, v in expected.items() if k != "measured_on"}
    measured_on = expected.get("measured_on") or {}
    named = measured_on.get("collection", "another collection")
    if "digest" not in measured_on:
        return [(logging.INFO, "expected scores not compared: the recipe does not say which collection "
                               "they were measured on (expected.measured_on)")]  # fmt: skip
    if collection_digest(evaluation.data, evaluation.split) != measured_on["digest"]:
        return [(logging.INFO, f"expected scores not compared: they were measured on {named}, and the "
                               f"evaluation here is on {evaluation.data} ({evaluation.split}), whose corpus, "
                               "queries or judgements differ")]  # fmt: skip
    lines = []
    changed = f" (with overrides {', '.join(overrides)})" if overrides else ""
    for measure, score in scores.items():
        if measure not in metrics:
            lines.append((logging.INFO, f"expected {measure} {score:.4f} not compared: the evaluation "
                                        f"did not measure it"))  # fmt: skip
            continue
        difference = metrics[measure] - score
        level = logging.WARNING if abs(difference) > EXPECTED_TOLERANCE else logging.INFO
        lines.append((level, f"{measure} {metrics[measure]:.4f}, expected {score:.4f} on {named} "
                             f"({difference:+.4f}){changed}"))  # fmt: skip
    return lines
