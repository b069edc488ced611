"""Log lines stay whole where processes share one stderr (the supervisor's children do):
every line is one JSON object, whatever the others write at the same time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WRITER = """
import sys
from worker.base.logs import configure_logging
import structlog
configure_logging("json", "info")
log = structlog.get_logger("t")
for i in range(int(sys.argv[1])):
    log.info("line", writer=sys.argv[2], i=i, pad="x" * (i % 97))
"""


def test_lines_of_processes_sharing_a_stderr_never_join(tmp_path: Path) -> None:
    lines = 3000
    out = tmp_path / "shared.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    with out.open("wb") as shared:
        writers = [
            subprocess.Popen(
                [sys.executable, "-c", WRITER, str(lines), name],
                stderr=shared,
                env=env,
                cwd=ROOT,
            )
            for name in ("a", "b", "c")
        ]
        assert all(w.wait(timeout=120) == 0 for w in writers)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 * lines
    for name in ("a", "b", "c"):
        assert [r["i"] for r in records if r["writer"] == name] == list(range(lines))
