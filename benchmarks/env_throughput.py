"""Env steps/s: utils' threaded env stepping against gymnasium's vector envs and ale-py's own.

Same game, envs, threads and step count for every engine; random actions; the engines are
measured in interleaved rounds, each in its own shuffled order (seeded), and the median is
reported, because these machines are noisy; each ratio is the median of the rounds' ratios
(engines run seconds apart within a round). Rotating one fixed order (A B C D, B C D A, ...)
is not enough: every engine then always follows the same one, and in an earlier version
utils' one-batch run always came right after gymnasium's 16 worker processes had exited.
Engines:
- utils.ThreadedAtariEnvs: ale-py's C++ vector env (stack_num=1) with the host-side episode
  accounting and reward clipping, plus the device frame stack (here the device is the CPU),
  as one batch, and as the native script runs it by default: 2 batches, a worker thread
  each, the C++ threads split between them (equal threads in total).
- ale-py AtariVectorEnv used directly, stack_num=4 (its own frame stack).
- gymnasium SyncVectorEnv and AsyncVectorEnv of ALE v5 envs + AtariPreprocessing + 4-frame
  stack, the baseline's env (utils.make_env).
Run: python benchmarks/env_throughput.py [--env-id Breakout-v5 --num-envs 16 --steps 400 --rounds 5]
"""

import argparse
import os
import platform
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
import ppo_atari_native  # noqa: E402
import utils  # noqa: E402

WARMUP = 20  # untimed vector steps first: thread start-up, first resets
SETTLE = 1.0  # seconds of quiet after each engine, for exiting worker processes and threads
GAME = utils.game_settings(ppo_atari_native.Args())  # the native script's default game


def run_utils(env_id, num_envs, threads, steps, seed=0, num_batches=1):
    """utils' env stepping as the native script drives it: one worker thread per env batch,
    each stepping its batch and pushing its frames; the C++ threads are split between the
    batches, so the total equals the other engines' (`threads`)."""
    torch.set_num_threads(1)  # as the native scripts do during the rollout on CPU
    envs = utils.ThreadedAtariEnvs(env_id, num_envs, num_batches, threads, seed, GAME)
    obs = torch.zeros((2, num_envs, 4, 84, 84), dtype=torch.uint8)
    batch = num_envs // num_batches
    staged = [torch.empty((batch, kernels.staged_row(84 * 84)), dtype=torch.uint8) for _ in range(num_batches)]
    x = [torch.empty((batch, 4, 84, 84)).contiguous(memory_format=torch.channels_last) for _ in range(num_batches)]

    def push(b, t, frames, ended):
        """the frames onto the stacks in obs[t], from obs[1 - t], as the native scripts push them"""
        sl = envs.slices[b]
        kernels.stage_frames(staged[b].numpy(), frames, ended)
        kernels.push_frames(obs[1 - t, sl], staged[b], obs[t, sl], x[b])

    for b, frames in enumerate(np.split(envs.reset(), num_batches)):
        push(b, 0, frames, slice(None))
    rewards, dones = np.zeros(num_envs, np.float32), np.zeros(num_envs, np.float32)
    actions = np.random.default_rng(seed).integers(envs.num_actions, size=(steps + WARMUP, num_envs))
    barrier = threading.Barrier(num_batches + 1)  # the clock starts when every batch is warm

    def batch_loop(b):
        sl = envs.slices[b]
        for t in range(steps + WARMUP):
            if t == WARMUP:
                barrier.wait()
            envs.send(b, actions[t, sl])
            frames, ended = envs.recv(b, rewards[sl], dones[sl])
            push(b, 1 - t % 2, frames, ended)  # alternate the two slots

    with ThreadPoolExecutor(num_batches) as pool:
        done = [pool.submit(batch_loop, b) for b in range(num_batches)]
        barrier.wait()
        start = time.perf_counter()
        for future in done:
            future.result()
    elapsed = time.perf_counter() - start
    envs.close()
    return steps * num_envs / elapsed


