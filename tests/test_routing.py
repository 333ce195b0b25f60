"""Routing among modules and averaging them: each route against the module it should equal."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder
from densekit.models.averaging import average_modules
from densekit.models.merge import merged_encoder
from densekit.routing.route import Route
from densekit.routing.router import Router, load_balancing_loss, soft_weights
from densekit.routing.strategies import STRATEGIES, RouteSpec
from densekit.routing.strategies.fixed import fixed_weights
from densekit.routing.strategy import check_query_only, routed_vectors
from densekit.training.modules import prepare_route

from .test_modules import TEXTS, embeddings, put_module, spec_of

QUERIES = [*TEXTS, "moon orbit and planets", "a doctor in a hospital"]


@pytest.fixture
def encoder(tiny_model: Path) -> DenseEncoder:
    """The tiny base with three query-only LoRA modules, a, b and c."""
    encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True).eval()
    for seed, name in enumerate("abc"):
        put_module(encoder, "query-lora", name, seed=seed)
    encoder.own = None
    return encoder


def query_inputs(encoder: DenseEncoder) -> dict[str, torch.Tensor]:
    return encoder.pad(encoder.tokenize(QUERIES, "query"))


def by_module(encoder: DenseEncoder, name: str | None) -> torch.Tensor:
    inputs = query_inputs(encoder)
    with torch.no_grad():
        return encoder.encode_with(name, inputs["input_ids"], inputs["attention_mask"], "query")


def routed(encoder: DenseEncoder, modules: list[str], weights: torch.Tensor) -> torch.Tensor:
    inputs = query_inputs(encoder)
    with torch.no_grad():
        return routed_vectors(encoder, modules, weights, inputs["input_ids"], inputs["attention_mask"])


def test_fixed_routing_equals_each_querys_named_module(encoder: DenseEncoder):
    spec = RouteSpec(type="fixed", modules=["a", "b", "c"], domains={"x": "a", "y": "c"}, fallback="base")
    domains = ["x", "y", "x", "unknown", "y"]
    vectors = routed(encoder, spec.modules, fixed_weights(spec, domains))
    expected = {
        "x": by_module(encoder, "a"),
        "y": by_module(encoder, "c"),
        "unknown": by_module(encoder, None),
    }
    for row, domain in enumerate(domains):
        assert torch.allclose(vectors[row], expected[domain][row], atol=1e-6)  # a batch of other rows
    assert encoder.own is None  # routing did not change the encoder's own module
    strict = spec.model_copy(update={"fallback": None})
    with pytest.raises(KeyError, match="domain 'unknown' has no module"):
        fixed_weights(strict, domains)


def test_soft_routing_with_one_hot_weights_equals_that_module(encoder: DenseEncoder):
    router = Router(encoder.dimension, 3)
    with torch.no_grad():
        router.scores.weight.zero_()
        router.scores.bias.copy_(torch.tensor([0.0, 1e4, 0.0]))  # a softmax of exactly (0, 1, 0)
    weights = soft_weights(router(by_module(encoder, None)))
    assert torch.equal(weights, torch.tensor([[0.0, 1.0, 0.0]]).expand(len(QUERIES), 3))
    assert torch.allclose(routed(encoder, ["a", "b", "c"], weights), by_module(encoder, "b"), atol=1e-6)


def test_top_k_with_k_equal_to_the_modules_is_soft_routing_and_smaller_k_runs_fewer(encoder: DenseEncoder):
    torch.manual_seed(0)
    router = Router(encoder.dimension, 3)
    scores = router(by_module(encoder, None))
    soft = soft_weights(scores)
    assert torch.equal(soft_weights(scores, k=3), soft)
    assert torch.equal(routed(encoder, ["a", "b", "c"], soft_weights(scores, k=3)),
                       routed(encoder, ["a", "b", "c"], soft))  # fmt: skip
    top1 = soft_weights(scores, k=1)
    assert torch.equal((top1 > 0).sum(-1), torch.ones(len(QUERIES), dtype=torch.long))
    assert torch.allclose(top1.sum(-1), torch.ones(len(QUERIES)))
    chosen = top1.argmax(-1)
    vectors = routed(encoder, ["a", "b", "c"], top1)
    for row, column in enumerate(chosen.tolist()):
        assert torch.allclose(vectors[row], by_module(encoder, "abc"[column])[row], atol=1e-6)


def test_a_top_1_router_in_training_routes_as_top_1_and_gets_a_gradient_through_the_choice(
    encoder: DenseEncoder,
):
    torch.manual_seed(0)
    top1 = Route(encoder, RouteSpec(type="top_k", modules=["a", "b", "c"], k=1))
    inputs = query_inputs(encoder)
    target = torch.randn(len(QUERIES), encoder.dimension, generator=torch.Generator().manual_seed(1))

    def vectors_and_router_gradient(training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        top1.router.train(training)
        top1.router.zero_grad()
        vectors = top1(inputs["input_ids"], inputs["attention_mask"])
        (vectors * target).sum().backward()
        return vectors.detach(), top1.router.scores.weight.grad.clone()

    served, hard_gradient = vectors_and_router_gradient(training=False)
    trained, gradient = vectors_and_router_gradient(training=True)
    assert float(hard_gradient.abs().max()) == 0  # a hard top-1 choice teaches the router nothing
    assert torch.allclose(trained, served, atol=1e-6)  # training routes as top-1 does...
    assert float(gradient.abs().max()) > 1e-4  # ...and the router learns
    scores = top1.scores(inputs["input_ids"], inputs["attention_mask"]).detach()
    assert torch.equal(soft_weights(scores, k=1, straight_through=True), soft_weights(scores, k=1))


def test_output_averaging_weighs_the_modules_vectors(encoder: DenseEncoder):
    weights = torch.tensor([[0.25, 0.75, 0.0]]).expand(len(QUERIES), 3)
    mixed = 0.25 * by_module(encoder, "a") + 0.75 * by_module(encoder, "b")
    expected = torch.nn.functional.normalize(mixed, dim=-1)
    assert torch.allclose(routed(encoder, ["a", "b", "c"], weights), expected, atol=1e-6)


def test_fusion_over_copies_of_a_module_is_that_module_and_uniform_attention_is_equal_averaging(
    encoder: DenseEncoder,
):
    put_module(encoder, "query-lora", "a-copy", seed=0)  # the same as module a
    encoder.own = None
    torch.manual_seed(0)
    copies = Route(encoder, RouteSpec(type="fusion", modules=["a", "a-copy"]))
    inputs = query_inputs(encoder)
    with torch.no_grad():
        weights = copies.weights(inputs["input_ids"], inputs["attention_mask"], None)
        assert torch.allclose(
            copies(inputs["input_ids"], inputs["attention_mask"]), by_module(encoder, "a"), atol=1e-6
        )
    assert torch.allclose(weights.sum(-1), torch.ones(len(QUERIES)))

    fusion = Route(encoder, RouteSpec(type="fusion", modules=["a", "b", "c"]))
    with torch.no_grad():
        fusion.router.query.weight.zero_()
        fusion.router.query.bias.zero_()  # every score 0: uniform attention
        fused = fusion(inputs["input_ids"], inputs["attention_mask"])
    assert torch.allclose(
        fused, routed(encoder, ["a", "b", "c"], torch.full((len(QUERIES), 3), 1 / 3)), atol=1e-6
    )


def test_the_load_balancing_loss_is_one_when_balanced_and_grows_with_collapse():
    balanced = torch.zeros(4, 2)
    assert float(load_balancing_loss(balanced, soft_weights(balanced))) == pytest.approx(1.0)
    collapsed = torch.tensor([[5.0, 0.0]] * 4)
    assert float(load_balancing_loss(collapsed, soft_weights(collapsed, k=1))) > 1.9


def test_averaging_two_copies_of_a_module_equals_that_module(encoder: DenseEncoder, tmp_path: Path):
    put_module(encoder, "query-lora", "copy", seed=0)  # the same start and changes as module a
    encoder.own = None
    averaged = average_modules(encoder, ["a", "copy"], [0.3, 0.7], "averaged")
    assert averaged.spec.rank == 8 and encoder.own is None
    assert torch.allclose(by_module(encoder, "averaged"), by_module(encoder, "a"), atol=1e-6)
    encoder.own = "averaged"  # it saves and loads like any module
    encoder.save(tmp_path / "averaged")
    loaded = DenseEncoder.load(tmp_path / "averaged").eval()
    assert np.array_equal(embeddings(loaded, "query"), embeddings(encoder, "query"))

    for kind in ["query-adapter"]:
        put_module(encoder, kind, "x", seed=3)
        put_module(encoder, kind, "y", seed=3)
        average_modules(encoder, ["x", "y"], [0.5, 0.5], "xy")
        assert torch.allclose(by_module(encoder, "xy"), by_module(encoder, "x"), atol=1e-6)


def test_averaged_lora_is_the_weighted_average_of_the_merged_models(encoder: DenseEncoder):
    average_modules(encoder, ["a", "b"], [0.4, 0.6], "ab")
    merged = {}
    for name in ["a", "b", "ab"]:
        merged[name] = merged_encoder(encoder, name).query_backbone.state_dict()
    changed = 0
    for key, value in merged["ab"].items():
        expected = 0.4 * merged["a"][key] + 0.6 * merged["b"][key]
        assert torch.allclose(value, expected, atol=1e-6), key
        changed += not torch.equal(merged["a"][key], merged["b"][key])
    assert changed > 0


def test_modules_of_other_settings_or_weights_not_summing_to_one_are_refused(encoder: DenseEncoder):
    put_module(encoder, "query-adapter", "adapter", seed=0)
    with pytest.raises(ValueError, match="differ in their settings"):
        average_modules(encoder, ["a", "adapter"], [0.5, 0.5], "mixed")
    with pytest.raises(ValueError, match="sum to 1"):
        average_modules(encoder, ["a", "b"], [0.5, 0.6], "ab")
    with pytest.raises(KeyError, match="no module called 'z'"):
        average_modules(encoder, ["a", "z"], [0.5, 0.5], "az")


def test_a_route_needs_modules_that_leave_passages_to_the_base(encoder: DenseEncoder):
    check_query_only(encoder, ["a", "b"])
    put_module(encoder, "lora", "both-sides", seed=0)
    with pytest.raises(ValueError, match="towers: query"):
        check_query_only(encoder, ["a", "both-sides"])


def test_a_route_spec_names_only_its_modules():
    with pytest.raises(ValueError, match="not among modules"):
        RouteSpec(type="fixed", modules=["a"], domains={"x": "b"})
    with pytest.raises(ValueError, match="k between 1"):
        RouteSpec(type="top_k", modules=["a", "b"], k=3)
    with pytest.raises(ValueError, match="named twice"):
        RouteSpec(type="soft", modules=["a", "a"])


def base_index(encoder: DenseEncoder, beir_dir: Path, folder: Path):
    from densekit.data import Dataset
    from densekit.encoding.corpus import encode_corpus
    from densekit.encoding.store import EmbeddingStore
    from densekit.index import SearchIndex, build_index
    from densekit.index.spec import IndexSpec

    encode_corpus(encoder, Dataset.open(beir_dir), folder / "emb", show_progress=False)
    build_index(EmbeddingStore.open(folder / "emb"), IndexSpec(), folder / "index", show_progress=False)
    return SearchIndex.load(folder / "index")


def test_a_retriever_with_a_fixed_route_searches_the_base_index_with_the_domains_module(
    encoder: DenseEncoder, beir_dir: Path, tmp_path: Path
):
    from densekit.data import Dataset
    from densekit.encoding.embed import embed_texts
    from densekit.retrieval.retriever import Retriever

    index = base_index(encoder, beir_dir, tmp_path)
    route = Route(encoder, RouteSpec(type="fixed", modules=["a", "b"], domains={"x": "a", "y": "b"}))
    retriever = Retriever(encoder, index, route=route)
    queries = Dataset.open(beir_dir).split_queries("test")[0]
    ids = list(queries)
    for domain, name in [("x", "a"), ("y", "b")]:
        encoder.own = name
        direct = embed_texts(encoder, [queries[q] for q in ids], "query")
        encoder.own = None
        routed_run = retriever.search_run(queries, 3, domain=domain)
        direct_run = index.search_run(direct, ids, 3)
        assert {q: list(d) for q, d in routed_run.items()} == {q: list(d) for q, d in direct_run.items()}
        assert all(abs(routed_run[q][d] - direct_run[q][d]) < 1e-6 for q in direct_run for d in direct_run[q])
    with pytest.raises(KeyError, match="domain 'z'"):
        retriever.search_run(queries, 3, domain="z")

    put_module(encoder, "lora", "both")  # an index of a passage-changing module's passages is not the base's
    other = base_index(encoder, beir_dir, tmp_path / "both")
    encoder.own = None
    with pytest.raises(ValueError, match="built with module 'both'"):
        Retriever(encoder, other, route=route)


# What each strategy needs of a route over modules a, b and c; a strategy not named needs nothing. The
# shared tests run every registered strategy (the registry is their matrix).
NEEDS = {"fixed": {"domains": {"x": "a", "y": "b", "z": "c"}}, "top_k": {"k": 2}}
TRAINING_NEEDS = {"top_k": {"k": 1}}  # a router trained over the two modules of `module_folders`
TRAINABLE = [name for name, strategy in STRATEGIES.items() if strategy.trainable]


def route_of(encoder: DenseEncoder, strategy: str) -> Route:
    return Route(encoder, RouteSpec(type=strategy, modules=["a", "b", "c"], **NEEDS.get(strategy, {})))


def domains_for(route: Route) -> list[str] | None:
    """Each query's domain where the route's strategy routes by domain."""
    return [["x", "y", "z"][i % 3] for i in range(len(QUERIES))] if route.strategy.takes_domains else None


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_saved_route_loads_to_the_same_routed_vectors_and_refuses_a_changed_module(
    encoder: DenseEncoder, tmp_path: Path, strategy: str
):
    folders = {}
    for name in "abc":
        encoder.own = name
        encoder.save(tmp_path / name)
        folders[name] = tmp_path / name
    encoder.own = None
    torch.manual_seed(0)
    route = route_of(encoder, strategy)
    route.save(tmp_path / "route", folders)
    loaded = Route.load(tmp_path / "route")
    domains = domains_for(route)
    assert np.array_equal(loaded.encode_queries(QUERIES, domains), route.encode_queries(QUERIES, domains))
    assert loaded.fingerprint() == route.fingerprint()

    put_module(encoder, "query-lora", "b", seed=7)  # module b changes and is saved in its folder again
    encoder.save(tmp_path / "b")
    with pytest.raises(ValueError, match=r"module 'b' .* changed since the route was made"):
        Route.load(tmp_path / "route")


# The spec of each route of `route_of` as densekit saved it when one flat spec held every strategy's
# settings (written by the code of commit 69f8413, before each strategy had a spec of its own): route
# folders made then must load, and routes made now must be saved (and fingerprinted) the same way.
FLAT_SPECS = {
    "fixed": '{"type":"fixed","modules":["a","b","c"],"domains":{"x":"a","y":"b","z":"c"},'
    '"fallback":null,"k":null}',
    "soft": '{"type":"soft","modules":["a","b","c"],"domains":{},"fallback":null,"k":null}',
    "top_k": '{"type":"top_k","modules":["a","b","c"],"domains":{},"fallback":null,"k":2}',
    "fusion": '{"type":"fusion","modules":["a","b","c"],"domains":{},"fallback":null,"k":null}',
}


@pytest.mark.parametrize("strategy", list(FLAT_SPECS))
def test_a_route_folder_saved_with_the_flat_spec_loads_to_the_same_route(
    encoder: DenseEncoder, tmp_path: Path, strategy: str
):
    from densekit.io.artefact import artefact_dir
    from densekit.routing.route import ROUTE_FILE, ROUTE_KIND, ROUTER_WEIGHTS

    folders = {}
    for name in "abc":
        encoder.own = name
        encoder.save(tmp_path / name)
        folders[name] = tmp_path / name
    encoder.own = None
    torch.manual_seed(0)
    route = route_of(encoder, strategy)
    assert route.spec.model_dump_json() == FLAT_SPECS[strategy]  # what the route's fingerprint digests
    route.save(tmp_path / "route", folders)
    saved = json.loads((tmp_path / "route" / ROUTE_FILE).read_text())
    assert saved["spec"] == json.loads(FLAT_SPECS[strategy])

    # the folder as the flat spec's code wrote it: its spec, the saved base, modules and router
    old = {**saved, "spec": json.loads(FLAT_SPECS[strategy])}
    with artefact_dir(tmp_path / "old", ROUTE_KIND, {"route": route.fingerprint()}) as written:
        (written / ROUTE_FILE).write_text(json.dumps(old, indent=2), encoding="utf-8")
        if (tmp_path / "route" / ROUTER_WEIGHTS).exists():
            (written / ROUTER_WEIGHTS).write_bytes((tmp_path / "route" / ROUTER_WEIGHTS).read_bytes())
    loaded = Route.load(tmp_path / "old")
    assert type(loaded.spec) is STRATEGIES[strategy].spec and loaded.spec == route.spec
    assert loaded.fingerprint() == route.fingerprint()
    domains = domains_for(route)
    assert np.array_equal(loaded.encode_queries(QUERIES, domains), route.encode_queries(QUERIES, domains))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_route_over_modules_that_add_nothing_gives_the_bases_vectors(tiny_model: Path, strategy: str):
    encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True).eval()
    for name in "abc":
        encoder.new_module(spec_of("query-lora", name))  # fresh: LoRA's B is zero
    encoder.own = None
    torch.manual_seed(0)
    route = route_of(encoder, strategy)
    base = embed_texts(encoder, QUERIES, "query")
    assert np.allclose(route.encode_queries(QUERIES, domains_for(route)), base, atol=1e-6)


@pytest.fixture
def module_folders(tiny_model: Path, tmp_path: Path) -> dict[str, str]:
    """Two query-only LoRA modules of the tiny base (mean pooling), saved."""
    encoder = DenseEncoder.load(tiny_model, pooling="mean").eval()
    folders = {}
    for seed, name in enumerate(["first", "second"]):
        put_module(encoder, "query-lora", name, seed=seed)
        encoder.save(tmp_path / name)
        folders[name] = str(tmp_path / name)
    return folders


@pytest.mark.parametrize("route_type", TRAINABLE)
def test_training_a_router_changes_only_the_router_and_saves_a_route_that_loads(
    collection, tiny_model: Path, module_folders: dict[str, str], tmp_path: Path, route_type: str
):
    from densekit.training.fine_tuning import run_training

    from .test_training import make_config

    section = {"type": route_type, "modules": module_folders, **TRAINING_NEEDS.get(route_type, {})}
    config = make_config(collection, tiny_model, route=section, optim={"learning_rate": 5e-2})
    torch.manual_seed(0)
    run_training(config, tmp_path / "run", show_progress=False)
    route = Route.load(tmp_path / "run" / "model")
    assert route.spec.modules == ["first", "second"] and route.spec.type == route_type
    for name, folder in module_folders.items():  # the modules are as they were saved
        assert route.encoder.attached[name].fingerprint() == DenseEncoder.load(folder).module.fingerprint()
    torch.manual_seed(config.seed)  # the run's start: the same draws give the router it started from
    start = prepare_route(DenseEncoder.load(tiny_model, pooling="mean"), config.route).router.state_dict()
    trained = route.router.state_dict()
    assert all(not torch.equal(trained[k], v) for k, v in start.items())
    figures = {"route_entropy"} | ({"loss_balance"} if STRATEGIES[route_type].balanced else set())
    rows = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    assert all(figures <= row.keys() for row in rows if "loss" in row)
    inputs = query_inputs(route.encoder)
    assert np.allclose(route.encode_queries(QUERIES), embed_like(route, inputs), atol=1e-6)
    with pytest.raises(ValueError, match="not modules and route"):
        make_config(collection, tiny_model, route={"modules": module_folders}, modules={"type": "lora"})


@pytest.mark.parametrize("strategy", TRAINABLE)
def test_a_killed_router_run_resumes_to_the_same_route(
    collection, tiny_model: Path, module_folders: dict[str, str], tmp_path: Path, monkeypatch, strategy: str
):
    from densekit.training.fine_tuning import run_training

    from .test_training import killed_at_step_five, make_config

    section = {"type": strategy, "modules": module_folders, **TRAINING_NEEDS.get(strategy, {})}
    config = make_config(collection, tiny_model, route=section, optim={"learning_rate": 5e-2})
    run_training(config, tmp_path / "straight", show_progress=False)
    killed_at_step_five(monkeypatch, config, tmp_path / "resumed")
    run_training(config, tmp_path / "resumed", resume=True, show_progress=False)
    straight = Route.load(tmp_path / "straight" / "model")
    assert Route.load(tmp_path / "resumed" / "model").fingerprint() == straight.fingerprint()
    started = Route.load(tmp_path / "straight" / "checkpoints" / "step-00000003" / "model")
    assert started.fingerprint() != straight.fingerprint()  # the router moved after the checkpoint


def _strategies_of(test) -> set[str]:
    """The strategies a parametrised test runs."""
    (mark,) = [mark for mark in test.pytestmark if mark.name == "parametrize"]
    return set(mark.args[1])


def test_every_registered_strategy_runs_through_the_shared_equivalence_tests():
    assert set(STRATEGIES) >= {"fixed", "soft", "top_k", "fusion"}
    saved = _strategies_of(test_a_saved_route_loads_to_the_same_routed_vectors_and_refuses_a_changed_module)
    zero = _strategies_of(test_a_route_over_modules_that_add_nothing_gives_the_bases_vectors)
    trained = _strategies_of(test_training_a_router_changes_only_the_router_and_saves_a_route_that_loads)
    resumed = _strategies_of(test_a_killed_router_run_resumes_to_the_same_route)
    for name, strategy in STRATEGIES.items():
        assert name in saved and name in zero, name
        assert (name in trained) == strategy.trainable and (name in resumed) == strategy.trainable, name


def test_router_gradients_with_grad_cache_equal_the_full_batchs(
    collection, still_model: Path, module_folders_still: dict[str, str]
):
    from densekit.data import Dataset
    from densekit.data.examples import read_examples
    from densekit.training.contrastive import ContrastiveTask

    from .test_training import gradients, make_config, max_difference

    texts = {doc.id: doc.full_text for doc in Dataset.open(collection[0]).iter_corpus()}
    results = []
    for cache in [{"enabled": False}, {"enabled": True, "chunk_size": 2}]:
        config = make_config(collection, still_model, route={"modules": module_folders_still},
                             grad_cache=cache, optim={"batch_size": 4})  # fmt: skip
        encoder = DenseEncoder.load(still_model, pooling="mean")
        torch.manual_seed(5)
        route = prepare_route(encoder, config.route).double()
        examples = read_examples(Path(config.data.train))
        task = ContrastiveTask(encoder, examples, texts, config, route, config.route.modules)
        figures = task.forward_backward(task.batch(0, 0))
        results.append((figures["loss"], gradients(route.router)))
    assert float(results[0][0]) == pytest.approx(float(results[1][0]), abs=1e-10)
    assert max_difference(results[0][1], results[1][1]) < 1e-10
    assert max(float(g.abs().max()) for g in results[0][1].values()) > 1e-6


@pytest.fixture
def module_folders_still(still_model: Path, tmp_path: Path) -> dict[str, str]:
    encoder = DenseEncoder.load(still_model, pooling="mean").eval()
    folders = {}
    for seed, name in enumerate(["first", "second"]):
        put_module(encoder, "query-lora", name, seed=seed)
        encoder.save(tmp_path / f"still-{name}")
        folders[name] = str(tmp_path / f"still-{name}")
    return folders


def test_the_route_and_average_commands_and_search_with_a_route(
    encoder: DenseEncoder, beir_dir: Path, tmp_path: Path
):
    from typer.testing import CliRunner

    from densekit.cli.main import app
    from densekit.data import Dataset
    from densekit.data.trec import read_run
    from densekit.diagnostics import Diagnostics
    from densekit.retrieval.retriever import Retriever

    for name in "ab":
        encoder.own = name
        encoder.save(tmp_path / name)
    encoder.own = None
    index = base_index(encoder, beir_dir, tmp_path)
    runner = CliRunner()
    route_command = ["modules", "route", str(tmp_path / "a"), str(tmp_path / "b"), "--domain", "x=a",
                     "--domain", "y=b", "-o", str(tmp_path / "route")]  # fmt: skip
    result = runner.invoke(app, route_command)
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["search", str(tmp_path / "route"), str(tmp_path / "index"), str(beir_dir),
                                 "--domain", "y", "--k", "3", "-o", str(tmp_path / "y.trec"), "--no-progress",
                                 "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 0, result.output
    route = Route(encoder, RouteSpec(type="fixed", modules=["a", "b"], domains={"x": "a", "y": "b"}))
    queries = Dataset.open(beir_dir).split_queries("test")[0]
    expected = Retriever(encoder, index, route=route).search_run(queries, 3, domain="y")
    searched = read_run(tmp_path / "y.trec", Diagnostics())
    assert {q: list(d) for q, d in searched.items()} == {q: list(d) for q, d in expected.items()}
    result = runner.invoke(app, ["search", str(tmp_path / "route"), str(tmp_path / "index"), str(beir_dir),
                                 "--domain", "z", "-o", str(tmp_path / "z.trec")])  # fmt: skip
    assert result.exit_code != 0 and not (tmp_path / "z.trec").exists()
    result = runner.invoke(app, ["search", str(tmp_path / "route"), str(tmp_path / "index"), str(beir_dir),
                                 "--pooling", "cls", "-o", str(tmp_path / "cls.trec")])  # fmt: skip
    assert result.exit_code != 0 and "--pooling do not apply" in str(result.exception)

    result = runner.invoke(app, ["modules", "average", str(tmp_path / "a"), str(tmp_path / "b"),
                                 "--weights", "0.5,0.5", "-o", str(tmp_path / "ab")])  # fmt: skip
    assert result.exit_code == 0, result.output
    averaged = DenseEncoder.load(tmp_path / "ab").eval()
    average_modules(encoder, ["a", "b"], [0.5, 0.5], "averaged")
    assert torch.allclose(by_module(averaged, "averaged"), by_module(encoder, "averaged"), atol=1e-6)


def embed_like(route: Route, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    """The route's vectors of QUERIES in one padded batch."""
    with torch.no_grad():
        return route(inputs["input_ids"], inputs["attention_mask"]).numpy()


