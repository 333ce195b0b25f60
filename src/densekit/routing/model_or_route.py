"""The one loader of what a command or the service is given as MODEL: a model folder (or hub id, or
module folder), loaded with its options, or a route folder, loaded with its base and modules."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from densekit.device import resolve_device
from densekit.errors import InputError
from densekit.models.config import EncoderOptions
from densekit.models.encoder import DenseEncoder
from densekit.routing.route import Route, is_route_folder


def load_model_or_route(
    model: str | Path,
    device: str = "auto",
    options: EncoderOptions | None = None,
    also_given: Sequence[str] = (),
) -> tuple[DenseEncoder, Route | None]:
    """The encoder `model` names, on `device`, and its route when `model` is a route folder (None
    otherwise). A route names its base, modules and settings, so `options` must set none of them with
    one, nor may the caller's other options it names in `also_given` (`ValueError` naming those set); a
    model is loaded with them."""
    options = options or EncoderOptions()
    if is_route_folder(model):
        given = [*options.given(), *also_given]
        if given:
            raise InputError(f"{model} is a route folder: it names its base, modules and settings; "
                             f"{', '.join(given)} do not apply")  # fmt: skip
        route = Route.load(model, resolve_device(device))
        return route.encoder, route
    encoder = DenseEncoder.load(
        model, trust_remote_code=options.trust_remote_code, module=options.module, **options.overrides()
    )
    return encoder.to(resolve_device(device)), None
