"""The run-long guard's own work per PPO iteration (script defaults: 32 minibatches), timed directly:
its mean |log-ratio| in every minibatch, the first one kept, one TensorBoard scalar. What the guard
costs end to end is below what benchmarks/sps.py can resolve on these machines (+-10%).
Run: python benchmarks/guard_cost.py
"""

import tempfile
import time

import torch
from torch.utils.tensorboard import SummaryWriter

logratio = torch.randn(256)
stats = torch.zeros(8)
w = SummaryWriter(tempfile.mkdtemp())
n = 2000
t = time.perf_counter()
for i in range(n):
    for mb in range(32):  # PPO defaults: 4 epochs x 8 minibatches, the gap computed in each
        gap = logratio.abs().mean()
    stats[7] = gap
    w.add_scalar("losses/rollout_logprob_gap", float(stats[7]), i)
per_iter = (time.perf_counter() - t) / n
iteration = 2048 / 460  # seconds: 2,048 steps at 460 steps/s (benchmarks/results/sps_compile_guard.md)
print(f"the guard per PPO iteration: {per_iter * 1e6:.0f} us of {iteration * 1e3:.0f} ms, {per_iter / iteration:.3%}")
