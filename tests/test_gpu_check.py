"""benchmarks/gpu_check.sh and the GPU benchmarks' plumbing, on a machine without a GPU: the
preflight stops with one line naming what is missing (a requirement, a wheel, a C compiler, a
GPU) before any tier runs, and a benchmark never blocks on its child's output."""

import ast
import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

import pytest
import torch
from conftest import ROOT, tier_cores, worker_cores

CHECK = ROOT / "benchmarks" / "gpu_check.sh"


def check_env(python, path, **env_vars):
    """gpu_check.sh's environment: this one without CC (Triton's compiler choice), with PYTHON and PATH."""
    env = {name: value for name, value in os.environ.items() if name != "CC"}
    return env | dict(PYTHON=str(python), PATH=path or os.environ["PATH"], **env_vars)


def gpu_check(*args, python=sys.executable, path=None, venv_dir=None, **env_vars):
    """Run gpu_check.sh; its report goes to a temporary file (result.report), not the repository's."""
    env = check_env(python, path, **env_vars)
    if venv_dir is not None:
        env["GPU_CHECK_VENV"] = str(venv_dir)
    report = Path(tempfile.mkdtemp()) / "gpu_check.md"
    if "--report" not in args:
        args = (*args, "--report", report)
    result = subprocess.run(["bash", str(CHECK), *args], env=env, capture_output=True, text=True, timeout=300)
    result.report = report
    return result, result.stderr.strip().splitlines()


def start_gpu_check(python, path, report, **popen):
    """gpu_check.sh in the background, writing `report`."""
    command = ["bash", str(CHECK), "--report", str(report)]
    return subprocess.Popen(command, env=check_env(python, path), **popen)


def wait_until(condition, seconds=30):
    """Poll `condition` every 50 ms until it holds or `seconds` pass."""
    for _ in range(int(seconds / 0.05)):
        if condition():
            return
        time.sleep(0.05)


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


