"""Native PPO's steps/s on a GPU over --num-gpu-batches x --num-envs.

Rollout only (`--update-epochs 0`) and end to end, for num-gpu-batches {1, 2, 4, 8, 12}
(where they divide num-envs) x num-envs {64, 256, 1024}. Without CUDA it says so and exits 0.
Run: python benchmarks/gpu_sweep.py [--iterations 6] [--env-threads N]
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sps import measure  # noqa: E402

BATCHES = [1, 2, 4, 8, 12]
NUM_ENVS = [64, 256, 1024]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6, help="iterations per measurement")
    parser.add_argument("--env-threads", type=int, default=os.cpu_count())
    parser.add_argument("--modes", nargs="+", default=["rollout-only", "end-to-end"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_sweep: CUDA is not available on this machine; nothing measured.")
        return

    print(f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}\n")
    for mode in args.modes:
        print(f"{mode}: steps/s by num-gpu-batches (columns) and num-envs (rows)\n")
        print("| num-envs | " + " | ".join(str(b) for b in BATCHES) + " |")
        print("|---|" + "---|" * len(BATCHES))
        with tempfile.TemporaryDirectory() as runs_dir:
            for num_envs in NUM_ENVS:
                cells = []
                for batches in BATCHES:
                    if num_envs % batches:
                        cells.append("-")
                        continue
                    extra = ["--num-envs", str(num_envs), "--num-gpu-batches", str(batches)]
                    extra += ["--num-env-threads", str(args.env_threads), "--device", "cuda"]
                    if mode == "rollout-only":
                        extra += ["--update-epochs", "0"]
                    budget = args.iterations * num_envs * 128
                    cells.append(f"{measure('ppo_atari_native.py', extra, budget, runs_dir):,.0f}")
                print(f"| {num_envs} | " + " | ".join(cells) + " |", flush=True)
        print()


if __name__ == "__main__":
    main()
