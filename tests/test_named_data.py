"""Collections by name (`irds:`, `hf:`): read for real by ir_datasets and Hugging Face `datasets` from
local files (a prepared IR_DATASETS_HOME; local folders in the hub's BEIR and MTEB layouts), with the
network shut (offline mode, and a proxy that refuses every connection), materialised into a cached
BEIR folder that every command and recipe reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

# Ids that look like numbers: a reader that guesses types (CSV) would make "007" 7.
DOCS = [("007", "Memory", "compact memories have flexible capacities"),
        ("12", "", "an electronic analogue computer for linear equations"),
        ("13", "Storage", "magnetic storage of digital data")]  # fmt: skip
QUERIES = [("01", "memory capacity"), ("2", "magnetic data storage")]
JUDGEMENTS = {"test": [("01", "007", 1), ("2", "13", 2)], "train": [("01", "12", 1)]}


def _lines(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _card(configs: dict[str, dict[str, str]]) -> str:
    """A dataset card whose YAML header lists configs and their split files, as hub datasets have."""
    listed = [{"config_name": name, "data_files": [{"split": s, "path": p} for s, p in splits.items()]}
              for name, splits in configs.items()]  # fmt: skip
    return "---\n" + yaml.safe_dump({"configs": listed}, sort_keys=False) + "---\n"


def write_mteb_layout(folder: Path) -> Path:
    """MTEB's layout: configs corpus, queries and default (the judgements), as JSON lines."""
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text(_lines([{"_id": i, "title": t, "text": x} for i, t, x in DOCS]))
    (folder / "queries.jsonl").write_text(_lines([{"_id": i, "text": x} for i, x in QUERIES]))
    for split, rows in JUDGEMENTS.items():
        judged = [{"query-id": q, "corpus-id": d, "score": float(s)} for q, d, s in rows]
        (folder / "qrels" / f"{split}.jsonl").write_text(_lines(judged))
    splits = {s: f"qrels/{s}.jsonl" for s in JUDGEMENTS}
    configs = {"default": splits, "corpus": {"corpus": "corpus.jsonl"},
               "queries": {"queries": "queries.jsonl"}}  # fmt: skip
    (folder / "README.md").write_text(_card(configs))
    return folder