def bin_with(tmp_path, *tools):
    """A PATH folder holding only these tools (and what the script needs to start)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "date", "mktemp", "grep", "tail", "cat", *tools):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def test_no_c_compiler_is_named_before_anything_runs(tmp_path):
    """Triton builds its launcher with a C compiler at the first launch: without one, say so."""
    result, lines = gpu_check(path=bin_with(tmp_path))
    assert result.returncode == 1 and len(lines) == 1 and "no C compiler" in lines[0], lines
    assert "stopped: no C compiler" in result.report.read_text()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no cc here")
def test_a_bare_cc_is_refused_like_no_compiler_unless_named_in_CC(tmp_path):
    """Triton looks for $CC, then gcc, then clang (triton/runtime/build.py), never for cc."""
    path = bin_with(tmp_path, "cc", "timeout", "tee")
    result, lines = gpu_check(path=path)
    assert result.returncode == 1 and len(lines) == 1 and "no C compiler" in lines[0], lines
    result, lines = gpu_check(path=path, CC="cc")
    assert not any("C compiler" in line for line in lines), lines


def test_a_failing_preflight_still_writes_a_report_naming_why(bare_python):
    """The report starts with what this machine has (here: no torch) and says, part by part,
    that nothing ran because the preflight stopped, and why."""
    result, lines = gpu_check(python=bare_python)
    assert result.returncode == 1 and len(lines) == 1, lines
    report = result.report.read_text()
    assert "| preflight | - | stopped: missing torch==" in report, report
    for title in (
        "Triton warm-up",
        "Speed targets",
        "Where the time goes",
        "GPU test tier",
        "Kernels",
        "Sweep, quick grid",
    ):
        assert re.search(rf"\| {title} \| - \| not run: the preflight stopped \(missing torch==", report), report
    assert "- torch: cannot be imported (ModuleNotFoundError" in report and "- Python 3." in report, report
    assert "torch (not installed)" in report, report


def write_parts(work, parts):
    for name, files in parts.items():
        for suffix, text in files.items():
            (work / f"{name}{suffix}").write_text(text)


NVIDIA_SMI = 'case "$*" in *compute_mode*) echo Exclusive_Process ;; *) echo 580.65.06 ;; esac'


@pytest.mark.parametrize("smi", [None, "exit 1", NVIDIA_SMI])
def test_the_report_needs_no_nvidia_smi_and_says_what_each_part_did(tmp_path, smi):
    """No nvidia-smi on PATH (or a failing one) costs only the driver's version and the GPU's
    compute mode; every part gets its line: ran, stopped at its limit, interrupted, or not run
    and why."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    write_parts(work, {
        "preflight": {".seconds": "12"},
        "warm": {".status": "ran", ".seconds": "31", ".code": "0", ".limit": "90", "": "triton_warm: done"},
        "tier": {".status": "stopped at its 240s limit", ".seconds": "240", ".code": "124", ".limit": "240",
                 "": "FAILED tests/test_gpu.py::test_x - boom\n= 1 failed, 9 passed in 239.00s ="},
        "targets": {".status": "running", ".limit": "150"},
        "kernels": {".status": "not run: the 600 s budget was spent"},
    })  # fmt: skip
    env = dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(shutil.which('env'))}")
    report = tmp_path / "out" / "gpu_check.md"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), str(work), str(report), "300"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = report.read_text()
    assert ("- NVIDIA driver: 580.65.06" in text) == (smi == NVIDIA_SMI), text
    if smi == NVIDIA_SMI:
        assert "- GPU compute mode: Exclusive_Process (one process at a time on the GPU: the tier ran serially)" in text
    else:
        assert "- GPU compute mode: unknown (no nvidia-smi)" in text, text
    assert "| preflight | - | passed (12 s) |" in text
    assert "| Triton warm-up | 90 s | ran, 31 s, exit code 0 |" in text
    assert (
        "| GPU test tier | 240 s | stopped at its 240s limit, 240 s, exit code 124: 1 failed, 9 passed in 239.00s |"
        in text
    )
    assert "- FAILED tests/test_gpu.py::test_x - boom" in text
    assert "| Speed targets | 150 s | started, did not finish: the script was interrupted |" in text
    assert "| Kernels | - | not run: the 600 s budget was spent |" in text
    assert "| Sweep, quick grid | - | not run: the script ended before it |" in text


def simulated_gpu_machine(tmp_path, mode=None, warm_up="", cores=16, tier=""):
    """A PATH on which gpu_check.sh's preflight passes as on a GPU machine with `cores` usable
    cores (utils.usable_cores): a stand-in Python that logs each part's arguments and Inductor's
    compile threads to parts.log and runs the report with this Python (`warm_up`, `tier`: what
    the Triton warm-up and the tier run besides); nvidia-smi saying the GPU's compute mode
    `mode` (None: no nvidia-smi); a C compiler that is never run."""
    path = bin_with(tmp_path, "timeout", "tee", "head", "mkdir", "sleep")
    bin_dir, log = Path(path), tmp_path / "parts.log"
    tools = {
        "python": f"""#!/usr/bin/env bash
case "$*" in
    -) cat >/dev/null ;;  # the preflight's list of missing requirements: none
    *usable_cores*) echo {cores} ;;
    *gpu_report.py*) exec {sys.executable} "$@" ;;
    *triton_warm.py*) echo "$*" >>{log}; {warm_up} ;;
    *"-m pytest"*) echo "$* threads=$TORCHINDUCTOR_COMPILE_THREADS" >>{log}; {tier} ;;
    *benchmarks/*) echo "$* threads=$TORCHINDUCTOR_COMPILE_THREADS" >>{log} ;;
esac  # every other check of the preflight passes
""",
        "gcc": "#!/bin/sh\nexit 1\n",
    }
    if mode is not None:
        tools["nvidia-smi"] = f'#!/bin/sh\ncase "$*" in *compute_mode*) echo {mode} ;; *) echo 580.65.06 ;; esac\n'
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir / "python", path, log


