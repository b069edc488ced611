"""The GPU check's own steps, rehearsed where only a GPU host's packages are.

A GPU host is lent rarely and for minutes; these tests run what `make gpu-check` runs before
it needs the GPU (scripts/gpu_host_rehearsal.py: the carry installed and proven, the carried
redis-server, the CUDA tests collected by the check's own pytest command line, its entry
points started) in an environment with exactly the host's packages and the carry, so that
a run there can fail only on what the GPU does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_host_rehearsal  # noqa: E402

from measure.gpu_check.carry import verify  # noqa: E402

pytestmark = pytest.mark.slow

GPU_HOST_FOLDERS = (ROOT / "shared" / "gpu-host", ROOT.parent / "shared" / "gpu-host")


def gpu_host_folder() -> Path | None:
    for folder in (*GPU_HOST_FOLDERS, Path("/work/shared/gpu-host")):
        if (folder / "redis" / "redis-server").is_file():
            return folder
    return None


def cuda_tests() -> list[str]:
    lines = (ROOT / "tests" / "cuda_tests.txt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


@dataclass
class Rehearsal:
    rc: int
    output: str
    work: Path
    summary: dict[str, object]


def rehearse(*argv: str, script: Path, work: Path) -> Rehearsal:
    done = subprocess.run(
        [sys.executable, str(script), "--work", str(work), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    summary_file = work / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return Rehearsal(done.returncode, done.stdout + done.stderr, work, summary)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> Rehearsal:
    if gpu_host_folder() is None:
        pytest.skip("no gpu-host folder (shared/gpu-host with redis/) next to the checkout")
    work = tmp_path_factory.mktemp("rehearsal")
    return rehearse(script=ROOT / "scripts" / "gpu_host_rehearsal.py", work=work)


def test_the_gpu_check_s_own_steps_pass_where_only_the_gpu_host_s_packages_are(
    rehearsal: Rehearsal,
) -> None:
    assert rehearsal.rc == 0, rehearsal.output[-4000:]
    listed = cuda_tests()
    modules = {test.split("::")[0] for test in listed}
    assert (
        f"{len(listed)} of {len(listed)} CUDA tests collected from {len(modules)} modules"
        in rehearsal.output
    ), rehearsal.output[-4000:]
    wheels = sorted((rehearsal.work / "carry" / "wheels").glob("*.whl"))
    assert f"carry: {len(wheels)} wheels installed in" in rehearsal.output


def test_the_carry_fits_what_may_travel_to_a_gpu_host(rehearsal: Rehearsal) -> None:
    carry_kib = rehearsal.summary["carry_kib"]
    assert isinstance(carry_kib, int) and carry_kib > 0
    limit_kib = gpu_host_rehearsal.CARRY_LIMIT_MIB * 1024
    spare_mib = (limit_kib - carry_kib) / 1024
    assert carry_kib <= limit_kib, (
        f"the GPU host's carry is {carry_kib / 1024:.1f} MiB, {-spare_mib:.1f} MiB over the "
        f"{gpu_host_rehearsal.CARRY_LIMIT_MIB} MiB limit"
    )
    assert f"{spare_mib:.1f} MiB under the 64 MiB limit" in rehearsal.output


def test_the_host_environment_lends_nothing_of_the_development_one(
    rehearsal: Rehearsal,
) -> None:
    """What the GPU host has imports there; what only this virtualenv has does not, so a
    test module that needs it fails the rehearsal instead of the GPU run."""
    python = rehearsal.work / "host-env" / "bin" / "python"
    probe = (
        "import importlib.util, json; "
        "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in "
        "['torch', 'torchvision', 'numpy', 'PIL', 'msgpack', 'psutil', "
        "'hypothesis', 'pyarrow', 'aiohttp', 'pytest', 'simplejpeg', 'redis', 'moto']}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    done = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, check=True, env=env
    )
    found = json.loads(done.stdout)
    host = ("torch", "torchvision", "numpy", "PIL", "msgpack", "psutil")
    assert {m: found[m] for m in host} == dict.fromkeys(host, True)
    dev_only = ("hypothesis", "pyarrow", "aiohttp", "pytest", "simplejpeg", "redis", "moto")
    assert {m: found[m] for m in dev_only} == dict.fromkeys(dev_only, False)


def test_the_host_packages_are_the_ones_the_gpu_host_folder_lists() -> None:
    folder = gpu_host_folder()
    if folder is None:
        pytest.skip("no gpu-host folder next to the checkout")
    readme = (folder / "README.md").read_text()
    found = re.search(
        r"\n\s*and put SITE on PYTHONPATH\. (.*?) are already on that host", readme, re.S
    )
    assert found, "the gpu-host README no longer lists the host's packages in one sentence"
    names = re.split(r",\s*|\s+and\s+", " ".join(found.group(1).split()))
    listed = {gpu_host_rehearsal.normalize(n) for n in names if n}
    # torch is the host's own (its Python and PyTorch head the README), pip installs the carry.
    ours = set(gpu_host_rehearsal.HOST_PACKAGES) - {"torch", "pip"}
    assert ours == listed


def test_a_carried_wheel_lost_and_a_module_the_host_lacks_are_named(
    rehearsal: Rehearsal, tmp_path: Path
) -> None:
    """The same steps in a copy of the checkout: simplejpeg is gone from the carry (over
    a site a stale install left with only its stamp), and one more CUDA test module imports
    pyarrow, which the host has not. The site is installed again and proven; then each
    module that cannot be collected is named with the module it lacks, and the run fails."""
    assert rehearsal.rc == 0
    copy = tmp_path / "checkout"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    (copy / "tests" / "test_needs_pyarrow.py").write_text(
        "import pyarrow\nimport pytest\n\n\n@pytest.mark.cuda\ndef test_x() -> None:\n"
        "    assert pyarrow\n"
    )
    with (copy / "tests" / "cuda_tests.txt").open("a") as listed:
        listed.write("tests/test_needs_pyarrow.py::test_x\n")
    carry = tmp_path / "carry"
    shutil.copytree(rehearsal.work / "carry-prepared", carry, copy_function=os.link)
    for wheel in (carry / "wheels").glob("simplejpeg-*.whl"):
        wheel.unlink()
    (carry / "site").mkdir()
    (carry / "site" / ".installed").touch()
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env.update(
        PYTHON=str(rehearsal.work / "host-env" / "bin" / "python"),
        GPU_CHECK_DIR=str(carry),
        GPU_CHECK_OUT=str(tmp_path / "out"),
    )
    done = subprocess.run(
        ["bash", str(copy / "scripts" / "gpu-check.sh"), "--rehearse"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    wheels = len(list((carry / "wheels").glob("*.whl")))
    assert f"carry: {wheels} wheels installed in {carry / 'site'}" in output
    lacks = "which the GPU host lacks (carry it: scripts/gpu-host-carry.txt)"
    assert f"tests/test_needs_pyarrow.py imports 'pyarrow', {lacks}" in output
    assert f"tests/pipeline/test_cuda.py imports 'simplejpeg', {lacks}" in output
    assert "python -m measure.gpu_check.check does not start" in output
    assert "gpu-check rehearsal: FAILED" in output


def _wheel(folder: Path, name: str, version: str, module: str) -> Path:
    """A minimal wheel of one module, as pip installs it."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{module}.py", "VALUE = 1\n")
        archive.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(
            f"{info}/RECORD", f"{module}.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n"
        )
    return path


