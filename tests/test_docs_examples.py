"""The docs paste: every fenced code block of README.md and docs/*.md is run, parsed or marked.

What each block gets, by its language:

- `bash`, `sh`, `shell`, `console` (`$ ` prompts; the other lines are output) and `python` blocks run
  in a fresh copy of a small workspace laid out as a newcomer's clone is: the repository root as the
  working folder and the shared collections beside it in `../shared/data/{scifact,nfcorpus,vaswani,
  cranfield}`, so the commands run exactly as printed. What they run on is small (see SUBSTITUTES):
  each collection is a tiny synthetic one (TOPICS below), and `sentence-transformers/all-MiniLM-L6-v2`
  is a folder of that name in the working folder holding the tests' tiny random sentence-transformers
  model (an existing folder wins over the bundled model, as for any name); `recipes/` and `benchmarks/`
  are the repository's. The workspace already holds what the README's pipeline makes (PREPARED), `$D`
  is set as the README sets it, and `~` is the workspace's own home. Their `densekit` commands and
  Python scripts start warm, with torch and transformers already imported (tests/warm_command.py).
- `yaml` and `json` blocks must parse.
- Any block may instead carry `<!-- not-run: REASON -->` on the line right before its opening fence: it
  is skipped, and its reason shown. A block in another language (a layout, an output) must carry it.
- docs/design.md's `<!-- example: NAME -->` blocks are checked by tests/test_architecture.py.

A `densekit serve` in a shell block is started in the background on a free port (the block's
`127.0.0.1:8000` is that port) and stopped when the block ends, once it has answered `/health`. A Python
block that talks to `http://127.0.0.1:8000` gets a service started as docs/serving.md starts one, with
the served model name `minilm`, the corpus and the token in `~/.densekit-token`.

`python tests/test_docs_examples.py` lists every block and what the check does with it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from .warm_command import WarmCommand

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console"}
PARSED = {"yaml", "yml", "json"}
NOT_RUN = re.compile(r"^\s*<!-- not-run: (?P<reason>\S.*?) -->\s*$")
DESIGN_EXAMPLE = re.compile(r"^<!-- example: (?P<name>.+?) -->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<language>[\w+-]*)")
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
COLLECTIONS = ["scifact", "nfcorpus", "vaswani", "cranfield"]
TOKEN_FILE = ".densekit-token"  # in the workspace's home, as the docs use `~/.densekit-token`
DOCS_PORT = "127.0.0.1:8000"
SUBSTITUTES = {
    "../shared/data/<name>": "a tiny synthetic collection of that name (TOPICS: 120 documents, 80 queries)",
    MINILM: "the tiny random sentence-transformers model (tests/conftest.py), a folder of that name",
    "~": "the workspace's home, holding the token file ~/.densekit-token",
    "$D": "../shared/data/scifact, as the README's pipeline sets it",
    "http://127.0.0.1:8000": "a service on a free port, started as docs/serving.md starts one",
}
# what the README's pipeline (and its first mining command) leave in runs/, made before any block runs
PREPARED = [
    "densekit bm25 $D --split test -o runs/bm25.trec",
    f"densekit encode {MINILM} $D -o runs/emb",
    "densekit index runs/emb -o runs/index --type flat",
    f"densekit search {MINILM} runs/index $D --split test -o runs/dense.trec",
    "densekit mine $D --split train -o runs/train.jsonl --source bm25 --ranks 10-200 --count 30",
]
TIMEOUT = 420  # seconds for one block: generous, for a machine shared with other work
# the service the Python examples of docs/serving.md talk to, started as that page starts it
SERVICE = (
    f"serve {MINILM} runs/index --corpus ../shared/data/scifact --served-model-name minilm "
    f"--api-key-file ../home/{TOKEN_FILE} --device cpu"
)


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # of the opening fence, from 1
    language: str
    text: str
    before: str  # the line right before the opening fence

    @property
    def where(self) -> str:
        """The block's page and line, as an editor takes them."""
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        """The reason the block is not run, where it is marked so."""
        found = NOT_RUN.match(self.before)
        return found["reason"] if found else None

    @property
    def design_example(self) -> str | None:
        """The name docs/design.md's test_architecture checks the block by, where it has one."""
        found = DESIGN_EXAMPLE.match(self.before.strip())
        return found["name"] if found and self.page.name == "design.md" else None


