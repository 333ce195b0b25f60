"""What every export of an encoder to another runtime shares: the traced module, the copy it is made
from, the check against PyTorch that it must pass before it is used, and the precisions each runs."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator

import torch

from densekit.errors import DensekitError, InputError, SettingError
from densekit.models.config import TextSide
from densekit.models.encoder import DenseEncoder

EXPORT_PRECISIONS: dict[str, tuple[str, ...]] = {
    "onnx": ("float32", "int8"),
    "openvino": ("float32", "bf16", "int8"),
}
# The least cosine between an export's vectors and PyTorch's on the probe texts: float32 differs only
# by the order of floating-point operations, bf16 by its rounding; int8 by its quantisation
# (all-MiniLM-L6-v2's lowest over 200 SciFact passages is 0.988 through ONNX Runtime).
MIN_COSINE = {"float32": 0.99999, "bf16": 0.999, "int8": 0.95}
_PROBE = (
    "Dense retrieval encodes queries and passages into vectors and ranks passages by inner product. "
    "The encoder is a transformer whose token states are pooled into one vector per text. "
)


class ExportError(DensekitError, RuntimeError):
    """An encoder that could not be exported, or whose export disagrees with PyTorch."""


class ExportedEncoder:
    """An encoder exported to another runtime for one or both text sides, with the module it was made
    with (`module`), at `precision`; subclasses run a padded batch (`run`). Called as
    `DenseEncoder.encode_with`'s batch part is."""

    backend: str = ""

    def __init__(self, sides: Iterable[str], precision: str, module: str | None,
                 calibration: dict | None = None):  # fmt: skip
        self.sides = tuple(sides)
        self.precision = precision
        self.module = module
        self.calibration = calibration

    def record(self) -> dict:
        """What artefacts made through this export record of it (`DenseEncoder.artefact_identity`)."""
        record = {"backend": self.backend, "precision": self.precision}
        return {**record, "calibration": self.calibration} if self.calibration is not None else record

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: TextSide) -> torch.Tensor:
        """Vectors for a padded batch of `side` texts."""
        if side not in self.sides:
            raise InputError(
                f"this {self.backend} export encodes {' and '.join(self.sides)} texts, not {side} ones"
            )
        return self.run(input_ids, attention_mask, side)

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: TextSide) -> torch.Tensor:
        """The runtime's vectors for a padded batch of `side` texts."""
        raise NotImplementedError

    def check_against(self, encoder: DenseEncoder) -> float:
        """The least cosine between this export's vectors and `encoder`'s (as it is now) on probe texts of
        several lengths, padded together; raises ExportError when it is below the precision's bound."""
        least = 1.0
        was_training = encoder.training
        encoder.eval()  # no dropout in the reference
        try:
            for side in self.sides:
                least = min(least, self._least_cosine(encoder, side))  # type: ignore[arg-type]
        finally:
            encoder.train(was_training)
        if least < MIN_COSINE[self.precision]:
            raise ExportError(
                f"the {self.backend} {self.precision} export disagrees with PyTorch: least cosine "
                f"{least:.6f} on the probe texts, below {MIN_COSINE[self.precision]}; use --backend torch"
            )
        return least

    def _least_cosine(self, encoder: DenseEncoder, side: TextSide) -> float:
        """The least cosine between this export's and `encoder`'s vectors of the probe texts."""
        texts = [" ".join((_PROBE * 4).split(" ")[:n]) for n in (2, 9, 40, 100)]
        batch = encoder.pad(encoder.tokenize(texts, side))
        with torch.inference_mode():
            reference = encoder.encode_with(self.module, batch["input_ids"], batch["attention_mask"], side)
        exported = self(batch["input_ids"], batch["attention_mask"], side)
        return float(torch.nn.functional.cosine_similarity(exported, reference.float(), dim=-1).min())


def check_export_precision(backend: str, precision: str) -> None:
    """Refuse a precision `backend` does not run."""
    if precision not in EXPORT_PRECISIONS[backend]:
        raise SettingError(
            f"--backend {backend} runs {' or '.join(EXPORT_PRECISIONS[backend])}, not {precision}"
        )


class SideForward(torch.nn.Module):
    """`encoder.encode_with(module, ..., side)` as a module of two inputs, for the exporters."""

    def __init__(self, encoder: DenseEncoder, side: TextSide, module: str | None):
        super().__init__()
        self.encoder, self.side, self.module = encoder, side, module

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder.encode_with(self.module, input_ids, attention_mask, self.side)


def copy_for_export(encoder: DenseEncoder) -> DenseEncoder:
    """A copy of `encoder` in eval mode, without its runtime (sessions do not copy), with the attention
    the exporters' fusions recognise."""
    held, encoder.runtime = encoder.runtime, None
    try:
        copied = copy.deepcopy(encoder).eval()
    finally:
        encoder.runtime = held
    for backbone in {id(b): b for b in (copied.query_backbone, copied.passage_backbone)}.values():
        backbone.set_attn_implementation("eager")
    return copied


@contextlib.contextmanager
def frozen(module: torch.nn.Module) -> Iterator[None]:
    """`module`'s parameters without gradients while the exporter traces it (it refuses to bake a
    parameter that needs one as a constant), as they were after."""
    needed = [(parameter, parameter.requires_grad) for parameter in module.parameters()]
    for parameter, _ in needed:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter, requires_grad in needed:
            parameter.requires_grad_(requires_grad)
