"""Where the native PPO's time goes, measured side by side on the machine it runs on.

For each configuration (16 envs x 8 batches, the headline; 16 x 2, the scripts' default), with the
same envs, batches and C++ env threads the script would use here (Breakout-v5, its default game):

1. envs alone: utils.ThreadedAtariEnvs with random actions, served round-robin by one thread as
   the single driver serves them (every batch sent, then every batch received): what the envs give;
2. the driver's host time per batch-step, by phase: utils.BatchedRollout.collect() with the single
   driver (CUDA's) and a profiler, its recv split into ale-py's call (its wait included) and the
   bookkeeping; "now" and "before" (the driver as it was before issue 59: AtariVectorEnv's send,
   the old bookkeeping, the frames' and the actions' copies launched apart from the step, kept
   below as subclasses), both with a device step that only copies (frames in, actions out), and
   "now" with the real step. The host time apart from waiting is every phase but ale-py's recv
   and the device wait; ale-py's own calls are timed apart, on a batch already done;
3. the rollout's steps/s: collect() as the script calls it (its driver), real and copy-only step;
4. the update alone per iteration (random data, the script's update): host time to queue it and
   wall time to finish it, eagerly, graphed (utils.GraphedStep: one CUDA graph replay per
   minibatch, as the script runs it on CUDA) and, with --compile, compiled (a cold compile takes
   minutes, so it is off by default);
5. end to end: ppo_atari_native.py itself for 3 iterations, steps/s after the first;
and what limits an iteration: the rollout's time against the driver's host time and the envs
alone, beside the update's.

Medians over --rounds. On a CPU the device is the CPU: CUDA's rows (GPU wait, graphs) say so.
Run: python benchmarks/rollout_cost.py [--configs 16x8 16x2] [--rounds 3] [--compile] [--out FILE.md]
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
import ppo_atari_native as native  # noqa: E402
import utils  # noqa: E402

ENV_ID = "Breakout-v5"
GAME = utils.game_settings(native.Args())
PHASES = ("recv (ale-py)", "bookkeeping", "staging", "launch", "GPU wait", "send")
WAITS = ("recv (ale-py)", "GPU wait")  # the phases that wait for the envs or the device


# ----------------------------------------------------------------------------- the driver, timed
class TimedEnvs(utils.ThreadedAtariEnvs):
    """recv's two parts timed apart: ale-py's call (it waits for the batch) and the bookkeeping."""

    profiler = None

    def recv(self, b, rewards_out, dones_out):
        start = time.perf_counter()
        results = self.envs[b].ale.recv()
        self.profiler.add("recv (ale-py)", time.perf_counter() - start)
        with self.profiler("bookkeeping"):
            return self.account(b, results, rewards_out, dones_out)


class BeforeEnvs(TimedEnvs):
    """ThreadedAtariEnvs's send and bookkeeping as they were before issue 59."""

    def send(self, b, actions):
        self.envs[b].send(actions)  # AtariVectorEnv's wrapper: its checks, a new paddle array

    def recv(self, b, rewards_out, dones_out):
        start = time.perf_counter()
        results = self.envs[b].recv()
        self.profiler.add("recv (ale-py)", time.perf_counter() - start)
        with self.profiler("bookkeeping"):
            obs, reward, terminated, truncated, info = results
            sl = self.slices[b]
            self.steps[b] += 1
            self.episode_return[sl] += reward
            self.episode_length[sl] += 1
            np.clip(reward, -self.reward_bound, self.reward_bound, out=rewards_out, casting="unsafe")
            new_frame_number = info["episode_frame_number"]
            game_over = truncated | (terminated & (new_frame_number < self.frame_number[sl]))
            self.frame_number[sl] = new_frame_number
            done = terminated if self.life_loss_terminal else game_over
            np.logical_or(done, truncated, out=dones_out, casting="unsafe")
            ended = np.flatnonzero(game_over)
            for j in sl.start + ended:
                self.finished.append(
                    (j, float(self.episode_return[j]), int(self.episode_length[j]), int(self.steps[b]))
                )
            self.episode_return[sl.start + ended] = self.episode_length[sl.start + ended] = 0
            return obs[:, 0], ended


