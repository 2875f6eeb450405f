"""Per env-batch rollout step, baseline vs native: launches, bytes allocated, bytes to the device.

- launches: aten ops the step dispatches (counted with a TorchDispatchMode; views such as
  slicing count too, since each is a dispatch) plus Triton launches. The fused kernels count
  as one launch each, as on a GPU, whichever path (Triton or torch reference) runs here.
- bytes allocated: torch.profiler(profile_memory=True) attributes allocated bytes to the op
  that made them; convolution primitives are reported apart, because ATen's CPU convolution
  allocates internally even through convolution.out.
- host-to-device bytes per env step: what the step copies from host memory into device storage.

Both sides run the same network at the same batch on real Breakout frames, on this machine's
device (CPU here: the copies that would cross PCIe are counted all the same).
Run: python benchmarks/rollout_profile.py [--batch 8] [--steps 64]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
import ppo_atari_baseline as baseline  # noqa: E402
import ppo_atari_native as native  # noqa: E402
import utils  # noqa: E402

CONV_OPS = ("convolution", "mkldnn", "conv2d")


class CountOps(TorchDispatchMode):
    """Counts aten ops; `kernel()` makes a fused kernel one launch whatever it dispatches."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))

    def kernel(self, fn):
        def launch(*args, **kwargs):
            self.ops.append(f"triton:{fn.__name__}")
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False

        return launch


def native_setup(batch, num_actions=4, steps=64, dtype=torch.float32, seed=0):
    """The native scripts' storage and buffers for one env batch on the CPU, plus `start(frames)`
    and `step(t, frames, ended)`: exactly the device work of the scripts' `launch` (the new
    frames staged and copied, kernels.policy_step into the storage, the actions to the host)."""
    device = torch.device("cpu")
    torch.manual_seed(seed)
    agent = native.Agent(num_actions).to(memory_format=torch.channels_last)
    weights = kernels.inference_weights(agent, dtype)
    obs = torch.zeros((steps + 1, batch, 4, 84, 84), dtype=torch.uint8)
    actions = torch.zeros((steps + 1, batch), dtype=torch.long)
    logprobs, values, uniforms = (torch.zeros((steps + 1, batch)) for _ in range(3))
    torch.rand(uniforms.shape, out=uniforms)
    buf = kernels.inference_buffers(obs[0].shape, num_actions, dtype, device)
    staging = utils.host_buffer(buf.staged.shape, torch.uint8, device)
    staging_np = staging.numpy()
    actions_host = utils.host_buffer((batch,), torch.long, device)
    views = [(obs[t - 1], obs[t], uniforms[t], actions[t], logprobs[t], values[t]) for t in range(steps + 1)]

    def start(frames):
        """obs[0]: the first frames of new games, older slots zero."""
        kernels.stage_frames(staging_np, frames, slice(None))
        buf.staged.copy_(staging, non_blocking=True)
        kernels.push_frames(obs[1], buf.staged, obs[0], buf.x)

    def step(t, frames, ended=()):
        kernels.stage_frames(staging_np, frames, ended)
        buf.staged.copy_(staging, non_blocking=True)
        kernels.policy_step(weights, buf, *views[t])
        actions_host.copy_(views[t][3], non_blocking=True)
        return actions_host

    return start, step


def real_frames(batch, steps, seed=0):
    """Frames [steps + 1, batch, 84, 84] and game-over lists from real Breakout play."""
    envs = utils.ThreadedAtariEnvs("Breakout-v5", batch, 1, 2, seed, utils.game_settings(native.Args()))
    frames, ended = [envs.reset()], [()]
    rewards, dones = np.zeros(batch, np.float32), np.zeros(batch, np.float32)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        envs.send(0, rng.integers(envs.num_actions, size=batch))
        f, e = envs.recv(0, rewards, dones)
        frames.append(f.copy())
        ended.append(e.copy())
    envs.close()
    return frames, ended


FUSED = ("push_frames", "linear_gelu", "policy_value_heads", "sample_logits")


def count_native(batch, steps=8, dtype=torch.float32):
    start, step = native_setup(batch, steps=steps, dtype=dtype)
    frames, _ = real_frames(batch, steps)
    start(frames[0])
    step(1, frames[1])  # warm-up
    originals = [getattr(kernels, name) for name in FUSED]
    with CountOps() as mode:
        # the fused kernels count one launch each, as on a GPU (policy_step finds them by name)
        for name, fn in zip(FUSED, originals):
            setattr(kernels, name, mode.kernel(fn))
        try:
            step(2, frames[2])
        finally:
            for name, fn in zip(FUSED, originals):
                setattr(kernels, name, fn)
    return mode.ops


def count_baseline(batch):
    agent = baseline.Agent(4)
    obs = torch.zeros((8, batch, 4, 84, 84), dtype=torch.uint8)
    actions, logprobs, rewards, dones, values = (torch.zeros((8, batch)) for _ in range(5))
    actions = actions.long()
    frames, _ = real_frames(batch, 8)
    next_obs = torch.tensor(np.stack([np.stack(frames[i : i + 4], 1) for i in range(4)])[0])
    next_done = torch.zeros(batch)
    env_obs = np.stack(frames[4:8], 1)
    env_reward, env_done = np.zeros(batch), np.zeros(batch, bool)
    with CountOps() as mode:
        # the baseline's rollout step, line for line (device = CPU)
        step, device = 1, torch.device("cpu")
        obs[step] = next_obs
        dones[step] = next_done
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step] = value.flatten()
        actions[step] = action
        logprobs[step] = logprob
        action.cpu().numpy()  # envs.step(action.cpu().numpy())
        next_done = np.logical_or(env_done, env_done)
        rewards[step] = torch.tensor(env_reward).to(device).view(-1)
        next_obs, next_done = torch.tensor(env_obs, device=device), torch.Tensor(next_done).to(device)
    return mode.ops