@pytest.mark.parametrize("mode, cores", [("Default", 16), ("Exclusive_Process", 16), ("Default", 6)])
def test_the_tier_runs_on_xdist_workers_unless_the_compute_mode_is_exclusive(tmp_path, mode, cores):
    """Every part runs, in order: the targets on a quiet machine first, then the tier on 4
    workers; under an exclusive compute mode, which gives one process at a time the GPU,
    serially, and the report says why; serially too where a CPU quota leaves under 8 usable
    cores, with Inductor's compile threads the usable cores, not the affinity mask."""
    python, path, log = simulated_gpu_machine(tmp_path, mode, cores=cores)
    result, lines = gpu_check(python=python, path=path)
    assert result.returncode == 0, lines
    parts = log.read_text().splitlines()
    assert [part.split()[0] for part in parts] == [
        "benchmarks/triton_warm.py", "benchmarks/gpu_targets.py", "benchmarks/rollout_cost.py", "-m",
        "benchmarks/kernels.py", "benchmarks/gpu_sweep.py",
    ], parts  # fmt: skip
    assert all(part.endswith(f" threads={cores}") for part in parts[1:]), parts
    tier = parts[3].split()
    serial = mode == "Exclusive_Process" or cores < 8
    assert (tier[tier.index("-n") + 1] if "-n" in tier else "serially") == ("serially" if serial else "4"), tier
    assert ("--dist loadgroup" in parts[3]) == (not serial), tier
    assert ("compute mode Exclusive_Process: the tier runs serially" in result.stdout) == (mode != "Default")
    report = result.report.read_text()
    assert "| Speed targets | 210 s | ran, " in report and "| GPU test tier | 300 s | ran, " in report, report
    assert "| Where the time goes | 120 s | ran, " in report, report
    assert ("the tier ran serially" in report) == (mode != "Default"), report


def test_a_shorter_budget_shortens_the_later_parts_and_the_report_says_of_what(tmp_path):
    """--budget 200 (a lease with less than 10 minutes left): the parts share 200 - 75 s, so the
    targets and the tier get at most what is left after the warm-up instead of their 210 and 300
    s, and the report and the parts log give the time taken of 200."""
    python, path, _ = simulated_gpu_machine(tmp_path)
    result, lines = gpu_check("--budget", "200", python=python, path=path)
    assert result.returncode == 0, lines
    report = result.report.read_text()
    limits = dict(re.findall(r"\| ([A-Za-z -]+) \| (\d+) s \| ran, ", report))
    assert limits["Triton warm-up"] == "90" and 100 <= int(limits["Speed targets"]) <= 125, report
    assert int(limits["GPU test tier"]) <= 125, report  # at most what is left of 200 - 75, not 300
    parts = result.report.with_name("gpu_check_parts.log").read_text()
    assert "== sweep: " in parts and "budget 200 s" in parts.splitlines()[0], parts
    assert re.search(r"took \d+ s of its 200\)", report), report


