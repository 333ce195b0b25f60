"""Pre-training mechanics: masks, spans, attention, the Condenser head's inputs, exports, equivalences."""

from __future__ import annotations

import json
import logging
import logging.handlers
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from densekit.configuration import validate_config
from densekit.data.diagnostics import DataError
from densekit.io.outputs import OutputError
from densekit.models import DenseEncoder
from densekit.pretraining.backbone import MaskedLanguageModel
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.corpus import read_texts, tokenize_corpus
from densekit.pretraining.masking import IGNORE, decoder_visibility, sample_span_pair, whole_word_mask
from densekit.pretraining.run import run_pretraining
from densekit.pretraining.tasks import PretrainTask

from .conftest import tiny_bert

TEXTS = [
    f"document {i} talks about {topic} and unbelievably interesting {topic} matters in paragraph {i}"
    for i, topic in enumerate(["volcanoes", "programming", "kittens", "banking", "football", "weather"] * 3)
]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


def make_config(corpus_file: Path, model: Path, method: str, **sections) -> PretrainConfig:
    tree = {
        "method": method,
        "model": {"path": str(model), "max_length": 24},
        "data": {"path": str(corpus_file)},
        "condenser": {"skip_from": 1, "head_layers": 1},
        "cocondenser": {"span_min": 4, "span_max": 8},
        "optim": {"batch_size": 4, "max_steps": 4, "learning_rate": 1e-3},
        "checkpoint": {"every": 2},
        "log_every": 1,
        "device": "cpu",
    }
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values) if isinstance(values, dict) else tree.update(
            {section: values}
        )
    return validate_config(tree, PretrainConfig, "<test>")


def make_task(config: PretrainConfig) -> PretrainTask:
    mlm = MaskedLanguageModel.load(config.model.path)
    corpus = tokenize_corpus(read_texts(Path(config.data.path)), mlm.tokenizer, None, show_progress=False)
    return PretrainTask(mlm, corpus, config)


def test_whole_word_masking_hits_its_ratio_and_keeps_words_whole():
    rng = np.random.default_rng(0)
    words = np.repeat(np.arange(400), rng.integers(1, 4, size=400))  # words of 1-3 tokens
    words = np.concatenate([[-1], words, [-1]])
    tokens = np.arange(len(words)) + 1000
    masked_share, replaced = [], []
    for _ in range(200):
        inputs, labels = whole_word_mask(tokens, words, 0.3, rng, mask_id=7, vocab_size=5000)
        chosen = labels != IGNORE
        masked_share.append(chosen[1:-1].mean())
        assert not chosen[0] and not chosen[-1]  # special tokens stay
        for word in np.unique(words[chosen]):
            assert chosen[words == word].all()  # a chosen word is masked whole
        assert (labels[chosen] == tokens[chosen]).all()
        replaced.append(((inputs == 7) & chosen).sum() / chosen.sum())
    assert abs(np.mean(masked_share) - 0.3) < 0.01
    assert abs(np.mean(replaced) - 0.8) < 0.03


def test_span_pairs_lie_in_their_document():
    rng = np.random.default_rng(1)
    for length in (3, 10, 50, 500):
        for start, end in sample_span_pair(length, 8, 32, rng):
            assert 0 <= start < end <= length
            assert (end - start == length) if length <= 8 else 8 <= end - start <= 32


def test_corpus_keeps_whole_documents_and_their_word_boundaries(tiny_model: Path):
    tokenizer = MaskedLanguageModel.load(str(tiny_model)).tokenizer
    long_text = " ".join(["unbelievably interesting volcanoes"] * 300)  # over the model's 512 tokens
    transformers_log = logging.getLogger("transformers")
    warnings = logging.handlers.BufferingHandler(capacity=100)
    transformers_log.addHandler(warnings)
    try:
        corpus = tokenize_corpus([long_text, "kittens"], tokenizer, None, show_progress=False)
    finally:
        transformers_log.removeHandler(warnings)
    assert not warnings.buffer  # documents are cut into spans later: no warning about their length
    expected = tokenizer(long_text, add_special_tokens=False)
    assert len(corpus.token_ids[0]) > tokenizer.model_max_length
    assert corpus.token_ids[0].tolist() == expected["input_ids"]
    assert corpus.word_ids[0].tolist() == expected.word_ids()
    assert corpus.word_ids[0][0] == corpus.word_ids[0][1]  # "unbelievably" is several pieces of one word
    truncated = tokenize_corpus([long_text], tokenizer, 5, show_progress=False)
    assert truncated.token_ids[0].tolist() == expected["input_ids"][:5]
    assert truncated.word_ids[0].tolist() == expected.word_ids()[:5]


