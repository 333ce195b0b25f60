"""Saved passage vectors in place of encoding passages, for runs whose passages stay the base's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from densekit.data import Dataset
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder
from densekit.training.fine_tuning import run_training

from .test_cross_encoder_training import make_config as cross_encoder_config
from .test_training import make_config

QUERY_LORA = {"type": "lora", "rank": 4, "towers": "query", "name": "q"}


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def base_embeddings(collection, still_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base's embeddings of the training collection's corpus, as `densekit encode` writes them."""
    folder = tmp_path_factory.mktemp("base-embeddings") / "embeddings"
    encoder = DenseEncoder.load(still_model, pooling="mean").eval()
    encode_corpus(encoder, Dataset.open(collection[0]), folder, show_progress=False)
    return folder


def test_a_query_only_module_trained_on_saved_passage_vectors_equals_one_encoding_them(
    collection, still_model: Path, base_embeddings: Path, tmp_path: Path
):
    saved = {"passage_embeddings": [str(base_embeddings)]}
    c = {"enabled": True, "chunk_size": 3}
    runs = {
        "encoded": make_config(collection, still_model, modules=QUERY_LORA),
        "saved": make_config(collection, still_model, modules=QUERY_LORA, data=saved),
        "saved, cached": make_config(collection, still_model, modules=QUERY_LORA, data=saved, grad_cache=c),
    }
    for name, config in runs.items():
        run_training(config, tmp_path / name, show_progress=False)
    reference = losses(tmp_path / "encoded")
    assert len(reference) == 6 and reference[0] != reference[-1]
    for name in ("saved", "saved, cached"):
        assert losses(tmp_path / name) == pytest.approx(reference, abs=1e-5), name
    texts = ["question about cats", "bread and an oven"]
    vectors = {name: embed_texts(DenseEncoder.load(tmp_path / name / "model").eval(), texts, "query")
               for name in runs}  # fmt: skip
    base = embed_texts(DenseEncoder.load(still_model, pooling="mean").eval(), texts, "query")
    assert abs(vectors["saved"] - vectors["encoded"]).max() < 1e-4
    assert abs(vectors["saved"] - base).max() > 1e-3  # the module did train


def test_saved_passage_vectors_are_refused_where_they_do_not_stand_for_the_passages(
    collection, still_model: Path, base_embeddings: Path, beir_dir: Path, tmp_path: Path
):
    saved = {"passage_embeddings": [str(base_embeddings)]}
    with pytest.raises(ValueError, match="this run changes how passages are encoded"):
        make_config(collection, still_model, data=saved)  # a full fine-tune
    with pytest.raises(ValueError, match="this run changes how passages are encoded"):
        make_config(collection, still_model, modules={**QUERY_LORA, "towers": "shared"}, data=saved)
    with pytest.raises(ValueError, match="saved passage vectors are not padded"):
        make_config(collection, still_model, modules=QUERY_LORA, data={**saved, "length_grouping": 2})
    with pytest.raises(ValueError, match=r"data\.passage_embeddings does not apply to a cross-encoder"):
        cross_encoder_config(collection, still_model, data=saved)
    cls = make_config(collection, still_model, modules=QUERY_LORA, data=saved, model={"pooling": "cls"})
    with pytest.raises(ValueError, match=r"was encoded from passages encoded with other settings \(pooling"):
        run_training(cls, tmp_path / "cls", show_progress=False)
    other = tmp_path / "other-embeddings"
    encode_corpus(DenseEncoder.load(still_model, pooling="mean").eval(), Dataset.open(beir_dir), other,
                  show_progress=False)  # fmt: skip
    elsewhere = make_config(
        collection, still_model, modules=QUERY_LORA, data={"passage_embeddings": [str(other)]}
    )
    with pytest.raises(ValueError, match="was encoded from none of the training collections' corpora"):
        run_training(elsewhere, tmp_path / "elsewhere", show_progress=False)
    assert not (tmp_path / "cls" / "model").exists() and not (tmp_path / "elsewhere" / "model").exists()