def test_the_routing_diagnostic_reports_each_collections_modules_and_collapse(
    encoder: DenseEncoder, beir_dir: Path, tmp_path: Path
):
    from typer.testing import CliRunner

    from densekit.cli.main import app

    for name in "ab":
        encoder.own = name
        encoder.save(tmp_path / name)
    encoder.own = None
    runner = CliRunner()
    for route, domains in [("split", ["x=a", "y=b"]), ("collapsed", ["x=a", "y=a"])]:
        command = ["modules", "route", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / route)]
        assert runner.invoke(app, command + [f"--domain={d}" for d in domains]).exit_code == 0
        diagnose = ["modules", "diagnose", str(tmp_path / route), str(beir_dir), str(beir_dir),
                    "--domain", "x", "--domain", "y", "--json", str(tmp_path / f"{route}.json"), "--plot",
                    str(tmp_path / f"{route}.png"), "--device", "cpu"]  # fmt: skip
        result = runner.invoke(app, diagnose)
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / f"{route}.json").read_text())
        assert (tmp_path / f"{route}.png").stat().st_size > 1000
        if route == "split":
            assert report["collections"]["x"]["top_share"] == {"a": 1.0, "b": 0.0}
            assert report["collections"]["y"]["mean_weight"] == {"a": 0.0, "b": 1.0}
            assert report["collapse"] == [] and "collapse" not in result.output
        else:
            assert report["collapse"] == ["module 'a' is the top choice of 100% of all queries",
                                          "module 'b' is never the top choice"]  # fmt: skip
            assert "collapse: module 'a'" in result.output


