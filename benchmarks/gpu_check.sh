#!/usr/bin/env bash
# One command for a GPU machine: the speed targets side by side (benchmarks/gpu_targets.py), where
# the time goes (benchmarks/rollout_cost.py), the GPU test tier (pytest -m cuda), the fused
# kernels against eager (benchmarks/kernels.py) and a short sweep (benchmarks/gpu_sweep.py
# --quick), written to one markdown report within a 10-minute budget (--budget: less), the
# tier's whole log beside it (REPORT_tier.log) and every part's output, appended as it runs, in
# REPORT_parts.log (what a hard kill leaves). The report is written however the run ends (the
# preflight stops, a part fails or runs out of time, Ctrl-C), starting with the machine's own
# versions and saying for each part whether it ran, stopped at its limit or did not run and why
# (benchmarks/gpu_report.py). A GPU image's own torch and triton are kept: only missing
# requirements are installed, from a folder of wheels (--wheels DIR, no network needed) into a
# venv that sees the image's packages. A preflight stops with one line naming what is missing
# before anything runs. How to prepare the folder: docs/gpu.md.
# Run: bash benchmarks/gpu_check.sh [--wheels DIR] [--report FILE.md] [--budget SECONDS] [--preflight] [--help]
# (--preflight runs only the preflight and writes no report; bad arguments exit 2, no report.)
#
# Timeline on a 16-core H100, estimated from the parts' sizes (limits in brackets):
#   preflight          10-20 s, 40-60 s when it makes the venv and installs wheels
#   Triton warm-up     20-40 s [90]: ~25 kernel specializations and their launchers, once
#   targets           100-180 s [210]: 5 script runs of 3 iterations on a quiet machine, first
#                      because they are the report's headline; the --compile run and the
#                      256-env run are each stopped at 100 s
#   cost               50-100 s [120]: where the time goes (benchmarks/rollout_cost.py, 16 x 8 and
#                      16 x 2: the envs alone, the driver's phases, the rollout, the update), also
#                      on a quiet machine
#   GPU tier          what is left, at most 300 s [300]: about 800 s of tests on 4 pytest-xdist
#                      workers of 4 cores each. --dist loadgroup with no test grouped makes each test its own unit,
#                      handed out in file order, one to each worker, then one more to a worker
#                      whenever it has 2 or fewer pending. The four tests that cold-compile with
#                      Inductor (60-120 s each) are the first four: one starts on each worker and
#                      the other tests follow them. The two A2C optimizers compile in one child
#                      process, so that the second meets Inductor's cache. Serially (no xdist,
#                      under 8 usable cores, or a compute mode other than Default) it is cut at
#                      its limit
#   kernels            20-35 s [45]
#   sweep              40-55 s [60]: cells started within 30 s
#   report              5-10 s [40]
# in all about 7-9 minutes; a part that would not fit in what is left of the budget (600 s, or
# --budget) is shortened or reported as not run, and the worst case (a part cut at the end of its
# share, its 20 s kill grace, the report's 40 s) ends at BUDGET - RESERVE + 60 (585 s of 600).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
report=benchmarks/results/gpu_check.md
wheels=""
preflight_only=0
budget=600
python=${PYTHON:-python3}
venv=${GPU_CHECK_VENV:-.venv-gpu}
export PYTHONUNBUFFERED=1
RESERVE=75 # seconds kept back at the end: a part's 20 s kill grace, the report's 30 s (+10 s kill grace), 15 s spare

