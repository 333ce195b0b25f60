"""Which runtime encodes: PyTorch, or an export checked against it (ONNX Runtime, `onnx_backend`;
OpenVINO, `openvino_backend`), chosen by `--backend` and `--precision`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from densekit.device import Precision
from densekit.encoding.export import EXPORT_PRECISIONS, check_export_precision
from densekit.errors import SettingError
from densekit.models.config import TextSide
from densekit.models.encoder import OWN, DenseEncoder, ModuleChoice

Backend = Literal["torch", "onnx", "openvino"]
# torch's three; int8 with onnx and openvino, bf16 with openvino too (`EXPORT_PRECISIONS`)
InferencePrecision = Literal["float32", "bf16", "fp16", "int8"]


def torch_precision(backend: str, precision: str) -> Precision:
    """The precision torch's autocast is to use for `precision` through `backend`: `precision` itself
    with torch, float32 with an export (which carries its own); a pair that does not go together is
    refused."""
    if backend == "torch":
        if precision == "int8":
            raise SettingError("--precision int8 runs through ONNX Runtime or OpenVINO: add --backend onnx "
                               "or --backend openvino")  # fmt: skip
        if precision not in ("float32", "bf16", "fp16"):
            raise SettingError(f"--precision {precision}: expected float32, bf16, fp16 or (with onnx) int8")
        return precision  # type: ignore[return-value]
    if backend not in EXPORT_PRECISIONS:
        raise SettingError(f"--backend {backend}: expected torch, onnx or openvino")
    check_export_precision(backend, precision)
    return "float32"


def needs_calibration(backend: str, precision: str) -> bool:
    """Whether the export is calibrated on texts of what it encodes (OpenVINO's int8: its activations'
    ranges are fixed before it runs)."""
    return backend == "openvino" and precision == "int8"


def use_backend(
    encoder: DenseEncoder,
    backend: str,
    precision: str,
    sides: Iterable[TextSide] = ("query", "passage"),
    module: ModuleChoice = OWN,
    calibration: Mapping[str, Sequence[str]] | None = None,
) -> Precision:
    """Make `encoder` encode `sides` texts with `module` through `backend` (torch, onnx or openvino) at
    `precision`, and return `torch_precision(backend, precision)`. `calibration`: texts of each side,
    for an export that needs them (`needs_calibration`)."""
    autocast_precision = torch_precision(backend, precision)
    if backend == "onnx":
        from densekit.encoding.onnx_backend import export_encoder

        encoder.runtime = export_encoder(encoder, precision, sides, module)
    elif backend == "openvino":
        from densekit.encoding.openvino_backend import export_openvino

        encoder.runtime = export_openvino(encoder, precision, sides, module, calibration)
    else:
        encoder.runtime = None
    return autocast_precision