def test_a_benchmark_with_a_route_searches_each_collection_by_its_domain_and_reuses_its_stages(
    encoder: DenseEncoder, beir_dir: Path, tmp_path: Path
):
    from densekit.data import Dataset
    from densekit.data.trec import read_run
    from densekit.diagnostics import Diagnostics
    from densekit.evaluation.benchmark import BenchmarkOptions, run_benchmark
    from densekit.index import SearchIndex
    from densekit.retrieval.retriever import Retriever

    quick = BenchmarkOptions(k=5, show_progress=False)

    route = Route(encoder, RouteSpec(type="fixed", modules=["a", "b"], domains={"x": "a", "y": "b"}))

    def benchmark():
        return run_benchmark(encoder, "routed", [beir_dir, beir_dir], tmp_path / "bench", quick, route=route,
                             domains=["x", "y"])  # fmt: skip

    result = benchmark()
    queries = Dataset.open(beir_dir).split_queries("test")[0]
    for collection, domain in zip(result.collections, ["x", "y"], strict=True):
        folder = tmp_path / "bench" / collection.name
        retriever = Retriever(encoder, SearchIndex.load(folder / "index"), route=route)
        expected = retriever.search_run(queries, 5, domain=domain)
        searched = read_run(folder / "dense.trec", Diagnostics())
        assert {q: list(d) for q, d in searched.items()} == {q: list(d) for q, d in expected.items()}
    first, second = (
        read_run(tmp_path / "bench" / c.name / "dense.trec", Diagnostics()) for c in result.collections
    )
    assert first != second  # each collection went to its own module
    again = benchmark()
    assert all(set(c.stages.values()) == {"reused"} for c in again.collections)


