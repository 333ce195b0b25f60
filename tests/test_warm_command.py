"""The warm `densekit` of the docs check (tests/warm_command.py) behaves as the real command: same
output, error and exit status, its own folder and environment, and the signals sent to it reach the
command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .warm_command import WarmCommand

SLEEPER = """
import os, signal, sys, time
from pathlib import Path
def stop(number, frame):
    Path("stopped").write_text(os.environ["WHO"])
    sys.exit(7)
signal.signal(signal.SIGTERM, stop)
Path("started").write_text(str(os.getpid()))
time.sleep(60)
"""


CAPTURED = {"capture_output": True, "text": True, "timeout": 120}


def outcome(done: subprocess.CompletedProcess) -> tuple[int, str, str]:
    """A command's exit status and what it printed on stdout and stderr."""
    return done.returncode, done.stdout, done.stderr


def test_the_warm_command_answers_as_the_real_one_and_passes_on_signals(beir_dir: Path, tmp_path: Path):
    warm = WarmCommand(tmp_path / "warm", dict(os.environ))
    try:
        codes = []
        for args in (["validate", str(beir_dir)], ["validate", str(tmp_path / "absent")], ["bogus"]):
            real = subprocess.run([Path(sys.executable).parent / "densekit", *args], **CAPTURED)
            warmed = subprocess.run([warm.bin / "densekit", *args], **CAPTURED)
            assert outcome(warmed) == outcome(real)
            codes.append(warmed.returncode)
        assert codes[0] == 0 and 0 not in codes[1:]

        folder = tmp_path / "work"
        folder.mkdir()
        (folder / "sleeper.py").write_text(SLEEPER)
        client = subprocess.Popen([warm.python, "sleeper.py"], cwd=folder, env={**os.environ, "WHO": "warm"})
        while not (folder / "started").exists():
            assert client.poll() is None, "the script did not start"
            time.sleep(0.05)
        assert int((folder / "started").read_text()) != client.pid  # a process of its own
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=30) == 7
        assert (folder / "stopped").read_text() == "warm"  # in its folder, with its environment
    finally:
        warm.stop()
