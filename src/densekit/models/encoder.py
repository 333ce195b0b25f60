"""The dense encoder: a transformer backbone (or two), pooling, normalisation and text preparation."""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase

from densekit.diagnostics import DataError, Problem
from densekit.errors import InputError
from densekit.io.artefact import artefact_dir
from densekit.io.model_card import write_model_card
from densekit.models import padding
from densekit.models.card import encoder_card
from densekit.models.checkpoint_files import (
    check_artefact_kind,
    check_vocabulary,
    load_pretrained,
    load_tokenizer,
    validated_file,
)
from densekit.models.config import CONFIG_FILE, EncoderConfig, TextSide
from densekit.models.dimensions import check_dimensions, truncated
from densekit.models.fingerprint import tensors_fingerprint, weights_fingerprint
from densekit.models.hub import locate_model
from densekit.models.modules.module import EncoderModule, ModuleError, is_module_folder, read_module_file
from densekit.models.packed import packed_hidden
from densekit.models.pooling import pool, without_prompt
from densekit.models.projection import Projection, read_projection
from densekit.models.st_folder import is_st_folder, projection_folder, read_st_folder, write_st_files

log = logging.getLogger("densekit")

MODEL_KIND = "model"
QUERY_TOWER = "query_encoder"
PASSAGE_TOWER = "passage_encoder"


class Own(Enum):
    """The type of `OWN`."""

    OWN = "own"


# `module=OWN`: encode with the encoder's own module (`DenseEncoder.own`: the one it was loaded with, or
# none); a name chooses a module on it for that call alone, None the base alone
OWN = Own.OWN
ModuleChoice = str | None | Own


class InferenceRuntime(Protocol):
    """What runs an encoder's inference in place of PyTorch (an ONNX Runtime or OpenVINO export, made by
    `densekit.encoding.runtimes.use_backend`): called as `encode_with`'s batch part is, at its own
    `precision`, for the `module` it was made with."""

    backend: str
    precision: str
    module: str | None

    def record(self) -> dict:
        """What artefacts made through it record of it: backend, precision and what else shaped it."""
        ...

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: TextSide) -> torch.Tensor:
        """Vectors for a padded batch of `side` texts."""
        ...


def _load_backbone(path: str | Path, trust_remote_code: bool) -> PreTrainedModel:
    """A transformer encoder; weights it lacks are named in one warning, but the pooler, which dense
    retrieval never uses (pre-training exports have none)."""
    model, report = load_pretrained(AutoModel, path, trust_remote_code)
    missing = [name for name in report.missing if not name.startswith("pooler.")]
    if missing:
        log.warning("%s lacks weights; they start from random values: %s", path, ", ".join(missing))
    check_finite(model, path)
    return model


def check_finite(model: torch.nn.Module, source: str | Path) -> None:
    """Refuse a model any of whose weights holds NaN or an infinity: every vector it made would."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DataError([Problem(Path(source), None, f"weight {name!r} holds NaN or infinite values")])


def _exporting() -> bool:
    """Whether the forward pass is being traced (an ONNX export): the graph must hold transformers'
    pass, whose shapes follow the inputs', not the packed one's shapes of the traced batch."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