def timed_steps(envs, num_envs, steps, seed):
    """Steps/s of a gymnasium-style vector env over `steps` random steps after a warm-up."""
    envs.reset(seed=seed)
    actions = np.random.default_rng(seed).integers(envs.single_action_space.n, size=(steps + WARMUP, num_envs))
    for t in range(steps + WARMUP):
        if t == WARMUP:
            start = time.perf_counter()
        envs.step(actions[t])
    elapsed = time.perf_counter() - start
    envs.close()
    return steps * num_envs / elapsed


def run_ale(env_id, num_envs, threads, steps, seed=0):
    from ale_py.vector_env import AtariVectorEnv

    envs = AtariVectorEnv(
        utils.rom_id(env_id), num_envs, **utils.ale_options(GAME), num_threads=threads, stack_num=4, life_loss_info=True
    )
    return timed_steps(envs, num_envs, steps, seed)


def run_gymnasium(mode, env_id, num_envs, threads, steps, seed=0):
    import gymnasium as gym

    from utils import make_env

    fns = [make_env(env_id, seed + i, GAME) for i in range(num_envs)]
    autoreset = gym.vector.AutoresetMode.SAME_STEP
    if mode == "async":
        envs = gym.vector.AsyncVectorEnv(fns, autoreset_mode=autoreset)
    else:
        envs = gym.vector.SyncVectorEnv(fns, autoreset_mode=autoreset)
    return timed_steps(envs, num_envs, steps, seed)


ENGINES = {
    "utils.ThreadedAtariEnvs (+ frame stack), 1 batch": run_utils,
    "utils.ThreadedAtariEnvs (+ frame stack), 2 batches (native default)": lambda *a: run_utils(*a, num_batches=2),
    "ale-py AtariVectorEnv, direct": run_ale,
    "gymnasium SyncVectorEnv + AtariPreprocessing": lambda *a: run_gymnasium("sync", *a),
    "gymnasium AsyncVectorEnv + AtariPreprocessing": lambda *a: run_gymnasium("async", *a),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-id", default="Breakout-v5")
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--steps", type=int, default=400, help="vector steps per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    results = {name: [] for name in ENGINES}
    names = list(ENGINES)
    order = np.random.default_rng(0)
    for r in range(args.rounds):
        # a new order each round, so that no engine always follows the same one (the async
        # gymnasium env's worker processes, for one, may still be exiting)
        for i in order.permutation(len(names)):
            name = names[i]
            sps = ENGINES[name](args.env_id, args.num_envs, args.threads, args.steps, r)
            results[name].append(sps)
            print(f"round {r + 1}: {name}: {sps:,.0f} steps/s", file=sys.stderr, flush=True)
            time.sleep(SETTLE)

    # ratios are taken within each round, then their median: the machine's speed drifts by
    # 30% over minutes here, far more than between two engines run seconds apart
    medians = {name: float(np.median(v)) for name, v in results.items()}
    ale = np.array(results["ale-py AtariVectorEnv, direct"])
    gym_async = np.array(results["gymnasium AsyncVectorEnv + AtariPreprocessing"])
    print(
        f"{args.env_id}, {args.num_envs} envs, {args.threads} threads, {args.steps} steps x {args.rounds} "
        f"rounds in shuffled order, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"{time.strftime('%Y-%m-%d')}\n"
    )
    print("| engine | agent steps/s (median) | runs | vs ale-py direct | vs gymnasium async |")
    print("|---|---|---|---|---|")
    for name, sps in medians.items():
        runs = np.array(results[name])
        vs_ale, vs_async = np.median(runs / ale), np.median(runs / gym_async)
        text = ", ".join(f"{v:,.0f}" for v in runs)
        print(f"| {name} | {sps:,.0f} | {text} | {vs_ale:.2f}x | {vs_async:.2f}x |")


if __name__ == "__main__":
    main()
