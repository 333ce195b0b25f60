"""Recipe steps for modules and routes, and for gathering benchmarks into one table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from densekit.data.dataset import Dataset
from densekit.data.examples import EXAMPLES_KIND, read_examples, write_examples
from densekit.errors import InputError
from densekit.evaluation.benchmark import BENCHMARK_MEASURES, BenchmarkOptions, run_benchmark
from densekit.io.outputs import check_file_output, write_output_text
from densekit.limits import MAX_RUN_DEPTH
from densekit.models.averaging import average_modules
from densekit.models.encoder import DenseEncoder
from densekit.recipes.steps import Step
from densekit.routing.hypernetwork import LoraHypernetwork
from densekit.routing.model_or_route import load_model_or_route
from densekit.routing.route import Route, load_modules
from densekit.routing.strategies import RouteSpec

TABLE_KIND = "benchmark table"


def _load_modules(folders: dict[str, str]) -> DenseEncoder:
    """The modules on their base, each of them the module its key names."""
    encoder, names = load_modules(list(folders.values()))
    for (name, folder), held in zip(folders.items(), names, strict=True):
        if name != held:
            raise InputError(f"{folder} holds module {held!r}, not {name!r}")
    return encoder


class MergeExamplesStep(Step):
    """Training files one after another in one file (examples of several domains, say)."""

    type: Literal["merge_examples"]
    inputs_: list[str] = Field(alias="inputs", min_length=1)
    output: str

    def inputs(self) -> list[str]:
        return list(self.inputs_)

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Write the examples of every input, in order."""
        check_file_output(self.output, EXAMPLES_KIND, self.inputs_, self.identity(), overwrite)
        examples = [example for path in self.inputs_ for example in read_examples(Path(path))]
        write_examples(Path(self.output), examples, self.inputs_, self.identity(), overwrite)


class RouteStep(Step):
    """`densekit modules route`: a fixed route over saved query-only modules."""

    type: Literal["route"]
    modules: dict[str, str] = Field(min_length=1, description="module name -> its folder")
    domains: dict[str, str] = Field(min_length=1, description="domain -> module name")
    fallback: str | None = None
    output: str

    def inputs(self) -> list[str]:
        return list(self.modules.values())

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Write the route folder."""
        encoder = _load_modules(self.modules)
        spec = RouteSpec(
            type="fixed", modules=list(self.modules), domains=self.domains, fallback=self.fallback
        )
        Route(encoder, spec).save(self.output, dict(self.modules))


class AverageStep(Step):
    """`densekit modules average`."""

    type: Literal["average"]
    modules: dict[str, str] = Field(min_length=2, description="module name -> its folder")
    weights: list[float]
    name: str = "averaged"
    output: str

    def inputs(self) -> list[str]:
        return list(self.modules.values())

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Write the averaged module's folder."""
        encoder = _load_modules(self.modules)
        average_modules(encoder, list(self.modules), self.weights, self.name)
        encoder.save(self.output, module=self.name)


class GenerateStep(Step):
    """`densekit modules generate`: a hypernetwork's module for one domain."""

    type: Literal["generate"]
    hypernetwork: str
    domain: str
    output: str

    def inputs(self) -> list[str]:
        return [self.hypernetwork]

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Write the domain's module folder."""
        network = LoraHypernetwork.load(self.hypernetwork)
        network.module_for(self.domain)
        network.encoder.save(self.output, module=self.domain)


class BenchmarkStep(Step):
    """`densekit benchmark`: a model (a folder, a module folder or a route folder) against BM25 on several
    collections; reuses what is unchanged, like the command."""

    type: Literal["benchmark"]
    model: str
    data: list[str] = Field(min_length=1)
    output: str
    name: str | None = None
    domains: list[str] | None = None
    indexes: list[str] | None = Field(
        default=None, description="an index per collection, searched instead of encoding its corpus"
    )
    split: str = "test"
    measures: list[str] = Field(default_factory=lambda: list(BENCHMARK_MEASURES))
    k: int = Field(1000, ge=1, le=MAX_RUN_DEPTH)
    batch_size: int = 64

    def inputs(self) -> list[str]:
        return [self.model, *self.data, *(self.indexes or [])]

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Benchmark and write the folder's table, JSON and chart."""
        encoder, route = load_model_or_route(self.model, device)
        for path in self.data:
            Dataset.open(path)  # a missing collection fails before any work
        options = BenchmarkOptions(
            self.split, self.measures, self.k, self.batch_size, show_progress, overwrite
        )
        run_benchmark(
            encoder, self.name or self._name or Path(self.model).name, [Path(p) for p in self.data],
            Path(self.output), options, route, self.domains,
            None if self.indexes is None else [Path(p) for p in self.indexes],
        )  # fmt: skip


class TableStep(Step):
    """One table of several benchmarks: a row per benchmark (its model), a column per collection and the
    mean, for one measure; BM25's row from the first benchmark. Markdown, and JSON beside it."""

    type: Literal["table"]
    benchmarks: dict[str, str] = Field(min_length=1, description="row name -> a benchmark folder")
    measure: str = "nDCG@10"
    output: str

    @field_validator("output")
    @classmethod
    def _not_the_json(cls, output: str) -> str:
        if Path(output).suffix == ".json":
            raise ValueError(f"{output} would be both the Markdown table and its JSON: name a .md file")
        return output

    def inputs(self) -> list[str]:
        return list(self.benchmarks.values())

    def outputs(self) -> list[str]:
        return [self.output, str(Path(self.output).with_suffix(".json"))]

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Write OUTPUT (Markdown) and OUTPUT's .json."""
        json_path = Path(self.output).with_suffix(".json")
        for path in (self.output, json_path):
            check_file_output(path, TABLE_KIND, self.inputs(), self.identity(), overwrite)
        rows: dict[str, dict[str, float]] = {}
        collections: list[str] = []
        for row, folder in self.benchmarks.items():
            results = json.loads((Path(folder) / "results.json").read_text(encoding="utf-8"))
            names = [c["name"] for c in results["collections"]]
            collections = collections or names
            if names != collections:
                raise InputError(
                    f"{folder}: benchmarks other collections ({names}) than the first ({collections})"
                )
            if not rows:
                rows["BM25"] = {c["name"]: c["scores"]["BM25"][self.measure] for c in results["collections"]}
            rows[row] = {
                c["name"]: c["scores"][results["model"]][self.measure] for c in results["collections"]
            }
        for values in rows.values():
            values["mean"] = sum(values[c] for c in collections) / len(collections)
        header = ["", *collections, "mean"]
        lines = [f"{self.measure}, {len(collections)} collections", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
        lines += ["| " + " | ".join([row] + [f"{values[c]:.4f}" for c in header[1:]]) + " |"
                  for row, values in rows.items()]  # fmt: skip
        identity, inputs = self.identity(), self.inputs()
        write_output_text(self.output, TABLE_KIND, "\n".join(lines) + "\n", identity, inputs, overwrite)
        table = {"measure": self.measure, "rows": rows}
        text = json.dumps(table, indent=2) + "\n"
        write_output_text(json_path, TABLE_KIND, text, identity, inputs, overwrite)


MODULE_STEP_TYPES: dict[str, type[Step]] = {
    "merge_examples": MergeExamplesStep, "route": RouteStep, "average": AverageStep, "generate": GenerateStep,
    "benchmark": BenchmarkStep, "table": TableStep,
}  # fmt: skip
