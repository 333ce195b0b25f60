"""A failed write names what it was writing: "runs/ft/checkpoints/step-00000300: No space left on device".

Python names the file of a failed `open`, but not of a failed `write`, `fsync` or `fallocate`, and
libraries written in Rust (safetensors, tokenizers) raise their own errors with the OS error's code in
their text. Both are turned here into an `OSError` of the same code naming the output, which the command
line shows as one line (`densekit.cli.main`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

# How Rust's std::io::Error ends its text ("No space left on device (os error 28)")
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# The errors of a write that names no file which are surely the output's: a full disk or quota, a file
# too large (anything else, a failed read of an input in the same block say, is left as it is)
WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def named_os_error(err: BaseException, path: Path | str, inside: Path | str | None = None) -> OSError | None:
    """`err` as an `OSError` naming `path` when it is a write failure (`WRITE_FAILURES`) naming no file,
    or a file under `inside` (a temporary, removed since), or told by a library in its text; else None,
    to leave it as it is."""
    if isinstance(err, OSError):
        code, named = err.errno, err.filename
        if isinstance(named, str | bytes) and inside is not None:
            named = None if Path(os.fsdecode(named)).is_relative_to(inside) else named
    elif isinstance(err, Exception) and (match := _RUST_OS_ERROR.search(str(err))):
        code, named = int(match.group(1)), None
    else:
        return None
    if code not in WRITE_FAILURES or named is not None:
        return None
    return OSError(code, os.strerror(code), str(path))


@contextlib.contextmanager
def naming(path: Path | str, inside: Path | str | None = None) -> Iterator[None]:
    """Re-raise a write failure of the block that names no file (or one under `inside`) as an
    `OSError` naming `path` (see `named_os_error`)."""
    try:
        yield
    except Exception as err:
        named = named_os_error(err, path, inside)
        if named is None:
            raise
        raise named from err