def write_beir_layout(folder: Path) -> Path:
    """BeIR's layout: configs corpus and queries as parquet, the judgements in a `-qrels` dataset of
    TSV files beside it."""
    (folder / "corpus").mkdir(parents=True)
    (folder / "queries").mkdir()
    columns = list(zip(*DOCS, strict=True))
    pq.write_table(pa.table({"_id": columns[0], "title": columns[1], "text": columns[2]}),
                   folder / "corpus" / "corpus-0-of-1.parquet")  # fmt: skip
    ids, texts = zip(*QUERIES, strict=True)
    pq.write_table(pa.table({"_id": ids, "text": texts}), folder / "queries" / "queries-0-of-1.parquet")
    configs = {"corpus": {"corpus": "corpus/*.parquet"}, "queries": {"queries": "queries/*.parquet"}}
    (folder / "README.md").write_text(_card(configs))
    qrels = folder.with_name(folder.name + "-qrels")
    qrels.mkdir()
    for split, rows in JUDGEMENTS.items():
        lines = ["query-id\tcorpus-id\tscore", *(f"{q}\t{d}\t{s}" for q, d, s in rows)]
        (qrels / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return folder


def write_vaswani_home(home: Path) -> Path:
    """An IR_DATASETS_HOME holding the three files ir_datasets extracts from Vaswani's archive, in that
    collection's own format (a record's id, its lines, a `/` line), so ir_datasets reads them and
    downloads nothing."""
    folder = home / "vaswani"
    folder.mkdir(parents=True)
    docs = "".join(f"{i}\n{text}\n   /\n" for i, (_, _, text) in enumerate(DOCS, start=1))
    (folder / "docs.txt").write_text(docs)
    queries = "".join(f"{i}\n{text}\n/\n" for i, (_, text) in enumerate(QUERIES, start=1))
    (folder / "queries.txt").write_text(queries)
    (folder / "qrels.txt").write_text("1\n 1 2\n   /\n2\n3\n   /\n")
    return home


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The environment of a densekit process with its own caches and no way out to the network."""
    variables = {key: value for key, value in os.environ.items() if not key.lower().endswith("_proxy")}
    dead_proxy = "http://127.0.0.1:9"  # the discard port: nothing listens, every connection is refused
    return variables | {
        "DENSEKIT_CACHE": str(tmp_path / "densekit-cache"), "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "IR_DATASETS_HOME": str(tmp_path / "irds-home"),
        "IR_DATASETS_DL_TRIES": "1", "HTTP_PROXY": dead_proxy, "HTTPS_PROXY": dead_proxy,
        "http_proxy": dead_proxy, "https_proxy": dead_proxy, "COLUMNS": "300",
    }  # fmt: skip


def densekit(env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess:
    """Run the command line in a process of its own (the libraries read their home variables once)."""
    command = [sys.executable, "-c", "from densekit.cli import main; main()", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def cached(env: dict[str, str]) -> list[Path]:
    """The collection folders materialised so far."""
    return sorted(p.parent for p in (Path(env["DENSEKIT_CACHE"]) / "collections").glob("*/*/corpus.jsonl"))


def read_collection(folder: Path) -> tuple[list[tuple], list[tuple], dict[str, list[tuple]]]:
    docs = [json.loads(line) for line in (folder / "corpus.jsonl").read_text().splitlines()]
    queries = [json.loads(line) for line in (folder / "queries.jsonl").read_text().splitlines()]
    judged = {p.stem: [tuple(line.split("\t")) for line in p.read_text().splitlines()[1:]]
              for p in (folder / "qrels").glob("*.tsv")}  # fmt: skip
    return ([(d["_id"], d["title"], d["text"].strip()) for d in docs],
            [(q["_id"], q["text"].strip()) for q in queries],
            {s: [(q, d, int(r)) for q, d, r in rows] for s, rows in judged.items()})  # fmt: skip


def test_hf_mteb_layout_is_a_collection_for_every_command(tmp_path: Path, env: dict[str, str]):
    source = write_mteb_layout(tmp_path / "nfmini")
    run = tmp_path / "bm25.trec"
    searched = densekit(env, "bm25", f"hf:{source}", "--output", run, "--k", "3")
    assert searched.returncode == 0, searched.stderr
    [folder] = cached(env)
    assert read_collection(folder) == (DOCS, QUERIES, JUDGEMENTS)
    manifest = json.loads((folder / "densekit-artefact.json").read_text())
    assert manifest["kind"] == "named collection"
    assert manifest["identity"]["source"] == f"hf:{source}"
    qrels = {f"qrels/{split}.tsv" for split in JUDGEMENTS}
    assert set(manifest["checksums"]) == {"corpus.jsonl", "queries.jsonl", *qrels}
    assert run.read_text().splitlines()[0].split()[:3] == ["01", "Q0", "007"]
    side = json.loads((tmp_path / ".bm25.trec.densekit.json").read_text())
    assert side["identity"]["inputs"] == [str(folder.resolve())]  # the folder, as any collection's


def test_hf_beir_layout_reads_parquet_and_the_qrels_dataset_beside_it(tmp_path: Path, env: dict[str, str]):
    source = write_beir_layout(tmp_path / "nfmini")
    validated = densekit(env, "validate", f"hf:{source}", "--split", "train")
    assert validated.returncode == 0, validated.stderr
    [folder] = cached(env)
    assert read_collection(folder) == (DOCS, QUERIES, JUDGEMENTS)  # "007" and "01" stay as they are


def test_irds_reads_a_prepared_home(env: dict[str, str]):
    write_vaswani_home(Path(env["IR_DATASETS_HOME"]))
    validated = densekit(env, "validate", "irds:vaswani")
    assert validated.returncode == 0, validated.stderr
    [folder] = cached(env)
    assert folder.name == "vaswani"
    docs, queries, judged = read_collection(folder)
    assert docs == [(str(i), "", text) for i, (_, _, text) in enumerate(DOCS, start=1)]  # Vaswani: no titles
    assert queries == [(str(i), text) for i, (_, text) in enumerate(QUERIES, start=1)]
    assert judged == {"test": [("1", "1", 1), ("1", "2", 1), ("2", "3", 1)]}


def in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point this process's densekit cache and `datasets`' own cache (which it reads at each load) into
    `tmp_path`."""
    import datasets

    monkeypatch.setenv("DENSEKIT_CACHE", str(tmp_path / "densekit-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def test_a_recipe_takes_a_name_as_its_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from densekit.data.dataset import Dataset
    from densekit.recipes.runner import run_recipe

    in_process(tmp_path, monkeypatch)
    source = write_mteb_layout(tmp_path / "nfmini")
    recipe = tmp_path / "bm25.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"path": "/nowhere"}, "steps": {
        "bm25": {"type": "bm25", "data": "{data.path}", "output": "{out}/bm25.trec"},
        "evaluate": {"type": "evaluate", "data": "{data.path}", "run": "{out}/bm25.trec",
                     "output": "{out}/bm25.json"}}}))  # fmt: skip
    metrics = run_recipe(recipe, tmp_path / "out", [f"data.path=hf:{source}"], "cpu", show_progress=False)
    assert metrics["nDCG@10"] > 0
    record = json.loads((tmp_path / "out" / ".steps" / "bm25.json").read_text())
    folder = Dataset.open(f"hf:{source}").root
    assert folder.parent.parent == tmp_path / "densekit-cache" / "collections"
    assert list(record["inputs"].values()) == [Dataset.open(folder).fingerprint()]  # the folder's content


