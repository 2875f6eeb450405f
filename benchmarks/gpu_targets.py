"""The GPU targets, measured side by side in one run: the baseline and the native script at 16
envs, the headline command with each driver and without CUDA graphs, and two throughput
configurations with more envs.

Each row is one run (Breakout-v5, the scripts' defaults unless listed), end to end between its
first and last progress line and rollout-only from its rollout figure (time spent collecting).
Printed as a markdown table with the ratios the targets are about. Without CUDA it exits 0.
Run: python benchmarks/gpu_targets.py [--iterations 4] [--out FILE.md]
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_sweep import run  # noqa: E402

HEADLINE = ["--env-id", "Breakout-v5", "--num-gpu-batches", "8"]
# (name, script, extra flags, agent steps per iteration)
RUNS = [
    ("baseline, 16 envs", "ppo_atari_baseline.py", [], 2048),
    ("native defaults, 16 envs x 2 batches", "ppo_atari_native.py", [], 2048),
    ("headline: 16 envs x 8 batches (single driver, graphs)", "ppo_atari_native.py", HEADLINE, 2048),
    ("headline, --driver threads", "ppo_atari_native.py", [*HEADLINE, "--driver", "threads"], 2048),
    ("headline, --no-cuda-graphs", "ppo_atari_native.py", [*HEADLINE, "--no-cuda-graphs"], 2048),
    ("headline, --policy module (the Agent's forward)", "ppo_atari_native.py", [*HEADLINE, "--policy", "module"], 2048),
    ("256 envs x 2 batches, 32 steps", "ppo_atari_native.py", ["--num-envs", "256", "--num-steps", "32"], 8192),
    (
        "256 envs x 8 batches, 32 steps",
        "ppo_atari_native.py",
        ["--num-envs", "256", "--num-steps", "32", "--num-gpu-batches", "8"],
        8192,
    ),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4, help="iterations per run (the first is not timed)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_targets: CUDA is not available on this machine; nothing measured.")
        return
    lines = [
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; Breakout-v5, {args.iterations} iterations per run\n",
        "| run | end-to-end steps/s | rollout-only steps/s | end to end vs baseline |",
        "|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as runs_dir:
        for name, script, extra, per_iteration in RUNS:
            try:
                results[name] = run(script, extra, args.iterations * per_iteration, runs_dir)
            except RuntimeError as e:
                print(str(e), file=sys.stderr)
                results[name] = None
            base = results.get("baseline, 16 envs")
            if results[name] is None:
                lines.append(f"| {name} | failed | | |")
            else:
                ratio = f"{results[name][0] / base[0]:.2f}x" if base else "-"
                lines.append(f"| {name} | {results[name][0]:,.0f} | {results[name][1]:,} | {ratio} |")
            print(lines[-1], flush=True)
    headline = results.get("headline: 16 envs x 8 batches (single driver, graphs)")
    native16, base = results.get("native defaults, 16 envs x 2 batches"), results.get("baseline, 16 envs")
    best = max(((r[0], name) for name, r in results.items() if r is not None), default=(0, "none"))
    lines.append("")
    if headline:
        lines.append(f"- headline command end to end: {headline[0]:,.0f} steps/s (target >= 10,000)")
    if native16 and base:
        lines.append(f"- native / baseline end to end at 16 envs: {native16[0] / base[0]:.2f}x (target >= 4x)")
    lines.append(f"- best configuration end to end: {best[1]}, {best[0]:,.0f} steps/s (target >= 20,000)")
    module = results.get("headline, --policy module (the Agent's forward)")
    if headline and module:
        lines.append(f"- general policy step / fused, headline end to end: {module[0] / headline[0]:.2f}x")
    print("\n".join(lines[-5:]))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
