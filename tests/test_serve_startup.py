"""`densekit serve` checks its paths, flags and token before importing torch or loading the model: a
mistyped folder or a public address without a token is refused in one line, at once; so do the commands
that load a model (`encode` and `search` here) for a mistyped model, data or module folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Runs `densekit` once for each argument list read as JSON from standard input, with `import torch`
# refused, so that a check made only after torch was imported shows as this error instead of the check's
# own; prints each run's exit status and standard error as JSON. One process for every case, for speed.
_WITHOUT_TORCH = """
import contextlib, io, json, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported before the arguments were checked")
        return None

sys.meta_path.insert(0, NoTorch())
from densekit.cli.main import main

results = []
for args in json.load(sys.stdin):
    sys.argv, err = ["densekit", *args], io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code
        except BaseException as problem:
            code, _ = 1, err.write(repr(problem))
    results.append({"code": code, "stderr": err.getvalue(), "torch": "torch" in sys.modules})
print(json.dumps(results))
"""

# name: (the arguments of `densekit`, split at spaces; words its error must hold)
_CASES = {
    "mistyped index": ("serve {model} {index}x", ["{index}x", "index folder not found"]),
    "no index": ("serve {model} {data}", ["{data}", "not an index folder"]),
    "mistyped model": ("serve {empty}/model {index}", ["{empty}/model", "no such folder"]),
    "public host": ("serve {model} {index} --host 0.0.0.0", ["--host 0.0.0.0", "token"]),
    "no corpus": ("serve {model} {index} --corpus {empty}", ["{empty}", "no corpus found"]),
    "no module": ("serve {model} {index} --module {empty}/adapter", ["adapter", "module folder not found"]),
    "module index form": (
        "serve {model} {index} --module-index name",
        ["--module-index name", "MODULE_DIR="],
    ),
    "module index module": (
        "serve {model} {index} --module-index {empty}/adapter={index}",
        ["adapter", "module folder not found"],
    ),
    "module index index": (
        "serve {model} {index} --module-index {empty}={empty}/other",
        ["other", "index folder not found"],
    ),
    "backend": ("serve {model} {index} --backend tensorrt", ["--backend tensorrt", "onnx or openvino"]),
    "int8 on torch": ("serve {model} {index} --precision int8", ["--precision int8", "--backend onnx"]),
    "bf16 on onnx": ("serve {model} {index} --backend onnx --precision bf16", ["float32 or int8, not bf16"]),
    "unknown precision": ("serve {model} {index} --precision double", ["--precision double"]),
    "encode: mistyped model": (
        "encode {empty}/model {data} --output {empty}/emb",
        ["{empty}/model", "no such folder"],
    ),
    "encode: mistyped data": ("encode {model} {data}x --output {empty}/emb", ["{data}x", "not a folder"]),
    "encode: mistyped module": (
        "encode {model} {data} --output {empty}/emb --module {empty}/adapter",
        ["--module", "module folder not found"],
    ),
    "search: mistyped index": (
        "search {model} {index}x {data} --output {empty}/run.trec",
        ["{index}x", "index folder not found"],
    ),
    "search: mistyped data": (
        "search {model} {index} {data}x --output {empty}/run.trec",
        ["{data}x", "not a folder"],
    ),
    "search: mistyped model": (
        "search {empty}/model {index} {data} --output {empty}/run.trec",
        ["{empty}/model", "no such folder"],
    ),
}


@pytest.fixture(scope="module")
def refusals(served: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each case of `_CASES` run (in one process without torch), by name, with its expected words."""
    data, index, model = served
    given = {"data": data, "index": index, "model": model, "empty": tmp_path_factory.mktemp("empty")}
    runs = [args.format(**given).split(" ") for args, _ in _CASES.values()]
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], input=json.dumps(runs), capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    results = json.loads(done.stdout)
    return {
        name: {**result, "words": [word.format(**given) for word in words]}
        for (name, (_, words)), result in zip(_CASES.items(), results, strict=True)
    }


@pytest.mark.parametrize("case", list(_CASES))
def test_a_bad_path_or_option_is_refused_in_one_line_before_torch(refusals: dict[str, dict], case: str):
    result = refusals[case]
    assert result["code"] == 2, result["stderr"]
    assert not result["torch"] and "torch imported" not in result["stderr"], result["stderr"]
    assert len(result["stderr"].strip().splitlines()) == 1, result["stderr"]
    for word in result["words"]:
        assert word in result["stderr"], result["stderr"]


def test_the_claimed_port_answers_without_nagles_delay():
    """The socket `serve` claims before loading is the one uvicorn serves on: its connections must get
    TCP_NODELAY from asyncio, or every response's body waits for the client's delayed acknowledgement
    (a single client's p50 was 60 ms for 11 ms of work)."""
    import asyncio
    import socket

    from densekit.cli.serve_command import claim_port

    async def nodelay_of_an_accepted_connection() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connection = writer.get_extra_info("socket")
            accepted.set_result(connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = claim_port("127.0.0.1", 0)
        server = await asyncio.start_server(on_connection, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
        return value

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0