def test_a_copy_is_reused_only_while_it_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from densekit.data.named import resolve_collection

    in_process(tmp_path, monkeypatch)
    source = write_mteb_layout(tmp_path / "nfmini")
    folder = resolve_collection(f"hf:{source}")
    manifest = folder / "densekit-artefact.json"
    os.utime(manifest, (1, 1))
    assert resolve_collection(f"hf:{source}") == folder
    assert manifest.stat().st_mtime == 1  # reused as it was
    changed = [{"_id": "01", "text": "memory"}, {"_id": "2", "text": "tape"}]
    (source / "queries.jsonl").write_text(_lines(changed))
    assert resolve_collection(f"hf:{source}") == folder
    assert read_collection(folder)[1] == [("01", "memory"), ("2", "tape")]  # the source changed: read again
    (folder / "corpus.jsonl").write_text("")  # damaged
    resolve_collection(f"hf:{source}")
    assert read_collection(folder)[0] == DOCS


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("irds:no-such/collection", "irds:no-such/collection: ir_datasets 0."),
        ("irds:vaswani", "irds:vaswani: ir_datasets could not download its files (no network?); put them "
                         "under IR_DATASETS_HOME"),
        ("hf:nobody/no-such-dataset", "hf:nobody/no-such-dataset: datasets could not load it"),
    ],
)  # fmt: skip
def test_a_name_that_cannot_be_read_is_refused_in_one_line(env: dict[str, str], name: str, says: str):
    refused = densekit(env, "validate", name)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.strip() and not line.startswith("INFO ")]
    assert len(lines) == 1, refused.stderr  # one line, beside what densekit said it was doing
    assert lines[0].startswith("error: " + says), lines[0]
    assert cached(env) == []


