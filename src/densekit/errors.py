"""The root of densekit's own errors.

Every error densekit raises on purpose derives from `DensekitError`, so a caller (the command line, a
script around the library) can tell densekit's refusals from a library's failure with one `except`.
Each error class keeps the built-in class it always had (`ValueError`, `RuntimeError`, `OSError`) as a
second base, so code that catches those goes on working. This module imports nothing of densekit's.
"""

from __future__ import annotations


class DensekitError(Exception):
    """An error densekit raises on purpose: bad input, a refused output, a model that does not fit.

    Its message is one line that says what is wrong and, where there is one, what to do instead; the
    command line prints it as it is and exits with status 2 (`densekit.cli.main`). `DataError` is the
    one subclass whose message may hold several lines, one a problem.
    """


class SettingError(DensekitError, ValueError):
    """A setting densekit refuses: a command-line option, a config or recipe key, an override, or a
    combination of them that cannot be used together. The message names the setting."""


class InputError(DensekitError, ValueError):
    """Input densekit refuses: a file, a run, vectors, a model or a module that does not fit what it is
    given for (the wrong shape, other weights, ids that do not match). The message names the input."""


class StateError(DensekitError, RuntimeError):
    """Work densekit cannot do in the state it finds: a package not installed, a service not started, a
    file that changed while it was read, an export made for another module."""
