#!/usr/bin/env bash
# One command for a GPU machine: the GPU test tier (pytest -m cuda), the speed targets side by
# side (benchmarks/gpu_targets.py), the fused kernels against eager (benchmarks/kernels.py) and
# a short sweep (benchmarks/gpu_sweep.py --quick), written to one markdown report within a
# 10-minute budget (a part that would not fit is reported as not run).
# A GPU image's own torch and triton are kept: only missing requirements are installed, from a
# folder of wheels (--wheels DIR, no network needed) into a venv that sees the image's packages.
# A preflight stops with one line naming what is missing before anything runs.
# Run: bash benchmarks/gpu_check.sh [--wheels DIR] [--report FILE.md] [--preflight]
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
report=benchmarks/results/gpu_check.md
wheels=""
preflight_only=0
python=${PYTHON:-python3}
venv=${GPU_CHECK_VENV:-.venv-gpu}
export PYTHONUNBUFFERED=1

stop() {  # one line on stderr, then exit 1: the machine lacks something
    echo "gpu_check: $*" >&2
    exit 1
}
usage() {
    echo "gpu_check: $* (usage: bash benchmarks/gpu_check.sh [--wheels DIR] [--report FILE.md] [--preflight])" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case $1 in
    --wheels) [ $# -ge 2 ] || usage "--wheels needs a folder"; wheels=$2; shift 2 ;;
    --report) [ $# -ge 2 ] || usage "--report needs a file"; report=$2; shift 2 ;;
    --preflight) preflight_only=1; shift ;;
    *) usage "unknown argument $1" ;;
    esac
done
[ -z "$wheels" ] || [ -d "$wheels" ] || usage "--wheels $wheels: no such folder"
command -v "$python" >/dev/null || stop "no $python on PATH (set PYTHON=...)"

# the requirements not importable by $python, pinned as in requirements.txt
missing() {
    "$1" - <<'EOF'
import importlib.util, re
pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", open("requirements.txt").read(), re.M))
modules = {"torch": "torch", "triton": "triton", "gymnasium": "gymnasium", "ale_py": "ale-py", "tyro": "tyro",
           "tensorboard": "tensorboard", "cv2": "opencv-python-headless", "numpy": "numpy", "pytest": "pytest"}
print(" ".join(f"{name}=={pins[name]}" for module, name in modules.items() if importlib.util.find_spec(module) is None))
EOF
}
need=$(missing "$python") || stop "$python cannot run"
if [ -n "$need" ]; then
    [ -n "$wheels" ] || stop "missing $need: install them, or pass --wheels DIR (a folder of cp312 wheels, see README)"
    # a venv that sees the image's torch and triton (a PEP 668 system Python refuses installs):
    # --system-site-packages for a system Python, a .pth for one that is itself a venv's
    if [ ! -x "$venv/bin/python" ]; then
        "$python" -m venv --system-site-packages "$venv" || stop "could not create $venv"
        site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$python" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/gpu_check_base.pth"
    fi
    python=$venv/bin/python
    need=$(missing "$python")
    if [ -n "$need" ]; then
        echo "installing from $wheels: $need"
        log=$(mktemp)
        # shellcheck disable=SC2086
        "$python" -m pip install -q --no-index --find-links "$wheels" $need >"$log" 2>&1 ||
            stop "could not install $need from $wheels: $(grep -m1 -E 'ERROR|error' "$log")"
    fi
fi
# what Triton needs at its first launch: a C compiler and Python's headers for its launcher
command -v gcc >/dev/null || command -v cc >/dev/null || command -v clang >/dev/null ||
    stop "no C compiler (gcc, cc or clang): Triton builds its launcher with one at the first launch"
"$python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
    stop "no Python.h for $python (install python3-dev): Triton builds its launcher against it"
