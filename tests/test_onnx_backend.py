"""Inference through ONNX Runtime (`--backend onnx`): the export against PyTorch, its int8, modules, and
what the artefacts it makes record."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from densekit.cli import app
from densekit.encoding.embed import embed_texts
from densekit.encoding.export import ExportError
from densekit.encoding.onnx_backend import export_encoder
from densekit.encoding.runtimes import use_backend
from densekit.encoding.store import EmbeddingStore
from densekit.evaluation.benchmark import BenchmarkOptions, run_benchmark
from densekit.io.outputs import OutputError
from densekit.models import DenseEncoder
from densekit.models.modules.kinds.lora import LoraSpec
from densekit.recipes.steps import EncodeStep
from densekit.training.passage_vectors import load_passage_vectors

from .conftest import tiny_bert

TEXTS = [
    "a",
    "marine mammals that breathe air",
    "dense retrieval ranks passages by the inner product of their vectors with the query's " * 3,
    "how do plants make energy from light",
]


def run_scores(path: Path) -> dict[tuple[str, str], float]:
    """A TREC run's scores by (query, document)."""
    rows = [line.split() for line in path.read_text().splitlines()]
    return {(row[0], row[2]): float(row[4]) for row in rows}


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def prefixed(tmp_path_factory: pytest.TempPathFactory) -> DenseEncoder:
    """A tiny encoder with a query prefix left out of the pooling, so the two kinds differ."""
    path = tiny_bert(tmp_path_factory.mktemp("onnx") / "model", seed=3)
    return DenseEncoder.load(path, query_prefix="query: ", include_prompt=False).eval()


@pytest.mark.parametrize("backend", ["onnx", "openvino"])
def test_a_float32_export_encodes_both_kinds_as_pytorch_does(prefixed: DenseEncoder, backend: str):
    pytest.importorskip(backend)
    reference = {kind: embed_texts(prefixed, TEXTS, kind, batch_size=3) for kind in ("query", "passage")}
    assert not np.allclose(reference["query"], reference["passage"], atol=1e-3)
    use_backend(prefixed, backend, "float32")
    try:
        assert prefixed.runtime.record() == {"backend": backend, "precision": "float32"}
        for kind in ("query", "passage"):
            np.testing.assert_allclose(embed_texts(prefixed, TEXTS, kind, batch_size=3), reference[kind],
                                       atol=1e-5)  # fmt: skip
    finally:
        prefixed.runtime = None


def test_an_int8_export_is_quantised_and_close(prefixed: DenseEncoder):
    reference = embed_texts(prefixed, TEXTS, "passage")
    exported = export_encoder(prefixed, "int8", ["passage"])
    ids = prefixed.pad(prefixed.tokenize(TEXTS, "passage"))
    vectors = exported(ids["input_ids"], ids["attention_mask"], "passage").numpy()
    cosines = (
        (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)
    )
    assert cosines.min() > 0.95
    assert np.abs(vectors - reference).max() > 1e-4  # not the float32 graph
    with pytest.raises(ValueError, match="encodes passage texts, not query ones"):
        exported(ids["input_ids"], ids["attention_mask"], "query")


def test_an_export_that_disagrees_with_pytorch_is_refused(prefixed: DenseEncoder, tmp_path: Path):
    exported = export_encoder(prefixed, "float32", ["passage"])
    other = DenseEncoder.load(tiny_bert(tmp_path / "other", seed=4)).eval()
    with pytest.raises(ExportError, match="disagrees with PyTorch: least cosine"):
        exported.check_against(other)


@pytest.mark.parametrize("backend", ["onnx", "openvino"])
def test_the_module_named_is_exported_and_must_be_the_one_encoded_with(tmp_path: Path, backend: str):
    pytest.importorskip(backend)
    encoder = DenseEncoder.load(tiny_bert(tmp_path / "model", seed=5)).eval()
    encoder.new_module(LoraSpec(name="domain", rank=4, alpha=8, dropout=0.0))
    with torch.no_grad():
        for name, parameter in encoder.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # a trained module: its output is not zero
    with_module = embed_texts(encoder, TEXTS, "query", module="domain")
    base = embed_texts(encoder, TEXTS, "query")
    assert not np.allclose(with_module, base, atol=1e-3)
    use_backend(encoder, backend, "float32", ["query"], module="domain")
    np.testing.assert_allclose(embed_texts(encoder, TEXTS, "query", module="domain"), with_module, atol=1e-5)
    with pytest.raises(RuntimeError, match="made with module 'domain', not None"):
        embed_texts(encoder, TEXTS, "query")