class BeforeRollout(utils.BatchedRollout):
    """The batch-step as it was before issue 59: the frames' copy, the step, the actions' copy and
    the event launched one by one (the step replayed from graphs of the policy alone)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        def step(t, b):
            self.policy.step(self.buffers[b], *self.step_views[t][b], shift=t > 0)

        graphs = self.device.type == "cuda" and kwargs["cuda_graphs"]
        self.step = utils.capture_graphs(step, self.T + 1, len(self.slices), self.streams) if graphs else step

    def launch(self, t, b, frames=None, ended=()):
        with utils.on_stream(self.streams[b]):
            if frames is not None:
                with self.profiler("staging"):
                    self.kernels.stage_frames(self.staging_np[b], frames, ended)
            with self.profiler("launch"):
                if frames is not None:
                    self.buffers[b].staged.copy_(self.staging[b], non_blocking=True)
                self.step(t, b)
                self.actions_host[b].copy_(self.step_views[t][b][3], non_blocking=True)
                self.step_done[b].record(self.streams[b])


def copy_only_policy(num_actions, dtype):
    """A device step that computes nothing: actions from the step's uniforms, so the envs play as
    with a random policy; with the rollout's own copies, frames in and actions out."""

    def step(buf, prev_obs, obs_out, uniform, action_out, logprob_out, value_out, shift=True):
        torch.mul(uniform, num_actions, out=buf.entropy)
        action_out.copy_(buf.entropy)  # float to long truncates: uniform in [0, 1) -> [0, A)

    return SimpleNamespace(name="copy-only", reason=None, dtype=dtype, step=step, refresh=lambda: None)


class Setup:
    """One configuration's envs, storage and policies, as ppo_atari_native.py makes them."""

    def __init__(self, num_envs, num_batches, device, precision, steps=128, seed=1):
        self.num_envs, self.num_batches, self.device, self.steps = num_envs, num_batches, device, steps
        self.dtype = utils.use_device(device, precision)
        self.batch = num_envs // num_batches
        self.threads, self.first_core = utils.env_threads(None, device, num_batches, self.batch)
        self.num_actions = utils.num_actions(ENV_ID, False)
        torch.manual_seed(seed)
        self.agent = native.Agent(self.num_actions).to(device, memory_format=torch.channels_last)
        frames = utils.probe_frames(ENV_ID, GAME, self.batch, device)
        self.policy = kernels.rollout_policy("auto", self.agent, self.dtype, frames, self.num_actions)
        self.seed = seed

    def envs(self, cls=utils.ThreadedAtariEnvs):
        return cls(ENV_ID, self.num_envs, self.num_batches, sum(self.threads), self.seed, GAME,
                   first_core=self.first_core)  # fmt: skip

    def storage(self):
        T, N, device = self.steps, self.num_envs, self.device
        return dict(
            obs=torch.zeros((T + 1, N, 4, 84, 84), dtype=torch.uint8, device=device),
            actions=torch.zeros((T + 1, N), dtype=torch.long, device=device),
            logprobs=torch.zeros((T + 1, N), device=device),
            values=torch.zeros((T + 1, N), device=device),
            rewards=torch.zeros((T, N), device=device),
            dones=torch.zeros((T + 1, N), device=device),
        )

    def rollout(self, envs, policy, driver, profiler, cls=utils.BatchedRollout):
        graphs = self.device.type == "cuda"
        return cls(envs, policy, **self.storage(), driver=driver, cuda_graphs=graphs, profiler=profiler)


def quiet_profiler(device):
    """utils.Profiler's host phases only: no torch.profiler trace, no timing events on the streams."""
    profiler = utils.Profiler(False, device=device)
    profiler.enabled = True
    return profiler


