"""Inference through OpenVINO (`--backend openvino`): the conversion against PyTorch, int8 calibrated on
the corpus, what artefacts record of it, and resuming an int8 encoding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from densekit.cli import app
from densekit.data import Dataset
from densekit.encoding import corpus as corpus_module
from densekit.encoding.corpus import encode_corpus, use_corpus_backend
from densekit.encoding.embed import embed_texts
from densekit.encoding.openvino_backend import calibration_texts, export_openvino
from densekit.encoding.runtimes import use_backend
from densekit.encoding.store import EmbeddingStore
from densekit.io.outputs import OutputError
from densekit.models import DenseEncoder
from densekit.recipes.steps import EncodeStep

from .conftest import tiny_bert

pytest.importorskip("openvino")
pytest.importorskip("nncf")

TEXTS = [
    "a",
    "marine mammals that breathe air",
    "dense retrieval ranks passages by the inner product of their vectors with the query's " * 3,
    "how do plants make energy from light",
]
CALIBRATION = [f"passage {i} about {' '.join(['plants', 'light', 'energy', 'whales'][: 1 + i % 4] * (i % 7))}"
               for i in range(40)]  # fmt: skip


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def prefixed(tmp_path_factory: pytest.TempPathFactory) -> DenseEncoder:
    """A tiny encoder with a query prefix left out of the pooling, so the two kinds differ."""
    path = tiny_bert(tmp_path_factory.mktemp("openvino") / "model", seed=3)
    return DenseEncoder.load(path, query_prefix="query: ", include_prompt=False).eval()


def test_int8_is_calibrated_on_the_texts_given_and_the_same_texts_give_the_same_vectors(
    prefixed: DenseEncoder,
):
    reference = embed_texts(prefixed, TEXTS, "passage")
    ids = prefixed.pad(prefixed.tokenize(TEXTS, "passage"))

    def vectors(calibration: list[str]) -> tuple[np.ndarray, dict]:
        exported = export_openvino(prefixed, "int8", ["passage"], calibration={"passage": calibration})
        return exported(ids["input_ids"], ids["attention_mask"], "passage").numpy(), exported.record()

    first, record = vectors(CALIBRATION)
    assert cosines(first, reference).min() > 0.95
    assert np.abs(first - reference).max() > 1e-4  # not the float32 model
    assert record["calibration"]["passage"]["texts"] == len(CALIBRATION)
    again, same = vectors(list(CALIBRATION))
    assert np.array_equal(first, again) and same == record  # what a resumed encoding relies on
    other, other_record = vectors(CALIBRATION[:8])
    assert other_record["calibration"] != record["calibration"]
    assert not np.array_equal(other, first)


def test_int8_without_texts_to_calibrate_on_is_refused_and_precisions_are_checked(prefixed: DenseEncoder):
    with pytest.raises(ValueError, match="calibrated on the query texts it encodes"):
        use_backend(prefixed, "openvino", "int8", ["query", "passage"], calibration={"passage": TEXTS})
    with pytest.raises(ValueError, match="--backend openvino runs float32 or bf16 or int8, not fp16"):
        use_backend(prefixed, "openvino", "fp16")
    with pytest.raises(ValueError, match="add --backend onnx or --backend openvino"):
        use_backend(prefixed, "torch", "int8")
    assert prefixed.runtime is None


def test_bf16_runs_where_the_cpu_computes_it_and_is_refused_elsewhere(prefixed: DenseEncoder):
    import openvino

    reference = embed_texts(prefixed, TEXTS, "query")
    if "BF16" not in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        with pytest.raises(ValueError, match="does not compute bf16"):
            use_backend(prefixed, "openvino", "bf16", ["query"])
        return
    use_backend(prefixed, "openvino", "bf16", ["query"])
    try:
        vectors = embed_texts(prefixed, TEXTS, "query")
    finally:
        prefixed.runtime = None
    assert cosines(vectors, reference).min() > 0.999
    assert np.abs(vectors - reference).max() > 1e-6  # rounded to bf16 on the way


def test_an_int8_encoding_records_its_calibration_and_resumes_to_the_same_vectors(
    tiny_model: Path, beir_dir: Path, tmp_path: Path, monkeypatch
):
    dataset = Dataset.open(beir_dir)

    def encoder() -> DenseEncoder:
        model = DenseEncoder.load(tiny_model)
        use_corpus_backend(model, "openvino", "int8", dataset)
        return model

    encode_corpus(encoder(), dataset, tmp_path / "straight", chunk_size=3, show_progress=False)
    made = EmbeddingStore.open(tmp_path / "straight").identity["inference"]
    texts = calibration_texts(dataset)
    assert len(texts) == dataset.count_documents()  # a corpus smaller than 512 calibrates on all of it
    assert made["calibration"]["passage"]["texts"] == len(texts)

    calls = []
    real = corpus_module.embed_texts

    def dies_on_second_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus_module, "embed_texts", dies_on_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(encoder(), dataset, tmp_path / "resumed", chunk_size=3, show_progress=False)
    monkeypatch.setattr(corpus_module, "embed_texts", real)
    progress = json.loads((tmp_path / "resumed" / "part-00000-of-00001.progress.json").read_text())
    assert progress["done"] == 3
    encode_corpus(encoder(), dataset, tmp_path / "resumed", chunk_size=3, show_progress=False)
    straight, resumed = EmbeddingStore.open(tmp_path / "straight"), EmbeddingStore.open(tmp_path / "resumed")
    assert np.array_equal(np.asarray(resumed.vectors()), np.asarray(straight.vectors()))
    exact = DenseEncoder.load(tiny_model)
    float32 = embed_texts(exact, [d.full_text for d in dataset.iter_corpus()], "passage")
    assert cosines(np.asarray(straight.vectors()), float32).min() > 0.95


def test_the_cli_and_a_recipe_encode_with_it_and_never_mix_it_with_onnx(
    tiny_model: Path, beir_dir: Path, tmp_path: Path
):
    emb = tmp_path / "emb"
    common = ["--no-progress", "--batch-size", "2"]
    result = invoke("encode", tiny_model, beir_dir, "-o", emb, "--backend", "openvino", "--precision", "int8",
                    *common)  # fmt: skip
    assert result.exit_code == 0, result.output
    record = EmbeddingStore.open(emb).identity["inference"]
    assert (record["backend"], record["precision"]) == ("openvino", "int8")
    with pytest.raises(OutputError, match=r"differs in: inference.backend, inference.calibration\)"):
        invoke("encode", tiny_model, beir_dir, "-o", emb, "--backend", "onnx", "--precision", "int8", *common)
    step = EncodeStep(type="encode", model=str(tiny_model), data=str(beir_dir), output=str(tmp_path / "step"),
                      backend="openvino", precision="int8")  # fmt: skip
    step.run("cpu", show_progress=False, overwrite=False)
    assert EmbeddingStore.open(tmp_path / "step").identity["inference"] == record
    from_step, from_cli = EmbeddingStore.open(tmp_path / "step"), EmbeddingStore.open(emb)
    np.testing.assert_array_equal(from_step.vectors(), from_cli.vectors())


def test_searching_with_openvino_queries_gives_the_torch_run_and_int8_queries_are_refused(
    tiny_model: Path, beir_dir: Path, tmp_path: Path
):
    emb, index = tmp_path / "emb", tmp_path / "index"
    assert invoke("encode", tiny_model, beir_dir, "-o", emb, "--no-progress").exit_code == 0
    assert invoke("index", emb, "-o", index, "--no-progress").exit_code == 0
    scores = {}
    for backend in ("torch", "openvino"):
        run = tmp_path / f"{backend}.trec"
        result = invoke("search", tiny_model, index, beir_dir, "-o", run, "--k", "20", "--backend", backend,
                        "--no-progress")  # fmt: skip
        assert result.exit_code == 0, result.output
        rows = [line.split() for line in run.read_text().splitlines()]
        scores[backend] = {(row[0], row[2]): float(row[4]) for row in rows}
    assert scores["openvino"].keys() == scores["torch"].keys()
    np.testing.assert_allclose([scores["openvino"][key] for key in scores["torch"]],
                               list(scores["torch"].values()), atol=1e-4)  # fmt: skip
    with pytest.raises(ValueError, match="calibrated on the query texts"):
        invoke("search", tiny_model, index, beir_dir, "-o", tmp_path / "x.trec", "--backend", "openvino",
               "--precision", "int8", "--no-progress")  # fmt: skip


def test_converting_and_quantising_send_no_telemetry_and_write_nothing_at_home(
    tiny_model: Path, tmp_path: Path
):
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    script = (
        "from densekit.models import DenseEncoder\n"
        "from densekit.encoding.openvino_backend import export_openvino\n"
        f"encoder = DenseEncoder.load({str(tiny_model)!r})\n"
        "export_openvino(encoder, 'int8', ['passage'], calibration={'passage': ['a text', 'another text']})\n"
        "import os; print(os.environ.get('CI'), os.environ.get('NNCF_CI'))\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("CI", "NNCF_CI")} | {"HOME": str(home)}
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].split() == ["None", "None"]  # the variables put back
    assert not list(home.rglob("*"))  # no consent file, no client id
