"""Checks of what a client sends the service, and bounds on what its errors echo back, so that no
request's text can fail another's and no error answer grows with the request that caused it."""

from __future__ import annotations

import math
import unicodedata
from typing import TYPE_CHECKING, Any

from densekit.errors import DensekitError

if TYPE_CHECKING:
    from densekit.retrieval.retriever import Retriever
    from densekit.serving.settings import Limits

MAX_SHOWN = 100  # characters of a client's value repeated in an error
MAX_PROBLEMS = 20  # validation problems listed in one error answer; the rest are counted
MAX_MESSAGE = 2000  # characters of one error message
_NESTING = 4  # levels of a client's value shown in a validation problem
# Unicode categories that show nothing on their own: controls, format characters (zero-width spaces
# and joiners, byte order marks, soft hyphens), surrogates, private-use and unassigned code points,
# separators (spaces, line and paragraph separators) and combining marks with nothing to combine with.
_INVISIBLE_CATEGORIES = ("C", "Z", "M")
# Letters and symbols that render blank (Hangul fillers, the blank Braille pattern): in categories Lo and
# So, but used to make text that looks empty.
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


class LimitError(DensekitError, ValueError):
    """A request that asks past a limit of the service, or for what it does not serve (422)."""


def check_k(k: int, limits: Limits) -> None:
    """`k` within 1 and `max_k`."""
    if not 1 <= k <= limits.max_k:
        raise LimitError(f"k={shown(k)}: ask for 1 to {limits.max_k} hits")


def check_hits(queries: int, k: int, limits: Limits) -> None:
    """Queries times k within `max_hits`."""
    if queries * k > limits.max_hits:
        raise LimitError(
            f"{queries} queries x k={k} = {queries * k} hits: ask for at most {limits.max_hits} in one "
            "request (fewer queries, or a smaller k)"
        )


def check_texts(texts: list[str], most: int, longest: int, what: str, many: str) -> None:
    """`texts` (a request's queries or inputs: `what`, `many` of them) within the limits: at most `most`
    of them, none longer than `longest` characters, none empty."""
    if not 1 <= len(texts) <= most:
        raise LimitError(f"{len(texts)} {many}: send 1 to {most} in one request")
    for number, text in enumerate(texts):
        if len(text) > longest:
            raise LimitError(f"{what} {number}: {len(text)} characters, over the limit of {longest}")
        where = unencodable_at(text)
        if where is not None:
            raise LimitError(f"{what} {number}: not valid Unicode text (a lone surrogate, "
                             f"U+{ord(text[where]):04X}, at character {where})")  # fmt: skip
        if is_blank(text):
            raise LimitError(f"{what} {number} is empty (only spaces, controls or invisible characters)")


def check_domain(retriever: Retriever, domain: str | None) -> None:
    """A domain goes with a fixed route, which needs one it knows (or a fallback)."""
    route = retriever.route
    if route is None or not route.strategy.takes_domains:
        if domain is not None:
            raise LimitError("domain: the service routes no queries by domain (it serves no fixed route)")
        return
    if domain in route.spec.domains or route.spec.fallback is not None:
        return
    known = ", ".join(repr(d) for d in route.spec.domains)
    how = ('send one as "domain" with the queries (/search), or ask /v1/embeddings for a model '
           "NAME:query@DOMAIN (GET /v1/models lists them)")  # fmt: skip
    if domain is None:
        raise LimitError(f"this service routes queries by their domain, and these came without one: {how}; "
                         f"domains: {known}")  # fmt: skip
    raise LimitError(f"domain {shown(domain)} is not routed here (domains: {known})")


def shown(value: object) -> str:
    """`value` as an error repeats it: its repr, cut to MAX_SHOWN characters and saying how long it was."""
    text = repr(value)
    if len(text) <= MAX_SHOWN:
        return text
    return f"{text[:MAX_SHOWN]}... ({len(text)} characters)"


def shortened(message: str) -> str:
    """An error message of at most MAX_MESSAGE characters."""
    if len(message) <= MAX_MESSAGE:
        return message
    return f"{message[:MAX_MESSAGE]}... ({len(message) - MAX_MESSAGE} more characters)"


def is_blank(text: str) -> bool:
    """Whether `text` shows nothing: every character is whitespace or of a category in
    _INVISIBLE_CATEGORIES (Cc, Cf, Cs, Co, Cn, Zs, Zl, Zp, Mn, Mc, Me), or a blank letter (_BLANK_LETTERS)."""
    return all(c.isspace() or c in _BLANK_LETTERS or unicodedata.category(c)[0] in _INVISIBLE_CATEGORIES
               for c in text)  # fmt: skip


def only_a_number(value: object) -> object:
    """`value`, unless it is a JSON boolean or string, which pydantic would otherwise read as a number
    (true as 1, "1_0" as 10): for a field of a request that takes a number."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is not a number")
    if isinstance(value, str):
        raise ValueError(f"{shown(value)} is text, not a number")
    return value


def unencodable_at(text: str) -> int | None:
    """The position of the first character of `text` that UTF-8 cannot encode (a lone surrogate, which a
    JSON escape such as \\ud800 can give), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def bounded_problems(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validation problems (pydantic's error dicts) as an error answer lists them: at most MAX_PROBLEMS,
    then one saying how many more; each value of the client's cut as `bounded` cuts it."""
    listed = [{key: bounded(value) for key, value in problem.items()} for problem in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS
        listed.append({"type": "truncated", "loc": [], "msg": f"... and {more} more problems"})
    return listed


def bounded(value: Any, depth: int = 0) -> Any:
    """`value` (from a client's request) cut to fit an error answer: strings to MAX_SHOWN characters,
    lists and mappings to MAX_PROBLEMS items, nesting to a few levels, and numbers JSON cannot write
    (NaN, infinity) and other objects as text."""
    if isinstance(value, str):
        return value if len(value) <= MAX_SHOWN else f"{value[:MAX_SHOWN]}... ({len(value)} characters)"
    if isinstance(value, bool | int) or value is None:
        return value if not isinstance(value, int) or abs(value) < 10**18 else shown(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if depth >= _NESTING:
        return "..."
    if isinstance(value, list | tuple):
        items = [bounded(item, depth + 1) for item in value[:MAX_PROBLEMS]]
        return items + ([f"... and {len(value) - MAX_PROBLEMS} more"] if len(value) > MAX_PROBLEMS else [])
    if isinstance(value, dict):
        pairs = list(value.items())
        kept = {bounded(str(key)): bounded(item, depth + 1) for key, item in pairs[:MAX_PROBLEMS]}
        if len(pairs) > MAX_PROBLEMS:
            kept["..."] = f"and {len(pairs) - MAX_PROBLEMS} more"
        return kept
    return shown(value)