def envs_alone(setup, rounds, steps=200, warmup=20):
    """Steps/s of the envs alone, served round-robin by one thread, random actions."""
    envs = setup.envs()
    envs.reset()
    B, batch = setup.num_batches, setup.batch
    rewards, dones = np.zeros((B, batch), np.float32), np.zeros((B, batch), np.float32)
    actions = np.random.default_rng(0).integers(envs.num_actions, size=(steps + warmup, B, batch))
    results = []
    for _ in range(rounds):
        for t in range(steps + warmup):
            if t == warmup:
                start = time.perf_counter()
            for b in range(B):
                envs.send(b, actions[t, b])
            for b in range(B):
                envs.recv(b, rewards[b], dones[b])
        results.append(steps * setup.num_envs / (time.perf_counter() - start))
        envs.pop_finished()
    envs.close()
    return statistics.median(results)


def driver_phases(setup, rounds, variant, policy):
    """Seconds per batch-step of each phase (medians over rounds of one horizon each) and the
    horizon's steps/s, served by the single driver."""
    envs_cls, rollout_cls = (BeforeEnvs, BeforeRollout) if variant == "before" else (TimedEnvs, utils.BatchedRollout)
    envs = setup.envs(envs_cls)
    profiler = envs.profiler = quiet_profiler(setup.device)
    rollout = setup.rollout(envs, policy, "single", profiler, rollout_cls)
    rollout.start()
    rollout.collect()  # warm: first frames, first replays
    per_round, sps = [], []
    batch_steps = (setup.steps + 1) * setup.num_batches
    for _ in range(rounds):
        profiler.totals.clear()
        start = time.perf_counter()
        rollout.collect()
        sps.append(setup.steps * setup.num_envs / (time.perf_counter() - start))
        per_round.append({name: profiler.totals.get(name, 0.0) / batch_steps for name in PHASES})
        envs.pop_finished()
    rollout.close()
    envs.close()
    return {name: statistics.median(r[name] for r in per_round) for name in PHASES}, statistics.median(sps)


def rollout_sps(setup, rounds, policy):
    """Steps/s of BatchedRollout.collect() as the script runs it (its driver on this device)."""
    envs = setup.envs()
    driver = utils.resolve_driver("auto", setup.device, setup.num_batches)
    rollout = setup.rollout(envs, policy, driver, utils.Profiler(False, device=setup.device))
    rollout.start()
    rollout.collect()
    results = []
    for _ in range(rounds):
        start = time.perf_counter()
        rollout.collect()
        results.append(setup.steps * setup.num_envs / (time.perf_counter() - start))
        envs.pop_finished()
    rollout.close()
    envs.close()
    return statistics.median(results), driver


def ale_calls(setup, repeats=200):
    """Microseconds of ale-py's own calls on one batch, apart from any wait (medians): its bound send,
    AtariVectorEnv.send's wrapper, and its recv on a batch already done."""
    envs = setup.envs()
    envs.reset()
    env, batch = envs.envs[0], setup.batch
    actions, paddle = np.zeros(batch, np.int64), np.ones(batch, np.float32)
    times = {"ale-py send (bound)": [], "AtariVectorEnv.send (wrapper)": [], "ale-py recv, batch done": []}
    for i in range(repeats):
        start = time.perf_counter()
        if i % 2:
            env.send(actions)
            times["AtariVectorEnv.send (wrapper)"].append(time.perf_counter() - start)
        else:
            env.ale.send(actions, paddle)
            times["ale-py send (bound)"].append(time.perf_counter() - start)
        time.sleep(0.005)  # the batch is done
        start = time.perf_counter()
        env.ale.recv()
        times["ale-py recv, batch done"].append(time.perf_counter() - start)
    envs.close()
    return {name: statistics.median(t) for name, t in times.items()}


