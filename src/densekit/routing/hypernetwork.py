"""A hypernetwork that generates a query-only LoRA module for a domain from a learned domain embedding.

Each domain has an embedding e (a learned vector); for every LoRA matrix of the module (each target
layer's A and B), a linear map of e gives that matrix. Trained across domains at once (one domain per
batch), the maps are shared knowledge and the embeddings what differs; a new domain gets a module by
fitting only its embedding on a few of its queries, the maps frozen. The B maps start at zero, so every
generated module starts as the base, as a fresh LoRA does.

The generated matrices enter the forward pass through `torch.func.functional_call` on a template LoRA
module of the same settings (written by hand: peft has no hypernetwork). `module_for(domain)` puts the
generated weights into an ordinary module, which saves, loads and merges like any other.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.func import functional_call

from densekit.diagnostics import DataError, Problem
from densekit.errors import InputError
from densekit.io.artefact import artefact_dir, verify
from densekit.models.checkpoint_files import read_safetensors, validated_file
from densekit.models.config import EncoderConfig
from densekit.models.encoder import DenseEncoder
from densekit.models.modules.kind import ModuleError
from densekit.models.modules.kinds.lora import LoraSpec
from densekit.models.modules.module import BaseRecord, EncoderModule
from densekit.models.modules.tower import state_mismatch

HYPER_FILE = "densekit-hypernetwork.json"
HYPER_KIND = "hypernetwork"
HYPER_WEIGHTS = "hypernetwork.safetensors"
TEMPLATE = "hypernetwork-template"


class HyperSpec(BaseModel):
    """The modules a hypernetwork generates, the domains it knows and the size of their embeddings."""

    model_config = ConfigDict(extra="forbid")

    lora: LoraSpec = LoraSpec(rank=8, towers="query")
    domains: list[str] = Field(min_length=1)
    embedding: int = Field(16, gt=0, description="size of a domain's embedding")


class HyperFile(BaseModel):
    """`densekit-hypernetwork.json`: the hypernetwork's spec, its base and the encoder settings."""

    model_config = ConfigDict(extra="forbid")

    spec: HyperSpec
    base: BaseRecord
    settings: EncoderConfig


