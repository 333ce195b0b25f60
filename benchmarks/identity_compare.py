r"""Compare two folders `benchmarks/identity_runs.py` wrote (before and after a change) file by file.

Each file is one of:

- identical: the same bytes;
- benign: different bytes for a reason that cannot change a result:
  - JSON (and JSON Lines) equal once each tree's own paths (its root, the checkout it ran, from its
    `_identity_run.json`; in keys too) are replaced by a placeholder and the keys that hold times dropped
    (`created`, `seconds`, `timings`, `stages`, `elapsed`, `wall_clock`, any key ending `_s`,
    `_seconds`, `_per_second`); a file named `timings.json` by its keys alone;
  - JSON whose only other differences are digests (`sha256:...`) of a file or folder that is itself
    identical or benign: a manifest's checksums, a folder's digest (`digest_of(tree_checksums(...))`,
    with or without densekit's manifest), a step record's fingerprint of an input;
  - text equal once the paths are replaced, or differing only by such digests (whole or cut short, as
    model cards show them) and, beside a folder's digest, that folder's size;
  - paths are the trees' own (root, checkout) and relative paths climbing out of the tree (a model
    card names its base model from the folder holding its own), which change with where a tree lies;
  - safetensors holding the same tensors (name, dtype, shape, bytes) and metadata in another order
    (safetensors.torch.save_model lists a tied model's shared names in its metadata in an order that
    changes from run to run);
  - `training_curves.png` beside a training log (`*.jsonl`) that is identical or benign;
  - the run record (`_identity_run.json`) when the model, data, parts, steps and depth agree;
- intended: a file whose path matches a pattern given as `--intended PATTERN=REASON` (fnmatch over
  the path below the root, `*` crossing folders) and differs or is on one side only: a change made on
  purpose between the two checkouts (by other work than the one compared), with its reason printed.
  Digests of intended files explain a difference as those of benign files do;
- unexplained: anything else, printed with its first difference;
- missing: on one side only.

Prints a table of counts per part (the first folder under the root) and each file neither identical
nor benign; exits 1 when any file is unexplained or missing. `--benign` lists the benign files with
their reason. Run from the repository root:

    .venv/bin/python -m benchmarks.identity_compare /work/ident/before /work/ident/after \
        --intended '*README.md=model cards rewritten by issue 63 (e4f73f0)'
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densekit.io.fingerprint import digest_of, file_digest

RECORD = "_identity_run.json"
MANIFEST = "densekit-artefact.json"
STATUSES = ("identical", "benign", "intended", "unexplained", "missing")
VOLATILE_KEYS = {"created", "seconds", "timings", "stages", "elapsed", "wall_clock", "wall-clock"}
VOLATILE_SUFFIXES = ("_s", "_seconds", "_per_second")
RECORD_KEYS = ("model", "data", "parts", "max_steps", "benchmark_k")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
DIGESTS = re.compile(r"(sha256:[0-9a-f]{12,64})")
SIZE = re.compile(r"\b\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b")
UPWARD = re.compile(r"(?<![\w./-])(?:\.\./)+[\w.\-/]*")
_ABSENT = object()
SAME = "(the same digest)"
Rewrites = tuple[Callable[[str], str], Callable[[str], str]]


@dataclass(frozen=True)
class Verdict:
    """What a file is (one of `STATUSES`) and why."""

    status: str
    why: str = ""

    @property
    def fine(self) -> bool:
        """Identical, benign or intended."""
        return self.status in ("identical", "benign", "intended")


def is_volatile(key: str) -> bool:
    """Whether a JSON key holds a time (dropped before comparing)."""
    return key in VOLATILE_KEYS or key.endswith(VOLATILE_SUFFIXES)


def normalised(value: Any, rewrite: Callable[[str], str]) -> Any:
    """`value` with volatile keys dropped and its strings, keys included, passed through `rewrite`."""
    if isinstance(value, dict):
        return {rewrite(k): normalised(v, rewrite) for k, v in value.items() if not is_volatile(k)}
    if isinstance(value, list):
        return [normalised(v, rewrite) for v in value]
    if isinstance(value, str):
        return rewrite(value)
    return value


def replaced(text: str, paths: list[tuple[re.Pattern[str], str]]) -> str:
    """`text` with each path pattern replaced by its placeholder."""
    for pattern, placeholder in paths:
        text = pattern.sub(placeholder, text)
    return text


def without_own_paths(text: str, paths: list[tuple[re.Pattern[str], str]], folder: Path) -> str:
    """`text` with its tree's own paths replaced by their placeholders, and each relative path climbing
    out (`../../x`, whose length depends on where the tree lies) by the absolute path it names from
    `folder`, itself with the tree's paths replaced."""

    def absolute(match: re.Match[str]) -> str:
        return replaced(os.path.normpath(os.path.join(folder, match.group(0))), paths)

    return replaced(UPWARD.sub(absolute, text), paths)