err=$("$python" -c "import gymnasium, ale_py, tyro, tensorboard, cv2, pytest, triton" 2>&1) ||
    stop "$python cannot import what the tests need: $(tail -n1 <<<"$err")"
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    stop "no CUDA GPU visible to torch; nothing to check"
"$python" -c "from triton.backends.nvidia.driver import libcuda_dirs; libcuda_dirs()" 2>/dev/null ||
    stop "Triton cannot find libcuda.so.1 (ldconfig -p, or set TRITON_LIBCUDA_PATH)"
if [ "$preflight_only" -eq 1 ]; then
    echo "gpu_check: preflight passed ($python)"
    exit 0
fi

work=$(mktemp -d)
# a cold Triton cache, so that the tier's time is what a fresh machine pays
export TRITON_CACHE_DIR=$work/triton-cache
left() { echo $((600 - ($(date +%s) - start))); }
section() {  # name, seconds it may take, command...: runs it if the budget allows, output to $work/name
    local name=$1 limit=$2
    shift 2
    local budget began
    budget=$(left)
    if [ "$budget" -lt 60 ]; then
        echo "not run: the 10-minute budget was spent" >"$work/$name"
        return
    fi
    # SIGINT, not SIGTERM, so that pytest still prints its summary; -k 30 kills what ignores it
    [ "$limit" -gt "$((budget - 45))" ] && limit=$((budget - 45))
    echo "== $name (at most ${limit}s)"
    began=$(date +%s)
    timeout -s INT -k 30 "$limit" "$@" 2>&1 | tee "$work/$name"
    local code=${PIPESTATUS[0]}
    [ "$code" -eq 124 ] || [ "$code" -eq 137 ] && echo "(stopped at its ${limit}s limit)" >>"$work/$name"
    echo "$(($(date +%s) - began))" >"$work/$name.seconds"
    return 0
}

section tier 360 "$python" -m pytest -m cuda -q -rfE -p no:cacheprovider tests/test_gpu.py -k "not gpu_sweep"
section targets 150 "$python" benchmarks/gpu_targets.py --iterations 4
section kernels 45 "$python" benchmarks/kernels.py --no-aot
section sweep 90 "$python" benchmarks/gpu_sweep.py --quick --time-limit 45

"$python" - "$work" "$report" "$(($(date +%s) - start))" <<'EOF'
import os, pathlib, platform, subprocess, sys, time
import torch, triton
sys.path.insert(0, ".")
import utils
work, report, seconds = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
read = lambda name: (work / name).read_text().rstrip() if (work / name).exists() else "not run"
tier = read("tier").splitlines()
summary = next((l for l in reversed(tier) if " passed" in l or " failed" in l or " error" in l), "no summary")
failures = [l for l in tier if l.startswith(("FAILED", "ERROR"))]
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
cores, whole = utils.usable_cores()
out = [
    f"# GPU check, {time.strftime('%Y-%m-%d %H:%M')}",
    "",
    f"- GPU: {torch.cuda.get_device_name()} ({smi or 'nvidia-smi not available'})",
    f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, Python {platform.python_version()}",
    f"- {cores} usable CPU cores of {os.cpu_count()}{'' if whole else ' (a cpuset or a CPU quota)'};"
    f" `bash benchmarks/gpu_check.sh` took {seconds} s",
    "",
    f"## GPU test tier (`pytest -m cuda`, without the sweep test: the sweep is below), {read('tier.seconds')} s"
    " from a cold Triton cache",
    "",
    f"{summary}",
    *([""] + [f"- {l}" for l in failures] if failures else []),
    "",
    "## Speed targets (`python benchmarks/gpu_targets.py`)",
    "",
    read("targets"),
    "",
    "## Kernels (`python benchmarks/kernels.py --no-aot`)",
    "",
    "```",
    read("kernels"),
    "```",
    "",
    "## Sweep, quick grid (`python benchmarks/gpu_sweep.py --quick`)",
    "",
    read("sweep"),
    "",
]
report.parent.mkdir(parents=True, exist_ok=True)
report.write_text("\n".join(out))
print(f"report: {report}")
EOF
