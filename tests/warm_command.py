"""A `densekit` command that starts warm, for tests that run the command line many times in a shell.

Each `densekit` process spends about 10 s of the 2-core CI machine importing torch and transformers
before it does anything. Here a server imports them once (`PRELOAD`, no densekit module among them)
and forks a child for every command; `densekit` on the shell's PATH is a small client (standard
library only) that hands the child its arguments, working folder, environment and standard streams,
passes on the signals the shell sends it (`kill`, Ctrl-C), and exits with the child's status. The
child imports densekit itself and runs the command line's own entry point, so what runs is the command
as a user runs it, in a process of its own; only the libraries' import is shared. A second client runs
`python SCRIPT` the same way, for the docs' Python examples.

Where the server is not running, the client runs the real `densekit` in its place.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import uuid
from pathlib import Path

PRELOAD = [
    "numpy",
    "torch",
    "transformers",
    "transformers.models.bert.modeling_bert",
    "faiss",
    "safetensors.torch",
]
LENGTH = struct.Struct("!I")
STATUS = struct.Struct("!i")

CLIENT = """\
import json, os, signal, socket, struct, sys

ADDRESS, PROGRAM, REAL = {address!r}, {program!r}, {real!r}


def received(connection, size):
    data = b""
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            return None
        data += more
    return data


connection = socket.socket(socket.AF_UNIX)
try:
    connection.connect(ADDRESS)
except OSError:
    os.execv(REAL, [REAL, *sys.argv[1:]])
request = json.dumps({{"argv": [PROGRAM, *sys.argv[1:]], "cwd": os.getcwd(), "env": dict(os.environ)}})
payload = request.encode("utf-8", "surrogateescape")
socket.send_fds(connection, [struct.pack("!I", len(payload))], [0, 1, 2])
connection.sendall(payload)
child = received(connection, 4)
if child is None:
    sys.exit(f"{{PROGRAM}}: the warm command server closed the connection")


def pass_on(number, frame, pid=struct.unpack("!i", child)[0]):
    try:
        os.kill(pid, number)
    except ProcessLookupError:  # it has just ended: its status is on its way
        pass


for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(number, pass_on)
status = received(connection, 4)
sys.exit(1 if status is None else struct.unpack("!i", status)[0])  # no status: the child was killed
"""


def _received(connection: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes from `connection`."""
    data = b""
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            raise ConnectionError("the client went away")
        data += more
    return data


def _run(argv: list[str]) -> None:
    """`densekit ARGS` as the command line's entry point runs it; `python SCRIPT ARGS` as Python runs a
    script (its folder first on the module path, run as `__main__`)."""
    if argv[0] == "python":
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
        runpy.run_path(argv[1], run_name="__main__")
        return
    from densekit.cli.main import main

    sys.argv = argv
    main()


def _run_child(connection: socket.socket) -> None:
    """Serve one request in this forked child: take on the client's streams, folder, environment and
    arguments, run the program, report its status to the client, and exit with it."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    header, streams, _, _ = socket.recv_fds(connection, LENGTH.size, 3)
    request = json.loads(_received(connection, LENGTH.unpack(header)[0]).decode("utf-8", "surrogateescape"))
    for number, stream in enumerate(streams):
        os.dup2(stream, number)
        os.close(stream)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    outcome = {"status": 1}
    # registered first, so it runs last: after every exit handler the command registers
    atexit.register(lambda: connection.sendall(STATUS.pack(outcome["status"])))
    connection.sendall(STATUS.pack(os.getpid()))
    try:
        _run(request["argv"])
        outcome["status"] = 0
    except SystemExit as done:
        code = done.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
        outcome["status"] = 0 if code is None else code if isinstance(code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(outcome["status"])


def serve(name: str) -> None:
    """Import `PRELOAD`, listen at the abstract socket `name` (Linux's: no file, no limit on the folder's
    path length), say `ready` on standard output, then fork a child for each connection until killed."""
    for module in PRELOAD:
        importlib.import_module(module)
    sys.path[0] = str(Path(sys.executable).parent)  # as in `densekit`'s own process: its script's folder
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    server = socket.socket(socket.AF_UNIX)
    server.bind(f"\0{name}")
    server.listen(64)
    print("ready", flush=True)
    while True:
        connection, _ = server.accept()
        if os.fork() == 0:
            server.close()
            _run_child(connection)
        connection.close()


class WarmCommand:
    """The server, started with `environment`, and its clients: `folder`/bin/densekit (put `bin` first on
    a shell's PATH) and `folder`/python, which runs `python SCRIPT ARGS`."""

    def __init__(self, folder: Path, environment: dict[str, str]):
        self.folder, self.bin = folder, folder / "bin"
        self.bin.mkdir(parents=True)
        name = f"densekit-warm-{uuid.uuid4().hex}"
        for program, real in (
            ("densekit", Path(sys.executable).parent / "densekit"),
            ("python", sys.executable),
        ):
            client = (self.bin if program == "densekit" else folder) / program
            # -S: the client needs nothing beyond the standard library, and starts in a few milliseconds
            text = CLIENT.format(address=f"\0{name}", program=program, real=str(real))
            client.write_text(f"#!{sys.executable} -S\n{text}")
            client.chmod(0o755)
        self.process = subprocess.Popen(
            [sys.executable, __file__, name], env=environment, stdout=subprocess.PIPE, text=True
        )
        if self.process.stdout.readline().strip() != "ready":
            self.process.kill()
            raise RuntimeError("the warm densekit server did not start")

    @property
    def python(self) -> Path:
        """The client that runs `python SCRIPT ARGS` warm."""
        return self.folder / "python"

    def stop(self) -> None:
        """Stop the server (children still running go on to their end)."""
        self.process.kill()
        self.process.wait()


if __name__ == "__main__":
    serve(sys.argv[1])
