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
