"""The small-BERT benchmark's up-front check of --fine-tune, before hours of pre-training (a check of
the benchmark script, kept with it: the package's tests never import benchmarks/)."""

from pathlib import Path

import pytest

from benchmarks.pretrain_small_bert import check_fine_tune

RECIPES = Path(__file__).parents[2] / "recipes"


def test_the_two_round_recipe_passes_the_check(beir_dir: Path, tiny_model: Path, tmp_path: Path):
    check_fine_tune(RECIPES / "scifact-two-round.yaml", tiny_model, beir_dir, 1e-4, tmp_path)


def test_a_recipe_without_a_test_score_after_round_one_is_refused(
    beir_dir: Path, tiny_model: Path, tmp_path: Path
):
    with pytest.raises(SystemExit, match=r"scifact-round1\.yaml writes no round1-test\.json"):
        check_fine_tune(RECIPES / "scifact-round1.yaml", tiny_model, beir_dir, 1e-4, tmp_path)


def test_a_collection_without_the_split_the_recipe_trains_on_is_refused(
    make_beir, tiny_model: Path, tmp_path: Path
):
    data = make_beir(qrels={"test": [("q1", "d1", 1)]})
    with pytest.raises(SystemExit, match="reads the train split"):
        check_fine_tune(RECIPES / "scifact-two-round.yaml", tiny_model, data, 1e-4, tmp_path)