def blocks(page: Path) -> Iterator[Block]:
    """Every fenced code block of `page` (Markdown's ``` and ~~~ fences, indented or not)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if not opening:
            number += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = number + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence)}{fence[0]}*\s*$", lines[end]):
            end += 1
        body = [line.removeprefix(indent) for line in lines[number + 1 : end]]
        before = lines[number - 1] if number else ""
        yield Block(page, number + 1, opening["language"].lower(), "\n".join(body) + "\n", before)
        number = end + 1


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]


def what_is_done(block: Block) -> str:
    """What the check does with `block`, in a few words."""
    if block.not_run:
        return f"not run: {block.not_run}"
    if block.design_example:
        return f"checked by tests/test_architecture.py ({block.design_example})"
    if block.language in SHELLS or block.language == "python":
        return "run"
    if block.language in PARSED:
        return "parsed"
    return "refused: no not-run marker"


# ---------------------------------------------------------------------------------------------------
# the workspace


def _topic_collection(root: Path, name: str) -> Path:
    """A tiny collection at `root`: 40 topics of 3 documents, a test and a train query each.

    One document has SciFact's id 4983, which docs/serving.md fetches.
    """
    from .conftest import write_beir

    corpus, queries, qrels = [], [], {"test": [], "train": []}
    for t, (a, b) in enumerate(TOPICS):
        for d in range(3):
            doc_id = "4983" if (t, d) == (0, 0) else f"{name[:2]}{t}d{d}"
            text = (
                f"A note on {a} and {b}, part {d}: how {a} relates to {b} and what {b} means for {a} today."
            )
            corpus.append({"_id": doc_id, "title": f"{a} {b}", "text": text})
        for split in qrels:
            queries.append({"_id": f"{split[:2]}{t}", "text": f"what about {a} and {b}"})
            qrels[split].append((f"{split[:2]}{t}", corpus[-3 + (split == "train")]["_id"], 1))
    return write_beir(root, corpus, queries, qrels)


_WORDS = "statins myopathy volcano lava python code kitten purr bank loan goal match rain cloud piano chord"
_WORDS += " bread oven moon orbit doctor patient railway station forest leaf river bridge"
WORDS = _WORDS.split(" ")
TOPICS = [(WORDS[i % len(WORDS)], WORDS[(i * 7 + 3) % len(WORDS)]) for i in range(40)]


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(workspace: Path, first_on_path: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment a block runs in: this virtualenv's commands first (after `first_on_path`, where
    given), the workspace's home, no hub."""
    names = {name: value for name, value in os.environ.items() if name != "DENSEKIT_API_KEY"}
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    names.update(
        PATH=f"{first_on_path}{os.pathsep}{path}" if first_on_path else path,
        HOME=str(workspace / "home"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        D="../shared/data/scifact",
        COLUMNS="120",
        **extra,
    )
    return names


def run_shell(
    script: str, workspace: Path, first_on_path: Path | None = None, timeout: float = TIMEOUT, **extra: str
) -> subprocess.CompletedProcess:
    """Run `script` with bash (stopping at the first failing command) in the workspace's repository,
    with the commands of `first_on_path` (where given) before the virtualenv's."""
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=workspace / "repo",
        env=environment(workspace, first_on_path, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _run_in_this_process(commands: list[str], folder: Path) -> None:
    """Run `densekit` commands in `folder` through the command line's app, in this process (whose torch
    is already imported: a command's own process would spend seconds importing it again)."""
    from typer.testing import CliRunner

    from densekit.cli.main import app

    here = Path.cwd()
    os.chdir(folder)
    try:
        for command in commands:
            words = command.replace("$D", "../shared/data/scifact").split()[1:]
            done = CliRunner().invoke(app, words)
            assert done.exit_code == 0, (
                f"preparing the docs workspace: {command}: {done.output}{done.exception}"
            )
    finally:
        os.chdir(here)


def make_workspace(workspace: Path, model: Path) -> Path:
    """Lay out a workspace at `workspace`: repo/ (the working folder, with the model folder, recipes,
    benchmarks and what PREPARED makes in runs/), shared/data/ and home/ (with the token file)."""
    for name in COLLECTIONS:
        _topic_collection(workspace / "shared" / "data" / name, name)
    shutil.copytree(model, workspace / "repo" / MINILM)
    for shared in ("recipes", "benchmarks"):
        (workspace / "repo" / shared).symlink_to(ROOT / shared)
    (workspace / "home").mkdir()
    (workspace / "home" / TOKEN_FILE).write_text("docs-check-token-0123456789abcdef\n")
    _run_in_this_process(PREPARED, workspace / "repo")
    return workspace


@pytest.fixture(scope="session")
def prepared_workspace(tmp_path_factory: pytest.TempPathFactory, tiny_st_model: Path) -> Path:
    """The workspace every block runs in, as made once. Artefacts record where their inputs were, so a
    block runs in this very folder, laid anew from a copy as made."""
    workspace = make_workspace(tmp_path_factory.mktemp("docs-workspace"), tiny_st_model)
    shutil.copytree(workspace, workspace.with_name(workspace.name + "-as-made"), symlinks=True)
    return workspace


@pytest.fixture
def workspace(prepared_workspace: Path) -> Path:
    """The prepared workspace, laid anew from its copy as made (the blocks of one worker run in turn)."""
    shutil.rmtree(prepared_workspace)
    shutil.copytree(
        prepared_workspace.with_name(prepared_workspace.name + "-as-made"), prepared_workspace, symlinks=True
    )
    return prepared_workspace


@pytest.fixture(scope="session")
def warm_densekit(
    prepared_workspace: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WarmCommand]:
    """`densekit` for the shell blocks, started warm (tests/warm_command.py): the server runs in the
    environment the blocks run in."""
    warm = WarmCommand(tmp_path_factory.mktemp("warm-densekit"), environment(prepared_workspace))
    yield warm
    warm.stop()


@pytest.fixture(scope="session")
def docs_service(
    tmp_path_factory: pytest.TempPathFactory, tiny_st_model: Path, warm_densekit: WarmCommand
) -> Iterator[str]:
    """`densekit serve` as docs/serving.md starts it (warm), over a workspace of its own (the blocks' is
    laid anew under them); yields its host:port."""
    import httpx

    own_workspace = make_workspace(tmp_path_factory.mktemp("docs-service"), tiny_st_model)

    port = free_port()
    command = [str(warm_densekit.bin / "densekit"), *SERVICE.split(), "--port", str(port)]
    log = own_workspace / "serve.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=own_workspace / "repo", env=environment(own_workspace), stdout=output, stderr=output
        )
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://{address}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if process.poll() is not None:
                    raise AssertionError(f"the docs' service did not start:\n{log.read_text()}") from None
                time.sleep(0.1)
        else:
            raise AssertionError(f"the docs' service did not answer /health:\n{log.read_text()}")
        yield address
    finally:
        process.terminate()
        process.wait(timeout=60)


# A shell function in front of the `densekit` command: `serve` runs in the background on the block's port
# until the block ends, and the block goes on once the service answers /health.
SERVE_IN_BACKGROUND = r"""
densekit() {
  if [ "${1:-}" != serve ]; then command densekit "$@"; return; fi
  command densekit "$@" --port "$DOCS_CHECK_PORT" > "$HOME/serve.log" 2>&1 &
  DOCS_CHECK_SERVER=$!
  trap 'kill $DOCS_CHECK_SERVER 2>/dev/null; wait $DOCS_CHECK_SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    if curl -s -o /dev/null "http://127.0.0.1:$DOCS_CHECK_PORT/health"; then return 0; fi
    if ! kill -0 $DOCS_CHECK_SERVER 2>/dev/null; then cat "$HOME/serve.log" >&2; return 1; fi
    sleep 0.1
  done
  echo "densekit serve did not answer /health" >&2; return 1
}
"""


def shell_script(block: Block) -> str:
    """The commands of a shell block, with the port mapping and a background `serve`."""
    text = block.text
    if block.language == "console":  # commands after `$ `; the other lines are what they print
        text = "\n".join(line[2:] for line in text.splitlines() if line.startswith("$ ")) + "\n"
    return SERVE_IN_BACKGROUND + text.replace(DOCS_PORT, "127.0.0.1:$DOCS_CHECK_PORT")


def failure(block: Block, result: subprocess.CompletedProcess) -> str:
    """The message for a block that failed: where it is, its exit status and the end of its output."""
    output = (result.stdout + result.stderr)[-4000:]
    return (
        f"{block.where}: the {block.language} example exits {result.returncode}:\n{block.text}\n---\n{output}"
    )


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[f"{b.where} {b.language or 'plain'}" for b in ALL_BLOCKS])
def test_docs_example(block: Block, request: pytest.FixtureRequest) -> None:
    if block.not_run:
        pytest.skip(f"{block.where} not run: {block.not_run}")
    if block.design_example:
        architecture = (ROOT / "tests" / "test_architecture.py").read_text(encoding="utf-8")
        assert f'design_example("{block.design_example}")' in architecture, (
            f"{block.where}: tests/test_architecture.py checks no example {block.design_example!r}"
        )
        return
    if block.language in PARSED:
        try:
            (json.loads if block.language == "json" else yaml.safe_load)(block.text)
        except (ValueError, yaml.YAMLError) as err:
            pytest.fail(f"{block.where}: the {block.language} example does not parse: {err}")
        return
    if block.language in SHELLS:
        workspace, warm = request.getfixturevalue("workspace"), request.getfixturevalue("warm_densekit")
        result = run_shell(shell_script(block), workspace, warm.bin, DOCS_CHECK_PORT=str(free_port()))
        assert result.returncode == 0, failure(block, result)
        return
    if block.language == "python":
        workspace = request.getfixturevalue("workspace")
        text = block.text
        if f"http://{DOCS_PORT}" in text:
            text = text.replace(DOCS_PORT, request.getfixturevalue("docs_service"))
        (workspace / "example.py").write_text(text, encoding="utf-8")
        result = subprocess.run(
            [request.getfixturevalue("warm_densekit").python, "../example.py"],
            cwd=workspace / "repo",
            env=environment(workspace),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert result.returncode == 0, failure(block, result)
        return
    pytest.fail(
        f"{block.where}: a {block.language or 'plain'} block is neither run nor parsed here: put "
        "`<!-- not-run: REASON -->` on the line before it"
    )


def test_every_page_has_its_blocks_found() -> None:
    # the fences are read as Markdown reads them: as many opening as closing fences on every page
    for page in PAGES:
        fences = [line for line in page.read_text(encoding="utf-8").splitlines() if FENCE.match(line)]
        assert len(fences) == 2 * len(list(blocks(page))), page


def test_help_shows_flags_without_a_value() -> None:
    # a flag (`--verbose`, `--overwrite`, `--help`) takes no value, so its help row names no type
    shown = [
        subprocess.run(
            [sys.executable, "-m", "densekit", *command, "--help"],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
            timeout=60,
        ).stdout
        for command in ([], ["encode"], ["modules", "route"])
    ]
    assert all("--help" in text for text in shown)
    assert [line for text in shown for line in text.splitlines() if "<bool>" in line] == []


if __name__ == "__main__":
    for found in ALL_BLOCKS:
        print(f"{found.where:28} {found.language or 'plain':8} {what_is_done(found)}")