def test_a_query_only_module_searches_the_bases_index_and_a_benchmark_given_it_encodes_nothing(
    encoder: DenseEncoder, beir_dir: Path, tmp_path: Path
):
    from densekit.data import Dataset
    from densekit.data.trec import read_run
    from densekit.diagnostics import Diagnostics
    from densekit.encoding.corpus import embedding_identity
    from densekit.evaluation.benchmark import BenchmarkOptions, run_benchmark

    quick = BenchmarkOptions(k=5, show_progress=False)

    dataset = Dataset.open(beir_dir)
    base = run_benchmark(encoder, "base", [beir_dir], tmp_path / "base", quick)
    base_index_dir = tmp_path / "base" / base.collections[0].name / "index"
    # query-only: its passages are the base's, so are its embeddings' records
    assert np.array_equal(embeddings(encoder, module="a"), embeddings(encoder, module=None))
    a_identity = embedding_identity(encoder, dataset, 1, None, module="a")
    assert a_identity == embedding_identity(encoder, dataset, 1, None, module=None)

    encoder.own = "a"
    own = run_benchmark(encoder, "a", [beir_dir], tmp_path / "own", quick)
    given = run_benchmark(encoder, "a", [beir_dir], tmp_path / "given", quick,
                          indexes=[base_index_dir])  # fmt: skip
    assert given.collections[0].stages["encode"] == f"given: {base_index_dir}"
    assert not (tmp_path / "given" / given.collections[0].name / "embeddings").exists()
    runs = [read_run(tmp_path / b / c.name / "dense.trec", Diagnostics())
            for b, c in (("own", own.collections[0]), ("given", given.collections[0]))]  # fmt: skip
    assert {q: list(d) for q, d in runs[0].items()} == {q: list(d) for q, d in runs[1].items()}
    assert all(abs(runs[0][q][d] - runs[1][q][d]) < 1e-6 for q in runs[0] for d in runs[0][q])
    assert given.collections[0].scores == own.collections[0].scores

    put_module(encoder, "lora", "both")  # a module that changes passages cannot search the base's index
    with pytest.raises(ValueError, match=r"built with the base model alone .* passages with module 'both'"):
        run_benchmark(encoder, "both", [beir_dir], tmp_path / "both", quick,
                      indexes=[base_index_dir])  # fmt: skip
    with pytest.raises(ValueError, match="2 indexes for 1 collections"):
        run_benchmark(encoder, "both", [beir_dir], tmp_path / "both", quick,
                      indexes=[base_index_dir, base_index_dir])  # fmt: skip