def differences(a: Any, b: Any, where: str = "") -> Iterator[tuple[str, Any, Any]]:
    """Each place where the JSON values `a` and `b` differ: (path, a's value, b's value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            yield from differences(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from differences(x, y, f"{where}[{i}]")
    elif a != b or type(a) is not type(b):
        yield where or ".", a, b


def safetensors_content(data: bytes) -> tuple[Any, dict[str, tuple[str, list[int], bytes]]]:
    """A safetensors file's metadata and its tensors by name (dtype, shape, bytes), in no order."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    body = data[8 + size :]
    tensors = {}
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            tensors[name] = (entry["dtype"], entry["shape"], body[start:end])
    return header.get("__metadata__"), tensors


def first_byte_difference(a: bytes, b: bytes) -> str:
    """Where two byte strings first differ."""
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"bytes differ from offset {at} ({len(a)} and {len(b)} bytes)"


def short(value: Any) -> str:
    """A value for one line of the report."""
    text = "(absent)" if value is _ABSENT else json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 100 else text[:97] + "..."


class Comparison:
    """Two trees of artefacts, each file classified once (`classify`)."""

    def __init__(self, a: Path, b: Path, intended: dict[str, str] | None = None) -> None:
        self.roots = (Path(a), Path(b))
        self.intended = intended or {}
        self.files = sorted(
            {p.relative_to(root).as_posix() for root in self.roots for p in root.rglob("*") if p.is_file()}
        )
        self.paths = (self._paths(self.roots[0]), self._paths(self.roots[1]))
        # where each tree was written (its run record's `out`): relative paths out of it are read from there
        self.homes = (self._home(self.roots[0]), self._home(self.roots[1]))
        self._verdicts: dict[str, Verdict] = {}
        self._busy: set[str] = set()
        self._digests: list[dict[str, set[tuple[str, bool]]] | None] = [None, None]
        self._file_digests: list[dict[str, str]] = [{}, {}]

    @staticmethod
    def _paths(root: Path) -> list[tuple[re.Pattern[str], str]]:
        """The tree's own paths (its root as given and resolved, and the output folder and checkout its
        run record names) as patterns, longest first, with their placeholders."""
        named = {str(root.resolve()): "<OUT>", str(root.absolute()): "<OUT>"}
        record = root / RECORD
        if record.is_file():
            saved = json.loads(record.read_text(encoding="utf-8"))
            named.update({saved.get("out") or str(root.resolve()): "<OUT>", saved.get("src") or "": "<SRC>"})
        named.pop("", None)
        ordered = sorted(named.items(), key=lambda item: -len(item[0]))
        return [(re.compile(re.escape(path) + r"(?![\w.-])"), placeholder) for path, placeholder in ordered]

    @staticmethod
    def _home(root: Path) -> Path:
        """Where the tree at `root` was written: its run record's `out`, else `root` itself."""
        record = root / RECORD
        if record.is_file():
            return Path(json.loads(record.read_text(encoding="utf-8")).get("out") or root.resolve())
        return root.resolve()

    def classify(self, rel: str) -> Verdict:
        """The verdict on the file `rel` (a path relative to both roots)."""
        if rel in self._verdicts:
            return self._verdicts[rel]
        if rel in self._busy:  # a digest of a file that (through others) digests itself: not explained
            return Verdict("unexplained", "its digest depends on itself")
        self._busy.add(rel)
        try:
            verdict = self._classify(rel)
        finally:
            self._busy.discard(rel)
        self._verdicts[rel] = verdict
        return verdict

    def _classify(self, rel: str) -> Verdict:
        a, b = (root / rel for root in self.roots)
        both = a.is_file() and b.is_file()
        if both and a.read_bytes() == b.read_bytes():
            return Verdict("identical")
        reason = next((why for pattern, why in self.intended.items() if fnmatch.fnmatch(rel, pattern)), None)
        if reason is not None:
            return Verdict("intended", reason if both else f"{reason} (only in one)")
        if not both:
            return Verdict("missing", f"only in {self.roots[0] if a.is_file() else self.roots[1]}")
        bytes_a, bytes_b = a.read_bytes(), b.read_bytes()
        name = a.name
        if rel == RECORD:
            return self._record(bytes_a, bytes_b)
        if name.endswith(".safetensors"):
            return self._safetensors(bytes_a, bytes_b)
        if name == "training_curves.png":
            return self._curves(rel)
        try:
            text_a, text_b = bytes_a.decode("utf-8"), bytes_b.decode("utf-8")
        except UnicodeDecodeError:
            return Verdict("unexplained", first_byte_difference(bytes_a, bytes_b))
        rewrite = (self._rewriter(0, rel), self._rewriter(1, rel))
        if name.endswith(".json"):
            return self._json(text_a, text_b, rewrite, keys_only=name == "timings.json")
        if name.endswith(".jsonl"):
            return self._json_lines(text_a, text_b, rewrite)
        return self._text(text_a, text_b, rewrite)

    def _rewriter(self, side: int, rel: str) -> Callable[[str], str]:
        """What replaces the paths of one side's tree in a string of its file `rel`."""
        # model cards name their base model from the folder holding theirs (`densekit.models.card.seen_from`)
        folder = (self.homes[side] / rel).parent.parent
        return lambda text: without_own_paths(text, self.paths[side], folder)

    def _record(self, bytes_a: bytes, bytes_b: bytes) -> Verdict:
        saved = [json.loads(data) for data in (bytes_a, bytes_b)]
        differ = [key for key in RECORD_KEYS if saved[0].get(key) != saved[1].get(key)]
        if differ:
            return Verdict("unexplained", f"the runs differ in {', '.join(differ)}")
        return Verdict("benign", "run record: the same model, data, parts, steps and depth")

    def _safetensors(self, bytes_a: bytes, bytes_b: bytes) -> Verdict:
        (meta_a, tensors_a), (meta_b, tensors_b) = safetensors_content(bytes_a), safetensors_content(bytes_b)
        if meta_a != meta_b:
            return Verdict("unexplained", f"safetensors metadata differ: {short(meta_a)} != {short(meta_b)}")
        for name in sorted(set(tensors_a) | set(tensors_b)):
            if tensors_a.get(name) != tensors_b.get(name):
                return Verdict("unexplained", f"tensor {name} differs")
        if list(tensors_a) != list(tensors_b):
            return Verdict("benign", "the same tensors and metadata, the tensors in another order")
        return Verdict("benign", "the same tensors and metadata, the metadata in another order")

    def _curves(self, rel: str) -> Verdict:
        folder = rel.rpartition("/")[0]
        logs = [f for f in self.files if f.rpartition("/")[0] == folder and f.endswith(".jsonl")]
        if not logs:
            return Verdict("unexplained", "training_curves.png differs and has no training log beside it")
        for log in logs:
            if not self.classify(log).fine:
                return Verdict("unexplained", f"training_curves.png differs, and so does {log}")
        return Verdict("benign", f"plot of a benign training log ({', '.join(logs)})")

    def _json(self, text_a: str, text_b: str, rewrite: Rewrites, keys_only: bool = False) -> Verdict:
        try:
            value_a, value_b = json.loads(text_a), json.loads(text_b)
        except json.JSONDecodeError:
            return self._text(text_a, text_b, rewrite)
        if keys_only and isinstance(value_a, dict) and isinstance(value_b, dict):
            if list(value_a) == list(value_b):
                return Verdict("benign", "timings: the same keys")
            return Verdict(
                "unexplained", f"timings of other steps: {short(list(value_a))} != {short(list(value_b))}"
            )
        return self._values(normalised(value_a, rewrite[0]), normalised(value_b, rewrite[1]))

    def _values(self, value_a: Any, value_b: Any, where: str = "") -> Verdict:
        """The verdict on two normalised JSON values: benign when they differ only by explained digests."""
        explained = []
        for path, x, y in differences(value_a, value_b, where):
            of = self._explain_digests(x, y)
            if of is None:
                return Verdict("unexplained", f"{path}: {short(x)} != {short(y)}")
            explained.append(of)
        if not explained:
            return Verdict("benign", "JSON equal without times and paths")
        return Verdict(
            "benign", "JSON equal but for digests of benign files: " + ", ".join(sorted(set(explained)))
        )

    def _json_lines(self, text_a: str, text_b: str, rewrite: Rewrites) -> Verdict:
        lines_a, lines_b = text_a.splitlines(), text_b.splitlines()
        if len(lines_a) != len(lines_b):
            return Verdict("unexplained", f"{len(lines_a)} lines against {len(lines_b)}")
        reasons = set()
        for number, (line_a, line_b) in enumerate(zip(lines_a, lines_b, strict=True), start=1):
            if line_a == line_b:
                continue
            try:
                value_a, value_b = json.loads(line_a), json.loads(line_b)
            except json.JSONDecodeError:
                return self._text(text_a, text_b, rewrite)
            verdict = self._values(
                normalised(value_a, rewrite[0]), normalised(value_b, rewrite[1]), f"line {number}"
            )
            if not verdict.fine:
                return verdict
            reasons.add(verdict.why)
        return Verdict("benign", "; ".join(sorted(reasons)) or "JSON lines equal")

    def _text(self, text_a: str, text_b: str, rewrite: Rewrites) -> Verdict:
        lines_a, lines_b = rewrite[0](text_a).splitlines(), rewrite[1](text_b).splitlines()
        if lines_a == lines_b:
            return Verdict("benign", "text equal but for paths")
        explained: set[str] = set()
        for at in range(max(len(lines_a), len(lines_b))):
            line_a = lines_a[at] if at < len(lines_a) else "(end)"
            line_b = lines_b[at] if at < len(lines_b) else "(end)"
            of = None if line_a != line_b and "(end)" in (line_a, line_b) else self._line(line_a, line_b)
            if of is None:
                return Verdict("unexplained", f"line {at + 1}: {short(line_a)} != {short(line_b)}")
            explained |= of
        named = ", ".join(sorted(explained))
        return Verdict("benign", f"text equal but for paths and digests (and sizes) of benign files: {named}")

    def _line(self, line_a: str, line_b: str) -> set[str] | None:
        """What two lines differ by: nothing, or digests of benign files and folders (and, beside a
        folder's digest, its size, which a path inside it changes); None when anything else."""
        if line_a == line_b:
            return set()
        pieces_a, pieces_b = DIGESTS.split(line_a), DIGESTS.split(line_b)
        if len(pieces_a) != len(pieces_b):
            return None
        explained = {self._explain_digests(x, y) for x, y in zip(pieces_a[1::2], pieces_b[1::2], strict=True)}
        if None in explained:
            return None
        explained.discard(SAME)
        texts_a, texts_b = pieces_a[::2], pieces_b[::2]
        if explained and any(e.endswith("/") for e in explained):  # type: ignore[union-attr]
            texts_a, texts_b = (
                [SIZE.sub("<size>", t) for t in texts_a],
                [SIZE.sub("<size>", t) for t in texts_b],
            )
        return explained if texts_a == texts_b else None  # type: ignore[return-value]

    def _explain_digests(self, x: Any, y: Any) -> str | None:
        """The file or folder whose digests `x` and `y` are on each side when it is identical, benign or
        intended (or, listed on one side only, the intended file it digests), else None."""
        if (x is _ABSENT) != (y is _ABSENT):  # listed on one side only: explained when what it digests
            side, digest = (1, y) if x is _ABSENT else (0, x)  # is a file changed on purpose
            if not (isinstance(digest, str) and DIGESTS.fullmatch(digest)):
                return None
            found = sorted(rel for rel, _ in self._digested(side, digest) if not rel.endswith("/"))
            return next((rel for rel in found if self.classify(rel).status == "intended"), None)
        if not (isinstance(x, str) and isinstance(y, str) and DIGESTS.fullmatch(x) and DIGESTS.fullmatch(y)):
            return None
        if x == y:
            return SAME
        for rel, skip_manifest in sorted(self._digested(0, x) & self._digested(1, y)):
            if self._covered_fine(rel, skip_manifest):
                return rel
        return None

    def _digested(self, side: int, digest: str) -> set[tuple[str, bool]]:
        """What a digest, or the start of one (a model card shows them cut), is of in one side's tree."""
        index = self._digest_index(side)
        if DIGEST.fullmatch(digest):
            return index.get(digest, set())
        return {found for full, of in index.items() if full.startswith(digest) for found in of}

    def _covered_fine(self, rel: str, skip_manifest: bool) -> bool:
        """Whether the file `rel`, or every file the digest of the folder `rel` covers, is fine."""
        if not rel.endswith("/"):
            return self.classify(rel).fine
        covered = [
            f
            for f in self.files
            if (rel == "/" or f.startswith(rel)) and self._covered(f, rel, skip_manifest)
        ]
        return all(self.classify(f).fine for f in covered)

    @staticmethod
    def _covered(file: str, folder: str, skip_manifest: bool) -> bool:
        """Whether `tree_checksums(folder)` lists `file` (not hidden; not the manifest if it is skipped)."""
        inside = file if folder == "/" else file[len(folder) :]
        return not any(part.startswith(".") for part in inside.split("/")) and not (
            skip_manifest and inside == MANIFEST
        )

    def _file_digest(self, side: int, rel: str) -> str:
        if rel not in self._file_digests[side]:
            self._file_digests[side][rel] = file_digest(self.roots[side] / rel)
        return self._file_digests[side][rel]

    def _digest_index(self, side: int) -> dict[str, set[tuple[str, bool]]]:
        """Every digest densekit may record of a file or folder of one tree: the file's, and each folder's
        `digest_of(tree_checksums(...))` with and without its manifest; folders' paths end with '/'."""
        index = self._digests[side]
        if index is not None:
            return index
        index = {}
        root = self.roots[side]
        mine = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file()]
        for rel in mine:
            index.setdefault(self._file_digest(side, rel), set()).add((rel, False))
        folders = {"/"} | {p.relative_to(root).as_posix() + "/" for p in root.rglob("*") if p.is_dir()}
        for folder in folders:
            for skip_manifest in (False, True):
                inside = {
                    (rel if folder == "/" else rel[len(folder) :]): self._file_digest(side, rel)
                    for rel in mine
                    if (folder == "/" or rel.startswith(folder)) and self._covered(rel, folder, skip_manifest)
                }
                index.setdefault(digest_of(inside), set()).add((folder, skip_manifest))
        self._digests[side] = index
        return index


