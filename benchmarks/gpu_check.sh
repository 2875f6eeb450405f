#!/usr/bin/env bash
# One command for a GPU machine: the GPU test tier (pytest -m cuda), the speed targets side by
# side (benchmarks/gpu_targets.py), the fused kernels against eager (benchmarks/kernels.py) and
# a short sweep (benchmarks/gpu_sweep.py --quick), written to one markdown report. It installs
# only requirements that are missing (a GPU image's own torch and triton are kept) and keeps
# to a 10-minute budget: a part that would not fit is reported as not run.
# Run: bash benchmarks/gpu_check.sh [REPORT.md]   (default: benchmarks/results/gpu_check.md)
set -uo pipefail
cd "$(dirname "$0")/.."
report=${1:-benchmarks/results/gpu_check.md}
python=${PYTHON:-python3}
start=$(date +%s)
work=$(mktemp -d)
export PYTHONUNBUFFERED=1

# what is missing, by import name -> requirement (pinned versions from requirements.txt)
missing=$($python - <<'EOF'
import importlib.util, re
pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", open("requirements.txt").read(), re.M))
modules = {"torch": "torch", "triton": "triton", "gymnasium": "gymnasium", "ale_py": "ale-py", "tyro": "tyro",
           "tensorboard": "tensorboard", "cv2": "opencv-python-headless", "numpy": "numpy", "pytest": "pytest"}
print(" ".join(f"{name}=={pins[name]}" for module, name in modules.items() if importlib.util.find_spec(module) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "installing what is missing: $missing"
    $python -m pip install -q $missing || echo "pip could not install: $missing"
fi
if ! $python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to torch; nothing to check." >&2
    exit 1
fi

left() { echo $((600 - ($(date +%s) - start))); }
section() {  # name, seconds it may take, command...: runs it if the budget allows, output to $work/name
    local name=$1 limit=$2
    shift 2
    local budget
    budget=$(left)
    if [ "$budget" -lt 30 ]; then
        echo "not run: the 10-minute budget was spent" >"$work/$name"
        return
    fi
    [ "$limit" -gt "$((budget - 15))" ] && limit=$((budget - 15))
    echo "== $name (at most ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$work/$name"
    local code=${PIPESTATUS[0]}
    [ "$code" -eq 124 ] && echo "(stopped at its ${limit}s limit)" >>"$work/$name"
    return 0
}

section tier 330 $python -m pytest -m cuda -q -rfE -p no:cacheprovider tests/test_gpu.py -k "not gpu_sweep"
section targets 150 $python benchmarks/gpu_targets.py --iterations 4
section kernels 50 $python benchmarks/kernels.py --no-aot
section sweep 90 $python benchmarks/gpu_sweep.py --quick --time-limit 45

$python - "$work" "$report" "$(( $(date +%s) - start ))" <<'EOF'
import pathlib, platform, subprocess, sys, time
import torch, triton
work, report, seconds = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
read = lambda name: (work / name).read_text().rstrip() if (work / name).exists() else "not run"
tier = read("tier").splitlines()
summary = next((l for l in reversed(tier) if " passed" in l or " failed" in l or " error" in l), "no summary")
failures = [l for l in tier if l.startswith(("FAILED", "ERROR"))]
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
out = [
    f"# GPU check, {time.strftime('%Y-%m-%d %H:%M')}",
    "",
    f"- GPU: {torch.cuda.get_device_name()} ({smi or 'nvidia-smi not available'})",
    f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, Python {platform.python_version()}",
    f"- {len(__import__('os').sched_getaffinity(0))} CPU cores usable; `bash benchmarks/gpu_check.sh` took {seconds} s",
    "",
    "## GPU test tier (`pytest -m cuda`, without the sweep test: the sweep is below)",
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