# ----------------------------------------------------------------------------- the update
def update_cost(setup, rounds, mode="eager"):
    """(host seconds to queue one iteration's update, wall seconds to finish it, minibatches) for
    ppo_atari_native.update on random data of the script's shapes (medians; the first call, with a
    compile if any, is left out). On a CPU one epoch of the four stands for the iteration: the
    figures are scaled by 4 (an epoch on 2 cores takes seconds)."""
    compile, graphs = mode == "--compile", mode == "graphed"
    args = native.Args(num_envs=setup.num_envs, compile=compile)
    epochs, args.update_epochs = args.update_epochs, args.update_epochs if setup.device.type == "cuda" else 1
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = args.batch_size // args.num_minibatches
    device, B = setup.device, args.batch_size
    agent = native.Agent(setup.num_actions).to(device, memory_format=torch.channels_last)
    # the script's optimizer: a tensor rate where the step is compiled or on CUDA
    lr = torch.tensor(args.learning_rate, device=device) if compile or device.type == "cuda" else args.learning_rate
    options = utils.optimizer_options(device, compile, graphs=graphs)
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5, **options)
    g = torch.Generator(device=device).manual_seed(0)
    b_obs = torch.randint(0, 256, (B, 4, 84, 84), dtype=torch.uint8, device=device, generator=g)
    b_actions = torch.randint(0, setup.num_actions, (B,), device=device, generator=g)
    b_logprobs = torch.full((B,), -np.log(setup.num_actions), device=device)
    b_advantages, b_returns, b_values = (torch.randn(B, device=device, generator=g) for _ in range(3))
    optimize = native.minibatch_step
    if compile:
        torch._dynamo.mark_static_address(b_obs)
        optimize = utils.CompiledStep(native.minibatch_step, device)
    elif graphs:  # off CUDA its checks and copies run, and the step eagerly
        optimize = utils.GraphedStep(native.minibatch_step, device, copied=["mb_inds"])
    data = (b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values)
    host, wall = [], []
    for i in range(rounds + 1):
        sync(device)
        start = time.perf_counter()
        native.update(agent, optimizer, *data, args, setup.dtype, 1, optimize)
        queued = time.perf_counter()
        sync(device)
        if i > 0:
            host.append(queued - start)
            wall.append(time.perf_counter() - start)
    scale = epochs / args.update_epochs
    return statistics.median(host) * scale, statistics.median(wall) * scale, epochs * args.num_minibatches


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- the report
def us(seconds):
    return f"{seconds * 1e6:,.0f}"


def host_apart_from_waiting(times):
    """A batch-step's host seconds in every phase but those that wait for the envs or the device."""
    return sum(seconds for phase, seconds in times.items() if phase not in WAITS)


def what_limits(setup, alone, real_phases, real, update):
    """One line: an iteration's time as the script spends it (the rollout at the real step's steps/s,
    the update as the script runs it), and which of the rollout's bounds binds: the driver's host
    time (its phases apart from waiting, every batch-step of the horizon), or the envs alone."""
    steps = setup.steps * setup.num_envs
    rollout, envs = steps / real, steps / alone
    driver = host_apart_from_waiting(real_phases[0]) * (setup.steps + 1) * setup.num_batches
    if update > rollout:
        limit = "the update"
    elif driver >= 0.8 * rollout:
        limit = "the driver's host time"
    elif envs >= 0.8 * rollout:
        limit = "the envs"
    else:
        limit = "waiting: neither the driver's host time nor the envs alone account for the rollout's time"
    return (
        f"An iteration of {steps:,} steps: rollout {rollout * 1e3:,.0f} ms (the driver's host time apart from "
        f"waiting {driver * 1e3:,.0f} ms, the envs alone {envs * 1e3:,.0f} ms) + update {update * 1e3:,.0f} ms "
        f"= {steps / (rollout + update):,.0f} steps/s at most; what limits it: **{limit}**."
    )


