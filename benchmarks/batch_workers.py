"""Round-robin in one thread vs one worker thread per env batch, for the native rollout.

Both modes run the native script's per-batch step (device frame stack, fused inference,
sampling, actions to the host) on utils.ThreadedAtariEnvs with real Breakout envs; only
who drives the batches differs:
- round-robin: one Python thread visits batch 0, 1, ..., B-1 each step; while it runs
  inference for batch b, the C++ threads step the other batches' envs.
- threads: batch b has its own Python thread doing recv, inference, send for all steps;
  torch ops and ale-py's recv release the GIL, so threads can overlap.
Interleaved rounds, medians. Run: python benchmarks/batch_workers.py [--num-envs 16 --steps 200]
"""

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_profile import native_setup  # noqa: E402

import utils  # noqa: E402


def rollout(mode, num_envs, num_batches, steps, env_threads, seed=0):
    torch.set_num_threads(1)  # as the native scripts do during the rollout on CPU
    envs = utils.ThreadedAtariEnvs("Breakout-v5", num_envs, num_batches, env_threads, seed)
    batch = envs.batch_size
    setups = [native_setup(batch, envs.num_actions, steps=steps + 1, seed=b) for b in range(num_batches)]
    rewards = np.zeros((steps + 1, num_envs), np.float32)
    dones = np.zeros((steps + 1, num_envs), np.float32)
    for b, frames in enumerate(np.split(envs.reset(), num_batches)):
        setups[b][1].start(0, frames)

    def drive(b, t):
        sl = envs.slices[b]
        frames, ended = (None, ()) if t == 0 else envs.recv(b, rewards[t - 1, sl], dones[t, sl])
        actions = setups[b][0](t, frames, ended)
        envs.send(b, actions.numpy())

    start = time.perf_counter()
    if mode == "round-robin":
        for t in range(steps):
            for b in range(num_batches):
                drive(b, t)
    else:
        workers = [threading.Thread(target=lambda b=b: [drive(b, t) for t in range(steps)]) for b in range(num_batches)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    for b in range(num_batches):  # collect the last step's results
        envs.recv(b, rewards[steps - 1, envs.slices[b]], dones[steps, envs.slices[b]])
    elapsed = time.perf_counter() - start
    envs.close()
    return steps * num_envs / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--env-threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    results = {}
    for r in range(args.rounds):
        for b in args.batches:
            for mode in ("round-robin", "threads"):
                sps = rollout(mode, args.num_envs, b, args.steps, args.env_threads, seed=r)
                results.setdefault((b, mode), []).append(sps)
                print(f"round {r + 1} B={b} {mode}: {sps:,.0f}", file=sys.stderr, flush=True)
    print(
        f"Native rollout (inference + env, no training), Breakout-v5, {args.num_envs} envs, "
        f"{args.env_threads} env threads per batch, {os.cpu_count()} cores, CPU, {time.strftime('%Y-%m-%d')}\n"
    )
    print("| num-gpu-batches | round-robin steps/s | thread per batch steps/s | threads / round-robin |")
    print("|---|---|---|---|")
    for b in args.batches:
        rr, th = np.median(results[(b, "round-robin")]), np.median(results[(b, "threads")])
        print(f"| {b} | {rr:,.0f} | {th:,.0f} | {th / rr:.2f}x |")


if __name__ == "__main__":
    main()
