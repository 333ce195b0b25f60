"""Progress a log can show: with standard error not a terminal (a file, CI, nohup), a long stage prints a
plain line when it starts, at a steady interval while it runs and when it ends, each with done/total,
rate and time left."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from densekit import progress
from densekit.progress import INTERVAL_VARIABLE, progress_bar

# "stage: 3/10 30% · 12.5 it/s · 0:00:01 elapsed · ETA 0:00:02" (the rate once it is known)
_LINE = re.compile(r"^(?P<stage>[^:]+): (?P<done>\d+)/(?P<total>\d+) \d+% · ")


def _lines(text: str, stage: str) -> list[re.Match]:
    return [m for m in map(_LINE.match, text.splitlines()) if m and m.group("stage") == stage]


def test_a_stage_that_runs_past_the_interval_prints_lines_a_log_can_show(monkeypatch, capfd):
    monkeypatch.setattr(progress, "MIN_INTERVAL_S", 0.01)  # lines every 0.05 s, for a quick test
    monkeypatch.setenv(INTERVAL_VARIABLE, "0.05")
    with progress_bar("working", 8) as advance:
        for _ in range(8):
            time.sleep(0.03)
            advance(1)
    err = capfd.readouterr().err
    lines = _lines(err, "working")
    assert len(lines) >= 4, err  # at start, at least twice in 0.24 s every 0.05 s, at the end
    assert lines[0].group("done") == "0" and lines[-1].group("done") == "8"
    assert all(m.group("total") == "8" for m in lines)
    assert "\x1b[" not in err and "━" not in err  # plain text, no bar or terminal codes
    middle = [m.string for m in lines[1:-1]]
    assert any(re.search(r"\d+(\.\d+)? it/s", line) for line in middle), err  # a rate once it is known
    assert any(re.search(r"ETA \d+:\d\d:\d\d", line) for line in middle), err


def test_the_interval_is_checked(monkeypatch):
    monkeypatch.setenv(INTERVAL_VARIABLE, "soon")
    with pytest.raises(ValueError, match=f"{INTERVAL_VARIABLE}.*seconds"), progress_bar("working", 3):
        pass


def test_no_lines_when_progress_is_off(monkeypatch, capfd):
    monkeypatch.setenv(INTERVAL_VARIABLE, "0.01")
    with progress_bar("working", 3, enabled=False) as advance:
        advance(3)
    assert capfd.readouterr().err == ""


def test_the_bm25_command_with_its_output_in_a_file_logs_its_stages(beir_dir: Path, tmp_path: Path):
    log = tmp_path / "log.txt"
    env = {**os.environ, INTERVAL_VARIABLE: "1"}
    output = tmp_path / "run.trec"
    command = [sys.executable, "-m", "densekit", "bm25", str(beir_dir), "--output", str(output)]
    with log.open("w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=True, timeout=120)
    text = log.read_text()
    for stage in ("BM25 indexing", "BM25 search"):
        lines = _lines(text, stage)
        assert len(lines) >= 2, text  # at start and at the end
        assert lines[0].group("done") == "0" and lines[-1].group("done") == lines[-1].group("total")
