"""Compile, once and in one process, every Triton kernel specialization that gpu_check.sh's
script runs launch, into TRITON_CACHE_DIR, so that the GPU tier's parallel test processes and
the benchmarks find them compiled instead of each compiling the same ones (on triton 3.6 each
new launcher signature is also a gcc build).

A specialization depends on the dtype, the batch size (==1, divisible by 16, tile bucket) and
each pointer's 16-byte alignment, which differs with the batch's offset in the rollout storage:
so each configuration below runs the rollout's policy steps (fused and module) on views of a
storage laid out as utils.BatchedRollout lays it out, for every batch.
Run: python benchmarks/triton_warm.py (without CUDA it says so and exits 0)
"""

import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from benchmarks import aot  # noqa: E402
from ppo_atari_native import Agent  # noqa: E402

# (envs, batches) of the runs gpu_check.sh makes: tests/test_gpu.py (headline 16x8, CSAN 8x4,
# the defaults 16x2, 8 envs with 2 batches), benchmarks/gpu_targets.py (256 envs x 8) and
# benchmarks/gpu_sweep.py --quick (16 and 64 envs x 1 and 8)
CONFIGS = [(16, 8), (8, 4), (16, 2), (8, 2), (256, 8), (16, 1), (64, 1), (64, 8)]
BREAKOUT_ACTIONS = 4


def warm(device, dtypes, configs=CONFIGS, num_actions=BREAKOUT_ACTIONS):
    """Run the fused and the module policy step for every batch of every configuration, at a
    step that carries the stacks over (t = 0) and one that pushes a frame; returns the steps run."""
    agent = Agent(num_actions).to(device)
    steps = 0
    for dtype in dtypes:
        for num_envs, num_batches in configs:
            B, T = num_envs // num_batches, 2
            # the two steps kernels.rollout_policy chooses from (its probe's fresh, aligned
            # tensors specialize as batch 0's views do)
            fused = functools.partial(kernels.policy_step, kernels.inference_weights(agent, dtype))
            module = functools.partial(kernels.module_policy_step, agent)
            obs = torch.zeros((T + 1, num_envs, 4, 84, 84), dtype=torch.uint8, device=device)
            actions = torch.zeros((T + 1, num_envs), dtype=torch.long, device=device)
            logprobs, values, uniforms = (torch.zeros((T + 1, num_envs), device=device) for _ in range(3))
            for step in (fused, module):
                for b in range(num_batches):
                    sl = slice(b * B, (b + 1) * B)
                    buf = kernels.inference_buffers(obs[0, sl].shape, num_actions, dtype, device)
                    for t in (0, 1):
                        prev = obs[t - 1 if t > 0 else T, sl]
                        views = (prev, obs[t, sl], uniforms[t, sl], actions[t, sl], logprobs[t, sl], values[t, sl])
                        step(buf, *views, shift=t > 0)
                        steps += 1
    return steps


def main():
    if not torch.cuda.is_available():
        print("triton_warm: CUDA is not available on this machine; nothing compiled.")
        return
    device = torch.device("cuda", torch.cuda.current_device())
    began = time.perf_counter()
    steps = warm(device, aot.dtypes(kernels.capability(device)))
    torch.cuda.synchronize()
    print(f"triton_warm: {steps} policy steps, every specialization compiled, {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