usage() {
    echo "gpu_check: $* (usage: bash benchmarks/gpu_check.sh [--wheels DIR] [--report FILE.md] [--budget SECONDS] [--preflight] [--help])" >&2
    exit 2
}
help() {
    cat <<HELP
usage: bash benchmarks/gpu_check.sh [--wheels DIR] [--report FILE.md] [--budget SECONDS] [--preflight]
The GPU check: the speed targets, the GPU test tier, the kernels and a short sweep, in one
report ($report by default), the tier's whole log beside it (REPORT_tier.log)
and every part's output as it runs (REPORT_parts.log: what is left if the command is killed).
  --wheels DIR      install the missing requirements from this folder of wheels (no network needed)
  --report FILE     where the report goes
  --budget SECONDS  the seconds the call may take, 180 to 600 (default 600): the later parts get less
  --preflight       only check what the machine has, write no report
Worst case: $((600 - RESERVE + 60)) s from the start to the report written, under 10 minutes (give
it a 600 s limit; with --budget B: B - 15 s, a limit of B). How to prepare the wheel folder on a CPU
machine first: docs/gpu.md.
HELP
    exit 0
}
while [ $# -gt 0 ]; do
    case $1 in
    --wheels) [ $# -ge 2 ] || usage "--wheels needs a folder"; wheels=$2; shift 2 ;;
    --report) [ $# -ge 2 ] || usage "--report needs a file"; report=$2; shift 2 ;;
    --budget)
        [ $# -ge 2 ] && [[ $2 =~ ^[0-9]+$ ]] && [ "$2" -ge 180 ] && [ "$2" -le 600 ] ||
            usage "--budget takes whole seconds from 180 to 600"
        budget=$2
        shift 2
        ;;
    --preflight) preflight_only=1; shift ;;
    --help | -h) help ;;
    *) usage "unknown argument $1" ;;
    esac
done
[ -z "$wheels" ] || [ -d "$wheels" ] || usage "--wheels $wheels: no such folder"

work=$(mktemp -d)
limited() {  # seconds, command...: under timeout where coreutils has it (the preflight checks for it)
    local seconds=$1
    shift
    if command -v timeout >/dev/null; then timeout -k 10 "$seconds" "$@"; else "$@"; fi
}
plain_report() {  # the report when no Python can write it: what the script itself knows
    local name
    mkdir -p "$(dirname "$report")" 2>/dev/null
    {
        echo "# GPU check, $(date '+%Y-%m-%d %H:%M')"
        echo
        echo "benchmarks/gpu_report.py could not run with $python; what the script knows:"
        echo
        if [ -s "$work/stopped" ]; then echo "- preflight: stopped: $(<"$work/stopped")"; else echo "- preflight: passed"; fi
        for name in warm targets cost tier kernels sweep; do
            if [ -s "$work/$name.status" ]; then echo "- $name: $(<"$work/$name.status")"; else echo "- $name: not run"; fi
        done
    } >"$report"
    echo "report: $report"
}
finish() {  # on every exit after the arguments are read: the report, then the exit code
    local code=$?
    trap - EXIT
    if [ "$preflight_only" -eq 0 ]; then
        if ! command -v "$python" >/dev/null ||
            ! limited 30 "$python" benchmarks/gpu_report.py "$work" "$report" "$(($(date +%s) - start))" "$budget" \
                2>"$work/report.log"; then
            plain_report
        fi
    fi
    exit "$code"
}
trap finish EXIT
stop() {  # one line on stderr, then exit 1: the machine lacks something (the report says what)
    echo "gpu_check: $*" >&2
    echo "$*" >"$work/stopped"
    exit 1
}
command -v "$python" >/dev/null || stop "no $python on PATH (set PYTHON=...)"

