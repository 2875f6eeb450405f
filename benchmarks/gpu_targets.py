"""The GPU targets, measured side by side in one run: the baseline and the native script at 16
envs, the headline command eagerly and with --compile, and 256 envs x 8 batches.

Each row is one run (Breakout-v5, the scripts' defaults unless listed), end to end between its
first and last progress line, rollout-only from its rollout figure (time spent collecting), and
its start-up (to the first progress line: the first iteration, the compile with --compile).
Each row is printed as it finishes; a run that fails or passes its limit says so and the next
one runs. Then the ratios the targets are about. Without CUDA it exits 0.
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
from gpu_sweep import Stopped, run  # noqa: E402

HEADLINE = ["--env-id", "Breakout-v5", "--num-gpu-batches", "8"]
BASELINE, NATIVE16, HEADLINE_RUN, COMPILED = (
    "baseline, 16 envs", "native defaults, 16 envs x 2 batches", "headline: 16 envs x 8 batches",
    "headline, --compile",
)  # fmt: skip
# (name, script, extra flags, agent steps per iteration, seconds it may take or None)
RUNS = [
    (BASELINE, "ppo_atari_baseline.py", [], 2048, None),
    (NATIVE16, "ppo_atari_native.py", [], 2048, None),
    (HEADLINE_RUN, "ppo_atari_native.py", HEADLINE, 2048, None),
    (COMPILED, "ppo_atari_native.py", [*HEADLINE, "--compile"], 2048, 100),  # a cold compile first
    (
        "256 envs x 8 batches, 32 steps",
        "ppo_atari_native.py",
        ["--num-envs", "256", "--num-steps", "32", "--num-gpu-batches", "8"],
        8192,
        100,
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
        "| run | end-to-end steps/s | rollout-only steps/s | start-up s | end to end vs baseline |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as runs_dir:
        for name, script, extra, per_iteration, limit in RUNS:
            try:
                results[name] = run(script, extra, args.iterations * per_iteration, runs_dir, timeout=limit)
            except RuntimeError as e:
                print(str(e), file=sys.stderr, flush=True)
                results[name] = None
                lines.append(f"| {name} | {'stopped at its limit' if isinstance(e, Stopped) else 'failed'} | | | |")
            else:
                r, base = results[name], results.get(BASELINE)
                ratio = f"{r.end_to_end / base.end_to_end:.2f}x" if base else "-"
                lines.append(f"| {name} | {r.end_to_end:,.0f} | {r.rollout:,} | {r.startup:.0f} | {ratio} |")
            print(lines[-1], flush=True)
    headline, compiled = results.get(HEADLINE_RUN), results.get(COMPILED)
    native16, base = results.get(NATIVE16), results.get(BASELINE)
    best = max(((r.end_to_end, name) for name, r in results.items() if r is not None), default=(0, "none"))
    summary = []
    if headline:
        summary.append(f"- headline command end to end: {headline.end_to_end:,.0f} steps/s (target >= 10,000)")
    if native16 and base:
        ratio = native16.end_to_end / base.end_to_end
        summary.append(f"- native / baseline end to end at 16 envs: {ratio:.2f}x (target >= 4x)")
    if headline and compiled:
        ratio = compiled.end_to_end / headline.end_to_end
        summary.append(f"- headline --compile / eager end to end, once compiled: {ratio:.2f}x")
    summary.append(f"- best configuration end to end: {best[1]}, {best[0]:,.0f} steps/s (target >= 20,000)")
    lines += ["", *summary]
    print("\n" + "\n".join(summary))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
