"""Routing among modules and averaging them: each route against the module it should equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from densekit.models import DenseEncoder
from densekit.models.modules.averaging import average_modules
from densekit.models.modules.merge import merged_encoder
from densekit.models.modules.routing import (
    Router,
    RouteSpec,
    check_query_only,
    fixed_weights,
    load_balancing_loss,
    routed_vectors,
    soft_weights,
)

from .test_modules import TEXTS, embeddings, put_module

QUERIES = [*TEXTS, "moon orbit and planets", "a doctor in a hospital"]


@pytest.fixture
def encoder(tiny_model: Path) -> DenseEncoder:
    """The tiny base with three query-only LoRA modules, a, b and c."""
    encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True).eval()
    for seed, name in enumerate("abc"):
        put_module(encoder, "query-lora", name, seed=seed)
    encoder.activate(None)
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
    assert encoder.active is None  # routing did not change the active module
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


def test_output_averaging_weighs_the_modules_vectors(encoder: DenseEncoder):
    weights = torch.tensor([[0.25, 0.75, 0.0]]).expand(len(QUERIES), 3)
    mixed = 0.25 * by_module(encoder, "a") + 0.75 * by_module(encoder, "b")
    expected = torch.nn.functional.normalize(mixed, dim=-1)
    assert torch.allclose(routed(encoder, ["a", "b", "c"], weights), expected, atol=1e-6)


def test_the_load_balancing_loss_is_one_when_balanced_and_grows_with_collapse():
    balanced = torch.zeros(4, 2)
    assert float(load_balancing_loss(balanced, soft_weights(balanced))) == pytest.approx(1.0)
    collapsed = torch.tensor([[5.0, 0.0]] * 4)
    assert float(load_balancing_loss(collapsed, soft_weights(collapsed, k=1))) > 1.9


def test_averaging_two_copies_of_a_module_equals_that_module(encoder: DenseEncoder, tmp_path: Path):
    put_module(encoder, "query-lora", "copy", seed=0)  # the same start and changes as module a
    encoder.activate(None)
    averaged = average_modules(encoder, ["a", "copy"], [0.3, 0.7], "averaged")
    assert averaged.spec.rank == 8 and encoder.active is None
    assert torch.allclose(by_module(encoder, "averaged"), by_module(encoder, "a"), atol=1e-6)
    encoder.activate("averaged")  # it saves and loads like any module
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
        encoder.activate(name)
        merged[name] = merged_encoder(encoder).query_backbone.state_dict()
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