# the requirements not importable by $python, pinned as in requirements.txt
missing() {
    "$1" - <<'EOF'
import importlib.util, re
pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", open("requirements.txt").read(), re.M))
modules = {"torch": "torch", "triton": "triton", "gymnasium": "gymnasium", "ale_py": "ale-py", "tyro": "tyro",
           "tensorboard": "tensorboard", "cv2": "opencv-python-headless", "numpy": "numpy", "pytest": "pytest",
           "xdist": "pytest-xdist", "execnet": "execnet"}
print(" ".join(f"{name}=={pins[name]}" for module, name in modules.items() if importlib.util.find_spec(module) is None))
EOF
}
need=$(missing "$python") || stop "$python cannot run"
if [ -n "$need" ]; then
    [ -n "$wheels" ] || stop "missing $need: install them, or pass --wheels DIR (a folder of cp312 wheels, see README)"
    # a venv that sees the image's torch and triton (a PEP 668 system Python refuses installs):
    # --system-site-packages for a system Python, a .pth for one that is itself a venv's. A
    # Python without ensurepip (Debian's without python3-venv) gets a venv without pip of its
    # own, which runs the image's pip; a venv without its marker was left half made: made again.
    if [ ! -f "$venv/gpu_check.ready" ]; then
        own_pip=--without-pip
        "$python" -c "import ensurepip" 2>/dev/null && own_pip=""
        # shellcheck disable=SC2086
        limited 120 "$python" -m venv --clear --system-site-packages $own_pip "$venv" >"$work/venv.log" 2>&1 ||
            stop "could not create $venv: $(tail -n1 "$work/venv.log")"
        site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$python" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/gpu_check_base.pth"
        "$venv/bin/python" -m pip --version >/dev/null 2>&1 ||
            stop "no pip for $venv: $python has neither ensurepip nor pip (install python3-venv or python3-pip)"
        : >"$venv/gpu_check.ready"
    fi
    python=$venv/bin/python
    need=$(missing "$python")
    if [ -n "$need" ]; then
        echo "installing from $wheels: $need"
        # shellcheck disable=SC2086
        limited 240 "$python" -m pip install -q --no-index --find-links "$wheels" $need >"$work/pip.log" 2>&1 ||
            stop "could not install $need from $wheels: $(grep -m1 -E 'ERROR|error' "$work/pip.log")"
    fi
fi
# what Triton needs at its first launch: a C compiler, found as Triton finds one ($CC, else
# gcc, else clang: a bare cc is never tried), and Python's headers for its launcher
if [ -n "${CC:-}" ]; then
    command -v "$CC" >/dev/null || stop "CC=$CC is not a command: Triton builds its launcher with \$CC at the first launch"
else
    command -v gcc >/dev/null || command -v clang >/dev/null ||
        stop "no C compiler that Triton finds (\$CC, gcc or clang; for cc set CC=cc): it builds its launcher with one at the first launch"
fi
"$python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
    stop "no Python.h for $python (install python3-dev): Triton builds its launcher against it"
command -v timeout >/dev/null && command -v tee >/dev/null || stop "no timeout or tee (coreutils): every part runs under them"
err=$("$python" -c "import gymnasium, ale_py, tyro, tensorboard, cv2, pytest, triton" 2>&1) ||
    stop "$python cannot import what the tests need: $(tail -n1 <<<"$err")"
limited 120 "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    stop "no CUDA GPU visible to torch; nothing to check"
"$python" -c "from triton.backends.nvidia.driver import libcuda_dirs; libcuda_dirs()" 2>/dev/null ||
    stop "Triton cannot find libcuda.so.1 (ldconfig -p, or set TRITON_LIBCUDA_PATH)"
if [ "$preflight_only" -eq 1 ]; then
    echo "gpu_check: preflight passed ($python)"
    exit 0
fi
echo "$(($(date +%s) - start))" >"$work/preflight.seconds"

running=""
interrupted() {  # Ctrl-C or SIGTERM: the running part's process group (timeout leads its own) gets
    # SIGINT too, and the report says the part did not finish. $! names the part's timeout as
    # soon as it is forked, before a trap can run (a pid written down later may not be there yet)
    [ -n "$running" ] && kill -INT -- "-$!" 2>/dev/null
    exit 130
}
trap interrupted INT TERM