def test_decoder_rows_never_see_themselves_and_always_see_the_embedding():
    rng = np.random.default_rng(2)
    visible = decoder_visibility(length=30, width=40, visible_ratio=0.5, rng=rng)
    assert visible.shape == (39, 40)
    rows = np.arange(39)
    assert not visible[rows, rows + 1].any()  # row r predicts position r + 1 and never sees it
    assert visible[:, 0].all()
    assert not visible[:, 30:].any()  # padding
    others = visible[:29, 1:30].sum() / (29 * 28)  # real rows, real positions other than their own
    assert abs(others - 0.5) < 0.05


def test_siblings_come_from_the_same_document(corpus_file: Path, tiny_model: Path):
    task = make_task(make_config(corpus_file, tiny_model, "cocondenser"))
    batch = task.batch(0, 0)
    assert batch["input_ids"].shape[0] == 8  # 4 documents, two spans each
    documents = [list(ids) for ids in task.corpus.token_ids]
    originals = torch.where(batch["labels"] != IGNORE, batch["labels"], batch["input_ids"])

    def source(row: int) -> set[int]:
        span = [t for t in originals[row].tolist() if t not in (task.cls_id, task.sep_id, task.pad_id)]
        found = set()
        for index, doc in enumerate(documents):
            for start in range(len(doc) - len(span) + 1):
                # masked tokens may have been replaced by random ones; compare the unmasked positions
                window = doc[start : start + len(span)]
                if sum(a != b for a, b in zip(window, span, strict=True)) <= 2:
                    found.add(index)
        return found

    for pair in range(4):
        assert source(2 * pair) & source(2 * pair + 1)


def test_condenser_head_reads_the_late_cls_and_the_early_states(corpus_file: Path, tiny_model: Path):
    task = make_task(make_config(corpus_file, tiny_model, "condenser"))
    task.module.eval()
    batch = task.batch(0, 0)
    seen = {}
    task.module.head.layers[0].register_forward_hook(
        lambda m, args, kwargs, out: seen.update(x=args[0]), with_kwargs=True
    )
    task.module(batch["input_ids"], batch["attention_mask"], batch["labels"])
    states = task.mlm.backbone(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
    )
    expected = torch.cat([states.last_hidden_state[:, :1], states.hidden_states[1][:, 1:]], dim=1)
    assert torch.allclose(seen["x"], expected, atol=1e-6)


def test_a_missing_mlm_head_is_tied_to_the_word_embeddings(tiny_model: Path):
    mlm = MaskedLanguageModel.load(str(tiny_model))
    embeddings = mlm.backbone.embeddings.word_embeddings.weight
    assert mlm.head.predictions.decoder.weight.data_ptr() == embeddings.data_ptr()


