"""Inference through OpenVINO on the CPU: an encoder converted per text side at float32, bf16 (where the
CPU computes it) or int8, and checked against PyTorch before it is used.

int8 is NNCF's post-training quantisation: weights and activations both int8, the activations' ranges
calibrated on texts of what is encoded (`calibration_texts`: documents spread over the corpus), which
the artefacts record. On wiki1m passages with all-MiniLM-L6-v2 it ran 1.4x ONNX Runtime's dynamic int8 on a
2-core AVX-512-VNNI CPU, closer to PyTorch (docs/scale.md). Like the ONNX export, nothing is cached on
disk: the model is converted from the weights in memory each time.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from densekit.data.dataset import Dataset
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

# How many texts int8's activation ranges are calibrated on, and in batches of how many: 512 wiki1m
# passages kept all-MiniLM-L6-v2's vectors at a mean cosine of 0.998 with PyTorch's (a probe).
CALIBRATION_TEXTS = 512
_CALIBRATION_BATCH = 32


class OpenVinoEncoder(ExportedEncoder):
    """Compiled OpenVINO models that encode one or both text sides as the encoder, with the module it was
    converted with, does; each calling thread runs its own inference request."""

    backend = "openvino"

    def __init__(
        self, compiled: dict[str, Any], precision: str, module: str | None, calibration: dict | None
    ):
        super().__init__(compiled, precision, module, calibration)
        self.compiled = compiled
        self._local = threading.local()

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: TextSide) -> torch.Tensor:
        """OpenVINO's vectors for a padded batch of `side` texts."""
        requests = self._local.__dict__.setdefault("requests", {})
        if side not in requests:
            requests[side] = self.compiled[side].create_infer_request()
        result = requests[side].infer(
            {"input_ids": input_ids.cpu().numpy(), "attention_mask": attention_mask.cpu().numpy()}
        )
        return torch.from_numpy(np.array(result[0], dtype=np.float32))  # a copy: the request reuses its own


def calibration_texts(dataset: Dataset, count: int = CALIBRATION_TEXTS) -> list[str]:
    """`count` documents' texts spread evenly over `dataset`'s corpus (every (documents / count)-th, from
    the first): what int8 through OpenVINO is calibrated on when it encodes that corpus."""
    step = max(1, dataset.count_documents() // count)
    documents = itertools.islice(dataset.iter_corpus(), 0, None, step)
    return [document.full_text for document in itertools.islice(documents, count)]


def export_openvino(
    encoder: DenseEncoder,
    precision: str,
    sides: Iterable[TextSide] = ("query", "passage"),
    module: ModuleChoice = OWN,
    calibration: Mapping[str, Sequence[str]] | None = None,
) -> OpenVinoEncoder:
    """Convert `encoder` with `module` (by default its own) for each of `sides` to OpenVINO at `precision`
    (float32, bf16 or int8: int8 calibrated on `calibration[side]`'s texts), check it against PyTorch
    and return it."""
    name = encoder.chosen(module)
    check_export_precision("openvino", precision)
    if encoder.device.type != "cpu":
        raise SettingError(f"--backend openvino runs on the CPU, not {encoder.device}: add --device cpu")
    try:
        with _telemetry_declined():  # its import writes under the home folder otherwise
            import openvino
    except ImportError:
        raise SettingError(
            "--backend openvino needs openvino and nncf: pip install 'densekit[openvino]'"
        ) from None
    core = openvino.Core()
    if precision == "bf16" and "BF16" not in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        raise SettingError("this CPU does not compute bf16 (no AVX-512-BF16 or AMX): use float32 or int8")
    sides = list(dict.fromkeys(sides))
    texts = _calibration_for(sides, calibration) if precision == "int8" else None
    config = {
        "INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32",
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_NUM_THREADS": torch.get_num_threads(),
    }
    copied = copy_for_export(encoder)
    compiled = {}
    with frozen(encoder), frozen(copied), _telemetry_declined():
        for side in sides:
            model = _convert(openvino, copied, side, name)
            if texts is not None:
                model = _quantise(model, copied, side, texts[side])
            compiled[side] = core.compile_model(model, "CPU", config)
    record = None if texts is None else {side: _digest(side_texts) for side, side_texts in texts.items()}
    exported = OpenVinoEncoder(compiled, precision, name, record)
    least = exported.check_against(encoder)
    log.info("OpenVINO %s export of %s checked against PyTorch (least cosine %.6f)",
             precision, " and ".join(compiled), least)  # fmt: skip
    return exported


@contextlib.contextmanager
def _telemetry_declined() -> Iterator[None]:
    """OpenVINO (from its import on, and its model converter) and NNCF report their use over the network,
    and write a client id under the home folder, unless a consent file there says no or they run in CI
    (`CI`, and NNCF's own `NNCF_CI`, read when nncf is first imported): densekit makes no network call
    nor writes outside its outputs unasked, so they run as in CI, the variables put back after."""
    names = ("CI", "NNCF_CI")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"CI": "true", "NNCF_CI": "1"})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _calibration_for(
    sides: list[str], calibration: Mapping[str, Sequence[str]] | None
) -> dict[str, list[str]]:
    """Each side's calibration texts; a side without any is refused."""
    missing = [side for side in sides if not (calibration and calibration.get(side))]
    if missing:
        raise SettingError(
            f"--backend openvino --precision int8 is calibrated on the {' and '.join(missing)} texts it "
            "encodes, which only `densekit encode` (and a recipe's encode step) give it: use --precision "
            "bf16 or float32 here"
        )
    return {side: list(calibration[side]) for side in sides}  # type: ignore[index]


def _digest(texts: Sequence[str]) -> dict:
    """What an artefact records of the texts an export was calibrated on."""
    payload = json.dumps(list(texts), ensure_ascii=False).encode("utf-8")
    return {"texts": len(texts), "sha256": hashlib.sha256(payload).hexdigest()}


def _convert(openvino: Any, encoder: DenseEncoder, side: TextSide, module: str | None) -> Any:
    """`encoder`'s `side` with `module` as an OpenVINO model of dynamic batch and length."""
    import warnings

    dummy = torch.ones((2, 8), dtype=torch.long)
    shape = [-1, -1]
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the tracer's warnings are about Python control flow
            return openvino.convert_model(
                SideForward(encoder, side, module),
                example_input=(dummy, dummy),
                input=[("input_ids", shape, openvino.Type.i64), ("attention_mask", shape, openvino.Type.i64)],
            )
    except Exception as err:
        named = f" with module {module!r}" if module else ""
        raise ExportError(f"could not convert the encoder{named} to OpenVINO: {err}".splitlines()[0]) from err


def _quantise(model: Any, encoder: DenseEncoder, side: TextSide, texts: list[str]) -> Any:
    """`model` quantised to int8 by NNCF, its activations' ranges taken over `texts` (batched by
    length)."""
    import nncf

    nncf.set_log_level(logging.ERROR)
    token_ids = encoder.tokenize(texts, side)
    order = np.argsort([-len(ids) for ids in token_ids], kind="stable")
    batches = []
    for start in range(0, len(order), _CALIBRATION_BATCH):
        padded = encoder.pad([token_ids[i] for i in order[start : start + _CALIBRATION_BATCH]])
        batches.append(
            {"input_ids": padded["input_ids"].numpy(), "attention_mask": padded["attention_mask"].numpy()}
        )
    return nncf.quantize(
        model, nncf.Dataset(batches), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(batches)
    )
