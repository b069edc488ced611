"""`git log --oneline` stays readable: every commit subject from the rule's start on is at
most 72 characters, the detail in the body (docs/development.md, Commits).

The rule holds from SINCE on; the history before it is left as it was written. A shallow
clone that lacks SINCE skips rather than guesses.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The commit that put every test under tests/<folder>/; subjects after it are checked.
SINCE = "3d7a038"
MAX_SUBJECT = 72


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
    )


def test_every_commit_subject_since_the_rule_is_at_most_72_characters() -> None:
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    if _git("cat-file", "-e", f"{SINCE}^{{commit}}").returncode != 0:
        pytest.skip(f"{SINCE} is not in this clone's history (a shallow clone)")
    log = _git("log", "--format=%h %s", f"{SINCE}..HEAD")
    assert log.returncode == 0, log.stderr
    long = [
        line
        for line in log.stdout.splitlines()
        if len(line.split(" ", 1)[1] if " " in line else "") > MAX_SUBJECT
    ]
    assert not long, (
        f"commit subjects over {MAX_SUBJECT} characters (shorten them with `git commit "
        "--amend` or `git rebase -i` before they land; the detail goes in the body):\n"
        + "\n".join(long)
    )