def part_of(rel: str) -> str:
    """The part a file belongs to: the first folder of its path ('.' for the root's files)."""
    return rel.split("/")[0] if "/" in rel else "."


def report(comparison: Comparison, show_benign: bool = False) -> dict[str, Counter]:
    """Print the table of counts per part and every file that is not fine; return the counts."""
    counts: dict[str, Counter] = {}
    problems, benign, intended = [], [], Counter()
    for rel in comparison.files:
        verdict = comparison.classify(rel)
        counts.setdefault(part_of(rel), Counter())[verdict.status] += 1
        if not verdict.fine:
            problems.append((rel, verdict))
        elif verdict.status == "benign":
            benign.append((rel, verdict))
        elif verdict.status == "intended":
            intended[verdict.why] += 1
    total: Counter = sum(counts.values(), Counter())
    print(f"| part | {' | '.join(STATUSES)} |")
    print(f"|---|{'---:|' * len(STATUSES)}")
    for part, counted in [*sorted(counts.items()), ("all", total)]:
        print(f"| {part} | {' | '.join(str(counted[s]) for s in STATUSES)} |")
    for why, files in sorted(intended.items()):
        print(f"\nintended: {files} file(s): {why}")
    if show_benign and benign:
        print("\nbenign:")
        for rel, verdict in benign:
            print(f"  {rel}: {verdict.why}")
    if problems:
        print("\nnot explained:")
        for rel, verdict in problems:
            print(f"  {verdict.status}: {rel}: {verdict.why}")
    return counts


def main(argv: list[str] | None = None) -> None:
    """Compare the two folders given; exit 1 when a file is unexplained or missing."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", type=Path, help="one identity_runs output folder (before)")
    parser.add_argument("b", type=Path, help="the other (after)")
    parser.add_argument("--benign", action="store_true", help="list each benign file with its reason")
    parser.add_argument("--intended", action="append", default=[], metavar="PATTERN=REASON",
                        help="files matching PATTERN changed on purpose, for REASON (repeatable)")
    args = parser.parse_args(argv)
    intended = dict(item.split("=", 1) for item in args.intended if "=" in item)
    if len(intended) != len(args.intended):
        raise SystemExit("--intended takes PATTERN=REASON")
    for folder in (args.a, args.b):
        if not folder.is_dir():
            raise SystemExit(f"{folder} is not a folder")
    counts = report(Comparison(args.a, args.b, intended), args.benign)
    bad = sum(c["unexplained"] + c["missing"] for c in counts.values())
    print(f"\n{bad} file(s) unexplained or missing" if bad else "\nno unexplained or missing file")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
