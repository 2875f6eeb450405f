"""benchmarks/gpu_check.sh and the GPU benchmarks' plumbing, on a machine without a GPU: the
preflight stops with one line naming what is missing (a requirement, a wheel, a C compiler, a
GPU) before any tier runs, and a benchmark never blocks on its child's output."""

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch
from conftest import ROOT

CHECK = ROOT / "benchmarks" / "gpu_check.sh"


def gpu_check(*args, python=sys.executable, path=None, venv_dir=None):
    env = dict(os.environ, PYTHON=str(python), PATH=path or os.environ["PATH"])
    if venv_dir is not None:
        env["GPU_CHECK_VENV"] = str(venv_dir)
    result = subprocess.run(["bash", str(CHECK), *args], env=env, capture_output=True, text=True, timeout=300)
    return result, result.stderr.strip().splitlines()


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A Python with none of the requirements (a venv without system packages)."""
    where = tmp_path_factory.mktemp("bare")
    venv.create(where, with_pip=False)
    return where / "bin" / "python"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_the_preflight_says_so():
    result, lines = gpu_check("--preflight")
    assert result.returncode == 1 and lines == ["gpu_check: no CUDA GPU visible to torch; nothing to check"], lines


def test_missing_requirements_without_wheels_are_named_in_one_line(bare_python):
    result, lines = gpu_check(python=bare_python)
    assert result.returncode == 1 and len(lines) == 1, lines
    assert "missing torch==" in lines[0] and "ale-py==" in lines[0] and "tyro==" in lines[0], lines
    assert "pass --wheels DIR" in lines[0]


def test_wheels_are_installed_from_the_folder_only(bare_python, tmp_path):
    """--no-index: a folder without the wheels fails at once, naming them, with no registry tried."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    result, lines = gpu_check("--wheels", wheels, python=bare_python, venv_dir=tmp_path / "v")
    assert result.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("gpu_check: could not install torch==") and f"from {wheels}:" in lines[0], lines
    # the venv it made sees the packages of the Python it was given, itself a venv here, as
    # the GPU image's torch lives in one
    site = subprocess.run([bare_python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    (Path(site) / "image_package.py").write_text("")
    seen = subprocess.run([tmp_path / "v" / "bin" / "python", "-c", "import image_package"], capture_output=True)
    assert seen.returncode == 0, seen.stderr


def test_no_c_compiler_is_named_before_anything_runs(tmp_path):
    """Triton builds its launcher with a C compiler at the first launch: without one, say so."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "date", "mktemp", "grep", "tail", "cat"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    result, lines = gpu_check(path=str(bin_dir))
    assert result.returncode == 1 and len(lines) == 1 and "no C compiler" in lines[0], lines


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    for args, text in [(["--bogus"], "unknown argument --bogus"), (["--wheels", tmp_path / "no"], "no such folder")]:
        result, lines = gpu_check(*args)
        assert result.returncode == 2 and len(lines) == 1 and text in lines[0], lines


def test_a_benchmark_run_does_not_block_on_a_child_that_fills_stderr(tmp_path):
    """gpu_sweep.run reads its child's progress lines; a child that writes more than a pipe
    holds (64 KiB) to stderr before them must not stall it."""
    child = tmp_path / "child.py"
    child.write_text(
        "import sys\n"
        "sys.stderr.write('warning ' * 100_000)\n"
        "print('step 128/256  SPS: 100 (rollout 200)', flush=True)\n"
        "print('step 256/256  SPS: 100 (rollout 300)', flush=True)\n"
    )
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import gpu_sweep;"
        f"print(gpu_sweep.run({str(child)!r}, [], 256, {str(tmp_path)!r})[1])"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == "300", result.stderr[-2000:]
