"""The linear layer after pooling: sentence-transformers' `Dense` module, read, applied and written.

A `Dense` folder holds `config.json` (`in_features`, `out_features`, `bias`, `activation_function`) and
its weights (`linear.weight`, `linear.bias`). densekit reads them from `model.safetensors` only: the
other format, `pytorch_model.bin`, is a pickle, which densekit never unpickles. The activation is named
by a class path that sentence-transformers imports; densekit maps the two it knows (the identity, tanh)
and refuses any other name, so that nothing a folder names is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from densekit.diagnostics import DataError, Problem
from densekit.limits import MAX_MODEL_WIDTH
from densekit.models.checkpoint_files import read_json_object

IDENTITY = "torch.nn.modules.linear.Identity"
TANH = "torch.nn.modules.activation.Tanh"
_ACTIVATIONS = {IDENTITY: torch.nn.Identity, TANH: torch.nn.Tanh}
WEIGHTS_FILE = "model.safetensors"


class Projection(torch.nn.Module):
    """`activation(vector @ weight.T + bias)`: what sentence-transformers' `Dense` computes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = IDENTITY):
        super().__init__()
        out_features, in_features = weight.shape
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias is not None)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if bias is not None:
                self.linear.bias.copy_(bias)
        self.activation_name = activation
        self.activation = _ACTIVATIONS[activation]()

    @property
    def in_features(self) -> int:
        """The width of the pooled vectors it takes."""
        return int(self.linear.in_features)

    @property
    def out_features(self) -> int:
        """The width of the vectors it makes."""
        return int(self.linear.out_features)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """The pooled vectors, projected."""
        return self.activation(self.linear(pooled))


def read_projection(folder: Path, hidden_size: int) -> Projection:
    """The `Dense` module saved in `folder`, taking `hidden_size`-wide pooled vectors; a folder that
    is not one densekit can use safely is refused in one line naming the file."""
    config_file = folder / "config.json"
    config = read_json_object(config_file)
    in_features, out_features = config.get("in_features"), config.get("out_features")
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if type(value) is not int or not 1 <= value <= MAX_MODEL_WIDTH:
            message = f"{name} {value!r}: expected a whole number from 1 to {MAX_MODEL_WIDTH}"
            raise DataError([Problem(config_file, None, message)])
    if in_features != hidden_size:
        message = f"in_features {in_features}: the transformer before it makes {hidden_size}-wide vectors"
        raise DataError([Problem(config_file, None, message)])
    activation = config.get("activation_function", TANH)  # sentence-transformers' default when unnamed
    if activation not in _ACTIVATIONS:
        known = " or ".join(_ACTIVATIONS)
        message = f"activation_function {activation!r} is not supported; densekit applies {known}"
        raise DataError([Problem(config_file, None, message)])
    if config.get("use_residual"):
        raise DataError([Problem(config_file, None, "use_residual: a residual Dense module is not read")])
    has_bias = config.get("bias", True)
    if type(has_bias) is not bool:
        raise DataError([Problem(config_file, None, f"bias {has_bias!r}: expected true or false")])
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        pickled = " (its pytorch_model.bin is a pickle, which densekit never loads)"
        found = pickled if (folder / "pytorch_model.bin").is_file() else ""
        raise DataError([Problem(weights_file, None, f"missing: a Dense module's weights{found}")])
    expected = {"linear.weight": (out_features, in_features)}
    if has_bias:
        expected["linear.bias"] = (out_features,)
    tensors = _read_tensors(weights_file, expected)
    return Projection(tensors["linear.weight"], tensors.get("linear.bias"), activation)


def _read_tensors(path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The tensors named in `expected` from a safetensors file, each checked for its shape, a floating
    type and finite values before it is used."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as saved:
            names = set(saved.keys())
            if names != set(expected):
                message = f"holds tensors {sorted(names)}; a Dense module holds {sorted(expected)}"
                raise DataError([Problem(path, None, message)])
            shapes = {name: tuple(saved.get_slice(name).get_shape()) for name in names}
            wrong = [f"{n} {shapes[n]} (expected {w})" for n, w in expected.items() if shapes[n] != w]
            if wrong:
                raise DataError([Problem(path, None, "wrong shapes: " + ", ".join(wrong))])
            tensors = {name: saved.get_tensor(name) for name in names}
    except (safetensors.SafetensorError, OSError) as err:
        raise DataError([Problem(path, None, f"not a readable safetensors file: {err}")]) from None
    for name, tensor in tensors.items():
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise DataError([Problem(path, None, f"{name}: expected finite floating-point values")])
    return {name: tensor.float() for name, tensor in tensors.items()}


def write_projection(folder: Path, projection: Projection) -> None:
    """Save `projection` into `folder` as sentence-transformers' `Dense` module, which it loads."""
    folder.mkdir(exist_ok=True)
    has_bias = projection.linear.bias is not None
    config: dict[str, Any] = {
        "in_features": projection.in_features,
        "out_features": projection.out_features,
        "bias": has_bias,
        "activation_function": projection.activation_name,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tensors = {"linear.weight": projection.linear.weight.detach().cpu().contiguous()}
    if has_bias:
        tensors["linear.bias"] = projection.linear.bias.detach().cpu().contiguous()
    safetensors.torch.save_file(tensors, str(folder / WEIGHTS_FILE))