def test_the_carry_proof_names_a_wheel_not_installed_and_a_module_gone(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    kept = _wheel(wheels, "rehearsal_kept", "1.0", "rehearsal_kept_mod")
    lost = _wheel(wheels, "rehearsal_lost", "2.0", "rehearsal_lost_mod")
    site = tmp_path / "site"
    # An empty site (what a stale install stamp used to vouch for) proves nothing.
    site.mkdir()
    ok, problems = verify(site, [kept, lost])
    assert ok == [] and len(problems) == 2
    assert (
        "rehearsal-kept 1.0 (rehearsal_kept-1.0-py3-none-any.whl) is not installed" in problems[0]
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--disable-pip-version-check", "--target", str(site), str(kept), str(lost)],
        check=True, capture_output=True,
    )  # fmt: skip
    (site / "rehearsal_lost_mod.py").unlink()
    sys.path.insert(0, str(site))
    try:
        ok, problems = verify(site, [kept, lost])
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("rehearsal_kept_mod", None)
    assert ok == ["rehearsal-kept 1.0 (rehearsal_kept_mod)"]
    assert problems == [
        "rehearsal-lost 2.0: module 'rehearsal_lost_mod' does not import: "
        "ModuleNotFoundError: No module named 'rehearsal_lost_mod'"
    ]