def allocated_bytes(fn, repeats):
    """Bytes allocated per call of fn(i) for i in range(repeats): (convolution primitives, fused
    kernels' torch reference, everything else, {op: bytes} of everything else). Bytes count
    for the outermost op that made them, so a conv's internal buffers land in the conv bucket."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(repeats):
            fn(i)
    conv = reference = other = 0
    others = {}
    for event in prof.events():
        if event.name == "[memory]" or event.self_cpu_memory_usage <= 0:
            continue
        names, parent = [event.name], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if any(c in name for name in names for c in CONV_OPS):
            conv += event.self_cpu_memory_usage
        elif any(name.startswith("kernels.") for name in names):
            reference += event.self_cpu_memory_usage
        else:
            other += event.self_cpu_memory_usage
            others[event.name] = others.get(event.name, 0) + event.self_cpu_memory_usage / repeats
    return conv / repeats, reference / repeats, other / repeats, others


def labelled(fn):
    """Run a fused kernel under a profiler label, so the bytes of its CPU torch reference
    (replaced by one Triton launch on a GPU) are reported apart."""

    def call(*args, **kwargs):
        with torch.profiler.record_function(f"kernels.{fn.__name__}"):
            return fn(*args, **kwargs)

    return call


def native_allocations(batch, steps=32, dtype=torch.float32):
    """Steady-state bytes per native step (two windows of a rollout, after a warm-up)."""
    start, step = native_setup(batch, steps=steps, dtype=dtype)
    originals = [getattr(kernels, name) for name in FUSED]
    for name, fn in zip(FUSED, originals):
        setattr(kernels, name, labelled(fn))
    try:
        return _native_windows(start, step, batch, steps)
    finally:
        for name, fn in zip(FUSED, originals):
            setattr(kernels, name, fn)


def _native_windows(start, step, batch, steps):
    frames, ended = real_frames(batch, steps)
    start(frames[0])
    for t in range(1, 4):  # warm-up
        step(t, frames[t], ended[t])
    windows = []
    half = 4 + (steps - 4) // 2
    for lo, hi in ((4, half), (half, steps)):
        windows.append(allocated_bytes(lambda i, lo=lo: step(lo + i, frames[lo + i], ended[lo + i]), hi - lo))
    return windows


def baseline_allocations(batch, repeats=16):
    agent = baseline.Agent(4)
    frames, _ = real_frames(batch, 8)
    env_obs = np.stack(frames[4:8], 1)
    obs = torch.zeros((8, batch, 4, 84, 84), dtype=torch.uint8)
    values, actions, logprobs = (
        torch.zeros((8, batch)),
        torch.zeros((8, batch), dtype=torch.long),
        torch.zeros(8, batch),
    )
    rewards, dones = torch.zeros((8, batch)), torch.zeros((8, batch))
    next_obs = torch.tensor(env_obs)

    def step():
        nonlocal next_obs
        obs[1] = next_obs
        dones[1] = torch.zeros(batch)
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[1] = value.flatten()
        actions[1] = action
        logprobs[1] = logprob
        action.cpu().numpy()
        rewards[1] = torch.tensor(np.zeros(batch)).view(-1)
        next_obs = torch.tensor(env_obs)

    step()
    return allocated_bytes(lambda i: step(), repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="envs per batch")
    args = parser.parse_args()
    batch = args.batch
    rows = []
    base_ops = count_baseline(batch)
    rows.append(("baseline (fp32)", base_ops, baseline_allocations(batch), 4 * 84 * 84 + 8 + 1))
    # native: one frame and one keep flag per env (kernels.staged_row(84 * 84) bytes with the padding)
    for name, dtype in (("native fp32", torch.float32), ("native bf16", torch.bfloat16)):
        ops = count_native(batch, dtype=dtype)
        rows.append((name, ops, native_allocations(batch, dtype=dtype)[1], kernels.staged_row(84 * 84)))
    print(f"Per env-batch rollout step, batch {batch} envs, torch {torch.__version__}, device cpu\n")
    print(
        "| script | launches (aten ops + Triton) | bytes allocated: conv primitives | fused kernels' CPU reference"
        " | everything else | host-to-device bytes per env step |"
    )
    print("|---|---|---|---|---|---|")
    for name, ops, (conv, reference, other, _), h2d in rows:
        print(f"| {name} | {len(ops)} | {conv:,.0f} | {reference:,.0f} | {other:,.0f} | {h2d:,} |")
    print()
    for name, ops, (_, _, _, others), _ in rows:
        print(f"{name}: {', '.join(ops)}")
        if others:
            print(f"  non-conv allocations: { {k: int(v) for k, v in others.items()} }")
    print(
        "\nbaseline host-to-device per env step: the stacked uint8 observation (4 x 84 x 84),"
        " the float64 reward and the done flag, every step; native: one 84x84 uint8 frame and its"
        " game's keep flag (a 16-byte aligned row), with rewards and terminals (8 bytes per env"
        " step) copied once per iteration."
    )


if __name__ == "__main__":
    main()
