"""Training a module instead of the whole encoder: the `modules:` section of a training config."""

from __future__ import annotations

import logging
from typing import Any

import torch

from densekit.data.examples import TrainingExample
from densekit.errors import InputError
from densekit.models.encoder import DenseEncoder
from densekit.models.modules.kind import ModuleKind, kind_of
from densekit.models.modules.module import EncoderModule
from densekit.routing.hypernetwork import HyperSpec, LoraHypernetwork
from densekit.routing.route import Route
from densekit.training import distributed
from densekit.training.config import HypernetworkSection, RouteSection

log = logging.getLogger("densekit")


def prepare_module(encoder: DenseEncoder, spec: Any, task: Any) -> EncoderModule:
    """Put the module `spec` describes on `encoder`, as its own and the only thing that trains, and say how
    much trains. A module loaded with the model (a module folder as `model.path`) continues training
    when it is the one `spec` describes; a kind that chooses its positions from gradients (a sparse
    difference) chooses them from the first `selection_batches` batches of `task`."""
    loaded = encoder.module
    if loaded is not None:
        if loaded.spec != spec:
            raise InputError(
                f"model.path holds module {loaded.name!r} ({loaded.spec.type}), which the modules section "
                f"does not describe: set modules to its settings to continue training it, or start from "
                f"its base ({loaded.base['source']})"
            )
        module = loaded
    else:
        kind = kind_of(spec)
        indices = _choose_positions(encoder, kind, spec, task) if kind.positions_from_gradients else None
        module = encoder.new_module(spec, indices)
        encoder.own = module.name  # what trains is the encoder with this module: every forward pass uses it
    trainable = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
    backbones = {*encoder.query_backbone.parameters(), *encoder.passage_backbone.parameters()}
    base = sum(p.numel() for p in backbones)
    log.info(
        "module %r (%s): trainable %s parameters, %.2f%% of the frozen base's %s",
        module.name, spec.type, f"{trainable:,}", 100 * trainable / base, f"{base:,}",
    )  # fmt: skip
    return module


def _choose_positions(
    encoder: DenseEncoder, kind: ModuleKind, spec: Any, task: Any
) -> dict[str, dict[str, torch.Tensor]]:
    """Sum each target weight's gradient magnitudes over the first batches (without dropout, so a
    resumed run chooses the same), averaged over processes, and let the kind choose from them (a sparse
    difference keeps the largest `density` share); a tied encoder's towers get the same positions."""
    backbones = {"query": encoder.query_backbone}
    if spec.towers == "separate" and not encoder.config.tied:
        backbones["passage"] = encoder.passage_backbone
    targets = {tower: kind.gradient_targets(backbone, spec) for tower, backbone in backbones.items()}
    weights = [weight for by_name in targets.values() for weight in by_name.values()]
    for parameter in encoder.parameters():
        parameter.requires_grad_(False)
    for weight in weights:
        weight.requires_grad_(True)
    scores = {id(weight): torch.zeros_like(weight) for weight in weights}
    encoder.eval()
    per_epoch = task.steps_per_epoch()
    for step in range(spec.selection_batches):
        task.forward_backward(task.batch(step // per_epoch, step % per_epoch))
        for weight in weights:
            if weight.grad is not None:  # a layer the loss does not reach (BERT's pooler) scores 0
                scores[id(weight)] += weight.grad.abs()
            weight.grad = None
    for weight in weights:
        weight.grad = scores[id(weight)]
    distributed.average_gradients(weights)  # averages the scores, held as gradients, in place
    for weight in weights:
        weight.grad = None
        weight.requires_grad_(False)
    chosen = {
        tower: kind.positions_from_scores({name: scores[id(w)] for name, w in by_name.items()}, spec)
        for tower, by_name in targets.items()
    }
    if spec.towers == "separate":
        chosen.setdefault("passage", chosen["query"])
    return chosen


def prepare_route(encoder: DenseEncoder, section: RouteSection) -> Route:
    """Load the modules `section` names onto `encoder` and put a fresh router over them, the only thing
    that trains (the base and the modules are frozen); the encoder is the base alone (`own` None)."""
    for name, folder in section.modules.items():
        module = encoder.load_module(folder)
        if module.name != name:
            raise InputError(f"route.modules.{name}: {folder} holds module {module.name!r}, not {name!r}")
    encoder.own = None
    for parameter in encoder.parameters():
        parameter.requires_grad_(False)
    spec = section.spec()
    route = Route(encoder, spec)
    log.info("router over modules %s (%s): trainable %s parameters", ", ".join(spec.modules), spec.type,
             f"{sum(p.numel() for p in route.router.parameters()):,}")  # fmt: skip
    return route


def prepare_hypernetwork(
    encoder: DenseEncoder, section: HypernetworkSection, examples: list[TrainingExample]
) -> LoraHypernetwork:
    """A fresh hypernetwork over the examples' domains, the only thing that trains; or, with
    `section.start`, that saved one with `section.new_domain` added, whose embedding alone trains."""
    domains = sorted({e.domain for e in examples if e.domain is not None})
    for parameter in encoder.parameters():
        parameter.requires_grad_(False)
    if section.start is None:
        network = LoraHypernetwork(encoder, HyperSpec(lora=section.lora, domains=domains,
                                                      embedding=section.embedding))  # fmt: skip
    else:
        if domains != [section.new_domain]:
            raise InputError(f"hypernetwork.new_domain {section.new_domain!r}: every example must be of that "
                             f"domain (they are of {', '.join(domains) or 'none'})")  # fmt: skip
        network = LoraHypernetwork.load(section.start, encoder.device, encoder)
        for key in ("lora", "embedding"):
            saved = getattr(network.spec, key)
            if key in section.model_fields_set and getattr(section, key) != saved:
                raise InputError(f"hypernetwork.{key}: {section.start} was trained with {saved!r}; leave it "
                                 "out to fit a new domain on it")  # fmt: skip
        network.add_domain(section.new_domain)
    trainable = sum(p.numel() for p in network.parameters() if p.requires_grad)
    log.info("hypernetwork over domains %s: trainable %s parameters", ", ".join(network.spec.domains),
             f"{trainable:,}")  # fmt: skip
    return network
