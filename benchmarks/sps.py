"""Steps/s of the three scripts, end to end and rollout only, side by side in one run.

Each variant runs as a user would run it (a subprocess, Breakout-v5, the scripts' defaults
unless listed), in rounds, each in its own shuffled order. Steps/s is measured from the
progress lines as they arrive, from the end of the first iteration to the end of the run,
so start-up and the first iteration's warm-up (and --compile's compile) are left out; "from
launch" counts every step over the time from starting the process to the last line, start-up
and compile included. Medians and ratios against the baseline are printed as a table.
Modes: end-to-end; rollout-only = `--update-epochs 0` (collect, no learning); profile =
`--profile`, whose table gives the update's share of iterations 2-4's wall time.
Run: python benchmarks/sps.py [--rounds 3] [--variants baseline native-fp32 ...] [--modes ...]
(--compile against eager: --variants native-fp32 native-fp32-compile a2c a2c-compile
--modes end-to-end profile)
"""

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_sweep import PROGRESS  # noqa: E402

SHARE = re.compile(r"of which the update \(training\) ([\d.]+)%")

# name -> (script, extra args, default budget in agent steps); PPO's batch is 16 x 128 = 2048 and
# its progress line comes every iteration, A2C's batch 16 x 32 = 512 and its line every --log-interval
VARIANTS = {
    "baseline": ("ppo_atari_baseline.py", [], 3 * 2048),
    "native-fp32": ("ppo_atari_native.py", ["--precision", "fp32"], 3 * 2048),
    "native-bf16": ("ppo_atari_native.py", ["--precision", "bf16"], 2 * 2048),
    # the rollout's general policy step (Agent.forward), as an edited network runs it
    "native-fp32-module": ("ppo_atari_native.py", ["--precision", "fp32", "--policy", "module"], 3 * 2048),
    "a2c": ("a2c_atari.py", ["--log-interval", "4"], 40 * 512),
    # the update compiled (docs/update.md); its compile lies in the first iteration
    "native-fp32-compile": ("ppo_atari_native.py", ["--precision", "fp32", "--compile"], 3 * 2048),
    "a2c-compile": ("a2c_atari.py", ["--log-interval", "4", "--compile"], 40 * 512),
    # a copy of the native script without the run-long guard (written at start, see without_guard)
    "native-fp32-noguard": ("ppo_atari_native_noguard.py", ["--precision", "fp32"], 3 * 2048),
}
# what the guard adds to ppo_atari_native.py: its gap per minibatch, kept for the first, logged and checked
GUARD = [
    ("logprob_gap = logratio.abs().mean()", "logprob_gap = old_approx_kl"),
    ("stats[7] = losses[6]", "pass"),
    ('writer.add_scalar("losses/rollout_logprob_gap", logprob_gap, global_step)', "pass"),
    ('utils.check_logprob_gap(logprob_gap, precision, iteration, run_dir / "checkpoint.pt", writer, envs)', "pass"),
]


def without_guard(where):
    """ppo_atari_native.py without the guard, written to `where` (it imports the repository's
    kernels and utils through PYTHONPATH); returns its path."""
    text = (ROOT / "ppo_atari_native.py").read_text()
    for old, new in GUARD:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = Path(where) / "ppo_atari_native_noguard.py"
    path.write_text(text)
    return path


MODES = ["end-to-end", "rollout-only", "profile"]
ROLLOUT_ONLY = ["--update-epochs", "0"]
PROFILE = ["--profile"]


def run(script, extra, budget, runs_dir):
    """One run of `script`: (steps/s from its first progress line to its last, steps/s from its
    launch to its last line, the update's share of iterations 2-4 where --profile printed it)."""
    command = [sys.executable, str(ROOT / script), *map(str, extra), "--total-timesteps", str(budget)]
    command += ["--runs-dir", runs_dir]
    launch = time.perf_counter()
    # one pipe for both: a child that fills an unread stderr pipe would block, and this with it
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks, tail, share = [], deque(maxlen=40), None
    for line in process.stdout:
        tail.append(line)
        if match := PROGRESS.search(line):
            marks.append((int(match.group(1).replace(",", "")), time.perf_counter()))
        if match := SHARE.search(line):
            share = float(match.group(1))
        if line.startswith("warning: --compile"):
            print(line, end="", file=sys.stderr, flush=True)
    if process.wait() != 0 or len(marks) < 2:
        raise RuntimeError(f"{' '.join(command)} failed:\n{''.join(tail)[-2000:]}")
    (step0, t0), (step1, t1) = marks[0], marks[-1]
    return (step1 - step0) / (t1 - t0), step1 / (t1 - launch), share


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--modes", nargs="+", default=["end-to-end", "rollout-only"], choices=MODES)
    parser.add_argument("--budget-scale", type=float, default=1.0, help="scale every variant's budget (a quick check)")
    parser.add_argument("--against", default="baseline", help="the variant the ratios are taken against")
    args = parser.parse_args()
    copies = tempfile.TemporaryDirectory()
    if "native-fp32-noguard" in args.variants:
        VARIANTS["native-fp32-noguard"] = (str(without_guard(copies.name)), *VARIANTS["native-fp32-noguard"][1:])
        os.environ["PYTHONPATH"] = str(ROOT)
    variants = [v for v in args.variants if (ROOT / VARIANTS[v][0]).exists()]

    # every (mode, variant) run of a round, in a new seeded order each round: no run always
    # follows the same one, and ratios are taken within a round (runs minutes apart), whose
    # median is reported, because the machine's speed drifts by 30% over minutes here
    runs = [(mode, name) for mode in args.modes for name in variants]
    # A2C has no separate rollout mode: its update is one pass over 80 samples; a rollout has nothing to compile
    runs = [(m, n) for m, n in runs if not (m == "rollout-only" and (n.startswith("a2c") or n.endswith("-compile")))]
    results = {run: [] for run in runs}
    order = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as runs_dir:
        for r in range(args.rounds):
            for i in order.permutation(len(runs)):
                mode, name = runs[i]
                script, extra, budget = VARIANTS[name]
                budget = int(budget * args.budget_scale)
                if mode == "rollout-only":
                    extra, budget = extra + ROLLOUT_ONLY, budget * 4
                if mode == "profile":
                    extra = extra + PROFILE
                sps, from_launch, share = run(script, extra, budget, runs_dir)
                results[(mode, name)].append((sps, from_launch, share))
                text = f"{sps:,.0f} steps/s, {from_launch:,.0f} from launch" + (f", update {share}%" if share else "")
                print(f"round {r + 1} {mode} {name}: {text}", file=sys.stderr, flush=True)

    print(
        f"Breakout-v5, script defaults, {args.rounds} rounds in shuffled order, {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), no GPU, {time.strftime('%Y-%m-%d')}\n"
    )
    print(
        f"| mode | script | steps/s (median) | runs | vs {args.against} (median of the rounds' ratios) "
        "| from launch (median) | update's share of iterations 2-4 (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, name in runs:
        values, from_launch, shares = (np.array(column, dtype=float) for column in zip(*results[(mode, name)]))
        base = results.get((mode, args.against))
        ratio = f"{np.median(values / np.array([b[0] for b in base])):.2f}x" if base else "-"
        text = ", ".join(f"{v:,.0f}" for v in values)
        share = "-" if np.isnan(shares).all() else f"{np.nanmedian(shares):.1f}%"
        launch = f"{np.median(from_launch):,.0f}"
        print(f"| {mode} | {name} | {np.median(values):,.0f} | {text} | {ratio} | {launch} | {share} |")


if __name__ == "__main__":
    main()
