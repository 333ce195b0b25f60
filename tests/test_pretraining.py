"""Pre-training: loading checkpoints, masks and spans, each objective against its definition, exports,
gradient caching and two processes against one, resuming, run folders."""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import shutil
import socket
import typing
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from densekit.configuration import validate_config
from densekit.diagnostics import DataError
from densekit.encoding.embed import embed_texts
from densekit.io.outputs import OutputError
from densekit.models import DenseEncoder
from densekit.pretraining.backbone import MaskedLanguageModel
from densekit.pretraining.base import PretrainTask
from densekit.pretraining.config import Method, PretrainConfig
from densekit.pretraining.corpus import read_texts, tokenize_corpus
from densekit.pretraining.masking import IGNORE, decoder_visibility, sample_span_pair, whole_word_mask
from densekit.pretraining.run import run_pretraining
from densekit.pretraining.tasks import TASKS, make_task
from densekit.training import distributed
from densekit.training.sampling import global_batch_rows

from .conftest import tiny_bert
from .processes import run_in_processes

TEXTS = [
    f"document {i} talks about {topic} and unbelievably interesting {topic} matters in paragraph {i}"
    for i, topic in enumerate(["volcanoes", "programming", "kittens", "banking", "football", "weather"] * 3)
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models here are tiny: one thread runs them faster than several, above all on a busy machine
    (two threads on a loaded 2-core machine made a step 20 times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


@pytest.fixture(scope="module")
def still_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 3-layer BERT without dropout: outputs depend on the inputs alone, and the early (layer 2)
    and late (layer 3) states of a Condenser split are distinct."""
    path = tiny_bert(tmp_path_factory.mktemp("still") / "model", layers=3)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config))
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


def build_task(config: PretrainConfig, dtype: torch.dtype | None = None) -> PretrainTask:
    mlm = MaskedLanguageModel.load(config.model.path)
    corpus = tokenize_corpus(read_texts(Path(config.data.path)), mlm.tokenizer, None, show_progress=False)
    task = make_task(mlm, corpus, config)
    if dtype is not None:
        task.module.to(dtype)
    return task


def originals(task: PretrainTask, epoch: int, step: int) -> list[np.ndarray]:
    """`[CLS] document [SEP]` of each document of a global batch, cut to the sequence length."""
    config, tokenizer = task.config, task.mlm.tokenizer
    rows = global_batch_rows(len(task.corpus), config.optim.batch_size, epoch, step, config.seed)
    limit = config.model.max_length - 2
    return [
        np.concatenate(
            [[tokenizer.cls_token_id], task.corpus.token_ids[doc][:limit], [tokenizer.sep_token_id]]
        )
        for doc in rows
    ]


def mean_token_loss(head: torch.nn.Module, states: torch.Tensor, labels: torch.Tensor) -> float:
    """Cross-entropy of the head's predictions from `states`, averaged over the labelled positions."""
    with torch.no_grad():
        log_probs = torch.log_softmax(head(states).double(), dim=-1)
    chosen = labels != IGNORE
    return float(-log_probs[chosen].gather(1, labels[chosen][:, None]).mean())


def padded_batch(task: PretrainTask) -> dict[str, torch.Tensor]:
    """The first batch of epoch 0 whose sequences differ in length (so some positions are padding)."""
    return next(
        batch
        for batch in (task.batch(0, step) for step in range(task.steps_per_epoch()))
        if batch["attention_mask"].sum(1).unique().numel() > 1
    )


def capture_output(module: torch.nn.Module, into: dict, name: str):
    return module.register_forward_hook(lambda _module, _args, output: into.update({name: output}))


def decode_step(task: PretrainTask):
    """One RetroMAE step on a padded batch: the batch, what the decoder was given (`inputs`) and gave
    (`decoded`), the step's report, the encoder's token states and the decoder tokens' embeddings."""
    batch = padded_batch(task)
    seen: dict = {}
    task.module.decoder.register_forward_pre_hook(lambda _m, args: seen.update(inputs=args))
    capture_output(task.module.decoder, seen, "decoded")
    report = task.forward_backward(batch)
    with torch.no_grad():
        backbone = task.mlm.backbone
        states = backbone(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        embedded = backbone.embeddings(input_ids=batch["decoder_input_ids"])
    return batch, seen, report, states, embedded


def test_whole_word_masking_hits_its_ratio_keeps_words_whole_and_replaces_80_10_10():
    rng = np.random.default_rng(0)
    words = np.repeat(np.arange(400), rng.integers(1, 4, size=400))  # words of 1-3 tokens
    words = np.concatenate([[-1], words, [-1]])
    tokens = np.arange(len(words)) + 1000
    masked_share, outcomes = [], {"mask": 0, "random": 0, "kept": 0}
    for _ in range(200):
        inputs, labels = whole_word_mask(tokens, words, 0.3, rng, mask_id=7, vocab_size=5000)
        chosen = labels != IGNORE
        masked_share.append(chosen[1:-1].mean())
        assert not chosen[0] and not chosen[-1]  # special tokens stay
        for word in np.unique(words[chosen]):
            assert chosen[words == word].all()  # a chosen word is masked whole
        assert (labels[chosen] == tokens[chosen]).all()
        assert (inputs[~chosen] == tokens[~chosen]).all()  # the rest is left alone
        assert ((inputs >= 0) & (inputs < 5000)).all()
        outcomes["mask"] += int((inputs[chosen] == 7).sum())
        outcomes["kept"] += int((inputs[chosen] == tokens[chosen]).sum())
        outcomes["random"] += int(((inputs[chosen] != 7) & (inputs[chosen] != tokens[chosen])).sum())
    assert abs(np.mean(masked_share) - 0.3) < 0.01
    total = sum(outcomes.values())
    assert abs(outcomes["mask"] / total - 0.8) < 0.01
    assert abs(outcomes["random"] / total - 0.1) < 0.01
    assert abs(outcomes["kept"] / total - 0.1) < 0.01


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


@pytest.fixture(scope="module")
def distinct_corpus_file(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """16 documents of 24 single-token words each, no word in two documents: a span's tokens say which
    document it came from."""
    vocab = AutoTokenizer.from_pretrained(tiny_model).get_vocab()
    words = sorted(w for w in vocab if w.isascii() and w.isalpha() and len(w) > 3)[: 16 * 24]
    path = tmp_path_factory.mktemp("distinct") / "texts.txt"
    path.write_text("".join(" ".join(words[24 * i : 24 * (i + 1)]) + "\n" for i in range(16)))
    return path


def test_each_span_and_its_sibling_come_from_the_same_document(distinct_corpus_file: Path, tiny_model: Path):
    config = make_config(distinct_corpus_file, tiny_model, "cocondenser")
    task = build_task(config)
    assert all(len(ids) == 24 for ids in task.corpus.token_ids)
    documents = global_batch_rows(len(task.corpus), config.optim.batch_size, 0, 0, config.seed)
    batch = task.batch(0, 0)
    assert batch["input_ids"].shape[0] == 2 * len(documents)  # two spans of each document
    restored = torch.where(batch["labels"] != IGNORE, batch["labels"], batch["input_ids"])
    for row in range(len(restored)):
        n = int(batch["attention_mask"][row].sum())
        ids = restored[row, :n].tolist()
        assert ids[0] == task.mlm.tokenizer.cls_token_id and ids[-1] == task.mlm.tokenizer.sep_token_id
        span = ids[1:-1]
        assert 4 <= len(span) <= 8  # cocondenser.span_min and span_max
        doc = task.corpus.token_ids[documents[row // 2]].tolist()  # rows 2k and 2k + 1: document k
        assert any(doc[start : start + len(span)] == span for start in range(len(doc) - len(span) + 1))


def test_mlm_masks_and_scores_only_the_masked_positions(corpus_file: Path, still_model: Path):
    task = build_task(make_config(corpus_file, still_model, "mlm", masking={"ratio": 0.3}), torch.float64)
    labelled_count, maskable_count = 0, 0
    for step in range(task.steps_per_epoch()):
        batch = task.batch(0, step)
        width = batch["input_ids"].shape[1]
        for row, ids in enumerate(originals(task, 0, step)):
            n = len(ids)
            labels, inputs = batch["labels"][row].numpy(), batch["input_ids"][row].numpy()
            chosen = labels != IGNORE
            assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
            assert not chosen[0] and not chosen[n - 1] and not chosen[n:].any()  # [CLS], [SEP], padding
            assert (labels[:n][chosen[:n]] == ids[chosen[:n]]).all()  # the original token is the target
            assert (inputs[:n][~chosen[:n]] == ids[~chosen[:n]]).all()  # unmasked tokens are left alone
            labelled_count += int(chosen.sum())
            maskable_count += n - 2
    assert abs(labelled_count / maskable_count - 0.3) < 0.06

    batch = task.batch(0, 1)
    report = task.forward_backward(batch)
    states = task.mlm.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    expected = mean_token_loss(task.mlm.head, states.last_hidden_state, batch["labels"])
    assert abs(report["loss_mlm"] - expected) < 1e-9
    assert report["loss"] == report["loss_mlm"]


def test_condenser_head_reads_the_late_cls_and_the_early_states_and_both_are_scored(
    corpus_file: Path, still_model: Path
):
    config = make_config(
        corpus_file, still_model, "condenser", condenser={"skip_from": 2, "late_mlm_weight": 0.5}
    )
    task = build_task(config, torch.float64)
    batch = task.batch(0, 0)
    seen: dict = {}
    task.module.head.layers[0].register_forward_pre_hook(lambda _m, args: seen.update(head_input=args[0]))
    capture_output(task.module.head, seen, "head_output")
    report = task.forward_backward(batch)
    with torch.no_grad():
        hidden = task.mlm.backbone(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        ).hidden_states
    late, early = hidden[3], hidden[2]  # the 3-layer model's output and layer 2's
    assert not torch.allclose(late, early)
    expected_input = torch.cat([late[:, :1], early[:, 1:]], dim=1)
    assert torch.allclose(seen["head_input"], expected_input, rtol=0, atol=1e-12)
    head_loss = mean_token_loss(task.mlm.head, seen["head_output"], batch["labels"])
    late_loss = mean_token_loss(task.mlm.head, late, batch["labels"])
    assert abs(report["loss_mlm_head"] - head_loss) < 1e-9
    assert abs(report["loss_mlm_late"] - late_loss) < 1e-9
    assert abs(report["loss"] - (head_loss + 0.5 * late_loss)) < 1e-9


def test_cocondenser_each_span_must_pick_its_sibling_among_all_other_spans(
    corpus_file: Path, still_model: Path
):
    config = make_config(
        corpus_file, still_model, "cocondenser", cocondenser={"temperature": 0.5, "contrastive_weight": 2.0}
    )
    task = build_task(config, torch.float64)
    batch = task.batch(0, 0)
    report = task.forward_backward(batch)
    with torch.no_grad():
        cls = task.mlm.backbone(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state[:, 0]
    spans = len(cls)
    assert spans == 2 * config.optim.batch_size  # rows 2k and 2k + 1 are document k's spans
    scores = cls @ cls.T / 0.5
    losses = []
    for i in range(spans):
        sibling = i + 1 if i % 2 == 0 else i - 1
        candidates = [j for j in range(spans) if j != i]  # the 2n - 1 other spans
        losses.append(float(torch.logsumexp(scores[i, candidates], dim=0) - scores[i, sibling]))
    assert abs(report["loss_contrastive"] - np.mean(losses)) < 1e-9
    expected_total = report["loss_mlm_head"] + report["loss_mlm_late"] + 2.0 * np.mean(losses)
    assert abs(report["loss"] - expected_total) < 1e-9


def test_retromae_masks_the_encoder_at_its_ratio_and_the_decoder_scores_every_token(
    corpus_file: Path, still_model: Path
):
    task = build_task(
        make_config(corpus_file, still_model, "retromae", masking={"ratio": 0.3}), torch.float64
    )
    labelled_count, maskable_count = 0, 0
    for step in range(task.steps_per_epoch()):
        batch = task.batch(0, step)
        width = batch["input_ids"].shape[1]
        for row, ids in enumerate(originals(task, 0, step)):
            n = len(ids)
            assert batch["decoder_input_ids"][row, :n].tolist() == ids.tolist()  # the decoder reads it all
            # every token is a target but the first, whose place the sentence embedding takes
            targets = [IGNORE, *ids[1:].tolist()] + [IGNORE] * (width - n)
            assert batch["decoder_labels"][row].tolist() == targets
            labelled_count += int((batch["labels"][row] != IGNORE).sum())
            maskable_count += n - 2
    assert abs(labelled_count / maskable_count - 0.3) < 0.06

    batch, seen, report, states, embedded = decode_step(task)
    query, content, _ = seen["inputs"]
    positions = task.mlm.backbone.embeddings.position_embeddings.weight[1 : batch["input_ids"].shape[1]]
    h = states[:, :1]  # the sentence embedding: the encoder's CLS state
    assert torch.allclose(query, h + positions[None], rtol=0, atol=1e-12)  # H1 = [h + p_i]
    assert torch.allclose(content, torch.cat([h, embedded[:, 1:]], dim=1), rtol=0, atol=1e-12)  # H2
    encoder_loss = mean_token_loss(task.mlm.head, states, batch["labels"])
    decoder_loss = mean_token_loss(task.mlm.head, seen["decoded"], batch["decoder_labels"][:, 1:])
    assert abs(report["loss_mlm_encoder"] - encoder_loss) < 1e-9
    assert abs(report["loss_decoder"] - decoder_loss) < 1e-9
    assert abs(report["loss"] - (encoder_loss + decoder_loss)) < 1e-9


def test_retromae_decoder_rows_see_a_sample_of_the_others_never_themselves_always_the_embedding(
    corpus_file: Path, still_model: Path
):
    task = build_task(make_config(corpus_file, still_model, "retromae"), torch.float64)
    task.module.eval()
    batch = padded_batch(task)
    visible = batch["decoder_visible"]
    seen: dict = {}
    capture_output(task.module.decoder, seen, "decoded")

    def decode(decoder_input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            task.module({**batch, "decoder_input_ids": decoder_input_ids})
        return seen["decoded"]  # row r predicts position r + 1

    reference = decode(batch["decoder_input_ids"])
    lengths = batch["attention_mask"].sum(1).tolist()
    b = int(np.argmin(lengths))  # the shortest sequence: it has padding positions too
    n, width = lengths[b], batch["input_ids"].shape[1]
    assert n < width
    seen_pairs, other_pairs = 0, 0
    for position in range(1, width):
        changed = batch["decoder_input_ids"].clone()
        changed[b, position] = 1000 if changed[b, position] != 1000 else 1001
        output = decode(changed)
        others = [row for row in range(len(output)) if row != b]
        assert torch.equal(output[others], reference[others])  # other sequences are untouched
        moved = ((output[b] - reference[b]).abs().amax(-1) > 1e-9).tolist()
        if position >= n:
            assert not any(moved)  # padding is never seen
            continue
        assert not moved[position - 1]  # the row predicting this token does not see it
        for row in range(n - 1):
            assert moved[row] == bool(visible[b, row, position]), (row, position)
            if row != position - 1:
                seen_pairs += moved[row]
                other_pairs += 1
    assert abs(seen_pairs / other_pairs - task.config.retromae.visible_ratio) < 0.15

    def with_other_embedding_in_content(_module, args):
        query, content, mask = args
        return query, torch.cat([content[:, :1] + 1.0, content[:, 1:]], dim=1), mask

    hook = task.module.decoder.register_forward_pre_hook(with_other_embedding_in_content)
    output = decode(batch["decoder_input_ids"])
    hook.remove()
    real_rows = torch.arange(width - 1)[None, :] < (batch["attention_mask"].sum(1)[:, None] - 1)
    moved = (output - reference).abs().amax(-1) > 1e-9
    assert moved[real_rows].all()  # every row sees the sentence embedding


def test_retromae_basic_decoding_masks_the_text_again_and_predicts_those_tokens(
    corpus_file: Path, still_model: Path
):
    config = make_config(
        corpus_file, still_model, "retromae", masking={"ratio": 0.3},
        retromae={"decoding": "basic", "decoder_mask_ratio": 0.6},
    )  # fmt: skip
    task = build_task(config, torch.float64)
    decoder_labelled, maskable = 0, 0
    for step in range(task.steps_per_epoch()):
        batch = task.batch(0, step)
        for row, ids in enumerate(originals(task, 0, step)):
            n = len(ids)
            labels, inputs = batch["decoder_labels"][row].numpy(), batch["decoder_input_ids"][row].numpy()
            chosen = labels != IGNORE
            assert not chosen[0] and not chosen[n - 1] and not chosen[n:].any()
            assert (labels[:n][chosen[:n]] == ids[chosen[:n]]).all()
            assert (inputs[:n][~chosen[:n]] == ids[~chosen[:n]]).all()
            decoder_labelled += int(chosen.sum())
            maskable += n - 2
    assert abs(decoder_labelled / maskable - 0.6) < 0.06

    batch, seen, report, states, embedded = decode_step(task)
    query, content, attention = seen["inputs"]
    assert torch.equal(query, content)
    assert torch.allclose(content[:, 0], states[:, 0], rtol=0, atol=1e-12)  # [h; e(x~_i) + p_i]
    assert torch.allclose(content[:, 1:], embedded[:, 1:], rtol=0, atol=1e-12)
    real = batch["attention_mask"].bool()
    assert not real.all()  # padding is there, and unseen
    assert torch.equal(attention, real[:, None, :].expand_as(attention))  # every real token, its own too
    decoder_loss = mean_token_loss(task.mlm.head, seen["decoded"], batch["decoder_labels"])
    assert abs(report["loss_decoder"] - decoder_loss) < 1e-9


@pytest.mark.parametrize("method", list(TASKS))
def test_each_method_exports_its_backbone_alone_with_cls_pooling(
    corpus_file: Path, still_model: Path, tmp_path: Path, method: str
):
    task = build_task(make_config(corpus_file, still_model, method))
    with torch.no_grad():
        for parameter in task.module.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)  # stands for training
    task.export(tmp_path / "model")
    exported = safetensors.torch.load_file(str(tmp_path / "model" / "model.safetensors"))
    backbone = task.mlm.backbone.state_dict()
    assert set(exported) == set(backbone)  # no head, no decoder, nothing added
    assert all(torch.equal(exported[k], backbone[k]) for k in exported)
    encoder = DenseEncoder.load(tmp_path / "model")
    assert encoder.config.pooling == "cls" and not encoder.config.normalize
    inputs = task.mlm.tokenizer(["kittens and volcanoes"], return_tensors="pt")
    with torch.no_grad():
        cls = task.mlm.backbone(**inputs).last_hidden_state[:, 0]
    assert np.allclose(embed_texts(encoder, ["kittens and volcanoes"], "passage"), cls.numpy(), atol=1e-6)


def test_cocondenser_grad_cache_equals_the_full_batch(corpus_file: Path, still_model: Path):
    plain = build_task(make_config(corpus_file, still_model, "cocondenser"), torch.float64)
    cached = build_task(
        make_config(corpus_file, still_model, "cocondenser", grad_cache={"enabled": True, "chunk_size": 3}),
        torch.float64,
    )
    cached.module.load_state_dict(plain.module.state_dict())  # the same fresh heads in both
    plain_parts = plain.forward_backward(plain.batch(0, 0))
    cached_parts = cached.forward_backward(cached.batch(0, 0))
    for name in plain_parts:
        assert abs(plain_parts[name] - cached_parts[name]) < 1e-9, name
    grads = {n: p.grad for n, p in plain.module.named_parameters() if p.grad is not None}
    other = dict(cached.module.named_parameters())
    assert max(float((g - other[n].grad).abs().max()) for n, g in grads.items()) < 1e-9


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _seeded_task(config: PretrainConfig) -> PretrainTask:
    torch.manual_seed(0)  # the same fresh heads in every process
    return build_task(config, torch.float64)


def _gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _cocondenser_step_worker(rank: int, world: int, port: int, configs: list[str], output: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for index, config_json in enumerate(configs):
            task = _seeded_task(PretrainConfig.model_validate_json(config_json))
            result = task.forward_backward(task.batch(0, 0))
            distributed.average_gradients([p for p in task.module.parameters() if p.requires_grad])
            result = {k: distributed.all_reduce_mean(v) for k, v in result.items()}  # as the trainer logs
            if rank == 0:
                safetensors.torch.save_file(_gradients(task.module), f"{output}-{index}")
                Path(f"{output}-{index}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_cocondenser_on_two_processes_gives_the_loss_and_gradients_of_one(
    corpus_file: Path, still_model: Path, tmp_path: Path
):
    configs = [
        make_config(
            corpus_file,
            still_model,
            "cocondenser",
            grad_cache=grad_cache,
            masking={"ratio": 0.4},
            cocondenser={"span_min": 4, "span_max": 12},
        )
        for grad_cache in ({"enabled": False}, {"enabled": True, "chunk_size": 3})
    ]
    labels = _seeded_task(configs[0]).batch(0, 0)["labels"]
    halves = (labels != IGNORE).reshape(2, -1).sum(1)  # each process's masked tokens
    assert halves[0] != halves[1]  # so each process's own MLM mean is not the batch's
    run_in_processes(
        _cocondenser_step_worker,
        (2, _free_port(), [c.model_dump_json() for c in configs], str(tmp_path / "g")),
    )
    for index, config in enumerate(configs):
        single = _seeded_task(config)
        expected = single.forward_backward(single.batch(0, 0))
        got = json.loads(Path(f"{tmp_path / 'g'}-{index}.json").read_text())
        assert got.keys() == expected.keys()
        for name in expected:
            assert abs(got[name] - expected[name]) < 1e-9, (index, name)
        two = safetensors.torch.load_file(f"{tmp_path / 'g'}-{index}")
        one = _gradients(single.module)
        assert two.keys() == one.keys()
        assert max(float((two[k] - one[k]).abs().max()) for k in one) < 1e-9


def bare_encoder_copy(source: Path, target: Path, drop: str) -> Path:
    """A copy of the checkpoint at `source` without its tensor `drop`."""
    shutil.copytree(source, target)
    weights = safetensors.torch.load_file(str(source / "model.safetensors"))
    del weights[drop]
    safetensors.torch.save_file(weights, str(target / "model.safetensors"))
    return target


def load_and_listen(path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture):
    """Load a checkpoint; return the model, densekit's records and what transformers logged or printed."""
    transformers_log = logging.getLogger("transformers")
    heard = logging.handlers.BufferingHandler(capacity=1000)
    transformers_log.addHandler(heard)
    caplog.clear()
    try:
        with caplog.at_level(logging.INFO, logger="densekit"):
            mlm = MaskedLanguageModel.load(str(path))
    finally:
        transformers_log.removeHandler(heard)
    said = [r.getMessage() for r in heard.buffer] + [capfd.readouterr().err]
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "densekit"]
    return mlm, records, "\n".join(said)


def test_a_bare_encoder_loads_without_a_transformers_report(
    tiny_model: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture
):
    mlm, records, said = load_and_listen(tiny_model, caplog, capfd)
    assert "corrupted" not in said and "LOAD REPORT" not in said and "MISSING" not in said
    assert records == [
        (logging.INFO, f"{tiny_model} has no MLM head; initialised a new one tied to the word embeddings")
    ]
    checkpoint = safetensors.torch.load_file(str(tiny_model / "model.safetensors"))
    backbone = mlm.backbone.state_dict()
    assert all(torch.equal(backbone[k], v) for k, v in checkpoint.items() if not k.startswith("pooler."))
    assert set(backbone) <= set(checkpoint)


def test_a_checkpoint_with_its_head_loads_it_and_says_nothing(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture
):
    trained = MaskedLanguageModel.load(str(tiny_model))
    with torch.no_grad():
        for parameter in trained.model.parameters():
            parameter.add_(torch.randn_like(parameter))
    trained.model.save_pretrained(tmp_path / "mlm")
    trained.tokenizer.save_pretrained(tmp_path / "mlm")
    mlm, records, said = load_and_listen(tmp_path / "mlm", caplog, capfd)
    assert not records and "corrupted" not in said and "LOAD REPORT" not in said
    expected = trained.model.state_dict()
    assert all(torch.equal(value, expected[k]) for k, value in mlm.model.state_dict().items())


def test_weights_the_objective_needs_are_named_when_missing(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture
):
    bare = bare_encoder_copy(tiny_model, tmp_path / "bare", "encoder.layer.1.attention.self.query.weight")
    _, records, said = load_and_listen(bare, caplog, capfd)
    assert "corrupted" not in said and "LOAD REPORT" not in said
    warnings = [message for level, message in records if level >= logging.WARNING]
    assert warnings == [
        f"{bare} lacks weights pre-training needs; they start from random values: "
        "bert.encoder.layer.1.attention.self.query.weight"
    ]

    full = MaskedLanguageModel.load(str(tiny_model))
    full.model.save_pretrained(tmp_path / "full")
    full.tokenizer.save_pretrained(tmp_path / "full")
    headless = bare_encoder_copy(
        tmp_path / "full", tmp_path / "part", "cls.predictions.transform.dense.weight"
    )
    _, records, _ = load_and_listen(headless, caplog, capfd)
    assert records == [
        (
            logging.WARNING,
            f"{headless} lacks weights pre-training needs; they start from random values: "
            "cls.predictions.transform.dense.weight",
        )
    ]


@pytest.mark.parametrize("method", list(TASKS))
def test_pretraining_resumes_exactly(
    corpus_file: Path, tiny_model: Path, tmp_path: Path, monkeypatch, method: str
):
    from densekit.training.trainer import Trainer

    config = make_config(corpus_file, tiny_model, method)
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
        build_task(make_config(corpus_file, tiny_model, "cocondenser"))  # spans of 4-8 tokens
    assert "overlap" not in caplog.text
    with caplog.at_level("WARNING", logger="densekit"):
        task = build_task(
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
    config = make_config(corpus_file, tiny_model, "mlm", optim={"max_steps": 2})
    output = tmp_path / "run"
    run_pretraining(config, output, show_progress=False)
    with pytest.raises(OutputError, match=r"already holds this pre-training run .*pass --resume"):
        run_pretraining(config, output, show_progress=False)
    other = make_config(corpus_file, tiny_model, "condenser", optim={"max_steps": 2})
    with pytest.raises(OutputError, match=r"differs in: config\.method\)"):
        run_pretraining(other, output, resume=True, show_progress=False)
    run_pretraining(other, output, show_progress=False, overwrite=True)
    assert json.loads((output / "densekit-artefact.json").read_text())["identity"]["config"]["method"] == (
        "condenser"
    )


def test_an_export_loads_as_an_encoder_without_a_report_of_its_absent_pooler(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture
):
    MaskedLanguageModel.load(str(tiny_model)).export(tmp_path / "export", 24)
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="densekit"):
        DenseEncoder.load(tmp_path / "export")
    said = capfd.readouterr().err
    assert "LOAD REPORT" not in said and "MISSING" not in said
    assert not [r for r in caplog.records if r.name == "densekit" and r.levelno >= logging.WARNING]
    bare = bare_encoder_copy(tmp_path / "export", tmp_path / "damaged", "encoder.layer.0.output.dense.bias")
    with caplog.at_level(logging.INFO, logger="densekit"):
        DenseEncoder.load(bare)
    assert "lacks weights; they start from random values: encoder.layer.0.output.dense.bias" in caplog.text


def test_every_pretraining_method_is_a_registered_task_run_through_the_shared_tests():
    assert set(typing.get_args(Method)) == set(TASKS)
    shared = (test_each_method_exports_its_backbone_alone_with_cls_pooling, test_pretraining_resumes_exactly)
    for test in shared:
        (mark,) = [mark for mark in test.pytestmark if mark.name == "parametrize"]
        assert set(mark.args[1]) == set(TASKS), test.__name__