def embed_texts_with(encoder: DenseEncoder, name: str | None) -> np.ndarray:
    """The test passages' vectors with module `name`."""
    return embeddings(encoder, module=name)


def test_the_service_routes_a_requests_queries_by_its_domain(
    encoder: DenseEncoder, beir_dir: Path, tmp_path: Path
):
    from fastapi.testclient import TestClient

    from densekit.retrieval.retriever import Retriever
    from densekit.serving.app import create_app

    for name in "ab":
        encoder.own = name
        encoder.save(tmp_path / name)
    encoder.own = None
    base_index(encoder, beir_dir, tmp_path)
    spec = RouteSpec(type="fixed", modules=["a", "b"], domains={"x": "a", "y": "b"})
    Route(encoder, spec).save(tmp_path / "route", {"a": tmp_path / "a", "b": tmp_path / "b"})
    retriever = Retriever.open(str(tmp_path / "route"), tmp_path / "index", beir_dir, device="cpu")
    assert retriever.route is not None and retriever.route.spec == spec
    texts = QUERIES[:3]
    with TestClient(create_app(retriever, "token")) as http:
        auth = {"Authorization": "Bearer token"}
        for domain in ("x", "y"):
            response = http.post("/search", json={"query": texts, "k": 3, "domain": domain}, headers=auth)
            assert response.status_code == 200, response.text
            expected = retriever.hits(retriever.encode_queries(texts, domains=[domain] * 3), 3)
            assert [[h["id"] for h in row] for row in response.json()["results"]] == [
                [h.id for h in row] for row in expected
            ]
        unknown = http.post("/search", json={"query": "q", "domain": "z"}, headers=auth)
        assert unknown.status_code == 422 and "'x', 'y'" in unknown.json()["detail"]
        assert http.get("/info", headers=auth).json()["route"]["domains"] == {"x": "a", "y": "b"}


