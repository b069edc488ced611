"""The JavaScript on the clients page reads embeddings as a Node client would: its functions,
taken from docs/clients.md as printed, run under `node` on bytes numpy wrote."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from tests.support.cli_runner import ROOT

CLIENTS = ROOT / "docs" / "clients.md"


def page_function(name: str) -> str:
    """The source of `function name(...) {...}` as the page prints it (up to the first line
    that closes it at the start of a line)."""
    text = CLIENTS.read_text()
    match = re.search(rf"^function {name}\(.*?^\}}$", text, re.M | re.S)
    assert match, f"docs/clients.md has no function {name}"
    return match.group(0)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_page_reads_an_embedding_as_numpy_wrote_it(dtype: str) -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(0, 1, 64).astype(dtype)
    # Every kind of half: zero and minus zero, subnormals, the largest, infinities, NaN.
    specials = np.array(
        [0.0, -0.0, 6e-8, -3e-5, 65504.0, np.inf, -np.inf, np.nan, 1 / 3], dtype=dtype
    )
    vector = np.concatenate([values, specials]).astype("<" + np.dtype(dtype).str[1:])
    script = "\n".join(
        [
            page_function("float16s"),
            page_function("embedding"),
            f"const fields = {{ embedding: Buffer.from({json.dumps(vector.tobytes().hex())}, "
            f"'hex'), dtype: Buffer.from({json.dumps(dtype)}) }};",
            "console.log(JSON.stringify(Array.from(embedding(fields), String)));",
        ]
    )
    node = shutil.which("node")
    assert node is not None
    done = subprocess.run(
        [node, "-e", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    got = np.array([float(v) for v in json.loads(done.stdout)], dtype=np.float64)
    want = vector.astype(np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # exact: every half is a float32 value