@pytest.mark.parametrize(
    ("name", "module"), [("irds:vaswani", "ir_datasets"), ("hf:BeIR/nfcorpus", "datasets")]
)
def test_a_missing_library_names_the_extra(tmp_path: Path, env: dict[str, str], name: str, module: str):
    shadow = tmp_path / "not-installed"
    shadow.mkdir()
    (shadow / f"{module}.py").write_text("raise ImportError('not installed')\n")  # as if it were absent
    refused = densekit(env | {"PYTHONPATH": str(shadow)}, "validate", name)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"error: {name}: reading it needs the {module} package: pip install 'densekit[data]'"
    ]


def test_exact_repeats_are_written_once_and_conflicting_ones_refused(tmp_path: Path, monkeypatch):
    from densekit.data.named import resolve_collection
    from densekit.diagnostics import DataError

    in_process(tmp_path, monkeypatch)
    source = write_mteb_layout(tmp_path / "nfmini")
    # the queries in two splits, "01" in both (as some MTEB datasets list them), and a judgement twice
    (source / "queries-dev.jsonl").write_text(_lines([{"_id": "01", "text": "memory capacity"}]))
    card = (source / "README.md").read_text()
    (source / "README.md").write_text(card.replace("  - split: queries\n    path: queries.jsonl\n",
                                                   "  - split: dev\n    path: queries-dev.jsonl\n"
                                                   "  - split: test\n    path: queries.jsonl\n"))  # fmt: skip
    with (source / "qrels" / "test.jsonl").open("a") as judged:
        judged.write(json.dumps({"query-id": "2", "corpus-id": "13", "score": 2.0}) + "\n")
    folder = resolve_collection(f"hf:{source}")
    assert read_collection(folder) == (DOCS, QUERIES, JUDGEMENTS)
    (source / "queries-dev.jsonl").write_text(_lines([{"_id": "01", "text": "another text"}]))
    with pytest.raises(DataError, match=r"queries\.jsonl:2: error: duplicate"):
        resolve_collection(f"hf:{source}")


@pytest.mark.parametrize("name", ["irds:..", "irds:.", "irds:../../etc", "hf:../x@..", "irds:a/../.."])
def test_a_name_never_leads_out_of_its_cache_folder(tmp_path: Path, monkeypatch, name: str):
    from densekit.data.named import cached_folder

    monkeypatch.setenv("DENSEKIT_CACHE", str(tmp_path))
    scheme = name.split(":")[0]
    folder = cached_folder(name)
    assert folder.parent == tmp_path / "collections" / scheme
    assert folder.name not in (".", "..")


def _halve_a_score(source: Path) -> None:
    rows = [json.loads(line) for line in (source / "qrels" / "test.jsonl").read_text().splitlines()]
    (source / "qrels" / "test.jsonl").write_text(_lines([rows[0] | {"score": 0.5}, *rows[1:]]))


def _drop_the_queries_config(source: Path) -> None:
    card = (source / "README.md").read_text()
    (source / "README.md").write_text(card.replace("queries", "topics"))


@pytest.mark.parametrize(
    ("spoil", "says"),
    [(_halve_a_score, r"query 01, document 007: score 0\.5 is not a whole number$"),
     (_drop_the_queries_config, r"not in the BEIR or MTEB layout: it has no queries config \(its configs: "
                                r"default, corpus, topics\)$")],
)  # fmt: skip
def test_a_dataset_densekit_cannot_read_is_refused_in_one_line(tmp_path: Path, monkeypatch, spoil, says: str):
    from densekit.data.named import resolve_collection
    from densekit.errors import DensekitError

    in_process(tmp_path, monkeypatch)
    source = write_mteb_layout(tmp_path / "nfmini")
    spoil(source)
    with pytest.raises(DensekitError, match=f"^hf:{re.escape(str(source))}: {says}") as refused:
        resolve_collection(f"hf:{source}")
    assert "\n" not in str(refused.value)
    assert not list((tmp_path / "densekit-cache").rglob("corpus.jsonl"))  # nothing half-made is left
