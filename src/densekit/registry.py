"""The one shape of densekit's extension points: a `Registry` of named pieces, each registered by a class
decorator in the one file that defines it, in a package whose every module is imported on first use.

Module kinds (`densekit.models.modules.kinds`), routing strategies (`densekit.routing.strategies`) and
pre-training objectives (`densekit.pretraining.objectives`) are each a package of such files: a new
piece is one new file there (PEFT's `register_peft_method` pattern). The matrices of the shared tests,
the `type` or `method` a config takes and the errors that list the known names are all read from the
registry. This module imports nothing of densekit's but its errors.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from densekit.errors import DensekitError

Entry = TypeVar("Entry")
Registered = TypeVar("Registered", bound=type)


class UnknownName(DensekitError, ValueError):
    """A name no piece of a registry has."""


class RegisteredTwice(DensekitError, TypeError):
    """Two pieces registered under one name."""


def spec_type(spec: Any) -> str:
    """The name a piece's spec class (pydantic) takes as its `type`: the one value of that field."""
    return str(spec.model_fields["type"].default)


class Registry(Mapping[str, Entry], Generic[Entry]):
    """The pieces of one extension point by name, in the order they were registered.

    `what` names a piece in errors ("routing strategy"); `name_of` reads the name of a registered class
    (its spec's `type`, its `name`); `entry` makes what the registry holds of it (the class itself, or
    one instance serving every use). `unknown` is the error an unknown name raises.
    """

    def __init__(
        self,
        what: str,
        name_of: Callable[[type], str],
        entry: Callable[[type], Entry] = lambda cls: cls,
        unknown: type[Exception] = UnknownName,
    ):
        self.what = what
        self.name_of = name_of
        self.entry = entry
        self.unknown = unknown
        self._entries: dict[str, Entry] = {}

    def register(self, cls: Registered) -> Registered:
        """Register `cls` under its name (a class decorator); a name taken twice is an error."""
        name = self.name_of(cls)
        if name in self._entries:
            raise RegisteredTwice(f"{self.what} {name!r} is registered twice")
        self._entries[name] = self.entry(cls)
        return cls

    def named(self, name: str) -> Entry:
        """The piece registered as `name`; an unknown name is an error naming it and the known ones."""
        if name not in self._entries:
            raise self.unknown(f"no {self.what} {name!r}; densekit has {', '.join(self._entries)}")
        return self._entries[name]

    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def import_every_module(package: str, path: Iterable[str]) -> None:
    """Import every module of `package` (found on its `path`), in the order of their names, so that the
    pieces they define register themselves: a package's `__init__` calls it with `__name__, __path__`."""
    for found in sorted(pkgutil.iter_modules(path), key=lambda found: found.name):
        importlib.import_module(f"{package}.{found.name}")