@pytest.mark.parametrize("method", ["mlm", "condenser", "cocondenser", "retromae"])
def test_each_method_trains_and_exports_the_encoder_alone(
    corpus_file: Path, tiny_model: Path, tmp_path: Path, method: str
):
    config = make_config(corpus_file, tiny_model, method, optim={"max_steps": 12, "learning_rate": 3e-3})
    run_pretraining(config, tmp_path / method, show_progress=False)
    records = [json.loads(line) for line in (tmp_path / method / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    exported = safetensors.torch.load_file(str(tmp_path / method / "model" / "model.safetensors"))
    assert not [k for k in exported if k.startswith(("cls.", "head.", "decoder.", "mlm."))]
    before = safetensors.torch.load_file(str(tiny_model / "model.safetensors"))
    assert set(exported) <= set(before)  # the backbone's own weights, nothing added
    encoder = DenseEncoder.load(tmp_path / method / "model")
    assert encoder.config.pooling == "cls"


def test_retromae_basic_decoding_runs(corpus_file: Path, tiny_model: Path, tmp_path: Path):
    config = make_config(corpus_file, tiny_model, "retromae", retromae={"decoding": "basic"})
    state = run_pretraining(config, tmp_path / "basic", show_progress=False)
    assert state["step"] == 4


def test_cocondenser_grad_cache_equals_the_full_batch(corpus_file: Path, tmp_path: Path):
    still = tiny_bert(tmp_path / "still")
    config_json = json.loads((still / "config.json").read_text())
    config_json.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (still / "config.json").write_text(json.dumps(config_json))
    plain = make_task(make_config(corpus_file, still, "cocondenser"))
    cached = make_task(
        make_config(corpus_file, still, "cocondenser", grad_cache={"enabled": True, "chunk_size": 3})
    )
    for task in (plain, cached):
        task.module.double()
    cached.module.load_state_dict(plain.module.state_dict())  # the same fresh heads in both
    plain_parts = plain.forward_backward(plain.batch(0, 0))
    cached_parts = cached.forward_backward(cached.batch(0, 0))
    for name in plain_parts:
        assert abs(plain_parts[name] - cached_parts[name]) < 1e-9, name
    grads = {n: p.grad for n, p in plain.module.named_parameters() if p.grad is not None}
    other = dict(cached.module.named_parameters())
    assert max(float((g - other[n].grad).abs().max()) for n, g in grads.items()) < 1e-9


def test_pretraining_resumes_exactly(corpus_file: Path, tiny_model: Path, tmp_path: Path, monkeypatch):
    from densekit.training.trainer import Trainer

    config = make_config(corpus_file, tiny_model, "condenser")
    run_pretraining(config, tmp_path / "straight", show_progress=False)
    real = Trainer._one_step

    def killed(self):
        if self.state["step"] == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Trainer, "_one_step", killed)
    with pytest.raises(KeyboardInterrupt):
        run_pretraining(config, tmp_path / "resumed", show_progress=False)
    monkeypatch.setattr(Trainer, "_one_step", real)
    run_pretraining(config, tmp_path / "resumed", resume=True, show_progress=False)
    a = safetensors.torch.load_file(
        str(tmp_path / "straight" / "checkpoints" / "step-00000004" / "state.safetensors")
    )
    b = safetensors.torch.load_file(
        str(tmp_path / "resumed" / "checkpoints" / "step-00000004" / "state.safetensors")
    )
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_spans_longer_than_half_the_documents_are_warned_of(
    corpus_file: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level("WARNING", logger="densekit"):
        make_task(make_config(corpus_file, tiny_model, "cocondenser"))  # spans of 4-8 tokens
    assert "overlap" not in caplog.text
    with caplog.at_level("WARNING", logger="densekit"):
        task = make_task(
            make_config(corpus_file, tiny_model, "cocondenser", cocondenser={"span_min": 10, "span_max": 16})
        )
    median = int(np.median([len(ids) for ids in task.corpus.token_ids]))
    assert median < 20  # both spans take more than half of a typical document
    assert f"the median document has {median} tokens and spans of 10-16 tokens" in caplog.text


def test_spans_longer_than_the_sequence_are_refused_by_the_config(corpus_file: Path, tiny_model: Path):
    with pytest.raises(DataError, match=r"span_max \+ 2 special tokens exceed model\.max_length"):
        make_config(corpus_file, tiny_model, "cocondenser", cocondenser={"span_max": 23})
    make_config(corpus_file, tiny_model, "cocondenser", cocondenser={"span_max": 22})  # 22 + 2 = 24 fits


def test_pretraining_into_an_existing_run_needs_resume_or_overwrite(
    corpus_file: Path, tiny_model: Path, tmp_path: Path
):
    config = make_config(corpus_file, tiny_model, "mlm")
    output = tmp_path / "run"
    run_pretraining(config, output, show_progress=False)
    with pytest.raises(OutputError, match=r"already holds this pre-training run .*pass --resume"):
        run_pretraining(config, output, show_progress=False)
    other = make_config(corpus_file, tiny_model, "condenser")
    with pytest.raises(OutputError, match=r"differs in: config\.method\)"):
        run_pretraining(other, output, resume=True, show_progress=False)
    run_pretraining(other, output, show_progress=False, overwrite=True)
    assert json.loads((output / "densekit-artefact.json").read_text())["identity"]["config"]["method"] == (
        "condenser"
    )
