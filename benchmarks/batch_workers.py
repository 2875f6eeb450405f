"""One driver thread against a worker thread per env batch, for the native rollout.

Runs ppo_atari_native.py as a user would, rollout only (--update-epochs 0), with
--driver single (one thread resumes the batches in turn: while one batch's policy runs or its
envs step, it serves the others) and --driver threads (each batch runs in a thread of its own),
for each --num-gpu-batches, in rounds of a new seeded order, on this machine's device (CPU
here; on a GPU machine the same command measures the GPU). Reports the rollout's steps/s
(progress line's rollout figure) and threads / single per round, median over rounds.
Run: python benchmarks/batch_workers.py [--rounds 3] [--num-envs 16] [--batches 2 4 8]
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_sweep import run  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iterations", type=int, default=8, help="iterations of 128 steps per run")
    args = parser.parse_args()
    runs = [(batches, driver) for batches in args.batches for driver in ("single", "threads")]
    results = {run_: [] for run_ in runs}
    order = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as runs_dir:
        for r in range(args.rounds):
            for i in order.permutation(len(runs)):
                batches, driver = runs[i]
                extra = ["--num-envs", args.num_envs, "--num-gpu-batches", batches, "--driver", driver]
                extra += ["--update-epochs", "0"]
                rollout = run("ppo_atari_native.py", extra, args.iterations * args.num_envs * 128, runs_dir).rollout
                results[runs[i]].append(rollout)
                print(f"round {r + 1}: {batches} batches, {driver}: {rollout:,} steps/s", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(
        f"native rollout only, Breakout-v5, {args.num_envs} envs, {args.rounds} rounds in shuffled order, "
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), {device}, "
        f"{time.strftime('%Y-%m-%d')}\n"
    )
    print("| num-gpu-batches | single driver steps/s (median) | thread per batch steps/s (median) | threads / single |")
    print("|---|---|---|---|")
    for batches in args.batches:
        single, threads = np.array(results[(batches, "single")]), np.array(results[(batches, "threads")])
        print(
            f"| {batches} | {np.median(single):,.0f} | {np.median(threads):,.0f} | {np.median(threads / single):.2f}x |"
        )


if __name__ == "__main__":
    main()
