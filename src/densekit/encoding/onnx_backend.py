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
import copy
import logging
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from densekit.device import Precision
from densekit.errors import DensekitError, InputError, SettingError
from densekit.models.config import TextSide
from densekit.models.encoder import OWN, DenseEncoder, ModuleChoice

log = logging.getLogger("densekit")

Backend = Literal["torch", "onnx"]
InferencePrecision = Literal["float32", "bf16", "fp16", "int8"]  # torch's three, and int8 with onnx
ONNX_PRECISIONS: tuple[str, ...] = ("float32", "int8")
# The least cosine between an export's vectors and PyTorch's on the probe texts: float32 differs only
# by the order of floating-point operations; int8 by its quantisation (all-MiniLM-L6-v2's lowest over 200
# SciFact passages is 0.988).
MIN_COSINE = {"float32": 0.99999, "int8": 0.95}
_FUSABLE = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet"}
_PROBE = (
    "Dense retrieval encodes queries and passages into vectors and ranks passages by inner product. "
    "The encoder is a transformer whose token states are pooled into one vector per text. "
)


class ExportError(DensekitError, RuntimeError):
    """An encoder that could not be exported, or whose export disagrees with PyTorch."""


def torch_precision(backend: str, precision: str) -> Precision:
    """The precision torch's autocast is to use for `precision` through `backend`: `precision` itself
    with torch, float32 with onnx (whose export carries its own); a pair that does not go together is
    refused."""
    if backend == "torch":
        if precision == "int8":
            raise SettingError("--precision int8 runs through ONNX Runtime: add --backend onnx")
        if precision not in ("float32", "bf16", "fp16"):
            raise SettingError(f"--precision {precision}: expected float32, bf16, fp16 or (with onnx) int8")
        return precision  # type: ignore[return-value]
    if backend != "onnx":
        raise SettingError(f"--backend {backend}: expected torch or onnx")
    return "float32"


def use_backend(
    encoder: DenseEncoder,
    backend: str,
    precision: str,
    sides: Iterable[TextSide] = ("query", "passage"),
    module: ModuleChoice = OWN,
) -> Precision:
    """Make `encoder` encode `sides` texts with `module` through `backend` (torch or onnx) at
    `precision`, and return `torch_precision(backend, precision)`."""
    autocast_precision = torch_precision(backend, precision)
    encoder.runtime = export_encoder(encoder, precision, sides, module) if backend == "onnx" else None
    return autocast_precision


class _SideForward(torch.nn.Module):
    """`encoder.encode_with(module, ..., side)` as a module of two inputs, for the exporter."""

    def __init__(self, encoder: DenseEncoder, side: TextSide, module: str | None):
        super().__init__()
        self.encoder, self.side, self.module = encoder, side, module

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder.encode_with(self.module, input_ids, attention_mask, self.side)


class OnnxEncoder:
    """ONNX Runtime sessions that encode one or both text sides as the encoder, with the module it was
    exported with, does; call it like `DenseEncoder.encode_with`'s batch part."""

    def __init__(self, sessions: dict[str, object], precision: str, module: str | None):
        self.sessions = sessions
        self.precision = precision
        self.module = module

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: TextSide) -> torch.Tensor:
        """Vectors for a padded batch of `side` texts."""
        if side not in self.sessions:
            raise InputError(f"this ONNX export encodes {' and '.join(self.sessions)} texts, not {side} ones")
        feeds = {
            "input_ids": input_ids.cpu().numpy().astype(np.int64, copy=False),
            "attention_mask": attention_mask.cpu().numpy().astype(np.int64, copy=False),
        }
        (vectors,) = self.sessions[side].run(None, feeds)  # type: ignore[attr-defined]
        return torch.from_numpy(vectors)

    def check_against(self, encoder: DenseEncoder) -> float:
        """The least cosine between this export's vectors and `encoder`'s (as it is now) on probe texts of
        several lengths, padded together; raises ExportError when it is below the precision's bound."""
        least = 1.0
        was_training = encoder.training
        encoder.eval()  # no dropout in the reference
        try:
            for side in self.sessions:
                least = min(least, self._least_cosine(encoder, side))
        finally:
            encoder.train(was_training)
        if least < MIN_COSINE[self.precision]:
            raise ExportError(
                f"the ONNX Runtime {self.precision} export disagrees with PyTorch: least cosine "
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


def export_encoder(
    encoder: DenseEncoder,
    precision: str,
    sides: Iterable[TextSide] = ("query", "passage"),
    module: ModuleChoice = OWN,
) -> OnnxEncoder:
    """Export `encoder` with `module` (by default its own) for each of `sides` to ONNX Runtime at
    `precision` (float32 or int8), check the export against PyTorch and return it."""
    name = encoder.chosen(module)
    if precision not in ONNX_PRECISIONS:
        raise SettingError(f"--backend onnx runs float32 or int8, not {precision}")
    if encoder.device.type != "cpu":
        raise SettingError(f"--backend onnx runs on the CPU, not {encoder.device}: add --device cpu")
    try:
        import onnxruntime
    except ImportError:
        raise SettingError(
            "--backend onnx needs onnxruntime and onnx: pip install 'densekit[onnx]'"
        ) from None
    held, encoder.runtime = encoder.runtime, None  # sessions do not copy
    try:
        copied = copy.deepcopy(encoder).eval()
    finally:
        encoder.runtime = held
    for backbone in {id(b): b for b in (copied.query_backbone, copied.passage_backbone)}.values():
        backbone.set_attn_implementation("eager")  # the attention the optimizer's fusions recognise
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    sessions: dict[str, object] = {}
    # a copy's forward hooks (adapters') still call the original's modules: both are frozen while traced
    with tempfile.TemporaryDirectory(prefix="densekit-onnx-") as folder, _frozen(encoder), _frozen(copied):
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
                _SideForward(encoder, side, module),
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
def _frozen(module: torch.nn.Module) -> Iterator[None]:
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
