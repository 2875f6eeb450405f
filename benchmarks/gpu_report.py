"""benchmarks/gpu_check.sh's report: the machine's own versions first, then one line per part
(preflight, Triton warm-up, targets, where the time goes, GPU tier, kernels, sweep) saying whether it ran, stopped at
its limit or did not run and why, then each part's output, its head and tail where it is long
(so that neither the first failure nor the summary is lost; gpu_check.sh keeps the tier's whole
log beside the report). Standard library only, and every import of the project's packages
guarded, so that it writes a report whatever is missing.
Run by gpu_check.sh: python benchmarks/gpu_report.py WORK_DIR REPORT.md SECONDS [BUDGET]
"""

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

# what gpu_check.sh runs, in order: (name in the work folder, title, command)
SECTIONS = [
    ("warm", "Triton warm-up", "python benchmarks/triton_warm.py"),
    ("targets", "Speed targets", "python benchmarks/gpu_targets.py"),
    ("cost", "Where the time goes", "python benchmarks/rollout_cost.py --no-end-to-end"),
    ("tier", "GPU test tier", "pytest -m cuda tests/test_gpu.py -k 'not gpu_sweep'"),
    ("kernels", "Kernels", "python benchmarks/kernels.py --no-aot"),
    ("sweep", "Sweep, quick grid", "python benchmarks/gpu_sweep.py --quick"),
]
MARKDOWN = {"targets", "cost", "sweep"}
HEAD, TAIL = 8_000, 16_000  # characters of each part's output kept in the report
# the distributions the project uses (requirements.txt, and what the GPU tier can use)
PACKAGES = [
    "torch", "triton", "numpy", "gymnasium", "ale-py", "tyro", "tensorboard", "opencv-python-headless",
    "pytest", "pytest-xdist", "execnet", "pytest-timeout", "pip",
]  # fmt: skip


def read(work, name, default=""):
    path = work / name
    return path.read_text(errors="replace").rstrip() if path.exists() else default


def gpu_query(field):
    """One --query-gpu field of nvidia-smi for the first GPU, or None (no nvidia-smi, or it failed)."""
    if shutil.which("nvidia-smi"):
        try:
            query = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
            if out:
                return out.splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def driver_version():
    """The NVIDIA driver's version: nvidia-smi where there is one, else the kernel module's."""
    version = gpu_query("driver_version")
    if version:
        return version
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return "unknown (no nvidia-smi, no /proc/driver/nvidia/version)"


def versions():
    """The image's own versions, each as far as it can be read."""
    lines = [f"- Python {platform.python_version()} ({sys.executable})"]
    try:
        import torch

        cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA build"
        lines.append(f"- torch {torch.__version__} ({cuda})")
        if torch.cuda.is_available():
            lines.append(
                f"- GPU: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
            )
        else:
            lines.append("- GPU: none visible to torch")
    except Exception as e:  # a broken install is what the report must still describe
        lines.append(f"- torch: cannot be imported ({type(e).__name__}: {e})")
    try:
        import triton

        lines.append(f"- triton {triton.__version__}")
    except Exception as e:
        lines.append(f"- triton: cannot be imported ({type(e).__name__}: {e})")
    lines.append(f"- NVIDIA driver: {driver_version()}")
    mode = gpu_query("compute_mode")  # gpu_check.sh runs the tier serially unless it is Default
    serially = "" if mode in (None, "Default") else " (one process at a time on the GPU: the tier ran serially)"
    lines.append(f"- GPU compute mode: {mode or 'unknown (no nvidia-smi)'}{serially}")
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import utils

        cores, whole = utils.usable_cores()
        lines.append(f"- {cores} usable CPU cores of {os.cpu_count()}{'' if whole else ' (a cpuset or a CPU quota)'}")
    except Exception:
        lines.append(f"- {len(os.sched_getaffinity(0))} CPU cores in this process's affinity of {os.cpu_count()}")
    installed = []
    for name in PACKAGES:
        try:
            installed.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            installed.append(f"{name} (not installed)")
    lines.append(f"- installed (as `pip list` shows them): {', '.join(installed)}")
    return lines


def excerpt(text, head=HEAD, tail=TAIL):
    """text, or its first `head` and last `tail` characters with a line saying what was left out."""
    if len(text) <= head + tail:
        return text
    return f"{text[:head]}\n\n[... {len(text) - head - tail:,} characters left out ...]\n\n{text[-tail:]}"


def tier_summary(output):
    """pytest's counts line (also printed after a KeyboardInterrupt) and its FAILED/ERROR lines."""
    lines = output.splitlines()
    words = (" passed", " failed", " error", " skipped", " deselected")
    counts = next((line.strip("= ") for line in reversed(lines) if any(w in line for w in words)), "no summary line")
    return counts, [line for line in lines if line.startswith(("FAILED", "ERROR"))]


def outcome(work, name, stopped):
    """One line: ran (seconds, exit code), stopped at its limit, or not run and why."""
    status = read(work, f"{name}.status")
    if not status:
        return f"not run: {stopped}" if stopped else "not run: the script ended before it"
    if status == "running":
        return "started, did not finish: the script was interrupted"
    if status.startswith("not run"):
        return status
    seconds, code = read(work, f"{name}.seconds", "?"), read(work, f"{name}.code", "?")
    text = f"{status}, {seconds} s, exit code {code}"
    if name == "tier":
        text += f": {tier_summary(read(work, 'tier'))[0]}"
    return text


def main():
    work, report, seconds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    budget = sys.argv[4] if len(sys.argv) > 4 else "600"
    stopped = read(work, "stopped")
    preflight = f"stopped: {stopped}" if stopped else f"passed ({read(work, 'preflight.seconds', '?')} s)"
    if stopped:
        stopped = f"the preflight stopped ({stopped})"
    limits = {
        name: f"{read(work, f'{name}.limit')} s" if read(work, f"{name}.limit") else "-" for name, _, _ in SECTIONS
    }
    out = [
        f"# GPU check, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "## This machine (the image's own versions; requirements.txt pins torch 2.13.0 / triton 3.7.1)",
        "",
        *versions(),
        "",
        f"## What ran (`bash benchmarks/gpu_check.sh` took {seconds} s of its {budget})",
        "",
        "| part | limit | outcome |",
        "|---|---|---|",
        f"| preflight | - | {preflight} |",
        *(f"| {title} | {limits[name]} | {outcome(work, name, stopped)} |" for name, title, _ in SECTIONS),
    ]
    failures = tier_summary(read(work, "tier"))[1]
    if failures:
        out += ["", "GPU tier failures:", "", *(f"- {line}" for line in failures)]
    report.parent.mkdir(parents=True, exist_ok=True)
    if read(work, "tier"):  # the report keeps its head and tail, the log all of it
        shutil.copyfile(work / "tier", report.with_name(f"{report.stem}_tier.log"))
        out += ["", f"The tier's whole log: {report.stem}_tier.log, beside this report."]
    for name, title, command in SECTIONS:
        text = excerpt(read(work, name))
        if text:  # the targets and the sweep print markdown tables; the rest is log output
            out += ["", f"## {title} (`{command}`)", "", *([text] if name in MARKDOWN else ["```", text, "```"])]
    report.write_text("\n".join(out) + "\n")
    print(f"report: {report}")


if __name__ == "__main__":
    main()