class DenseEncoder(torch.nn.Module):
    """Maps texts to vectors: `query` texts through the query tower, `passage` texts through the other.

    With `config.tied` both towers are one backbone. A `projection` (sentence-transformers' Dense
    module) maps the pooled vectors of either tower before they are cut and normalised. Load any
    Hugging Face encoder folder, a sentence-transformers folder, a saved densekit model or a hub id
    with `DenseEncoder.load`.

    Modules (`densekit.models.modules`) sit on the frozen backbones, any number at once, by name; each
    call that encodes, saves or describes takes the one to use (`module=`): by default (`OWN`) the
    encoder's own, `own` (the module it was loaded with, or None: the base alone). Nothing switches
    modules for other callers, so threads may encode with different modules at once. With `runtime`
    set, inference (`densekit.encoding.embed`) runs through that ONNX Runtime export instead.
    """

    def __init__(
        self,
        backbone: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: EncoderConfig,
        passage_backbone: PreTrainedModel | None = None,
        source: str = "",
        projection: Projection | None = None,
    ):
        super().__init__()
        if config.tied != (passage_backbone is None):
            raise InputError("a tied encoder takes one backbone; an untied one takes two")
        self.projection = projection
        self.query_backbone = backbone
        self.passage_backbone = passage_backbone if passage_backbone is not None else backbone
        self.tokenizer = tokenizer
        self.config = config
        self.source = source
        self.attached = torch.nn.ModuleDict()
        self.own: str | None = None  # the module `OWN` means: the one loaded with the encoder, or none
        self.runtime: InferenceRuntime | None = None  # set by `densekit.encoding.runtimes.use_backend`
        self._prompt_lengths: dict[str, int] = {}

    @classmethod
    def load(
        cls,
        name_or_path: str | Path,
        trust_remote_code: bool = False,
        module: str | Path | None = None,
        **overrides: Any,
    ) -> DenseEncoder:
        """Load an encoder; keyword overrides (pooling=..., normalize=...) replace the saved settings.

        `name_or_path` may be a module folder, which loads the base it names with the module as its own;
        `module` puts a module folder on the model named as its own (`own`)."""
        if is_module_folder(name_or_path):
            if module is not None:
                raise InputError(
                    f"{name_or_path} is a module folder: give it alone, or its base as the model and the "
                    "module with --module"
                )
            module, name_or_path = name_or_path, read_module_file(name_or_path).base.source
        if module is not None:
            if not is_module_folder(module):
                check_artefact_kind(module, "a module folder")
                raise DataError([Problem(Path(module), None, "not a module folder: it has no "
                                                             "densekit-module.json")])  # fmt: skip
            settings = read_module_file(module).settings.model_dump(exclude_unset=True)
            overrides = {**settings, **{k: v for k, v in overrides.items() if v is not None}}
        encoder = cls._load_base(name_or_path, trust_remote_code, overrides)
        if module is not None:
            encoder.own = encoder.load_module(module).name
        return encoder

    @classmethod
    def _load_base(
        cls, name_or_path: str | Path, trust_remote_code: bool, overrides: dict[str, Any]
    ) -> DenseEncoder:
        path = locate_model(name_or_path)
        local = Path(path)
        check_artefact_kind(local, "a model folder")
        fields: dict[str, Any] = {}
        backbone_path: str | Path = path
        if (local / CONFIG_FILE).is_file():
            fields = validated_file(local / CONFIG_FILE, EncoderConfig).model_dump(exclude_unset=True)
        elif is_st_folder(local):
            backbone_path, fields = read_st_folder(local)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        config = EncoderConfig(**fields)
        if config.tied or not (local / QUERY_TOWER).is_dir():
            backbone = _load_backbone(backbone_path, trust_remote_code)
            passage = None if config.tied else _load_backbone(backbone_path, trust_remote_code)
        else:
            backbone = _load_backbone(local / QUERY_TOWER, trust_remote_code)
            passage = _load_backbone(local / PASSAGE_TOWER, trust_remote_code)
        tokenizer = load_tokenizer(backbone_path, trust_remote_code)
        check_vocabulary(tokenizer, backbone, backbone_path)
        dense = projection_folder(local) if is_st_folder(local) else None
        projection = None if dense is None else read_projection(dense, int(backbone.config.hidden_size))
        encoder = cls(backbone, tokenizer, config, passage, source=str(name_or_path), projection=projection)
        if config.dimensions is not None:
            given = overrides.get("dimensions") is not None
            setting = "--dimensions" if given else "its saved dimensions"
            width = check_dimensions(config.dimensions, encoder.width, config.matryoshka_dims,
                                     str(name_or_path), setting, ordered=config.variance_ordered)  # fmt: skip
            encoder.config = config.model_copy(update={"dimensions": width})
        return encoder

    def base_fingerprint(self) -> str:
        """A digest of the base weights (both towers and the projection) and the tokenizer, as they are
        now."""
        weights = [self.query_backbone, self.passage_backbone]
        return weights_fingerprint(weights + ([self.projection] if self.projection is not None else []),
                                   self.tokenizer)  # fmt: skip

    def fingerprint(self, module: ModuleChoice = OWN) -> str:
        """A digest of what encodes with `module`: the base, and the module's weights when there is one."""
        return self._fingerprint_with(self.chosen(module))

    def identity(self, module: ModuleChoice = OWN) -> dict[str, Any]:
        """What an artefact made with this encoder and `module` records of it: weights, every setting, the
        module."""
        return self._identity_with(self.chosen(module))

    def artefact_identity(self, identity: dict, precision: str = "float32") -> dict:
        """`identity` (what an artefact this encoder made records) with how it computed the vectors under
        `inference`: its runtime's backend and precision, or torch at `precision`; as it is for PyTorch
        at float32, which records made before backends existed mean."""
        if self.runtime is not None:
            inference = self.runtime.record()
        elif precision == "float32":
            return identity
        else:
            inference = {"backend": "torch", "precision": precision}
        return {**identity, "inference": inference}

    def passage_module(self, module: ModuleChoice = OWN) -> str | None:
        """`module` when it changes how passages are encoded; None for the base alone and for a
        query-only module (`towers: query`), whose passages are the base's."""
        held = self.module_named(module)
        return None if held is None or held.spec.towers == "query" else held.name

    def passage_fingerprint(self, module: ModuleChoice = OWN) -> str:
        """A digest of what encodes passages: `fingerprint(module)`, less a query-only module."""
        return self._fingerprint_with(self.passage_module(module))

    def passage_identity(self, module: ModuleChoice = OWN) -> dict[str, Any]:
        """What passage embeddings record of the encoder that made them: `identity(module)`, less a
        query-only module, so that the base's index serves every query-only module of that base."""
        return self._identity_with(self.passage_module(module))

    def _fingerprint_with(self, name: str | None) -> str:
        base = self.base_fingerprint()
        if name is None:
            return base
        return tensors_fingerprint({}, f"{base}|{self.attached[name].fingerprint()}")

    def _identity_with(self, name: str | None) -> dict[str, Any]:
        identity = {"weights": self._fingerprint_with(name), "settings": self.config.model_dump()}
        if name is not None:
            identity["module"] = name
        return identity

    def new_module(
        self, spec: Any, sparse_indices: dict[str, dict[str, torch.Tensor]] | None = None
    ) -> EncoderModule:
        """Put a fresh module of `spec` on the backbones (frozen from now on, as is the projection);
        `own` is left as it is."""
        if self.projection is not None:
            self.projection.requires_grad_(False)
        source = Path(self.source)
        base = {
            "source": str(source.resolve()) if source.exists() else self.source,
            "fingerprint": self.base_fingerprint(),
        }
        module = EncoderModule.build(self.query_backbone, self.passage_backbone, spec, base, sparse_indices)
        self.attach(module.to(self.device))
        return module

    def load_module(self, folder: str | Path) -> EncoderModule:
        """Put the module saved in `folder` on the backbones (`own` is left as it is); refused when it
        was trained on other base weights, or when a module of its name with other weights is on them."""
        module = EncoderModule.load(
            folder, self.query_backbone, self.passage_backbone, self.base_fingerprint()
        )
        held = dict(self.attached.items()).get(module.name)
        if held is not None and held.fingerprint() != module.fingerprint():
            where = f"loaded from {held.folder}" if held.folder is not None else "made in this process"
            raise ModuleError(
                f"{folder} holds module {module.name!r}, and a module of that name with other weights is on "
                f"this encoder already ({where}): modules used together need names of their own"
            )
        self.attach(module.to(self.device))
        return module

    def attach(self, module: EncoderModule) -> None:
        """Hold `module` under its name (replacing one of that name)."""
        self.attached[module.name] = module

    def require_module(self, name: str) -> None:
        """Refuse a name no module on this encoder has."""
        if name not in self.attached:
            held = ", ".join(self.attached) or "none"
            raise KeyError(f"no module called {name!r} on this encoder (it holds: {held})")

    def chosen(self, module: ModuleChoice = OWN) -> str | None:
        """The name of the module `module` chooses (`OWN`: `own`), refused when none on this encoder has
        it; None for the base alone."""
        if module is OWN:
            return self.own
        if module is not None:
            self.require_module(module)  # type: ignore[arg-type]
        return module  # type: ignore[return-value]

    def module_named(self, module: ModuleChoice = OWN) -> EncoderModule | None:
        """The module `module` chooses (`OWN`: the encoder's own), if any."""
        name = self.chosen(module)
        return None if name is None else self.attached[name]

    @property
    def module(self) -> EncoderModule | None:
        """The encoder's own module (`own`), if any."""
        return self.module_named(OWN)

    @property
    def dimension(self) -> int:
        """The size of the vectors this encoder produces: its `dimensions` setting, else its width."""
        return self.config.dimensions or self.width

    @property
    def width(self) -> int:
        """The size of the vectors the model makes before any are cut (`dimensions`): its projection's
        output, or without one its hidden size."""
        return self.projection.out_features if self.projection is not None else self.hidden_size

    @property
    def hidden_size(self) -> int:
        """The size of the token states the backbone makes, which pooling keeps."""
        return int(self.query_backbone.config.hidden_size)

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.query_backbone.parameters()).device

    def backbone(self, side: TextSide) -> PreTrainedModel:
        """The tower that encodes `side` texts."""
        return self.query_backbone if side == "query" else self.passage_backbone

    def tokenize(self, texts: list[str], side: TextSide) -> list[list[int]]:
        """Token ids of each text with its prefix, truncated to the side's length, not padded."""
        prefix = self.config.prefix(side)
        encoded = self.tokenizer(
            [prefix + text for text in texts] if prefix else texts,
            truncation=True,
            max_length=self.config.max_length(side),
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return encoded["input_ids"]

    def pad(self, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        """Pad token id lists to the longest, on the tokenizer's padding side, as model inputs."""
        longest = max(len(seq) for seq in sequences)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        left = self.tokenizer.padding_side == "left"
        for row, seq in enumerate(sequences):
            if left:
                input_ids[row, longest - len(seq) :] = torch.tensor(seq)
                attention_mask[row, longest - len(seq) :] = 1
            else:
                input_ids[row, : len(seq)] = torch.tensor(seq)
                attention_mask[row, : len(seq)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def prompt_length(self, side: TextSide) -> int:
        """Tokens the `side` prefix takes at the start of a text (its leading special token included,
        no trailing one), as sentence-transformers counts them; 0 without a prefix."""
        prefix = self.config.prefix(side)
        if not prefix:
            return 0
        if prefix not in self._prompt_lengths:
            ids = self.tokenizer(prefix)["input_ids"]
            trailing = bool(ids) and ids[-1] in self.tokenizer.all_special_ids
            self._prompt_lengths[prefix] = len(ids) - trailing
        return self._prompt_lengths[prefix]

    def computes_only_tokens(self, side: TextSide, module: ModuleChoice = OWN) -> bool:
        """Whether inference on a padded batch of `side` texts (with `module`, on this device) computes
        only their tokens where padding is worth skipping, so that padding costs next to nothing
        (`densekit.models.padding.packs_on`); training computes every position."""
        return padding.packs_on(self.backbone(side), self.device, self.chosen(module))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        side: TextSide,
        module: ModuleChoice = OWN,
    ) -> torch.Tensor:
        """Vectors for a padded batch of `side` texts, with `module` (by default the encoder's own)."""
        return self.encode_with(module, input_ids, attention_mask, side)

    def encode_with(
        self, module: ModuleChoice, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: TextSide
    ) -> torch.Tensor:
        """Vectors for a padded batch of `side` texts with `module` (a name; None: the base alone; `OWN`:
        the encoder's own module)."""
        name = self.chosen(module)
        held = None if name is None else self.attached[name]
        inferring = not self.training and not torch.is_grad_enabled() and not _exporting()
        if inferring and self.computes_only_tokens(side, name) and padding.worth_packing(attention_mask):
            hidden = packed_hidden(self.backbone(side), input_ids, attention_mask)
        elif held is None:
            hidden = self.backbone(side)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        else:
            tower = held.query_tower if side == "query" else held.passage_tower
            hidden = tower(input_ids, attention_mask)
        pooled_mask = attention_mask
        if not self.config.include_prompt and self.config.pooling != "cls" and self.config.prefix(side):
            pooled_mask = without_prompt(attention_mask, self.prompt_length(side))
        pooled = pool(hidden, pooled_mask, self.config.pooling)
        if self.projection is not None:
            pooled = self.projection(pooled)
        return truncated(pooled, self.config.dimensions, self.config.normalize)

    def save(self, path: str | Path, module: ModuleChoice = OWN) -> None:
        """Save atomically: safetensors, `densekit.json`, and sentence-transformers files when tied; with a
        `module` (by default the encoder's own), the module's folder (which names this base) instead.

        `path` must be new, empty or a folder of the same kind densekit saved (which is replaced)."""
        module = self.module_named(module)
        if module is not None:
            if module.base["fingerprint"] != self.base_fingerprint():
                raise ModuleError(
                    f"the base weights changed while module {module.name!r} was on them; a module folder "
                    "names the base it was made on, so it is not saved"
                )
            module.save(path, self.config.model_dump())
            return
        if self.projection is not None and not self.config.tied:
            raise InputError("densekit saves a projection (Dense module) with a tied encoder only")
        with artefact_dir(path, MODEL_KIND, self.identity(None), {"source": self.source}) as tmp:
            if self.config.tied:
                self.query_backbone.save_pretrained(tmp, safe_serialization=True)
                write_st_files(tmp, self.config, self.hidden_size, self.projection)
            else:
                self.query_backbone.save_pretrained(tmp / QUERY_TOWER, safe_serialization=True)
                self.passage_backbone.save_pretrained(tmp / PASSAGE_TOWER, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            (tmp / CONFIG_FILE).write_text(self.config.model_dump_json(indent=2), encoding="utf-8")
        settings = self.config.model_dump(mode="json")
        write_model_card(path, encoder_card(Path(path), self.source, settings, self.config.tied))
