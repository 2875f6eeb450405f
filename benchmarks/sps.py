"""Steps/s of the three scripts, end to end and rollout only, side by side in one run.

Each variant runs as a user would run it (a subprocess, Breakout-v5, the scripts' defaults
unless listed), in rounds, each in its own shuffled order. Steps/s is measured from the
progress lines as they arrive, from the end of the first iteration to the end of the run,
so start-up and the first iteration's warm-up are left out. Medians and ratios against the
baseline are printed as a table. Rollout only = `--update-epochs 0` (collect, no learning).
Run: python benchmarks/sps.py [--rounds 3] [--variants baseline native-fp32 ...]
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_sweep import run  # noqa: E402

# name -> (script, extra args, default budget in agent steps); PPO's batch is 16 x 128 = 2048
VARIANTS = {
    "baseline": ("ppo_atari_baseline.py", [], 3 * 2048),
    "native-fp32": ("ppo_atari_native.py", ["--precision", "fp32"], 3 * 2048),
    "native-bf16": ("ppo_atari_native.py", ["--precision", "bf16"], 2 * 2048),
    # the rollout's general policy step (Agent.forward), as an edited network runs it
    "native-fp32-module": ("ppo_atari_native.py", ["--precision", "fp32", "--policy", "module"], 3 * 2048),
    "a2c": ("a2c_atari.py", ["--log-interval", "25"], 25 * 80 * 4),
}
ROLLOUT_ONLY = ["--update-epochs", "0"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--modes", nargs="+", default=["end-to-end", "rollout-only"])
    args = parser.parse_args()
    variants = [v for v in args.variants if (ROOT / VARIANTS[v][0]).exists()]

    # every (mode, variant) run of a round, in a new seeded order each round: no run always
    # follows the same one, and ratios are taken within a round (runs minutes apart), whose
    # median is reported, because the machine's speed drifts by 30% over minutes here
    runs = [(mode, name) for mode in args.modes for name in variants]
    # A2C has no separate rollout mode: its update is one pass over 80 samples
    runs = [(mode, name) for mode, name in runs if not (mode == "rollout-only" and name == "a2c")]
    results = {run: [] for run in runs}
    order = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as runs_dir:
        for r in range(args.rounds):
            for i in order.permutation(len(runs)):
                mode, name = runs[i]
                script, extra, budget = VARIANTS[name]
                if mode == "rollout-only":
                    extra, budget = extra + ROLLOUT_ONLY, budget * 4
                sps = run(script, extra, budget, runs_dir)[0]  # steps/s from the first progress line on
                results[(mode, name)].append(sps)
                print(f"round {r + 1} {mode} {name}: {sps:,.0f} steps/s", file=sys.stderr, flush=True)

    print(
        f"Breakout-v5, script defaults, {args.rounds} rounds in shuffled order, {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), no GPU, {time.strftime('%Y-%m-%d')}\n"
    )
    print("| mode | script | steps/s (median) | runs | vs baseline (median of the rounds' ratios) |")
    print("|---|---|---|---|---|")
    for mode, name in runs:
        values = np.array(results[(mode, name)])
        base = results.get((mode, "baseline"))
        ratio = f"{np.median(values / np.array(base)):.2f}x" if base else "-"
        text = ", ".join(f"{v:,.0f}" for v in values)
        print(f"| {mode} | {name} | {np.median(values):,.0f} | {text} | {ratio} |")


if __name__ == "__main__":
    main()
