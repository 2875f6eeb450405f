"""Native PPO's steps/s on a GPU over num-envs x num-gpu-batches, against the envs' own ceiling.

For num-envs {16, 64, 128, 256, 512} x num-gpu-batches {1, 2, 4, 8} (where they divide), one
run of ppo_atari_native.py per cell (Breakout-v5, the script's defaults otherwise: one driver
thread, CUDA graphs, bf16 where the GPU has it, env threads = usable cores - 1) gives:
- end to end: steps/s between its first and last progress line (the first iteration, with the
  start-up, left out);
- rollout only: the progress line's rollout figure (steps over the time spent collecting);
and for each num-envs the env-only steps/s of the same envs with the same threads (utils'
engine as benchmarks/env_throughput.py runs it: ale-py stepping and the frame push, no
network), the ceiling a rollout can reach, with the rollout's share of it.
--quick: 16 and 64 envs x 1 and 8 batches (the GPU test tier runs it). Cells not started
within --time-limit seconds are reported as not run. Without CUDA it says so and exits 0.
Run: python benchmarks/gpu_sweep.py [--quick] [--iterations 3] [--time-limit 450] [--out FILE.md]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque, namedtuple
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import utils

NUM_ENVS = [16, 64, 128, 256, 512]
BATCHES = [1, 2, 4, 8]
QUICK = ([16, 64], [1, 8])
PROGRESS = re.compile(r"step ([\d,]+)/[\d,]+  SPS: (\d+)(?: \(rollout (\d+)\))?")
# steps/s end to end and rollout only, and the seconds from the start to the first progress line
Run = namedtuple("Run", "end_to_end rollout startup")


class Stopped(RuntimeError):
    """A run stopped at its time limit."""


def run(script, extra, budget, runs_dir, timeout=None):
    """Run(end_to_end, rollout, startup) of one run of `script`: end to end between its first and
    last progress line, rollout from the last line's rollout figure, startup from its start to
    the first line (the first iteration included). RuntimeError if it fails; Stopped, killed,
    after `timeout` seconds."""
    command = [sys.executable, str(ROOT / script), *map(str, extra), "--total-timesteps", str(budget)]
    command += ["--runs-dir", str(runs_dir)]
    began = time.perf_counter()
    # one pipe for both: a child that fills an unread stderr pipe would block, and this with it
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped = threading.Event()

    def stop():
        stopped.set()
        process.kill()

    timer = threading.Timer(timeout, stop) if timeout else None
    if timer:
        timer.start()
    marks, tail = [], deque(maxlen=40)
    try:
        for line in process.stdout:
            tail.append(line)
            match = PROGRESS.search(line)
            if match:
                marks.append((int(match.group(1).replace(",", "")), time.perf_counter(), int(match.group(3) or 0)))
        code = process.wait()
    finally:
        if timer:
            timer.cancel()
    if stopped.is_set():
        raise Stopped(f"{' '.join(command)} stopped at its {timeout:.0f} s limit:\n{''.join(tail)[-2000:]}")
    if code != 0 or len(marks) < 2:
        raise RuntimeError(f"{' '.join(command)} failed:\n{''.join(tail)[-2000:]}")
    (step0, t0, _), (step1, t1, rollout) = marks[0], marks[-1]
    return Run((step1 - step0) / (t1 - t0), rollout, t0 - began)


def run_cell(num_envs, batches, iterations, runs_dir):
    extra = ["--num-envs", num_envs, "--num-gpu-batches", batches]
    return run("ppo_atari_native.py", extra, iterations * num_envs * 128, runs_dir)


def env_ceiling(num_envs, threads, steps=300):
    """Env-only steps/s of num_envs Breakout envs on `threads` C++ threads (utils' engine)."""
    import env_throughput

    return env_throughput.run_utils("Breakout-v5", num_envs, threads, steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 and 64 envs x 1 and 8 batches")
    parser.add_argument("--iterations", type=int, default=3, help="iterations per run (the first is not timed)")
    parser.add_argument("--time-limit", type=float, default=450, help="seconds; later cells are not run")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_sweep: CUDA is not available on this machine; nothing measured.")
        return
    envs_list, batches_list = QUICK if args.quick else (NUM_ENVS, BATCHES)
    threads = max(1, utils.usable_cores()[0] - 1)  # the native script's default on CUDA
    start = time.perf_counter()
    lines = [
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; Breakout-v5, native defaults, {args.iterations} iterations per run\n",
        "| num-envs | env-only steps/s | num-gpu-batches | end-to-end steps/s | rollout-only steps/s "
        "| rollout / env-only |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as runs_dir:
        for num_envs in envs_list:
            if time.perf_counter() - start > args.time_limit:
                lines.append(f"| {num_envs} | not run (time limit) | | | | |")
                print(lines[-1], flush=True)
                continue
            ceiling = env_ceiling(num_envs, threads)
            for batches in batches_list:
                if num_envs % batches or num_envs // batches < 1:
                    continue
                if time.perf_counter() - start > args.time_limit:
                    row = f"| {num_envs} | {ceiling:,.0f} | {batches} | not run (time limit) | | |"
                else:
                    try:
                        end_to_end, rollout, _ = run_cell(num_envs, batches, args.iterations, runs_dir)
                        row = (
                            f"| {num_envs} | {ceiling:,.0f} | {batches} | {end_to_end:,.0f} | {rollout:,} "
                            f"| {rollout / ceiling:.0%} |"
                        )
                    except RuntimeError as e:
                        row = f"| {num_envs} | {ceiling:,.0f} | {batches} | failed | | |"
                        print(str(e), file=sys.stderr)
                lines.append(row)
                print(row, flush=True)
    lines.append(f"\n{time.perf_counter() - start:.0f} s in all")
    print(lines[-1])
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