def test_a_fresh_hypernetworks_modules_are_the_base_and_a_generated_module_is_an_ordinary_one(
    encoder: DenseEncoder, tmp_path: Path
):
    from densekit.models.modules.kinds.lora import LoraSpec
    from densekit.routing.hypernetwork import HyperSpec, LoraHypernetwork

    torch.manual_seed(0)
    network = LoraHypernetwork(encoder, HyperSpec(lora=LoraSpec(rank=4, towers="query"), domains=["x", "y"]))
    inputs = query_inputs(encoder)
    with torch.no_grad():
        fresh = network.encode(network.embedding("x"), inputs["input_ids"], inputs["attention_mask"])
        assert torch.equal(fresh, by_module(encoder, None))  # B maps start at zero, as a new LoRA's B
        for generator in network.maps:
            generator.weight.normal_(0, 0.3)
        generated = {d: network.encode(network.embedding(d), inputs["input_ids"], inputs["attention_mask"])
                     for d in ("x", "y")}  # fmt: skip
    assert (generated["x"] - generated["y"]).abs().max() > 1e-3  # each domain its own module
    network.module_for("x")
    assert torch.allclose(by_module(encoder, "x"), generated["x"], atol=1e-6)
    encoder.own = "x"
    encoder.save(tmp_path / "x")  # saves, loads and merges like any module
    loaded = DenseEncoder.load(tmp_path / "x").eval()
    assert torch.allclose(by_module(loaded, "x"), generated["x"], atol=1e-6)
    assert torch.allclose(by_module(merged_encoder(encoder, "x").eval(), None), generated["x"], atol=1e-5)


