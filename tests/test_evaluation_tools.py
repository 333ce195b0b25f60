"""Judging retrievers: paired significance tests, fusion, the multi-collection benchmark and ANCE's
negatives diagnostic."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from typer.testing import CliRunner

from densekit.cli.main import app
from densekit.data.dataset import Dataset
from densekit.data.examples import TrainingExample, write_examples
from densekit.data.trec import read_run, write_run
from densekit.diagnostics import DataError, Diagnostics
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.embed import embed_texts
from densekit.encoding.store import EmbeddingStore
from densekit.evaluation import evaluate
from densekit.evaluation.benchmark import BenchmarkOptions, run_benchmark
from densekit.evaluation.compare import compare_runs
from densekit.evaluation.fusion import linear_fusion, reciprocal_rank_fusion
from densekit.evaluation.significance import holm, paired_test, per_query
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.mining.diagnose import NegativesReport, _plot_label, diagnose_negatives, plot_negatives
from densekit.models import DenseEncoder

from .conftest import tiny_bert

runner = CliRunner()

# --- significance ---------------------------------------------------------------------------------


def _exact_sign_flip_p(diffs: np.ndarray) -> float:
    """The reference: every one of the 2^n sign patterns, two-sided as twice the smaller tail."""
    observed = diffs.mean()
    means = np.array(
        [(np.array(signs) * diffs).mean() for signs in itertools.product([1, -1], repeat=len(diffs))]
    )
    tolerance = 1e-12
    greater = np.mean(means >= observed - tolerance)
    less = np.mean(means <= observed + tolerance)
    return min(1.0, 2 * min(greater, less))


def _hand_t_test_p(diffs: np.ndarray) -> float:
    t = diffs.mean() / (diffs.std(ddof=1) / math.sqrt(len(diffs)))
    return float(2 * stats.t.sf(abs(t), len(diffs) - 1))


def test_paired_tests_equal_the_hand_computed_t_test_and_the_exact_randomisation_test():
    rng = np.random.default_rng(3)
    control = {f"q{i}": float(v) for i, v in enumerate(rng.uniform(0, 1, 10))}
    arm = {q: v + float(rng.normal(0.08, 0.1)) for q, v in control.items()}
    result = paired_test(control, arm, trials=5000)  # over 2^10 patterns: scipy enumerates them all
    diffs = np.array([arm[q] - control[q] for q in sorted(control)])
    assert result.p_t_test == pytest.approx(_hand_t_test_p(diffs), rel=1e-9)
    assert result.p_randomisation == pytest.approx(_exact_sign_flip_p(diffs), abs=1e-9)
    assert (result.better, result.worse) == (int((diffs > 0).sum()), int((diffs < 0).sum()))
    assert result.mean_difference == pytest.approx(diffs.mean())


def test_a_sampled_randomisation_test_is_fixed_by_its_seed_and_near_the_exact_p():
    rng = np.random.default_rng(5)
    control = {f"q{i}": float(v) for i, v in enumerate(rng.uniform(0, 1, 16))}
    arm = {q: v + float(rng.normal(0.03, 0.1)) for q, v in control.items()}
    first, again = (
        paired_test(control, arm, trials=2000, seed=7),
        paired_test(control, arm, trials=2000, seed=7),
    )
    assert first.p_randomisation == again.p_randomisation
    diffs = np.array([arm[q] - control[q] for q in sorted(control)])
    assert first.p_randomisation == pytest.approx(_exact_sign_flip_p(diffs), abs=0.03)


def test_identical_runs_differ_by_nothing_and_a_missing_query_counts_as_zero():
    scores = {f"q{i}": i / 10 for i in range(10)}
    same = paired_test(scores, dict(scores), trials=1000)
    assert (same.mean_difference, same.better, same.worse, same.p_t_test, same.p_randomisation) == (
        0,
        0,
        0,
        1,
        1,
    )
    missing = paired_test({"a": 0.4, "b": 0.2}, {"a": 0.4}, trials=1000)
    assert (missing.queries, missing.worse, missing.mean_difference) == (2, 1, pytest.approx(-0.1))


def test_holm_equals_the_step_down_adjustment_worked_by_hand():
    # sorted: 0.01 x3 = 0.03, 0.02 x2 = 0.04, 0.04 x1 = 0.04 (kept monotone), back in the given order
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])


QRELS = {"q1": {"a": 1, "b": 0}, "q2": {"c": 2}, "q3": {"d": 1}}
RUNS = {
    "first": {"q1": {"b": 3.0, "a": 2.0}, "q2": {"c": 1.0}, "q3": {"x": 1.0, "d": 0.5}},
    "better": {"q1": {"a": 3.0, "b": 2.0}, "q2": {"c": 1.0}, "q3": {"d": 1.0}},
    "partial": {"q1": {"a": 3.0}},
}


def test_per_query_values_average_to_evaluate_even_for_a_query_the_run_does_not_answer():
    for run in RUNS.values():
        values = per_query(QRELS, run, "nDCG@10")
        assert set(values) == set(QRELS)
        assert np.mean(list(values.values())) == pytest.approx(evaluate(QRELS, run, ["nDCG@10"])["nDCG@10"])


def test_compare_tests_every_run_against_the_first_with_holm_across_them():
    [comparison] = compare_runs(QRELS, RUNS, ["RR@10"], trials=1000)
    assert comparison.control == "first"
    by_name = {arm.name: arm for arm in comparison.arms}
    # RR@10 per query: first 0.5, 1, 0.5; better 1, 1, 1; partial 1, 0, 0
    assert comparison.control_mean == pytest.approx(2 / 3)
    assert by_name["better"].mean == pytest.approx(1.0)
    assert (by_name["better"].test.better, by_name["better"].test.worse) == (2, 0)
    assert (by_name["partial"].test.better, by_name["partial"].test.worse) == (1, 2)
    for test, adjusted in (("p_t_test", "p_t_test_holm"), ("p_randomisation", "p_randomisation_holm")):
        raw = [getattr(by_name[n].test, test) for n in ("better", "partial")]
        assert [getattr(by_name[n], adjusted) for n in ("better", "partial")] == pytest.approx(holm(raw))


def test_compare_command_writes_its_figures_and_a_plot(tmp_path: Path):
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t{r}\n" for q, docs in QRELS.items() for d, r in docs.items()))  # fmt: skip
    paths = []
    for name, run in RUNS.items():
        write_run(tmp_path / f"{name}.trec", run)
        paths.append(str(tmp_path / f"{name}.trec"))
    args = ["compare", str(qrels), *paths, "-m", "RR@10", "--trials", "1000",
            "--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png")]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    [saved] = json.loads((tmp_path / "c.json").read_text())
    assert [r["name"] for r in saved["runs"]] == ["better.trec", "partial.trec"]
    assert saved["runs"][0]["mean"] == pytest.approx(1.0)
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output  # its own plot and figures are replaced, not refused


# --- fusion ---------------------------------------------------------------------------------------

FIRST = {"q": {"a": 9.0, "b": 5.0, "c": 1.0}}
SECOND = {"q": {"c": 0.9, "d": 0.7, "a": 0.1}}


def test_reciprocal_rank_fusion_equals_the_hand_computed_run():
    fused = reciprocal_rank_fusion([FIRST, SECOND], k=60, weights=[1.0, 2.0])
    expected = {"a": 1 / 61 + 2 / 63, "b": 1 / 62, "c": 1 / 63 + 2 / 61, "d": 2 / 62}
    assert fused["q"] == pytest.approx(expected)
    assert list(fused["q"]) == ["c", "a", "d", "b"]


def test_linear_fusion_equals_hand_computed_runs_under_both_normalisations():
    minmax = linear_fusion([FIRST, SECOND], weights=[0.5, 0.5], normalisation="minmax")
    # FIRST: a 1, b 0.5, c 0; SECOND: c 1, d 0.75, a 0; a missing document takes 0
    assert minmax["q"] == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.5, "d": 0.375})
    assert list(minmax["q"]) == ["a", "c", "d", "b"]  # equal scores ordered by document id
    zscore = linear_fusion([FIRST, SECOND], normalisation="zscore")
    z_first = dict(zip("abc", stats.zscore([9.0, 5.0, 1.0]), strict=True))
    z_second = dict(zip("cda", stats.zscore([0.9, 0.7, 0.1]), strict=True))
    floor_first, floor_second = min(z_first.values()), min(z_second.values())
    expected = {d: z_first.get(d, floor_first) + z_second.get(d, floor_second) for d in "abcd"}
    assert zscore["q"] == pytest.approx(expected)


def test_fusion_refuses_a_weight_per_run_mismatch_and_keeps_the_depth():
    with pytest.raises(ValueError, match="2 weights for 3 runs"):
        reciprocal_rank_fusion([FIRST, SECOND, FIRST], weights=[1, 1])
    # a and c both score 1/61 + 1/63: the tie goes by document id
    assert list(reciprocal_rank_fusion([FIRST, SECOND], depth=2)["q"]) == ["a", "c"]


def test_fuse_command_writes_the_fused_run(tmp_path: Path):
    write_run(tmp_path / "a.trec", FIRST)
    write_run(tmp_path / "b.trec", SECOND)
    args = ["fuse", str(tmp_path / "a.trec"), str(tmp_path / "b.trec"), "-o", str(tmp_path / "f.trec")]
    result = runner.invoke(app, [*args, "--method", "linear", "--weights", "0.5,0.5"])
    assert result.exit_code == 0, result.output
    fused = read_run(tmp_path / "f.trec", Diagnostics())
    assert fused["q"] == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.5, "d": 0.375})
    for wrong in (["--method", "rrf", "--normalisation", "zscore"], ["--method", "linear", "--k", "10"]):
        refused = runner.invoke(app, [*args[:-1], str(tmp_path / "g.trec"), *wrong])
        assert refused.exit_code != 0 and not (tmp_path / "g.trec").exists()


# --- benchmark ------------------------------------------------------------------------------------


def test_a_second_benchmark_reuses_every_stage_and_reports_the_same_scores(
    beir_dir: Path, collection, tiny_model: Path, tmp_path: Path
):
    encoder = DenseEncoder.load(tiny_model)
    data = [beir_dir, collection[0]]
    first = run_benchmark(encoder, "tiny", data, tmp_path / "bench", BenchmarkOptions(show_progress=False))
    assert [c.name for c in first.collections] == ["beir", "data"]
    assert all(isinstance(v, float) for c in first.collections for v in c.stages.values())
    parts = sorted((tmp_path / "bench").glob("*/embeddings/*.npy"))
    stamps = [p.stat().st_mtime_ns for p in parts]
    again = run_benchmark(encoder, "tiny", data, tmp_path / "bench", BenchmarkOptions(show_progress=False))
    assert all(v == "reused" for c in again.collections for v in c.stages.values())
    assert [p.stat().st_mtime_ns for p in parts] == stamps
    assert [c.scores for c in again.collections] == [c.scores for c in first.collections]
    saved = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert saved["mean"]["tiny"]["nDCG@10"] == pytest.approx(
        np.mean([c.scores["tiny"]["nDCG@10"] for c in first.collections])
    )
    table = (tmp_path / "bench" / "results.md").read_text()
    assert "| **mean** |" in table and "BM25 nDCG@10" in table
    assert (tmp_path / "bench" / "results.png").read_bytes().startswith(b"\x89PNG")


def test_a_benchmark_redoes_the_dense_stages_when_the_collection_changes(
    make_beir, tiny_model: Path, tmp_path: Path
):
    encoder = DenseEncoder.load(tiny_model)
    data = make_beir()
    run_benchmark(encoder, "tiny", [data], tmp_path / "bench", BenchmarkOptions(show_progress=False))
    with (data / "queries.jsonl").open("a") as handle:  # queries change: the runs are made again
        handle.write(json.dumps({"_id": "q9", "text": "an extra query"}) + "\n")
    again = run_benchmark(encoder, "tiny", [data], tmp_path / "bench", BenchmarkOptions(show_progress=False))
    stages = again.collections[0].stages
    assert (stages["encode"], stages["index"]) == ("reused", "reused")
    assert isinstance(stages["bm25"], float) and isinstance(stages["search"], float)


def test_a_benchmark_folder_of_another_model_is_refused(beir_dir: Path, tiny_model: Path, tmp_path: Path):
    run_benchmark(
        DenseEncoder.load(tiny_model),
        "tiny",
        [beir_dir],
        tmp_path / "bench",
        BenchmarkOptions(show_progress=False),
    )
    other = DenseEncoder.load(tiny_bert(tmp_path / "other", seed=1))
    with pytest.raises(ValueError, match="differs in: model"):
        run_benchmark(other, "other", [beir_dir], tmp_path / "bench", BenchmarkOptions(show_progress=False))
    # with overwrite, every stage of the model is made again; BM25's is still the same
    redone = run_benchmark(
        other, "other", [beir_dir], tmp_path / "bench", BenchmarkOptions(show_progress=False, overwrite=True)
    )
    stages = redone.collections[0].stages
    assert stages["bm25"] == "reused"
    assert all(isinstance(stages[s], float) for s in ("encode", "index", "search"))


# --- negatives diagnostic -------------------------------------------------------------------------


def test_diagnose_negatives_finds_the_constructed_overlap_and_margins(
    collection, tiny_model: Path, tmp_path: Path
):
    data, _ = collection
    encoder = DenseEncoder.load(tiny_model)
    dataset = Dataset.open(data)
    encode_corpus(encoder, dataset, tmp_path / "emb", show_progress=False)
    store = EmbeddingStore.open(tmp_path / "emb")
    build_index(store, IndexSpec(type="flat"), tmp_path / "index", show_progress=False)
    index = SearchIndex.load(tmp_path / "index")
    vectors = dict(zip(store.ids(), store.vectors(), strict=True))
    queries, _ = dataset.split_queries("train")
    depth = 5
    examples, expected_margins = [], []
    chosen = list(queries.items())[:4]
    # encoded and searched together, as the diagnostic does, so that which documents are in the top 5
    # does not hang on near-ties that a batch of another shape sums differently
    query_vectors = embed_texts(encoder, [text for _, text in chosen], "query")
    rankings = index.search(query_vectors, len(vectors)).doc_ids()
    for (query_id, text), query_vector, ranking in zip(chosen, query_vectors, rankings, strict=True):
        ranked = list(ranking)
        positive = ranked[-1]  # the lowest-ranked document, so that no negative is it
        negatives = [ranked[0], ranked[4], ranked[5]]  # the first and fifth are in the top 5, the sixth not
        examples.append(
            TrainingExample(query_id=query_id, query=text, positives=[positive], negatives=negatives)
        )
        expected_margins += [float((vectors[positive] - vectors[d]) @ query_vector) for d in negatives]
    write_examples(tmp_path / "examples.jsonl", examples)
    report = diagnose_negatives(tmp_path / "examples.jsonl", encoder, index, depth=depth)
    assert (report.examples, report.negatives, report.in_top_k) == (4, 12, 8)
    assert report.share_in_top_k == pytest.approx(8 / 12)
    assert report.mean_margin == pytest.approx(np.mean(expected_margins), abs=1e-5)


def test_diagnose_negatives_names_a_document_the_index_lacks(collection, tiny_model: Path, tmp_path: Path):
    data, _ = collection
    encoder = DenseEncoder.load(tiny_model)
    encode_corpus(encoder, Dataset.open(data), tmp_path / "emb", show_progress=False)
    build_index(
        EmbeddingStore.open(tmp_path / "emb"), IndexSpec(type="flat"), tmp_path / "index", show_progress=False
    )
    examples = [TrainingExample(query_id="q0", query="volcano", positives=["t0d0"], negatives=["nowhere"])]
    write_examples(tmp_path / "bad.jsonl", examples)
    with pytest.raises(DataError, match=r"bad.jsonl:1: .*'nowhere' is not in the index"):
        diagnose_negatives(tmp_path / "bad.jsonl", encoder, SearchIndex.load(tmp_path / "index"))


def test_the_negatives_plot_names_each_file_and_an_ance_version_by_its_folder(tmp_path: Path):
    names = ["two-round/round1-examples.jsonl", *(f"version-00000{v}/examples.jsonl" for v in (0, 1))]
    reports = [NegativesReport(n, 4, 12, 5, k, k / 12, 0.3 - k / 100) for k, n in enumerate(names, 4)]
    plot_negatives(reports, tmp_path / "negatives.png")
    assert (tmp_path / "negatives.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = ["two-round/\nround1-examples", "version-000000", "version-000001"]
    assert [_plot_label(n) for n in names] == labels


def test_success_at_k_is_dpr_top_k_accuracy_through_the_evaluate_command(tmp_path: Path):
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("".join(f"{q}\t{d}\t{r}\n" for q, docs in QRELS.items() for d, r in docs.items()))
    write_run(tmp_path / "first.trec", RUNS["first"])
    args = ["evaluate", str(qrels), str(tmp_path / "first.trec"), "-m", "Success@1", "-m", "Success@2"]
    result = runner.invoke(app, [*args, "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    # a relevant document first for q2 only; within the first two for all three queries
    assert json.loads((tmp_path / "s.json").read_text()) == pytest.approx(
        {"Success@1": 1 / 3, "Success@2": 1.0}
    )