def test_int8_needs_onnx_and_onnx_needs_float32_or_int8(prefixed: DenseEncoder):
    with pytest.raises(ValueError, match="int8 runs through ONNX Runtime or OpenVINO: add --backend onnx"):
        use_backend(prefixed, "torch", "int8")
    with pytest.raises(ValueError, match="--backend onnx runs float32 or int8, not bf16"):
        use_backend(prefixed, "onnx", "bf16")
    assert prefixed.runtime is None


def test_embeddings_record_the_backend_and_are_not_mistaken_for_float32_ones(
    tiny_model: Path, beir_dir: Path, tmp_path: Path
):
    int8, float32 = tmp_path / "int8", tmp_path / "float32"
    common = ["--no-progress", "--batch-size", "2"]
    assert invoke("encode", tiny_model, beir_dir, "-o", int8, "--backend", "onnx", "--precision", "int8",
                  *common).exit_code == 0  # fmt: skip
    assert EmbeddingStore.open(int8).identity["inference"] == {"backend": "onnx", "precision": "int8"}
    with pytest.raises(OutputError, match=r"differs in: inference\)"):
        invoke("encode", tiny_model, beir_dir, "-o", int8, *common)
    assert invoke("encode", tiny_model, beir_dir, "-o", float32, *common).exit_code == 0
    assert "inference" not in EmbeddingStore.open(float32).identity  # as before backends existed
    quantised, exact = EmbeddingStore.open(int8).vectors(), EmbeddingStore.open(float32).vectors()
    assert 1e-4 < np.abs(quantised - exact).max() < 0.2
    with pytest.raises(ValueError, match="int8 runs through ONNX Runtime or OpenVINO: add --backend onnx"):
        invoke("encode", tiny_model, beir_dir, "-o", tmp_path / "x", "--precision", "int8", *common)

    encoder = DenseEncoder.load(tiny_model)
    with pytest.raises(ValueError, match="was encoded by onnx at int8; training looks up the float32"):
        load_passage_vectors([str(int8)], encoder, {"": beir_dir}, "/")


def test_searching_with_onnx_queries_gives_the_torch_run(tiny_model: Path, beir_dir: Path, tmp_path: Path):
    emb, index = tmp_path / "emb", tmp_path / "index"
    assert invoke("encode", tiny_model, beir_dir, "-o", emb, "--no-progress").exit_code == 0
    assert invoke("index", emb, "-o", index, "--no-progress").exit_code == 0
    runs = {}
    for backend in ("torch", "onnx"):
        runs[backend] = tmp_path / f"{backend}.trec"
        result = invoke("search", tiny_model, index, beir_dir, "-o", runs[backend], "--k", "20",
                        "--backend", backend, "--no-progress")  # fmt: skip
        assert result.exit_code == 0, result.output
    # every document is retrieved (k > corpus); a random model's scores nearly tie, so compare scores
    torch_scores, onnx_scores = run_scores(runs["torch"]), run_scores(runs["onnx"])
    assert onnx_scores.keys() == torch_scores.keys()
    np.testing.assert_allclose([onnx_scores[key] for key in torch_scores], list(torch_scores.values()),
                               atol=1e-4)  # fmt: skip


def test_a_benchmark_on_another_backend_encodes_again(tiny_model: Path, beir_dir: Path, tmp_path: Path):
    encoder = DenseEncoder.load(tiny_model)
    folder = tmp_path / "bench"
    first = run_benchmark(encoder, "tiny", [beir_dir], folder, BenchmarkOptions(show_progress=False))
    with pytest.raises(ValueError, match="inference"):
        use_backend(encoder, "onnx", "float32")
        run_benchmark(encoder, "tiny", [beir_dir], folder, BenchmarkOptions(show_progress=False))
    again = run_benchmark(
        encoder, "tiny", [beir_dir], folder, BenchmarkOptions(show_progress=False, overwrite=True)
    )
    stages = again.collections[0].stages
    assert isinstance(stages["encode"], float) and isinstance(stages["search"], float)
    assert stages["bm25"] == "reused"
    assert first.collections[0].scores["tiny"]["R@100"] == again.collections[0].scores["tiny"]["R@100"]
    assert (
        EmbeddingStore.open(folder / beir_dir.name / "embeddings").identity["inference"]["backend"] == "onnx"
    )


def test_a_recipes_encode_step_takes_the_backend(tiny_model: Path, beir_dir: Path, tmp_path: Path):
    step = EncodeStep(type="encode", model=str(tiny_model), data=str(beir_dir), output=str(tmp_path / "emb"),
                      backend="onnx", precision="int8")  # fmt: skip
    step.run("cpu", show_progress=False, overwrite=False)
    made = EmbeddingStore.open(tmp_path / "emb").identity
    assert made["inference"] == {"backend": "onnx", "precision": "int8"}
    with pytest.raises(ValidationError, match="precision"):  # refused when the recipe is read
        EncodeStep(type="encode", model="m", data="d", output="o", precision="int4")