def test_training_a_hypernetwork_changes_only_it_and_saves_one_that_loads(
    collection, tiny_model: Path, tmp_path: Path
):
    from densekit.data.examples import read_examples, write_examples
    from densekit.routing.hypernetwork import LoraHypernetwork
    from densekit.training.fine_tuning import run_training

    from .test_training import make_config

    root, train = collection
    tagged = [e.model_copy(update={"domain": "even" if i % 2 == 0 else "odd"})
              for i, e in enumerate(read_examples(train))]  # fmt: skip
    write_examples(tmp_path / "tagged.jsonl", tagged)
    section = {"lora": {"type": "lora", "rank": 4, "towers": "query"}, "embedding": 8}
    config = make_config((root, tmp_path / "tagged.jsonl"), tiny_model, hypernetwork=section,
                         data={"batches": "by_domain"}, optim={"learning_rate": 1e-2})  # fmt: skip
    run_training(config, tmp_path / "run", show_progress=False)
    network = LoraHypernetwork.load(tmp_path / "run" / "model")
    assert network.spec.domains == ["even", "odd"]
    base = DenseEncoder.load(tiny_model, pooling="mean")
    assert network.encoder.base_fingerprint() == base.base_fingerprint()  # the base did not move
    inputs = query_inputs(network.encoder)
    with torch.no_grad():
        even, odd = (network.encode(network.embedding(d), inputs["input_ids"], inputs["attention_mask"])
                     for d in ("even", "odd"))  # fmt: skip
        plain = by_module(network.encoder, None)
    assert (even - plain).abs().max() > 1e-4 and (even - odd).abs().max() > 1e-5
    with pytest.raises(ValueError, match="by_domain"):
        make_config((root, tmp_path / "tagged.jsonl"), tiny_model, hypernetwork=section)
    with pytest.raises(ValueError, match="not modules and hypernetwork"):
        make_config((root, tmp_path / "tagged.jsonl"), tiny_model, hypernetwork=section,
                    modules={"type": "lora"}, data={"batches": "by_domain"})  # fmt: skip


def test_a_new_domain_fits_only_its_embedding_and_its_generated_module_is_written(
    collection, tiny_model: Path, tmp_path: Path
):
    from typer.testing import CliRunner

    from densekit.cli.main import app
    from densekit.data.examples import read_examples, write_examples
    from densekit.routing.hypernetwork import LoraHypernetwork
    from densekit.training.fine_tuning import run_training

    from .test_training import make_config

    root, train = collection
    examples = read_examples(train)
    write_examples(tmp_path / "two.jsonl", [e.model_copy(update={"domain": "even" if i % 2 == 0 else "odd"})
                                            for i, e in enumerate(examples)])  # fmt: skip
    write_examples(tmp_path / "new.jsonl", [e.model_copy(update={"domain": "new"}) for e in examples[:8]])
    section = {"lora": {"type": "lora", "rank": 4, "towers": "query"}, "embedding": 8}
    first = make_config((root, tmp_path / "two.jsonl"), tiny_model, hypernetwork=section,
                        data={"batches": "by_domain"}, optim={"learning_rate": 1e-2})  # fmt: skip
    run_training(first, tmp_path / "two", show_progress=False)
    fitting = {**section, "start": str(tmp_path / "two" / "model"), "new_domain": "new"}
    by_domain = {"batches": "by_domain"}
    fit = make_config((root, tmp_path / "new.jsonl"), tiny_model, hypernetwork=fitting, data=by_domain,
                      optim={"learning_rate": 5e-2, "batch_size": 4})  # fmt: skip
    run_training(fit, tmp_path / "fit", show_progress=False)
    other = make_config((root, tmp_path / "new.jsonl"), tiny_model, hypernetwork={**fitting, "embedding": 4},
                        data=by_domain, optim={"batch_size": 4})  # fmt: skip
    with pytest.raises(ValueError, match=r"hypernetwork.embedding: .* was trained with 8"):
        run_training(other, tmp_path / "other", show_progress=False)
    before, after = (
        LoraHypernetwork.load(tmp_path / "two" / "model"),
        LoraHypernetwork.load(tmp_path / "fit" / "model"),
    )
    assert after.spec.domains == ["even", "odd", "new"]
    assert torch.equal(after.embeddings[:2], before.embeddings)  # the known domains' embeddings kept
    maps_before, maps_after = before.maps.state_dict(), after.maps.state_dict()
    assert all(torch.equal(maps_after[k], v) for k, v in maps_before.items())  # the maps frozen
    assert not torch.allclose(after.embeddings[2], before.embeddings.mean(0))  # the new one was fitted

    command = ["modules", "generate", str(tmp_path / "fit" / "model"), "--domain", "new", "-o",
               str(tmp_path / "new-module")]  # fmt: skip
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    module = DenseEncoder.load(tmp_path / "new-module").eval()
    inputs = query_inputs(module)
    with torch.no_grad():
        expected = after.encode(after.embedding("new"), inputs["input_ids"], inputs["attention_mask"])
    assert torch.allclose(by_module(module, "new"), expected, atol=1e-6)