def measure(config, device, precision, rounds, compile, end_to_end):
    num_envs, num_batches = config
    setup = Setup(num_envs, num_batches, device, precision)
    copy_policy = copy_only_policy(setup.num_actions, setup.dtype)
    lines = [f"### {num_envs} envs x {num_batches} batches ({sum(setup.threads)} env threads)", ""]
    alone = envs_alone(setup, rounds)
    phases = {
        "before, copy-only step": driver_phases(setup, rounds, "before", copy_policy),
        "now, copy-only step": driver_phases(setup, rounds, "now", copy_policy),
        "now, real step": driver_phases(setup, rounds, "now", setup.policy),
    }
    lines += [
        "| driver (single), per batch-step, us | " + " | ".join(PHASES) + " | host apart from waiting | steps/s |"
    ]
    lines += ["|---" * (len(PHASES) + 3) + "|"]
    for name, (times, sps) in phases.items():
        host = host_apart_from_waiting(times)
        lines.append(f"| {name} | " + " | ".join(us(times[k]) for k in PHASES) + f" | **{us(host)}** | {sps:,.0f} |")
    before = host_apart_from_waiting(phases["before, copy-only step"][0])
    now = host_apart_from_waiting(phases["now, copy-only step"][0])
    lines += ["", f"Host time per batch-step apart from waiting, copy-only step: now / before = {now / before:.2f}"]
    calls = ale_calls(setup)
    lines += ["", "ale-py's own calls on one batch, us: " + ", ".join(f"{k} {us(v)}" for k, v in calls.items())]
    real, driver = rollout_sps(setup, rounds, setup.policy)
    copy, _ = rollout_sps(setup, rounds, copy_policy)
    lines += [
        "",
        "| steps/s | envs alone | rollout, copy-only step | rollout, real step | real / envs alone |",
        "|---|---|---|---|---|",
        f"| driver {driver} | {alone:,.0f} | {copy:,.0f} | {real:,.0f} | {real / alone:.0%} |",
    ]
    modes = ["eager", "graphed"] + (["--compile"] if compile else [])
    lines += [
        "",
        "| update per iteration | host to queue it, ms | wall, ms | host per minibatch, ms |",
        "|---|---|---|---|",
    ]
    walls = {}
    for name in modes:
        host, walls[name], minibatches = update_cost(setup, rounds, name)
        label = f"{name} (no CUDA: eager)" if name == "graphed" and device.type != "cuda" else name
        lines.append(f"| {label} | {host * 1e3:,.1f} | {walls[name] * 1e3:,.1f} | {host / minibatches * 1e3:,.2f} |")
    lines += ["", what_limits(setup, alone, phases["now, real step"], real, walls["graphed"])]
    if end_to_end:
        sys.path.append(str(ROOT / "benchmarks"))  # last: benchmarks/kernels.py is not the root's kernels
        from gpu_sweep import run as run_script

        flags = ["--num-envs", num_envs, "--num-gpu-batches", num_batches, "--seed", 1]
        with tempfile.TemporaryDirectory() as runs_dir:
            result = run_script("ppo_atari_native.py", flags, 3 * num_envs * 128, runs_dir, timeout=300)
        lines += ["", f"End to end, ppo_atari_native.py, 3 iterations: {result.end_to_end:,.0f} steps/s "
                  f"(rollout {result.rollout:,}; start-up {result.startup:.0f} s)"]  # fmt: skip
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["16x8", "16x2"], help="NUM_ENVSxNUM_BATCHES")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--compile", action="store_true", help="also the update under --compile")
    parser.add_argument("--no-end-to-end", dest="end_to_end", action="store_false")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = parser.parse_args()
    try:
        configs = [tuple(int(x) for x in c.split("x")) for c in args.configs]
        assert all(n > 0 and b > 0 and n % b == 0 for n, b in configs)
    except (ValueError, AssertionError):
        parser.error("--configs: NUM_ENVSxNUM_BATCHES, the batches dividing the envs, e.g. 16x8")
    device = utils.resolve_device(args.device)
    precision = utils.resolve_precision(args.precision, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    lines = [
        f"{where}, {os.cpu_count()} cores, torch {torch.__version__}, {precision}, {time.strftime('%Y-%m-%d')}; "
        f"{ENV_ID}, 128 steps a horizon, medians of {args.rounds} rounds",
        "",
    ]
    if device.type != "cuda":
        lines += ["No CUDA: the device step runs on the CPU, inside `launch`; GPU wait is an event that waits "
                  "for nothing; no CUDA graphs.", ""]  # fmt: skip
    print("\n".join(lines), flush=True)
    for config in configs:
        section = measure(config, device, precision, args.rounds, args.compile, args.end_to_end) + [""]
        print("\n".join(section), flush=True)
        lines += section
    if args.out:
        Path(args.out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