# a cold Triton cache, compiled once by the warm-up, then shared by every part
export TRITON_CACHE_DIR=$work/triton-cache
left() { echo $((budget - RESERVE - ($(date +%s) - start))); }
# every part's whole output, appended as it runs: a kill that leaves no time for the report
# (the GPU lease's own limit) still leaves what ran
mkdir -p "$(dirname "$report")"
name=${report##*/}
parts_log=${report%"$name"}${name%.*}_parts.log  # REPORT.md's stem, as the tier log's
echo "gpu_check: $(date '+%Y-%m-%d %H:%M:%S'), budget ${budget} s, $python" >"$parts_log"

section() {  # name, seconds it may take, command...: runs it within what is left of the budget;
    # its output, limit, seconds, exit code and status (what the report says of it) go to $work
    local name=$1 limit=$2
    shift 2
    local share began code
    share=$(left)
    if [ "$share" -lt 20 ]; then
        echo "not run: the ${budget} s budget was spent" >"$work/$name.status"
        echo "== $name: $(<"$work/$name.status")" >>"$parts_log"
        return 0
    fi
    [ "$limit" -gt "$share" ] && limit=$share
    echo "$limit" >"$work/$name.limit"
    echo "== $name (at most ${limit}s)" | tee -a "$parts_log"
    echo running >"$work/$name.status"
    began=$(date +%s)
    # SIGINT, not SIGTERM, so that pytest still prints its summary; -k 20 kills what ignores it.
    # In the background and waited for, so that a Ctrl-C or SIGTERM reaches `interrupted` at once.
    running=$name
    timeout -s INT -k 20 "$limit" "$@" > >(tee -a "$work/$name" "$parts_log") 2>&1 &
    wait $!
    code=$?
    running=""
    echo "$code" >"$work/$name.code"
    echo "$(($(date +%s) - began))" >"$work/$name.seconds"
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
        echo "stopped at its ${limit}s limit" >"$work/$name.status"
    else
        echo ran >"$work/$name.status"
    fi
    echo "== $name: $(<"$work/$name.status"), $(<"$work/$name.seconds") s, exit code $code" >>"$parts_log"
    return 0
}

# the tier on 4 pytest-xdist workers of 4 usable cores each (a cgroup CPU quota counts:
# utils.usable_cores; tests/test_gpu.py gives each worker its slice and Inductor its threads),
# serially where xdist is missing, under 8 usable cores, or where the GPU's compute mode is not
# Default (an exclusive mode gives one process at a time a CUDA context: the workers and the
# scripts they start would be refused the GPU)
cores=$("$python" -c 'import utils; print(utils.usable_cores()[0])' 2>/dev/null) || cores=0
workers=$((cores / 4 < 4 ? cores / 4 : 4))
# Inductor counts the affinity mask, not a quota
[ "$cores" -gt 0 ] && export TORCHINDUCTOR_COMPILE_THREADS=$cores
mode=$(limited 20 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -n1)
parallel=()
[ "$workers" -ge 2 ] && [ "${mode:-Default}" = Default ] && "$python" -c "import xdist" 2>/dev/null &&
    parallel=(-n "$workers" --dist loadgroup)
[ "${mode:-Default}" = Default ] || echo "gpu_check: compute mode $mode: the tier runs serially"

section warm 90 "$python" benchmarks/triton_warm.py
section targets 210 "$python" benchmarks/gpu_targets.py --iterations 3
# where the time goes (the end-to-end rows are the targets' own), still on a quiet machine
section cost 120 "$python" benchmarks/rollout_cost.py --no-end-to-end
# -rfEP: the failures, and what passing tests print (the guard's gap under --compile)
section tier 300 "$python" -m pytest -m cuda -q -rfEP -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} \
    tests/test_gpu.py -k "not gpu_sweep"
section kernels 45 "$python" benchmarks/kernels.py --no-aot
section sweep 60 "$python" benchmarks/gpu_sweep.py --quick --time-limit 30
# the report: written by finish, on this exit as on any other