def test_the_multi_domain_recipe_runs_end_to_end_on_tiny_collections(tiny_st_model: Path, tmp_path: Path):
    from densekit.recipes.runner import run_recipe
    from densekit.routing.hypernetwork import LoraHypernetwork

    from .conftest import CORPUS, QRELS, QUERIES, write_beir
    from .training_fixtures import write_training_collection

    for name in ("scifact", "nfcorpus"):
        write_training_collection(tmp_path / name)
    for name in ("vaswani", "cranfield"):
        write_beir(tmp_path / name, CORPUS, QUERIES, QRELS)
    overrides = [f"data.{name}={tmp_path / name}" for name in ("scifact", "nfcorpus", "vaswani", "cranfield")]
    overrides += [f"model.path={tiny_st_model}", "train.batch_size=4", "router.batch_size=4", "module.rank=4",
                  "negatives.count=4"]  # fmt: skip
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "multi-domain.yaml"
    metrics = run_recipe(recipe, tmp_path / "out", overrides, device="cpu", show_progress=False)
    assert 0 <= metrics["nDCG@10"] <= 1
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    assert list(table["rows"]) == [
        "BM25", "base zero-shot", "multi-task module", "SciFact module", "NFCorpus module", "fixed routing",
        "learned soft", "top-1", "parameter averaging", "fusion", "hypernetwork",
    ]  # fmt: skip
    assert all(
        set(row) == {"scifact", "nfcorpus", "vaswani", "cranfield", "mean"} for row in table["rows"].values()
    )
    for bench in (tmp_path / "out").glob("bench-*"):  # the base's four indexes served every row
        stages = [c["stages"] for c in json.loads((bench / "results.json").read_text())["collections"]]
        assert all(s["encode"].startswith("given: ") for s in stages), bench
    fixed = table["rows"]["fixed routing"]
    scifact_alone, base = table["rows"]["SciFact module"], table["rows"]["base zero-shot"]
    assert fixed["scifact"] == pytest.approx(scifact_alone["scifact"])  # its domain's module
    assert fixed["vaswani"] == pytest.approx(base["vaswani"])  # an unknown domain falls back to the base

    few_shot = Path(__file__).resolve().parents[1] / "recipes" / "few-shot-cranfield.yaml"
    overrides = [f"data.path={tmp_path / 'cranfield'}", "data.take=2", f"multi_domain.out={tmp_path / 'out'}",
                 f"model.path={tiny_st_model}", "train.batch_size=2", "train.epochs=1", "module.rank=4",
                 "negatives.count=4"]  # fmt: skip
    metrics = run_recipe(few_shot, tmp_path / "few-shot", overrides, device="cpu", show_progress=False)
    assert 0 <= metrics["nDCG@10"] <= 1
    rows = json.loads((tmp_path / "few-shot" / "table.json").read_text())["rows"]
    assert list(rows) == ["BM25", "base zero-shot", "LoRA on the 32", "hypernetwork, fitted on the 32"]
    for bench in ("bench-base", "bench-lora", "bench-hypernetwork"):
        [held_out] = json.loads((tmp_path / "few-shot" / bench / "results.json").read_text())["collections"]
        assert held_out["queries"] == 2 and held_out["stages"]["encode"].startswith("given: ")
    fitted = LoraHypernetwork.load(tmp_path / "few-shot" / "hypernetwork" / "model")
    assert fitted.spec.domains[2] == "cranfield"  # after the two it was trained on


def test_settings_a_route_would_ignore_are_refused(collection, tiny_model: Path, encoder: DenseEncoder):
    from densekit.cli.options import load_model
    from densekit.models.config import EncoderOptions

    from .test_training import make_config

    with pytest.raises(ValueError, match="k applies to a top_k route"):
        RouteSpec(type="soft", modules=["a", "b"], k=1)
    with pytest.raises(ValueError, match="apply to a fixed route"):
        RouteSpec(type="soft", modules=["a", "b"], domains={"x": "a"})
    folders = {"a": "a", "b": "b"}
    with pytest.raises(ValueError, match=r"no load-balancing term"):
        make_config(
            collection, tiny_model, route={"type": "fusion", "modules": folders, "load_balancing": 0.1}
        )
    with pytest.raises(ValueError, match="k applies to a top_k route, not to a soft one"):
        make_config(collection, tiny_model, route={"type": "soft", "modules": folders, "k": 1})
    with pytest.raises(ValueError, match=r"eval\.split with hypernetwork"):
        make_config(
            collection, tiny_model, hypernetwork={}, data={"batches": "by_domain"}, eval={"split": "test"}
        )
    with pytest.raises(ValueError, match="does not combine with"):
        make_config(collection, tiny_model, route={"modules": folders}, ance={"enabled": True})
    soft = Route(encoder, RouteSpec(type="soft", modules=["a", "b"]))
    with pytest.raises(ValueError, match="domains apply to a fixed one"):
        soft.encode_queries(QUERIES, ["x"] * len(QUERIES))
    with pytest.raises(ValueError, match="--domain chooses a module through a route"):
        load_model(str(tiny_model), "cpu", EncoderOptions(), "x")


def test_a_routes_queries_are_encoded_at_the_precision_asked(encoder: DenseEncoder, beir_dir: Path):
    from densekit.data import Dataset
    from densekit.encoding.embed import embed_texts

    route = Route(encoder, RouteSpec(type="fixed", modules=["a", "b"], domains={"x": "a", "y": "b"}))
    texts = list(Dataset.open(beir_dir).split_queries("test")[0].values())
    routed = {p: route.encode_queries(texts, ["x"] * len(texts), precision=p) for p in ("float32", "bf16")}
    direct_bf16 = embed_texts(encoder, texts, "query", precision="bf16", module="a")
    assert np.abs(routed["bf16"] - routed["float32"]).max() > 1e-5  # bf16 reached the modules
    np.testing.assert_allclose(routed["bf16"], direct_bf16, atol=2e-2)
