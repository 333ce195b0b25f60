"""Inference through ONNX Runtime: an encoder exported per text side, optionally quantised to int8, and
checked against PyTorch before it is used.

The exported graph is the whole of `DenseEncoder.encode_with` for one side (backbone, the module,
pooling, normalisation), so what runs is what PyTorch computes, less floating-point order. It is
exported to a temporary folder and held in memory: nothing is cached on disk, so no export can outlive
the weights it was made from. Export uses torch's TorchScript-based exporter (the dynamo exporter does
not trace these models' dynamic shapes yet); BERT-like graphs are then fused by onnxruntime's
transformer optimizer, and int8 is onnxruntime's dynamic quantisation, per channel (measured in
benchmarks/results/cpu_inference_paths.json: per tensor loses far more agreement with float32).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from densekit.encoding.export import (
    ExportedEncoder,
    ExportError,
    SideForward,
    check_export_precision,
    copy_for_export,
    frozen,
)
from densekit.errors import SettingError
from densekit.models.config import TextSide
from densekit.models.encoder import OWN, DenseEncoder, ModuleChoice

log = logging.getLogger("densekit")

_FUSABLE = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet"}


class OnnxEncoder(ExportedEncoder):
    """ONNX Runtime sessions that encode one or both text sides as the encoder, with the module it was
    exported with, does."""

    backend = "onnx"

    def __init__(self, sessions: dict[str, object], precision: str, module: str | None):
        super().__init__(sessions, precision, module)
        self.sessions = sessions

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: TextSide) -> torch.Tensor:
        """ONNX Runtime's vectors for a padded batch of `side` texts."""
        feeds = {
            "input_ids": input_ids.cpu().numpy().astype(np.int64, copy=False),
            "attention_mask": attention_mask.cpu().numpy().astype(np.int64, copy=False),
        }
        (vectors,) = self.sessions[side].run(None, feeds)  # type: ignore[attr-defined]
        return torch.from_numpy(vectors)


def export_encoder(
    encoder: DenseEncoder,
    precision: str,
    sides: Iterable[TextSide] = ("query", "passage"),
    module: ModuleChoice = OWN,
) -> OnnxEncoder:
    """Export `encoder` with `module` (by default its own) for each of `sides` to ONNX Runtime at
    `precision` (float32 or int8), check the export against PyTorch and return it."""
    name = encoder.chosen(module)
    check_export_precision("onnx", precision)
    if encoder.device.type != "cpu":
        raise SettingError(f"--backend onnx runs on the CPU, not {encoder.device}: add --device cpu")
    try:
        import onnxruntime
    except ImportError:
        raise SettingError(
            "--backend onnx needs onnxruntime and onnx: pip install 'densekit[onnx]'"
        ) from None
    copied = copy_for_export(encoder)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    sessions: dict[str, object] = {}
    # a copy's forward hooks (adapters') still call the original's modules: both are frozen while traced
    with tempfile.TemporaryDirectory(prefix="densekit-onnx-") as folder, frozen(encoder), frozen(copied):
        for side in dict.fromkeys(sides):
            path = _export_side(copied, side, name, Path(folder), precision)
            sessions[side] = onnxruntime.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"]
            )
    exported = OnnxEncoder(sessions, precision, name)
    least = exported.check_against(encoder)
    log.info("ONNX Runtime %s export of %s checked against PyTorch (least cosine %.6f)",
             precision, " and ".join(sessions), least)  # fmt: skip
    return exported


def _export_side(
    encoder: DenseEncoder, side: TextSide, module: str | None, folder: Path, precision: str
) -> Path:
    """The ONNX file of `encoder`'s `side` with `module`, fused where the optimizer knows the model
    and quantised for int8."""
    import warnings

    target = folder / f"{side}.onnx"
    dummy = torch.ones((2, 8), dtype=torch.long)
    axes = {0: "batch", 1: "tokens"}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the exporter's tracer warnings are about Python control flow
            torch.onnx.export(
                SideForward(encoder, side, module),
                (dummy, dummy),
                str(target),
                input_names=["input_ids", "attention_mask"],
                output_names=["vectors"],
                dynamic_axes={"input_ids": axes, "attention_mask": axes, "vectors": {0: "batch"}},
                opset_version=17,
                dynamo=False,
            )
    except Exception as err:
        named = f" with module {module!r}" if module else ""
        raise ExportError(f"could not export the encoder{named} to ONNX: {err}".splitlines()[0]) from err
    config = encoder.backbone(side).config
    with _quiet_logging():
        return _optimise(target, folder, side, precision, config)


def _optimise(target: Path, folder: Path, side: str, precision: str, config: object) -> Path:
    """`target` fused where onnxruntime's optimizer knows the model, then quantised for int8."""
    if config.model_type in _FUSABLE:  # type: ignore[attr-defined]
        from onnxruntime.transformers.optimizer import optimize_model

        fused = folder / f"{side}-fused.onnx"
        optimize_model(
            str(target), model_type="bert", num_heads=config.num_attention_heads,  # type: ignore[attr-defined]
            hidden_size=config.hidden_size,  # type: ignore[attr-defined]
        ).save_model_to_file(str(fused))  # fmt: skip
        target = fused
    if precision == "int8":
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantised = folder / f"{side}-int8.onnx"
        quantize_dynamic(
            str(target), str(quantised), weight_type=QuantType.QInt8, per_channel=True,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )  # fmt: skip
        target = quantised
    return target


@contextlib.contextmanager
def _quiet_logging() -> Iterator[None]:
    """onnxruntime's optimizer and quantiser log every node at INFO and advice at WARNING on the root
    logger; what matters is checked after (`check_against`)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)
