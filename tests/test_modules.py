"""Modules on a frozen base: each kind against the base, saved against live, merged against unmerged,
trained against the whole model's trainer guarantees (GradCache, two processes, resume)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from pydantic import TypeAdapter

from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder
from densekit.models.encoder import OWN, ModuleChoice
from densekit.models.merge import merged_encoder
from densekit.models.modules.kind import MODULE_KINDS, ModuleKind
from densekit.models.modules.kinds.sparse_diff import choose_sparse_indices, sparse_targets
from densekit.models.modules.module import ModuleError
from densekit.models.modules.peft_kind import PeftKind
from densekit.models.modules.specs import ModuleSpec
from densekit.training.checkpoint import load_state, save_state
from densekit.training.fine_tuning import run_training

from .conftest import tiny_bert
from .hostile.commands import cli as run_command
from .processes import run_in_processes
from .test_arguments_not_state import each_from_threads_at_once
from .test_training import (
    _free_port,
    _one_step_worker,
    gradients,
    killed_at_step_five,
    make_config,
    make_task,
    max_difference,
)

TEXTS = ["question about cats and kittens", "bread flour and an oven", "a text about trains"]
SPEC = TypeAdapter(ModuleSpec)
# Settings that keep a kind small on the tiny model; a kind not named here runs with its defaults.
SMALL = {"lora": {"rank": 4}, "prefix": {"virtual_tokens": 3}, "prompt": {"virtual_tokens": 3},
         "adapter": {"bottleneck": 8}, "sparse_diff": {"density": 0.05}}  # fmt: skip
# The shared tests' matrix: every registered kind (a kind registered is a kind tested), and the
# variants with code paths of their own.
KINDS = {name: {"type": name, **SMALL.get(name, {})} for name in MODULE_KINDS} | {
    "parallel-adapter": {"type": "adapter", "placement": "parallel", "bottleneck": 8},
    "separate-lora": {"type": "lora", "rank": 4, "towers": "separate"},
}
QUERY_ONLY = {"query-lora": {"type": "lora", "rank": 4, "towers": "query"},
              "query-adapter": {"type": "adapter", "bottleneck": 8, "towers": "query"}}  # fmt: skip
# a variant only merging tests: densekit's own kind folded into each of two towers
SEPARATE_BITFIT = {"separate-bitfit": {"type": "bitfit", "towers": "separate"}}
CASES = {**KINDS, **QUERY_ONLY, **SEPARATE_BITFIT}


def kind_of_case(case: str) -> ModuleKind:
    return MODULE_KINDS[CASES[case]["type"]]


# kinds whose added output is zero until trained (prefix and prompt tuning add inputs instead)
ZERO_AT_START = [case for case in KINDS if kind_of_case(case).starts_as_base]
MERGEABLE = [case for case in {**KINDS, **SEPARATE_BITFIT} if kind_of_case(case).mergeable]
NOT_MERGEABLE = [name for name, kind in MODULE_KINDS.items() if not kind.mergeable]
PEFT_KINDS = [name for name, kind in MODULE_KINDS.items() if isinstance(kind, PeftKind)]


def spec_of(kind: str, name: str | None = None):
    return SPEC.validate_python({**CASES[kind], "name": name or kind})


def embeddings(encoder: DenseEncoder, kind: str = "passage", module: ModuleChoice = OWN) -> np.ndarray:
    return embed_texts(encoder, TEXTS, kind, batch_size=2, module=module)


def put_module(encoder: DenseEncoder, kind: str, name: str | None = None, seed: int = 0):
    """A module of `kind` on `encoder` as its own (its random start drawn from `seed`), its parameters
    moved away from their start."""
    torch.manual_seed(seed)
    spec = spec_of(kind, name)
    indices = None
    if kind_of_case(kind).positions_from_gradients:
        generator = torch.Generator().manual_seed(seed)
        scores = {
            n: torch.rand(w.shape, generator=generator)
            for n, w in sparse_targets(encoder.query_backbone, spec).items()
        }
        indices = {"query": choose_sparse_indices(scores, spec.density)}
    module = encoder.new_module(spec, indices)
    encoder.own = module.name
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tower in module.towers().values():
            for parameter in tower.own_parameters().values():
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return module


@pytest.fixture
def encoder(tiny_model: Path) -> DenseEncoder:
    return DenseEncoder.load(tiny_model, pooling="mean", normalize=True).eval()


@pytest.mark.parametrize("kind", ZERO_AT_START)
def test_a_module_with_zero_output_gives_exactly_the_bases_embeddings(encoder: DenseEncoder, kind: str):
    base = embeddings(encoder)
    spec = spec_of(kind)
    indices = None
    if kind_of_case(kind).positions_from_gradients:
        targets = sparse_targets(encoder.query_backbone, spec)
        indices = {"query": choose_sparse_indices({n: w.abs() for n, w in targets.items()}, spec.density)}
    name = encoder.new_module(spec, indices).name
    assert np.array_equal(embeddings(encoder, module=name), base)
    base_queries = embeddings(encoder, "query", module=None)
    assert np.array_equal(embeddings(encoder, "query", module=name), base_queries)


@pytest.mark.parametrize("kind", list(KINDS))
def test_save_then_load_gives_the_same_embeddings_and_the_base_stays_bit_identical(
    encoder: DenseEncoder, kind: str, tmp_path: Path
):
    base_state = {k: v.clone() for k, v in encoder.query_backbone.state_dict().items()}
    base = embeddings(encoder)
    module = put_module(encoder, kind)
    shared = {id(p) for p in encoder.query_backbone.parameters()}
    assert all(shared <= {id(p) for p in tower.parameters()} for tower in module.towers().values())
    live = embeddings(encoder)
    assert np.abs(live - base).max() > 1e-3  # the module changes the embeddings
    encoder.save(tmp_path / "module")
    loaded = DenseEncoder.load(tmp_path / "module").eval()
    assert loaded.own == kind
    assert loaded.module.fingerprint() == encoder.module.fingerprint()
    assert np.array_equal(embeddings(loaded), live)
    assert np.array_equal(embeddings(loaded, "query"), embeddings(encoder, "query"))
    size = sum(p.stat().st_size for p in (tmp_path / "module").rglob("*") if p.is_file())
    assert size < 200_000  # the module alone, not the base (about 300 kB here)
    if CASES[kind]["type"] == "sparse_diff":  # positions in 32 bits: a third of the folder saved
        saved = safetensors.torch.load_file(str(tmp_path / "module" / "module.safetensors"))
        assert {t.dtype for name, t in saved.items() if name.endswith("indices")} == {torch.int32}
    state = encoder.query_backbone.state_dict()
    assert all(torch.equal(state[k], base_state[k]) for k in base_state)
    assert np.array_equal(embeddings(encoder, module=None), base)


@pytest.mark.parametrize("kind", list(QUERY_ONLY))
def test_a_query_only_module_leaves_passages_to_the_base_and_saves_only_its_query_side(
    encoder: DenseEncoder, kind: str, tmp_path: Path
):
    base_passages, base_queries = embeddings(encoder), embeddings(encoder, "query")
    put_module(encoder, kind)
    assert np.array_equal(embeddings(encoder), base_passages)
    live_queries = embeddings(encoder, "query")
    assert np.abs(live_queries - base_queries).max() > 1e-3
    assert not any(p.requires_grad for p in encoder.passage_backbone.parameters())
    encoder.save(tmp_path / "module")
    assert sorted(p.name for p in (tmp_path / "module").iterdir() if p.is_dir()) == ["query"]
    loaded = DenseEncoder.load(tmp_path / "module").eval()
    assert np.array_equal(embeddings(loaded, "query"), live_queries)
    assert np.array_equal(embeddings(loaded), base_passages)
    if kind == "query-lora":
        merged = merged_encoder(encoder, OWN).eval()
        assert np.abs(embeddings(merged, "query") - live_queries).max() < 1e-5
        assert np.abs(embeddings(merged) - base_passages).max() < 1e-5


def test_one_base_holds_several_modules_and_encodes_with_the_one_each_call_names(
    encoder: DenseEncoder, tmp_path: Path
):
    base = embeddings(encoder)
    put_module(encoder, "lora", "first", seed=1)
    encoder.save(tmp_path / "first")
    put_module(encoder, "adapter", "second", seed=2)
    encoder.save(tmp_path / "second")
    assert list(encoder.attached) == ["first", "second"] and encoder.own == "second"
    for name in ["first", "second", "first"]:
        alone = DenseEncoder.load(tmp_path / name).eval()
        assert np.array_equal(embeddings(encoder, module=name), embeddings(alone))
    assert np.array_equal(embeddings(encoder, module=None), base)
    assert encoder.own == "second"  # naming a module for a call leaves the encoder's own as it was
    with pytest.raises(KeyError, match="holds: first, second"):
        embeddings(encoder, module="third")


def test_every_kind_on_one_base_encoded_from_threads_at_once_gives_each_modules_vectors_alone(
    encoder: DenseEncoder,
):
    for seed, case in enumerate(KINDS, start=1):
        put_module(encoder, case, case.replace("-", "_"), seed=seed)
    names = [None, *encoder.attached]
    alone = {name: embeddings(encoder, "query", module=name) for name in names}
    for name in names[1:]:
        assert np.abs(alone[name] - alone[None]).max() > 1e-3, name
    each_from_threads_at_once(lambda name: embeddings(encoder, "query", module=name), alone, 3)


def test_a_module_on_another_base_is_refused(encoder: DenseEncoder, tmp_path: Path):
    put_module(encoder, "lora")
    encoder.save(tmp_path / "module")
    other = tiny_bert(tmp_path / "other", seed=1)
    with pytest.raises(ModuleError, match="trained on another base"):
        DenseEncoder.load(other, module=tmp_path / "module")
    # the same base, named by its folder, takes it
    same = DenseEncoder.load(encoder.source, module=tmp_path / "module").eval()
    assert np.array_equal(embeddings(same), embeddings(encoder))
    with torch.no_grad():  # a base that moved under its module (a bug, or a user's edit) is not saved
        encoder.query_backbone.embeddings.word_embeddings.weight[0, 0] += 1
    with pytest.raises(ModuleError, match="base weights changed"):
        encoder.save(tmp_path / "moved")


def test_a_module_whose_files_changed_is_refused(encoder: DenseEncoder, tmp_path: Path):
    put_module(encoder, "adapter")
    encoder.save(tmp_path / "module")
    weights = tmp_path / "module" / "module.safetensors"
    state = safetensors.torch.load_file(str(weights))
    state = {k: v + 1 for k, v in state.items()}
    safetensors.torch.save_file(state, str(weights))
    with pytest.raises(ValueError, match=r"module\.safetensors"):
        DenseEncoder.load(tmp_path / "module")


@pytest.mark.parametrize("kind", MERGEABLE)
def test_merged_modules_equal_the_unmerged_module(encoder: DenseEncoder, kind: str):
    put_module(encoder, kind)
    live = embeddings(encoder)
    merged = merged_encoder(encoder, OWN)
    assert np.abs(embeddings(merged.eval()) - live).max() < 1e-5
    assert np.abs(embeddings(merged, "query") - embeddings(encoder, "query")).max() < 1e-5


@pytest.mark.parametrize("kind", NOT_MERGEABLE)
def test_a_module_that_does_not_fold_is_refused_naming_the_kinds_that_do(encoder: DenseEncoder, kind: str):
    put_module(encoder, kind)
    folding = ", ".join(name for name, other in MODULE_KINDS.items() if other.mergeable)
    with pytest.raises(ValueError, match=rf"is {kind}; only {folding} fold into the weights"):
        merged_encoder(encoder, OWN)


def test_a_merged_lora_folder_loads_in_sentence_transformers_with_the_modules_embeddings(
    encoder: DenseEncoder, tmp_path: Path, capsys: pytest.CaptureFixture
):
    from sentence_transformers import SentenceTransformer

    put_module(encoder, "lora")
    encoder.save(tmp_path / "module")
    code, err, _ = run_command(capsys, "modules", "merge", tmp_path / "module", "-o", tmp_path / "full")
    assert code == 0, err
    theirs = SentenceTransformer(str(tmp_path / "full"), device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert np.abs(theirs - embeddings(encoder)).max() < 1e-5


def test_merging_another_module_into_a_merged_folder_needs_overwrite_and_then_replaces_it(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    for seed in (0, 1):
        encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True).eval()
        put_module(encoder, "lora", seed=seed)
        encoder.save(tmp_path / f"module{seed}")
    merge = ("modules", "merge", tmp_path / "module0", "-o", tmp_path / "full")
    assert run_command(capsys, *merge)[0] == 0
    assert run_command(capsys, *merge)[0] == 0  # the same merge again
    other = ("modules", "merge", tmp_path / "module1", "-o", tmp_path / "full")
    code, err, _ = run_command(capsys, *other)
    assert code != 0 and "pass --overwrite to replace it" in err
    code, err, _ = run_command(capsys, *other, "--overwrite")
    assert code == 0, err
    second = DenseEncoder.load(tmp_path / "module1")
    assert np.abs(embeddings(DenseEncoder.load(tmp_path / "full")) - embeddings(second)).max() < 1e-5


@pytest.mark.parametrize("kind", PEFT_KINDS)
def test_peft_itself_loads_a_peft_kind_module_folder_to_the_same_states(
    encoder: DenseEncoder, kind: str, tmp_path: Path
):
    from peft import PeftModel
    from transformers import AutoModel

    put_module(encoder, kind)
    encoder.save(tmp_path / "module")
    model = PeftModel.from_pretrained(AutoModel.from_pretrained(encoder.source), str(tmp_path / "module"))
    model.eval()
    batch = encoder.pad(encoder.tokenize(TEXTS, "passage"))
    with torch.no_grad():
        theirs = model(**batch).last_hidden_state
        ours = encoder.module.passage_tower(batch["input_ids"], batch["attention_mask"])
    virtual = MODULE_KINDS[kind].output_virtual_tokens(spec_of(kind))
    assert torch.allclose(theirs[:, virtual:], ours, atol=1e-6)


def module_config(collection, model: Path, kind: str, **sections):
    return make_config(collection, model, modules=dict(KINDS[kind]), **sections)


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_changes_only_the_module(collection, tiny_model: Path, tmp_path: Path, kind: str, caplog):
    config = module_config(
        collection, tiny_model, kind, optim={"max_steps": 3, "learning_rate": 1e-2}, checkpoint={"every": 10}
    )
    with caplog.at_level(logging.INFO, logger="densekit"):
        run_training(config, tmp_path / "run", show_progress=False)
    assert any(re.search(r"trainable [\d,]+ parameters, \d+\.\d\d% of the frozen base's [\d,]+", r.message)
               for r in caplog.records)  # fmt: skip
    trained = DenseEncoder.load(tmp_path / "run" / "model").eval()
    assert trained.own == "module"
    base = DenseEncoder.load(tiny_model, pooling="mean").eval()
    assert trained.base_fingerprint() == base.base_fingerprint()  # the base did not move
    assert np.abs(embeddings(trained) - embeddings(base)).max() > 1e-4  # the module did
    start = safetensors.torch.load_file(str(tiny_model / "model.safetensors"))
    assert all(torch.equal(v, start[k]) for k, v in base.query_backbone.state_dict().items() if k in start)


def test_grad_cache_with_a_module_equals_the_full_batch(collection, still_model: Path):
    plain = make_task(module_config(collection, still_model, "lora", optim={"batch_size": 8}))
    cached = make_task(
        module_config(collection, still_model, "lora", optim={"batch_size": 8},
                      grad_cache={"enabled": True, "chunk_size": 3})
    )  # fmt: skip
    for task in (plain, cached):
        put_module(task.encoder, "lora", "module")
    plain_loss = plain.forward_backward(plain.batch(0, 0))["loss"]
    cached_loss = cached.forward_backward(cached.batch(0, 0))["loss"]
    assert abs(plain_loss - cached_loss) < 1e-10
    plain_grads, cached_grads = gradients(plain.encoder), gradients(cached.encoder)
    assert plain_grads and all("lora_" in name for name in plain_grads)  # only the module gets gradients
    assert max_difference(plain_grads, cached_grads) < 1e-10


def _lora_module(encoder: DenseEncoder) -> None:
    put_module(encoder, "lora", "module")


def test_two_processes_train_a_module_like_one(collection, still_model: Path, tmp_path: Path):
    config = module_config(collection, still_model, "lora", optim={"batch_size": 8})
    single = make_task(config)
    _lora_module(single.encoder)
    single_loss = single.forward_backward(single.batch(0, 0))["loss"]
    run_in_processes(
        _one_step_worker, (2, _free_port(), config.model_dump_json(), str(tmp_path / "g"), _lora_module)
    )
    two = safetensors.torch.load_file(str(tmp_path / "g"))
    assert abs(json.loads((tmp_path / "g.json").read_text())["loss"] - single_loss) < 1e-10
    assert max_difference(two, gradients(single.encoder)) < 1e-10


@pytest.mark.parametrize("kind", list(MODULE_KINDS))
def test_a_killed_module_run_resumes_to_the_same_module(
    collection, tiny_model: Path, tmp_path: Path, monkeypatch, kind: str
):
    config = module_config(collection, tiny_model, kind, optim={"learning_rate": 1e-2})
    run_training(config, tmp_path / "straight", show_progress=False)
    killed_at_step_five(monkeypatch, config, tmp_path / "resumed")
    run_training(config, tmp_path / "resumed", resume=True, show_progress=False)
    straight = DenseEncoder.load(tmp_path / "straight" / "model")
    resumed = DenseEncoder.load(tmp_path / "resumed" / "model")
    assert straight.fingerprint() == resumed.fingerprint()
    saved = safetensors.torch.load_file(
        str(tmp_path / "resumed" / "checkpoints" / "step-00000003" / "state.safetensors")
    )
    base_names = safetensors.torch.load_file(str(tiny_model / "model.safetensors")).keys()
    assert saved and not any(key.endswith(name) for key in saved for name in base_names)
    assert (
        straight.module.fingerprint()
        != DenseEncoder.load(
            tmp_path / "straight" / "checkpoints" / "step-00000003" / "model"
        ).module.fingerprint()
    )


def test_a_module_run_resumes_only_on_the_base_it_started_from(collection, tmp_path: Path, monkeypatch):
    base = tiny_bert(tmp_path / "base")
    config = module_config(collection, base, "lora", optim={"learning_rate": 1e-2})
    killed_at_step_five(monkeypatch, config, tmp_path / "run")
    tiny_bert(tmp_path / "base", seed=1)
    with pytest.raises(ValueError, match=r"differs in: inputs\.model\.path"):
        run_training(config, tmp_path / "run", resume=True, show_progress=False)


def test_a_checkpoint_of_a_frozen_base_holds_the_rest_and_loads_only_on_that_base(tmp_path: Path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    save_state(model, tmp_path / "state.safetensors")
    assert set(safetensors.torch.load_file(str(tmp_path / "state.safetensors"))) == {"1.weight", "1.bias"}
    trained = {k: t.clone() for k, t in model.state_dict().items()}
    with torch.no_grad():
        model[1].weight.add_(1.0)
    load_state(model, tmp_path / "state.safetensors", torch.device("cpu"))
    assert all(torch.equal(t, trained[k]) for k, t in model.state_dict().items())
    with torch.no_grad():
        model[0].weight.add_(1e-3)
    with pytest.raises(ValueError, match="other frozen weights"):
        load_state(model, tmp_path / "state.safetensors", torch.device("cpu"))


def test_a_module_folder_continues_training_only_as_the_same_module(
    collection, tiny_model: Path, tmp_path: Path
):
    first = module_config(collection, tiny_model, "lora", optim={"max_steps": 2})
    run_training(first, tmp_path / "round1", show_progress=False)
    second = module_config(collection, tmp_path / "round1" / "model", "lora", optim={"max_steps": 2})
    run_training(second, tmp_path / "round2", show_progress=False)
    round1 = DenseEncoder.load(tmp_path / "round1" / "model")
    round2 = DenseEncoder.load(tmp_path / "round2" / "model")
    assert round1.base_fingerprint() == round2.base_fingerprint()
    assert round1.module.fingerprint() != round2.module.fingerprint()
    other = module_config(collection, tmp_path / "round1" / "model", "adapter", optim={"max_steps": 2})
    with pytest.raises(ValueError, match="does not describe"):
        run_training(other, tmp_path / "round2b", show_progress=False)
    whole = make_config(collection, tmp_path / "round1" / "model", optim={"max_steps": 2})
    with pytest.raises(ValueError, match="is a module folder"):
        run_training(whole, tmp_path / "round2c", show_progress=False)
    assert not (tmp_path / "round2c").exists()


def test_an_index_made_with_a_module_is_searched_only_with_that_module(
    beir_dir: Path, encoder: DenseEncoder, tmp_path: Path, capsys: pytest.CaptureFixture
):
    from densekit.data import Dataset
    from densekit.encoding.corpus import encode_corpus
    from densekit.encoding.store import EmbeddingStore
    from densekit.index import SearchIndex, build_index
    from densekit.index.spec import IndexSpec
    from densekit.retrieval.retriever import Retriever

    put_module(encoder, "lora", "second", seed=2)
    put_module(encoder, "lora", "first", seed=1)
    encoder.save(tmp_path / "first")
    encode_corpus(encoder, Dataset.open(beir_dir), tmp_path / "emb", show_progress=False)
    build_index(EmbeddingStore.open(tmp_path / "emb"), IndexSpec(), tmp_path / "index", show_progress=False)
    made = json.loads((tmp_path / "emb" / "densekit-artefact.json").read_text())
    assert made["identity"]["model"]["module"] == "first"
    index = SearchIndex.load(tmp_path / "index")
    queries = Dataset.open(beir_dir).split_queries("test")[0]
    retriever = Retriever(encoder, index)
    ranked = retriever.search_run(queries, 3)
    assert ranked
    refusal = "built with module 'first', and this encoder encodes passages with module 'second'"
    with pytest.raises(ValueError, match=refusal):
        Retriever(encoder, index, module="second")
    assert retriever.search_run(queries, 3) == ranked  # its module is its own, whatever others ask for

    def search(output: str, *module: str) -> tuple[int, str, str]:
        return run_command(capsys, "search", encoder.source, tmp_path / "index", beir_dir, "--split", "test",
                           "-o", tmp_path / output, *module)  # fmt: skip

    assert search("run.trec", "--module", str(tmp_path / "first"))[0] == 0
    code, err, _ = search("alone.trec")
    assert code == 2 and not (tmp_path / "alone.trec").exists()
    assert "built with module 'first', and this encoder encodes passages with the base model alone" in err


def _cases_of(test) -> set[str]:
    """The kinds a parametrised test runs (its cases' types)."""
    (mark,) = [mark for mark in test.pytestmark if mark.name == "parametrize"]
    return {CASES[case]["type"] if case in CASES else case for case in mark.args[1]}


def test_every_registered_kind_runs_through_the_shared_equivalence_tests():
    assert set(MODULE_KINDS) >= {"lora", "ia3", "prefix", "prompt", "adapter", "bitfit", "sparse_diff"}
    saved = _cases_of(test_save_then_load_gives_the_same_embeddings_and_the_base_stays_bit_identical)
    trained = _cases_of(test_training_changes_only_the_module)
    resumed = _cases_of(test_a_killed_module_run_resumes_to_the_same_module)
    zero = _cases_of(test_a_module_with_zero_output_gives_exactly_the_bases_embeddings)
    merged = _cases_of(test_merged_modules_equal_the_unmerged_module)
    refused = _cases_of(test_a_module_that_does_not_fold_is_refused_naming_the_kinds_that_do)
    peft_loads = _cases_of(test_peft_itself_loads_a_peft_kind_module_folder_to_the_same_states)
    for name, kind in MODULE_KINDS.items():
        assert name in saved and name in trained and name in resumed, name
        assert (name in zero) == kind.starts_as_base, name
        assert (name in merged) == kind.mergeable and (name in refused) != kind.mergeable, name
        assert (name in peft_loads) == isinstance(kind, PeftKind), name