def test_a_hard_kill_leaves_every_part_s_output_so_far_in_the_parts_log(tmp_path):
    """The lease's own limit may kill the whole command with no time for the report: the parts
    log beside it holds each finished part's output and outcome, and the running part's so far."""
    python, path, _ = simulated_gpu_machine(tmp_path, warm_up="echo warmed", tier="echo tier began; sleep 60")
    report = tmp_path / "out" / "gpu_check.md"
    log = report.with_name("gpu_check_parts.log")
    proc = start_gpu_check(
        python, path, report, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_until(lambda: log.exists() and "tier began" in log.read_text())
    finally:  # the whole session: each part's timeout leads a process group of its own
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == proc.pid:
                    os.kill(int(stat.parent.name), signal.SIGKILL)
        proc.wait(timeout=30)
    text = log.read_text()
    assert not report.exists() and "tier began" in text, text
    assert text.index("== warm (at most 90s)") < text.index("warmed") < text.index("== warm: ran, "), text
    assert "== targets: ran, " in text and "== tier (at most " in text and "== tier: " not in text, text


def test_help_says_the_worst_case_and_where_the_wheels_are_prepared():
    result = subprocess.run(["bash", str(CHECK), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and not result.stderr, result.stderr
    assert "Worst case: 585 s from the start to the report written, under 10 minutes" in result.stdout
    assert "docs/gpu.md" in result.stdout and (ROOT / "docs" / "gpu.md").is_file()


def test_the_report_keeps_the_head_and_tail_of_a_long_tier_and_its_whole_log_beside_it(tmp_path):
    """pytest prints the failures' tracebacks first and the summary last: a long tier output
    keeps both in the report, and the whole output is written beside it as REPORT_tier.log."""
    tier = "echo 'FAILED first traceback'; printf '%0100000d\\n' 0; echo '= 1 failed in 9.00s ='"
    python, path, _ = simulated_gpu_machine(tmp_path, tier=tier)
    result, lines = gpu_check(python=python, path=path)
    assert result.returncode == 0, lines
    report = result.report.read_text()
    assert "FAILED first traceback" in report and "= 1 failed in 9.00s =" in report, report[-3000:]
    assert "characters left out" in report and len(report) < 40_000
    log = result.report.with_name("gpu_check_tier.log").read_text()
    assert log.startswith("FAILED first traceback") and "0" * 100_000 in log and log.endswith("= 1 failed in 9.00s =\n")
    assert "The tier's whole log: gpu_check_tier.log, beside this report." in report


def test_an_interrupt_stops_the_running_part_with_its_process_group(tmp_path):
    """SIGTERM to gpu_check.sh while a part runs: the part's whole process group gets SIGINT, so
    nothing is left running, and the report says the part was interrupted."""
    part_pid = tmp_path / "part.pid"
    python, path, _ = simulated_gpu_machine(tmp_path, warm_up=f"echo $$ >{part_pid}; exec sleep 60")
    report = tmp_path / "report.md"
    proc = start_gpu_check(python, path, report, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: part_pid.exists() and part_pid.read_text().strip())
        assert part_pid.exists(), "the part never started"
        sleeper = int(part_pid.read_text())
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    for _ in range(100):
        if not Path(f"/proc/{sleeper}").exists() or "Z" in Path(f"/proc/{sleeper}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        os.kill(sleeper, signal.SIGKILL)
        raise AssertionError("the interrupted part's process is still running")
    assert "| Triton warm-up | 90 s | started, did not finish: the script was interrupted |" in report.read_text()


def test_a_python_without_ensurepip_gets_a_venv_that_runs_the_images_pip(tmp_path):
    """Debian's Python without python3-venv has no ensurepip: the venv is made without pip of
    its own and runs the base's pip (here pip in the base's site-packages, nothing else)."""
    base = tmp_path / "base"
    venv.create(base, with_pip=False)
    base_python = base / "bin" / "python"
    site = subprocess.run([base_python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    import pip

    (Path(site) / "pip").symlink_to(Path(pip.__file__).parent)
    no_ensurepip = tmp_path / "no_ensurepip"
    (no_ensurepip / "ensurepip").mkdir(parents=True)
    (no_ensurepip / "ensurepip" / "__init__.py").write_text("raise ImportError('ensurepip is disabled')\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    result, lines = gpu_check(
        "--wheels", wheels, python=base_python, venv_dir=tmp_path / "v", PYTHONPATH=str(no_ensurepip)
    )
    # pip ran in the new venv: it looked in the folder and found no torch
    assert len(lines) == 1 and lines[0].startswith("gpu_check: could not install torch=="), lines
    assert "ERROR" in lines[0], lines
    made = tmp_path / "v" / "bin" / "python"
    assert not list((tmp_path / "v").glob("lib/python*/site-packages/pip")), "the venv has a pip of its own"
    assert subprocess.run([made, "-m", "pip", "--version"], capture_output=True).returncode == 0


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    for args, text in [
        (["--bogus"], "unknown argument --bogus"),
        (["--wheels", tmp_path / "no"], "no such folder"),
        (["--budget", "100"], "--budget takes whole seconds from 180 to 600"),
        (["--budget", "9m"], "--budget takes whole seconds from 180 to 600"),
    ]:
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


def test_a_benchmark_run_is_stopped_at_its_limit_and_says_so(tmp_path):
    """gpu_sweep.run: Run(end_to_end, rollout, startup) of a run that finishes; a run that hangs
    after its first progress line (a cold compile, 256 seeded resets) is killed at its limit."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_sweep

    child = tmp_path / "child.py"
    child.write_text(
        "import sys, time\n"
        "time.sleep(0.5)\n"
        "print('step 128/384  SPS: 100 (rollout 200)', flush=True)\n"
        "print('step 256/384  SPS: 100 (rollout 300)', flush=True)\n"
        "time.sleep(float(sys.argv[sys.argv.index('--total-timesteps') + 1]) / 1000)\n"
    )
    done = gpu_sweep.run(child, [], 384, tmp_path, timeout=30)
    assert done.rollout == 300 and done.startup >= 0.5 and done.end_to_end > 0, done
    began = time.perf_counter()
    with pytest.raises(gpu_sweep.Stopped, match="stopped at its 2 s limit"):
        gpu_sweep.run(child, [], 60_000, tmp_path, timeout=2)
    assert time.perf_counter() - began < 20


def test_the_targets_print_each_row_as_it_finishes_and_go_on_past_a_stopped_run(monkeypatch, capsys):
    """gpu_targets.py: the five runs in order, the --compile and 256-env ones under a 100 s limit;
    a run stopped at its limit is reported so, the next one still runs, and the summary gives
    the targets' ratios from the runs that finished."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_sweep
    import gpu_targets

    calls = []

    def fake_run(script, extra, budget, runs_dir, timeout=None):
        calls.append((script, extra, timeout))
        if "--compile" in extra:
            raise gpu_sweep.Stopped("stopped at its 100 s limit")
        speed = 1000.0 if "baseline" in script else 4000.0 + 1000 * len(calls)
        return gpu_sweep.Run(speed, 2 * int(speed), 7.0)

    monkeypatch.setattr(gpu_targets, "run", fake_run)
    monkeypatch.setattr(gpu_targets.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_targets.torch.cuda, "get_device_name", lambda: "a GPU")
    monkeypatch.setattr(sys, "argv", ["gpu_targets.py", "--iterations", "3"])
    gpu_targets.main()
    out = capsys.readouterr().out
    assert [c[2] for c in calls] == [None, None, None, 100, 100], calls
    assert calls[3][1] == [*gpu_targets.HEADLINE, "--compile"] and "--num-envs" in calls[4][1], calls
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert [row.split(" | ")[0] for row in rows] == [f"| {name}" for name, *_ in gpu_targets.RUNS], rows
    assert rows[3] == "| headline, --compile | stopped at its limit | | | |", rows
    assert rows[4].startswith("| 256 envs x 8 batches, 32 steps | 9,000 | 18,000 | 7 | 9.00x |"), rows
    assert "- headline command end to end: 7,000 steps/s (target >= 10,000)" in out
    assert "- native / baseline end to end at 16 envs: 6.00x (target >= 4x)" in out


def test_each_xdist_worker_of_the_gpu_tier_gets_its_own_cores():
    """gpu_check.sh runs the tier on pytest-xdist workers; each keeps to a disjoint slice of the
    cores (so its scripts see a cpuset, and utils.env_threads pins nothing)."""
    slices = [worker_cores(f"gw{i}", 3, range(16)) for i in range(3)]
    assert [len(s) for s in slices] == [6, 5, 5] and set().union(*slices) == set(range(16))
    assert worker_cores("gw3", 4, range(16)) == {12, 13, 14, 15}
    assert worker_cores("gw1", 4, range(2)) == {0, 1}  # fewer cores than workers: shared


def test_the_docs_download_every_wheel_the_preflight_may_ask_for():
    """The preflight installs what is missing from --wheels DIR with --no-index: a package that
    docs/gpu.md's download commands leave out stops it (opencv-python-headless did). The short
    command has what the GPU image lacks; the long one every requirement the preflight checks,
    pytest-xdist and execnet among them (without them the tier runs serially, past its limit)."""
    script, doc = CHECK.read_text(), (ROOT / "docs" / "gpu.md").read_text()
    modules = re.search(r"modules = (\{.*?\})", script, re.S)[1]
    assert '"xdist": "pytest-xdist"' in modules and '"execnet": "execnet"' in modules, modules
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M))
    commands = [doc[i : doc.index("```", i)] for i in [m.start() for m in re.finditer("pip download", doc)]]
    assert len(commands) == 2, commands
    for name in ("gymnasium", "ale-py", "tyro"):
        assert f"{name}=={pins[name]}" in commands[0], name
    for name in re.findall(r'"[a-z_0-9]+": "([a-z0-9-]+)"', modules):
        if name in ("torch", "triton"):  # the image's own, named in the paragraph after the command
            assert f"`torch=={pins['torch']} triton=={pins['triton']}`" in doc
        else:
            assert f"{name}=={pins[name]}" in commands[1], name


def test_the_gpu_tiers_compile_tests_start_first():
    """xdist (--dist loadgroup) hands out tests in file order, one to each of the 4 workers
    first: the tier's four cold Inductor compiles (a minute or two each) are the first four
    tests collected from tests/test_gpu.py, so that each worker starts one, and none starts last."""
    text = (ROOT / "tests" / "test_gpu.py").read_text()
    tests = [node for node in ast.parse(text).body if getattr(node, "name", "").startswith("test_")]
    sources = [ast.get_source_segment(text, node) for node in tests]
    # gpu_updates.py compiles, but for its "graphed" checks (no Inductor)
    compiling = [
        i for i, source in enumerate(sources)
        if '"--compile"' in source or ("gpu_updates.py" in source and '"graphed"' not in source)
    ]  # fmt: skip
    assert compiling == list(range(len(compiling))), [node.name for node in tests]
    values = [
        [len(d.args[1].elts) for d in tests[i].decorator_list if "parametrize" in ast.unparse(d)] for i in compiling
    ]
    items = sum(math.prod(v) for v in values)  # a parametrized test is one item per value
    assert items == 4, [tests[i].name for i in compiling]


def test_the_gpu_tiers_workers_share_the_usable_cores_under_a_quota(monkeypatch, tmp_path):
    """A 16-CPU quota on a 64-core affinity: 4 workers get 4 cores each, not 16 (each with a
    compile pool and env threads of that size), and without the quota 16 each."""
    import utils

    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(utils.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(utils, "CGROUP_CPU_MAX", tmp_path / "cpu.max")
    for quota, each in [("1600000 100000", 4), ("max 100000", 16)]:
        (tmp_path / "cpu.max").write_text(quota + "\n")
        slices = [tier_cores(f"gw{i}", 4) for i in range(4)]
        assert [len(s) for s in slices] == [each] * 4 and len(set().union(*slices)) == 4 * each, slices


def test_the_triton_warm_up_runs_both_policy_steps_for_every_batch():
    """benchmarks/triton_warm.py on CPU (the torch references stand in for the kernels): the
    fused and the module step, for each batch, at t = 0 and t = 1."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import triton_warm

    assert triton_warm.warm(torch.device("cpu"), [torch.float32], [(4, 2)]) == 2 * 2 * 2