class LoraHypernetwork(torch.nn.Module):
    """Generates a query-only LoRA module per domain on `encoder`'s frozen base."""

    def __init__(self, encoder: DenseEncoder, spec: HyperSpec):
        super().__init__()
        if spec.lora.towers != "query":
            raise InputError("a hypernetwork generates query-only modules: set lora.towers to query")
        template = encoder.new_module(spec.lora.model_copy(update={"name": TEMPLATE}))
        for parameter in template.parameters():
            parameter.requires_grad_(False)
        self.encoder = encoder
        self.spec = spec
        self.shapes = {name: p.shape for name, p in template.query_tower.own_parameters().items()}
        _check_maps_size(encoder, spec, sum(shape.numel() for shape in self.shapes.values()))
        self.embeddings = torch.nn.Parameter(0.1 * torch.randn(len(spec.domains), spec.embedding))
        self.maps = torch.nn.ModuleList(
            torch.nn.Linear(spec.embedding, shape.numel()) for shape in self.shapes.values()
        )
        with torch.no_grad():
            for name, generator in zip(self.shapes, self.maps, strict=True):
                if ".lora_B." in name:
                    generator.weight.zero_()
                    generator.bias.zero_()
                else:  # A: about the scale of peft's own (Kaiming-uniform) start
                    bound = 1 / self.shapes[name][-1] ** 0.5
                    generator.weight.normal_(0, 0.02)
                    generator.bias.uniform_(-bound, bound)
        self.to(encoder.device)

    def add_domain(self, domain: str) -> None:
        """Learn `domain`'s embedding alone from now on (the maps and the other embeddings frozen),
        starting from the mean of the known ones."""
        if domain in self.spec.domains:
            raise InputError(f"domain {domain!r} is known to this hypernetwork already")
        for parameter in [self.embeddings, *self.maps.parameters()]:
            parameter.requires_grad_(False)
        self.new_embedding = torch.nn.Parameter(self.embeddings.detach().mean(0).clone())
        self.spec = self.spec.model_copy(update={"domains": [*self.spec.domains, domain]})

    def embedding(self, domain: str) -> torch.Tensor:
        """The learned embedding of a known domain."""
        if hasattr(self, "new_embedding") and domain == self.spec.domains[-1]:
            return self.new_embedding
        if domain not in self.spec.domains:
            raise InputError(
                f"domain {domain!r} is not one of this hypernetwork's: {', '.join(self.spec.domains)}"
            )
        return self.embeddings[self.spec.domains.index(domain)]

    def generate(self, embedding: torch.Tensor) -> dict[str, torch.Tensor]:
        """The module's matrices for a domain embedding, by their names in the template's query tower."""
        return {name: generator(embedding).view(shape) for (name, shape), generator in
                zip(self.shapes.items(), self.maps, strict=True)}  # fmt: skip

    def encode(
        self, embedding: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """Query vectors of a padded batch with the module generated from `embedding`."""
        prefix = f"attached.{TEMPLATE}.query_tower."
        weights = {prefix + name: tensor for name, tensor in self.generate(embedding).items()}
        return functional_call(
            self.encoder,
            weights,
            (input_ids, attention_mask, "query"),
            {"module": TEMPLATE},
            tie_weights=False,
        )

    def module_for(self, domain: str, embedding: torch.Tensor | None = None) -> EncoderModule:
        """An ordinary module, named `domain`, holding the weights generated for it (from `embedding`,
        or the learned one); put on the encoder, its own module left as it was."""
        embedding = self.embedding(domain) if embedding is None else embedding
        try:
            spec = LoraSpec.model_validate({**self.spec.lora.model_dump(), "name": domain})
        except ValidationError as err:
            raise InputError(f"domain {domain!r} cannot name a module: {err.errors()[0]['msg']}") from None
        module = self.encoder.new_module(spec)
        with torch.no_grad():
            own = module.query_tower.own_parameters()
            for name, tensor in self.generate(embedding).items():
                own[name].copy_(tensor)
        return module

    def save(self, folder: str | Path) -> None:
        """Write the hypernetwork's folder: its maps and embeddings, its spec and its base."""
        base = {"source": self.encoder.source, "fingerprint": self.encoder.base_fingerprint()}
        description = {
            "spec": self.spec.model_dump(),
            "base": base,
            "settings": self.encoder.config.model_dump(),
        }
        state = {
            k: v.detach().contiguous().cpu()
            for k, v in self.state_dict().items()
            if not k.startswith("encoder.") and k != "new_embedding"
        }
        if hasattr(self, "new_embedding"):
            state["embeddings"] = torch.cat([state["embeddings"], self.new_embedding.detach().cpu()[None]])
        identity = {"base": base["fingerprint"], "spec": self.spec.model_dump()}
        with artefact_dir(folder, HYPER_KIND, identity, {"base": base["source"]}) as tmp:
            safetensors.torch.save_file(state, str(tmp / HYPER_WEIGHTS))
            (tmp / HYPER_FILE).write_text(json.dumps(description, indent=2), encoding="utf-8")

    @classmethod
    def load(
        cls, folder: str | Path, device: torch.device | str = "cpu", encoder: DenseEncoder | None = None
    ) -> LoraHypernetwork:
        """The hypernetwork saved in `folder`, on its base (loaded, or `encoder` when it is that base)."""
        folder = Path(folder)
        manifest = verify(folder)
        if manifest.kind != HYPER_KIND or not (folder / HYPER_FILE).is_file():
            what = f"not a hypernetwork folder (densekit made it as a {manifest.kind})"
            raise DataError([Problem(folder, None, what)])
        description = validated_file(folder / HYPER_FILE, HyperFile)
        if encoder is None:
            settings = description.settings.model_dump(exclude_unset=True)
            encoder = DenseEncoder.load(description.base.source, **settings).to(device)
        if encoder.base_fingerprint() != description.base.fingerprint:
            raise InputError(f"{folder}: made on another base than this model ({description.base.source})")
        network = cls(encoder.eval(), description.spec)
        state = read_safetensors(folder / HYPER_WEIGHTS, device=str(device))
        own = {k: v for k, v in network.state_dict().items() if not k.startswith("encoder.")}
        problem = state_mismatch(own, state)
        if problem:
            what = f"its tensors do not fit the hypernetwork its spec describes ({problem})"
            raise DataError([Problem(folder / HYPER_WEIGHTS, None, what)])
        network.load_state_dict(state, strict=False)
        return network.eval()


def _check_maps_size(encoder: DenseEncoder, spec: HyperSpec, module_parameters: int) -> None:
    """Refuse, before they are allocated, maps larger than the base: each of the module's
    `module_parameters` values is a linear map of the `spec.embedding` entries of a domain's embedding."""
    count = (spec.embedding + 1) * module_parameters + len(spec.domains) * spec.embedding
    limit = sum(p.numel() for p in encoder.query_backbone.parameters())
    if count > limit:
        raise ModuleError(
            f"a hypernetwork with embedding {spec.embedding} over {len(spec.domains)} domains "
            f"would hold {count:,} parameters, more than its base ({limit:,}); lower embedding"
        )
