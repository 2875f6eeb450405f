"""What the Atari scripts share. First the native rollout: threaded env stepping and CUDA stream
batching. Then the conventions every script follows: flags, torchrun, run directories and logs,
the compiled update (--compile) and the graphed one (CUDA graphs), checkpoints and stops, the game
in gymnasium, evaluation, profiling. The design: docs/rollout.md, docs/update.md, docs/protocol.md.
"""

import contextlib
import copy
import csv
import difflib
import functools
import gc
import inspect
import io
import math
import os
import pickle
import random
import re
import shlex
import signal
import sys
import threading
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import torch

SCORES_CSV = Path(__file__).with_name("atari_scores.csv")
# the game's settings: fields of every script's Args, whose defaults are the protocol (README, "The game")
GAME = ("repeat_action_probability", "frame_skip", "frame_stack", "screen_size", "noop_max", "fire_reset",
        "max_episode_frames", "full_action_space", "clip_rewards", "life_loss_terminal")  # fmt: skip


def game_settings(args) -> dict:
    """The game a script's args set (GAME's fields), as plain data."""
    return {name: getattr(args, name) for name in GAME}


def ale_options(game: dict) -> dict:
    """AtariVectorEnv's keywords for `game`: rewards unclipped (returns are summed from them)."""
    return dict(
        frameskip=game["frame_skip"], repeat_action_probability=game["repeat_action_probability"],
        noop_max=game["noop_max"], use_fire_reset=game["fire_reset"],
        max_num_frames_per_episode=game["max_episode_frames"], full_action_space=game["full_action_space"],
        img_height=game["screen_size"], img_width=game["screen_size"], reward_clipping=False, autoreset_mode="SameStep",
    )  # fmt: skip


# ----------------------------------------------------------------------------- threaded envs
def seeded_reset(envs, seed):
    """Seed an AtariVectorEnv (env i: seed + i, below 2**31) and start its games; returns (obs, info).
    The second, unseeded reset unties the first game's FIRE frame from its noop count (docs/protocol.md)."""
    envs.reset(seed=(seed + np.arange(envs.num_envs)) % 2**31)
    return envs.reset()


def probe_frames(env_id, game, num_envs, device, steps=40, seed=0) -> torch.Tensor:
    """Real frame stacks of `game`, uint8 [num_envs, stack, size, size] on `device`, after `steps` random steps."""
    from ale_py.vector_env import AtariVectorEnv

    envs = AtariVectorEnv(rom_id(env_id), num_envs, **ale_options(game), stack_num=game["frame_stack"], num_threads=1)
    obs, _ = seeded_reset(envs, seed)
    actions = np.random.default_rng(seed).integers(envs.single_action_space.n, size=(steps, num_envs))
    for action in actions:
        obs, *_ = envs.step(action)
    envs.close()
    return torch.from_numpy(obs).to(device)


NO_GAME_ENDED = np.zeros(0, dtype=np.int64)


class ThreadedAtariEnvs:
    """`num_envs` ale-py envs playing `game` in `num_batches` fixed batches, each one AtariVectorEnv
    whose C++ threads step it with the GIL released. Each env returns its newest frame only; full-game
    returns are summed here from raw rewards. serial=True: send() steps the batch to completion (debugging)."""

    def __init__(self, env_id, num_envs, num_batches, num_threads, seed, game, serial=False, first_core=None):
        from ale_py.vector_env import AtariVectorEnv

        assert num_envs % num_batches == 0
        self.num_envs, self.num_batches = num_envs, num_batches
        self.batch_size = num_envs // num_batches
        self.slices = [slice(b * self.batch_size, (b + 1) * self.batch_size) for b in range(num_batches)]
        self.life_loss_terminal, self.frame_shape = game["life_loss_terminal"], (game["screen_size"],) * 2
        self.reward_bound = 1.0 if game["clip_rewards"] else np.inf  # what the learner's rewards are clipped to
        self.threads_per_batch = split_threads(num_threads, num_batches, self.batch_size)
        # with first_core, batch b's threads are pinned to its own cores, after the earlier batches'
        offsets = np.cumsum([0, *self.threads_per_batch[:-1]])
        self.envs = [
            AtariVectorEnv(rom_id(env_id), self.batch_size, **ale_options(game), num_threads=threads, stack_num=1,
                           thread_affinity_offset=-1 if first_core is None else first_core + int(offsets[b]),
                           life_loss_info=self.life_loss_terminal)
            for b, threads in enumerate(self.threads_per_batch)
        ]  # fmt: skip
        self.num_actions, self.seed = int(self.envs[0].single_action_space.n), seed
        self.full_strength = np.ones(self.batch_size, dtype=np.float32)  # ale-py's paddle strength, unused here
        self.episode_return = np.zeros(num_envs, dtype=np.float64)
        self.episode_length, self.frame_number = np.zeros((2, num_envs), dtype=np.int64)
        # each batch's slices of them, made once: recv runs every batch-step
        self.accounts = [
            (self.episode_return[sl], self.episode_length[sl], self.frame_number[sl]) for sl in self.slices
        ]
        self.finished = []  # (env index, full-game return, length in agent steps, step it ended)
        self.steps = np.zeros(num_batches, dtype=np.int64)  # vector steps per batch since pop_finished
        self.serial, self.results = serial, [None] * num_batches

    def reset(self, seed=None) -> np.ndarray:
        """Reset every env, the batches at once (a seeded reset reloads each env's ROM, and ale-py
        releases the GIL); returns the first frames, uint8 [num_envs, size, size]."""
        seed = self.seed if seed is None else seed
        frames = np.empty((self.num_envs, *self.frame_shape), dtype=np.uint8)
        with ThreadPoolExecutor(self.num_batches) as pool:
            resets = list(pool.map(seeded_reset, self.envs, seed + self.batch_size * np.arange(self.num_batches)))
        for b, (obs, info) in enumerate(resets):
            frames[self.slices[b]] = obs[:, -1]
            self.frame_number[self.slices[b]] = info["episode_frame_number"]
        self.episode_return[:] = self.episode_length[:] = 0
        return frames

    def send(self, b: int, actions: np.ndarray):
        """Start batch b's step with int64 actions [batch]. ale-py's bound call: AtariVectorEnv.send's
        checks and its new paddle-strength array per call cost as much again (docs/rollout.md)."""
        self.envs[b].ale.send(actions, self.full_strength)
        if self.serial:
            self.results[b] = self.envs[b].ale.recv()

    def recv(self, b: int, rewards_out: np.ndarray, dones_out: np.ndarray):
        """Wait for batch b and write the learner's rewards and terminals in place; returns (frames
        uint8 [batch, size, size], indices in the batch whose game ended)."""
        return self.account(b, self.results[b] if self.serial else self.envs[b].ale.recv(), rewards_out, dones_out)

    def account(self, b: int, results, rewards_out: np.ndarray, dones_out: np.ndarray):
        """recv's bookkeeping of ale-py's results for batch b, in a few array operations: the games'
        returns and lengths, the learner's rewards (clipped) and terminals; a game's end is rare."""
        obs, reward, terminated, truncated, info = results
        returns, lengths, frame_number = self.accounts[b]
        self.steps[b] += 1
        returns += reward
        lengths += 1
        np.copyto(rewards_out, reward, casting="unsafe")
        if reward.any():
            np.clip(rewards_out, -self.reward_bound, self.reward_bound, out=rewards_out)
        # a real game over restarts the episode frame counter; a lost life does not
        new_frame_number = info["episode_frame_number"]
        game_over = terminated & (new_frame_number < frame_number)
        game_over |= truncated
        frame_number[:] = new_frame_number
        np.logical_or(terminated if self.life_loss_terminal else game_over, truncated, out=dones_out, casting="unsafe")
        if not game_over.any():
            return obs[:, 0], NO_GAME_ENDED
        ended = np.flatnonzero(game_over)
        for j in ended:
            self.finished.append((self.slices[b].start + j, float(returns[j]), int(lengths[j]), int(self.steps[b])))
        returns[ended] = lengths[ended] = 0
        return obs[:, 0], ended

    def pop_finished(self):
        """The games ended since the last call, in order; each one's last field counts the vector
        steps since that call (1 = the first), so a script logs it at the step where it ended."""
        finished = sorted(self.finished, key=lambda game: game[3])
        self.finished = []
        self.steps[:] = 0
        return finished

    def close(self):
        for env in self.envs:
            env.close()


def split_threads(num_threads, num_batches, batch_size) -> list[int]:
    """Batch b gets q + (b < r) threads, q, r = divmod(num_threads, num_batches); 1 to batch_size."""
    q, r = divmod(num_threads, num_batches)
    return [max(1, min(q + (b < r), batch_size)) for b in range(num_batches)]


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "quota period", or "max period"
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")  # -1: no quota


def usable_cores() -> tuple[int, bool]:
    """(CPUs this process may use, whether it owns every core): the affinity mask, capped by a
    cgroup CPU quota, which containers often use instead of a cpuset."""
    affinity = os.sched_getaffinity(0)
    cores, quota = len(affinity), None
    try:
        if CGROUP_CPU_MAX.exists():
            limit, period = CGROUP_CPU_MAX.read_text().split()[:2]
            quota = None if limit == "max" else int(limit) / int(period)
        elif CGROUP_V1_QUOTA.exists():
            limit = int(CGROUP_V1_QUOTA.read_text())
            period = int(CGROUP_V1_QUOTA.with_name("cpu.cfs_period_us").read_text())
            quota = None if limit <= 0 else limit / period
    except (OSError, ValueError):
        quota = None
    if quota is not None and quota < cores:
        return max(1, math.ceil(quota)), False  # CPU time, not cores: never pin
    return cores, affinity == set(range(os.cpu_count() or 1))


def env_threads(requested, device, num_batches, batch_size, local_rank=0, local_world_size=1):
    """(env threads of each batch, first core to pin them from or None) for this process. CUDA:
    its share of the cores but the driver's, pinned when it owns the machine; CPU: min(cores,
    batch size) per batch, unpinned (docs/rollout.md, "The env-thread budget")."""
    cores, whole_machine = usable_cores()
    share = max(1, cores // local_world_size)
    if requested is None:
        requested = max(num_batches, share - 1) if device.type == "cuda" else num_batches * min(cores, batch_size)
    per_batch = split_threads(requested, num_batches, batch_size)
    pinned = device.type == "cuda" and whole_machine and sum(per_batch) <= share - 1
    return per_batch, (local_rank * share if pinned else None)


# ----------------------------------------------------------------------------- GPU batching
# Each env batch has its own stream, pinned host buffers and events, used by the rules in
# docs/rollout.md ("Streams and events"). On CPU a stream is None (on_stream enters nothing for
# it) and an event records and waits for nothing.
def new_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def on_stream(stream):  # torch.cuda.stream(None) would still initialize CUDA where it is available
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def fork_streams(streams):
    """Each stream waits for the default stream's work so far; no host sync."""
    for stream in filter(None, streams):
        stream.wait_stream(torch.cuda.current_stream(stream.device))


def join_streams(streams):
    """The default stream waits for each stream's work so far; no host sync."""
    for stream in filter(None, streams):
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def new_event(device: torch.device):
    """An event the host waits on by sleeping, not by spinning a core the env threads need (CPU: a no-op)."""
    if device.type == "cuda":
        return torch.cuda.Event(blocking=True)
    return SimpleNamespace(record=lambda stream=None: None, synchronize=lambda: None)


def host_buffer(shape, dtype, device: torch.device) -> torch.Tensor:
    """Page-locked when a GPU is used, so copies can be asynchronous."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def warm_up(step, num_steps, num_batches, streams):
    """Run step(t, b) once for every step and batch on this thread, before any worker thread
    or capture: Triton compiles at a first launch (not thread-safe), cuDNN picks algorithms."""
    fork_streams(streams)  # the buffers, storage and weights were made on the default stream
    for b, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            for t in range(num_steps):
                step(t, b)
    torch.cuda.synchronize()


def capture_graphs(step, num_steps, num_batches, streams):
    """A CUDA graph of step(t, b) for every step and batch, after a warm_up; returns replay(t, b).
    Each batch captures on its own stream into one memory pool, with cuBLAS's workspaces cleared
    first so that its own is made in that pool (docs/rollout.md, "CUDA graphs")."""
    graphs = [[None] * num_batches for _ in range(num_steps)]
    torch.cuda.synchronize()
    for b in range(num_batches):
        pool = torch.cuda.graph_pool_handle()
        torch._C._cuda_clearCublasWorkspaces()  # the next cuBLAS call, in capture, makes one in `pool`
        for t in range(num_steps):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(streams[b]):  # (torch.cuda.graph() would collect garbage per graph)
                graph.capture_begin(pool=pool)
                step(t, b)
                graph.capture_end()
            graphs[t][b] = graph
    torch.cuda.synchronize()
    return lambda t, b: graphs[t][b].replay()


def drive(rollouts, mode, pool=None):
    """Run every batch's rollout generator to its end. "single": one thread resumes them in turn (each
    yields where it waits); "threads": one worker thread each from `pool`; "sequential": one after another."""
    run_through = functools.partial(deque, maxlen=0)
    if mode == "threads":
        list(pool.map(run_through, rollouts))
    elif mode == "sequential":
        list(map(run_through, rollouts))
    else:
        while rollouts:  # each next() runs a batch to its next wait
            rollouts = [rollout for rollout in rollouts if next(rollout, StopIteration) is not StopIteration]


class BatchedRollout:
    """The native scripts' rollout: the env batches stepped by their C++ threads while the
    device runs the policy for other batches, each batch with its own stream and buffers,
    writing straight into the script's storage (passed by keyword, shapes in the script).
    policy: kernels.rollout_policy's; driver: see drive; cuda_graphs: replay each batch-step."""

    def __init__(self, envs, policy, *, obs, actions, logprobs, values, rewards, dones, driver, cuda_graphs, profiler):
        import kernels  # here, not at the top: the baseline imports utils and needs no Triton

        self.kernels, self.policy, self.envs, self.driver, self.profiler = kernels, policy, envs, driver, profiler
        self.rewards, self.dones = rewards, dones
        self.device, (T, N) = obs.device, rewards.shape
        self.T, self.obs, self.slices, num_batches = T, obs, envs.slices, len(envs.slices)
        # every sample's uniform, drawn before each rollout; rewards and terminals stay on the
        # host, where they arrive, until the horizon is done, then cross to the device once
        self.uniforms = torch.zeros((T + 1, N), device=self.device)
        self.rewards_host = host_buffer((T, N), torch.float32, self.device)
        self.dones_host = host_buffer((T + 1, N), torch.float32, self.device)
        self.rewards_np, self.dones_np = self.rewards_host.numpy(), self.dones_host.numpy()
        self.copied = new_event(self.device)  # the host writes rewards_host and dones_host after it
        self.training_threads = torch.get_num_threads()
        # per batch: a stream, device buffers, pinned buffers for its new frames and its actions,
        # and an event after its step's last copy (the host waits on it before reusing them)
        batch = envs.batch_size
        self.streams = [new_stream(self.device) for _ in range(num_batches)]
        self.buffers = [kernels.inference_buffers(obs[0, sl].shape, envs.num_actions, policy.dtype, self.device)
                        for sl in self.slices]  # fmt: skip
        self.staging = [host_buffer(buf.staged.shape, torch.uint8, self.device) for buf in self.buffers]
        self.actions_host = [host_buffer((batch,), torch.long, self.device) for _ in self.slices]
        self.staging_np = [staging.numpy() for staging in self.staging]
        self.actions_host_np = [actions_host.numpy() for actions_host in self.actions_host]
        self.step_done = [new_event(self.device) for _ in self.slices]
        # every view batch b's step t touches, made once: the stacks before it (at t = 0, obs[T]
        # from the last horizon), its stacks, uniforms, actions, log-probs and values
        self.step_views = [
            [(obs[t - 1 if t > 0 else T, sl], obs[t, sl], self.uniforms[t, sl], actions[t, sl], logprobs[t, sl],
              values[t, sl]) for sl in self.slices]
            for t in range(T + 1)
        ]  # fmt: skip

        def step(t, b):  # frames in, the policy, actions out: one graph, one launch per batch-step
            self.buffers[b].staged.copy_(self.staging[b], non_blocking=True)
            policy.step(self.buffers[b], *self.step_views[t][b], shift=t > 0)
            self.actions_host[b].copy_(self.step_views[t][b][3], non_blocking=True)

        if self.device.type == "cuda":
            warm_up(step, T + 1, num_batches, self.streams)
        self.step = capture_graphs(step, T + 1, num_batches, self.streams) if cuda_graphs else step
        self.pool = ThreadPoolExecutor(num_batches, thread_name_prefix="env-batch") if driver == "threads" else None

    def start(self):
        """Start the games: their first frames go to obs[T] (older frames zero), which the first
        rollout moves to step 0."""
        kernels = self.kernels
        for b, frames in enumerate(np.split(self.envs.reset(), len(self.slices))):
            with on_stream(self.streams[b]):
                kernels.stage_frames(self.staging_np[b], frames, ended=slice(None))
                self.buffers[b].staged.copy_(self.staging[b], non_blocking=True)
                prev, out = self.obs[self.T - 1, self.slices[b]], self.obs[self.T, self.slices[b]]
                kernels.push_frames(prev, self.buffers[b].staged, out, self.buffers[b].x)
                self.step_done[b].record(self.streams[b])  # staging[b] is written again after it
        join_streams(self.streams)
        self.dones_np[self.T] = 0

    def collect(self, should_stop=lambda: False):
        """One rollout of T steps into the storage, rewards and terminals copied to the device
        after it. Returns False, the rollout abandoned, if should_stop() came true."""
        self.policy.refresh()
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # idle OpenMP threads would spin on the env threads' cores
        torch.rand(self.uniforms.shape, out=self.uniforms, device=self.device)
        self.copied.synchronize()  # the last copies of the host buffers are done
        self.dones_np[0] = self.dones_np[self.T]
        fork_streams(self.streams)
        self.stopped = False
        drive([self.rollout_batch(b, should_stop) for b in range(len(self.slices))], self.driver, self.pool)
        join_streams(self.streams)
        if self.device.type == "cpu":
            torch.set_num_threads(self.training_threads)
        if self.stopped:
            return False
        self.rewards.copy_(self.rewards_host, non_blocking=True)
        self.dones.copy_(self.dones_host, non_blocking=True)
        self.copied.record()
        return True

    def launch(self, t, b, frames=None, ended=()):
        """Queue batch b's step t on its stream: its new frames staged (at t = 0 the stacks only
        move, and the staged copy goes unread), the step (frames in, policy, actions out), the event."""
        if frames is not None:
            with self.profiler("staging"):
                self.kernels.stage_frames(self.staging_np[b], frames, ended)
        with on_stream(self.streams[b]), self.profiler("launch"):
            with self.profiler.gpu(self.streams[b]):
                self.step(t, b)
            self.step_done[b].record(self.streams[b])

    def rollout_batch(self, b, should_stop):
        """Env batch b through the horizon, as a generator that pauses (yield) while its policy
        runs and while its envs step; a stop sets self.stopped and ends it."""
        sl = self.slices[b]
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        for step in range(self.T + 1):
            if should_stop():
                self.stopped = True
                return
            if step == 0:
                self.launch(0, b)
            else:
                with self.profiler("env wait"):
                    frames, ended = self.envs.recv(b, self.rewards_np[step - 1, sl], self.dones_np[step, sl])
                self.launch(step, b, frames, ended)
            yield
            with self.profiler("GPU wait"):
                self.step_done[b].synchronize()
            if step < self.T:  # the step after the horizon only gives the bootstrap value
                with self.profiler("send"):
                    self.envs.send(b, self.actions_host_np[b])
                yield

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()


def resolve_driver(driver: str, device: torch.device, num_batches: int) -> str:
    """auto: one driver thread on CUDA, a worker thread per batch elsewhere; one batch: sequential."""
    if num_batches == 1:
        return "sequential"
    if driver == "auto":
        return "single" if device.type == "cuda" else "threads"
    return driver


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto: bf16 where the hardware has it (CUDA sm_80+, CPUs with AVX-512 BF16 or AMX), else fp32."""
    if device.type == "cuda":
        has_bf16 = torch.cuda.get_device_capability(device) >= (8, 0)
        if precision == "bf16" and not has_bf16:
            raise UsageError(f"--precision bf16: not supported by {torch.cuda.get_device_name(device)}")
    else:
        has_bf16 = cpu_has_bf16()
    return ("bf16" if has_bf16 else "fp32") if precision == "auto" else precision


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def use_device(device: torch.device, precision: str) -> torch.dtype:
    """Make `device` this thread's and return the rollout's dtype. fp32 means float32 everywhere,
    TF32 off in cuDNN and matmuls, so that the rollout's log-probs equal the learner's."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # worker threads set theirs
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.bfloat16 if precision == "bf16" else torch.float32


# ----------------------------------------------------------------------------- games and flags
class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit code 2."""


def fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


DEFAULT_ENV_ID = "Breakout-v5"


@functools.cache
def atari_games() -> dict:
    """ale-py's v5 games: 'mspacman' -> ('MsPacman', ROM id 'ms_pacman')."""
    import ale_py
    from ale_py import roms

    gym.register_envs(ale_py)
    names = [key[4:-3] for key in gym.envs.registry if key.startswith("ALE/") and key.endswith("-v5")]
    rom_ids = {rom.replace("_", ""): rom for rom in roms.get_all_rom_ids()}
    return {name.lower(): (name, rom_ids[name.lower()]) for name in names if name.lower() in rom_ids}


def canonical_env_id(env_id: str) -> str:
    """'breakout-v5', 'ALE/Breakout-v5' -> 'Breakout-v5'; an unknown game fails with close matches."""
    match = re.fullmatch(r"(?:ALE/)?([A-Za-z0-9_]+)-v5", env_id)
    if match is None:
        raise UsageError(f"--env-id {env_id!r}: expected a name like Breakout-v5 or ALE/Breakout-v5")
    games = atari_games()
    key = match.group(1).lower().replace("_", "")
    if key not in games:
        names = [name for name, _ in games.values()]
        close = difflib.get_close_matches(match.group(1), names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(c + '-v5' for c in close)}?" if close else ""
        raise UsageError(f"--env-id {env_id!r}: unknown Atari game {match.group(1)!r}{hint}")
    return f"{games[key][0]}-v5"


def game_name(env_id: str) -> str:
    return canonical_env_id(env_id).removesuffix("-v5")


def rom_id(env_id: str) -> str:
    return atari_games()[game_name(env_id).lower()][1]


def num_actions(env_id: str, full_action_space: bool) -> int:
    """The size of the action set the envs use: every joystick action, or the game's minimal set."""
    from ale_py import ALEInterface, LoggerMode, roms

    ALEInterface.setLoggerMode(LoggerMode.Error)
    ale = ALEInterface()
    ale.loadROM(roms.get_rom_path(rom_id(env_id)))
    return len(ale.getLegalActionSet() if full_action_space else ale.getMinimalActionSet())


def cli(args_class):
    """tyro.cli(args_class), its multi-line error box turned into one line and exit code 2."""
    import tyro

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            return tyro.cli(args_class)
    except SystemExit as e:
        text = captured.getvalue()
        if e.code in (0, None):  # --help
            print(text, end="")
            raise
        # tyro's box: a title, a rule (in a terminal, none), the message wrapped over lines up
        # to the next rule, then for a misspelled flag what was meant
        lines = [line.strip(" │╭╮╰╯\t") for line in text.splitlines() if line.strip() and not line.startswith("usage:")]
        body = lines[1:]
        while body and not body[0].strip("-─"):
            body.pop(0)
        message = []
        for line in body:
            if not line.strip("-─") or line.startswith("For full helptext"):
                break
            message.append(line)
        message = " ".join(message) or "could not parse the command line"
        if "Perhaps you meant:" in lines and lines.index("Perhaps you meant:") + 1 < len(lines):
            message += f"; perhaps you meant {lines[lines.index('Perhaps you meant:') + 1].split()[0]}"
        fail(f"{message} (see --help)")


def resolve_device(spec: str) -> torch.device:
    """auto: CUDA when present, else CPU. A CUDA device comes back with its index."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", spec):
        raise UsageError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


# every numeric flag's valid range (its --help says it too): flag -> (what it must be, test)
AT_LEAST_0, AT_LEAST_1 = ("at least 0", lambda v: v >= 0), ("at least 1", lambda v: v >= 1)
POSITIVE = ("finite and > 0", lambda v: math.isfinite(v) and v > 0)
NON_NEGATIVE = ("finite and >= 0", lambda v: math.isfinite(v) and v >= 0)
RANGES = {
    "seed": ("an integer in [0, 2**32 - 1]", lambda v: 0 <= v < 2**32),
    **dict.fromkeys(["total_timesteps", "num_envs", "num_steps", "num_minibatches", "num_gpu_batches", "save_interval",
                     "log_interval", "eval_episodes", "frame_skip", "max_episode_frames"], AT_LEAST_1),
    **dict.fromkeys(["update_epochs", "noop_max"], AT_LEAST_0),
    "frame_stack": ("in [1, 16]", lambda v: 1 <= v <= 16), "screen_size": ("in [16, 256]", lambda v: 16 <= v <= 256),
    "num_env_threads": ("at least 1 (or unset)", lambda v: v is None or v >= 1),
    **dict.fromkeys(["learning_rate", "clip_coef", "max_grad_norm"], POSITIVE),
    **dict.fromkeys(["ent_coef", "vf_coef", "rms_eps"], NON_NEGATIVE),
    **dict.fromkeys(["gamma", "gae_lambda", "repeat_action_probability"], ("in [0, 1]", lambda v: 0 <= v <= 1)),
    "target_kl": ("finite and > 0 (or unset)", lambda v: v is None or (math.isfinite(v) and v > 0)),
    "rms_alpha": ("in [0, 1)", lambda v: 0 <= v < 1),
}  # fmt: skip


def check_args(args, make_agent):
    """What every script checks of its flags before anything starts: numeric ranges, that its
    network make_agent(num_actions, frame_stack, screen_size) takes such frames, the game (its
    canonical name from here on), the experiment name, the runs directory (a directory, or under a
    writable one), --capture-video."""
    for name, value in vars(args).items():
        if name in RANGES and not RANGES[name][1](value):
            raise UsageError(f"--{name.replace('_', '-')} must be {RANGES[name][0]}, got {value}")
    stack, size = args.frame_stack, args.screen_size
    try:  # one zero observation through the script's network (quietly: too small a frame may warn)
        with warnings.catch_warnings(action="ignore"):
            make_agent(18, stack, size).eval().get_action_and_value(torch.zeros(1, stack, size, size))
    except (RuntimeError, ValueError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"--screen-size {size}: the network cannot take {size}x{size} frames ({why})")
    if args.env_id is None and args.eval_checkpoint is None:  # evaluation: the checkpoint's game
        args.env_id = DEFAULT_ENV_ID
    if args.env_id is not None:
        args.env_id = canonical_env_id(args.env_id)
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*", args.exp_name) or ".." in args.exp_name:
        raise UsageError(f"--exp-name {args.exp_name!r}: a name (letters, digits, _ . + = -), not a path")
    path = Path(args.runs_dir).absolute()
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "is not a directory" if not existing.is_dir() else "is not writable"
        raise UsageError(f"--runs-dir {str(args.runs_dir)!r}: {str(existing)!r} {why}")
    if args.capture_video and args.eval_checkpoint is None:
        raise UsageError("--capture-video records evaluation games: use it with --eval-checkpoint")
    import importlib.util

    if args.capture_video and importlib.util.find_spec("moviepy") is None:
        raise UsageError("--capture-video needs moviepy: pip install moviepy")


# ----------------------------------------------------------------------------- torchrun
def torchrun_device(device: torch.device) -> torch.device:
    """Under torchrun on CUDA, cuda:LOCAL_RANK (one GPU per process); else the CPU."""
    if device.type != "cuda":
        return device
    local_world_size, count = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if local_world_size > count:
        raise UsageError(
            f"torchrun started {local_world_size} processes on this machine, which has {count} GPU(s): "
            f"use --nproc-per-node {count}, or --device cpu"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed(backend, device: torch.device):
    """Join torchrun's process group (nccl on CUDA, gloo on CPU, unless `backend` says);
    returns (rank, world size, local rank, local world size)."""
    import torch._dynamo  # noqa: F401  (imported after the group exists, it keeps gloo's threads alive at exit)
    import torch.distributed as dist

    dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"))
    local = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return dist.get_rank(), dist.get_world_size(), *local


def all_reduce_gradients(parameters, world_size):
    """Average the gradients over the ranks: one all-reduce of one flat buffer, eagerly wherever the
    step is not (--compile: CompiledStep has Dynamo skip it; graphed: between two graphs)."""
    import torch.distributed as dist

    grads = [p.grad for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    between_graphs(dist.all_reduce, flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def agree(stop, nonfinite, logprob_gap):
    """Under torchrun every rank stops, diverges or fails the guard when any rank does: sets `stop` where
    another rank was signalled; returns whether any rank's `nonfinite` was set and the largest `logprob_gap`."""
    import torch.distributed as dist

    device = logprob_gap.device
    flags = torch.stack([torch.tensor(float(bool(stop)), device=device), nonfinite.float(), logprob_gap.float()])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0] > 0 and not stop:
        stop.received = "a signal on another rank"
    return flags[1] > 0, flags[2]


def finish_distributed(agent, rank: int, world_size: int):
    """Say whether every rank ends with rank 0's weights (a silent desync would not), and leave."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in agent.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        identical = all(torch.equal(g, gathered[0]) for g in gathered)
        print(f"weights identical on all {world_size} ranks: {identical}", flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- runs and logs
def start_run(args, checkpoint, rank=0, distributed=False):
    """Log setup: (run directory, TensorBoard writer, stop signal, start iteration, global step). A resumed
    run continues in its directory, a new one gets its own; under torchrun only rank 0 logs, to rank 0's."""
    from torch.utils.tensorboard import SummaryWriter

    if checkpoint is not None:
        run_dir = checkpoint_path(args.resume).parent
        start_iteration, global_step = checkpoint["iteration"], checkpoint["global_step"]
    else:
        run_dir = make_run_dir(args) if rank == 0 else None
        start_iteration, global_step = 0, 0
        if distributed:
            import torch.distributed as dist

            names = [run_dir.name if rank == 0 else None]
            dist.broadcast_object_list(names, src=0)
            run_dir = Path(args.runs_dir) / names[0]
    nothing = lambda *args, **kwargs: None
    writer = SimpleNamespace(add_scalar=nothing, add_text=nothing, close=nothing)  # what other ranks log to
    if rank == 0:
        # purge_step drops the events a crashed run wrote after its last checkpoint
        writer = SummaryWriter(str(run_dir), purge_step=global_step + 1 if checkpoint else None)
        if checkpoint is None:
            rows = "\n".join(f"|{key}|{value}|" for key, value in sorted(vars(args).items()))
            writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{rows}")
    return run_dir, writer, StopSignal(run_dir / "checkpoint.pt"), start_iteration, global_step


def make_run_dir(args) -> Path:
    """runs/{Game}-v5__{exp_name}__{seed}__{unix_time}, made exclusively: a second run started
    in the same second gets the suffix -2 (then -3, ...)."""
    name = f"{canonical_env_id(args.env_id)}__{args.exp_name}__{args.seed}__{int(time.time())}"
    base = Path(args.runs_dir) / name
    base.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 1000):
        run_dir = base if attempt == 1 else base.with_name(f"{name}-{attempt}")
        with contextlib.suppress(FileExistsError):  # exclusive: fails if another run made it first
            run_dir.mkdir()
            return run_dir
    raise UsageError(f"could not create a new run directory next to {base}")


def describe_run(args, device: torch.device, envs: str, precision: str = "fp32", world_size: int = 1) -> str:
    """The first line of every run: where it runs and what it will do, on which game and action set."""
    where = "cpu (no CUDA found)" if not torch.cuda.is_available() else "cpu"
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} ({device})"
    actions = f"{num_actions(args.env_id, args.full_action_space)} actions"
    stack, size = args.frame_stack, args.screen_size
    frames = f", {stack}x{size}x{size} frames" if (stack, size) != (4, 84) else ""
    game = f"{args.env_id} ({actions}{', full set' if args.full_action_space else ''}{frames})"
    if args.eval_checkpoint is not None:
        what = f"evaluating {args.eval_checkpoint} on {game} for {args.eval_episodes} games"
    else:
        batch = args.batch_size * world_size
        steps = args.num_iterations * batch
        iterations = f"{args.num_iterations:,} iteration{'s' if args.num_iterations != 1 else ''}"
        what = f"{game}, {iterations} of {batch:,} steps = {steps:,} agent steps"
    return f"{where}, {precision}, {envs}; {what}"


def rollout_text(args, threads_per_batch, first_core, driver, graphs, policy) -> str:
    """The first line's account of a native rollout: envs, threads, driver, graphs, policy step."""
    threads = f"{sum(threads_per_batch)} env threads ({','.join(map(str, threads_per_batch))} per batch)"
    text = f"{args.num_envs} envs x {args.num_gpu_batches} batches, {threads}"
    text += " pinned" if first_core is not None else ""
    text += f", driver {driver}, CUDA graphs {'on' if graphs else 'off'}, policy {policy.name}"
    return text + (f" ({policy.reason})" if policy.reason else "")


class Progress:
    """One line per iteration, from host-side numbers only (no GPU sync)."""

    def __init__(self, total_steps: int, start_step: int):
        self.total_steps, self.start_step, self.start_time = total_steps, start_step, time.time()
        self.recent_returns = deque(maxlen=20)
        self.rollout_time = 0.0  # seconds spent collecting, added up by the scripts
        self.compiled = None  # --compile: the CompiledStep, whose time the first line reports

    def sps(self, global_step: int) -> int:
        return int((global_step - self.start_step) / max(time.time() - self.start_time, 1e-9))

    def line(self, iteration: int, num_iterations: int, global_step: int) -> str:
        sps = self.sps(global_step)
        seconds = int((self.total_steps - global_step) / max(sps, 1))
        hours, rest = divmod(seconds, 3600)
        eta = f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
        ret = f"{np.mean(self.recent_returns):.1f}" if self.recent_returns else "-"
        rollout = f" (rollout {int((global_step - self.start_step) / self.rollout_time)})" if self.rollout_time else ""
        compiled = ""
        if self.compiled is not None:
            compiled, self.compiled = self.compiled.text(), None
        return (
            f"iter {iteration}/{num_iterations}  step {global_step:,}/{self.total_steps:,}  "
            f"SPS: {sps}{rollout}  ETA {eta}  return {ret} (last {len(self.recent_returns)} games){compiled}"
        )


# ----------------------------------------------------------------------------- --compile
class CompiledStep:
    """--compile: `step` (loss, backward, clip, optimizer step) under torch.compile, replayed from CUDA
    graphs on CUDA, its first call timed. Where that first call fails compiled, the optimizers' weights
    and state are put back (its graphs ran as they compiled) and it and every later call run eagerly
    after one line on stderr; a later call's error raises (docs/update.md)."""

    def __init__(self, step, device: torch.device, backend="inductor"):
        global all_reduce_gradients  # here, not at import: torch._dynamo takes seconds to import
        if not hasattr(all_reduce_gradients, "_torchdynamo_orig_callable"):
            all_reduce_gradients = torch.compiler.disable(all_reduce_gradients)
        import torch._inductor.config as inductor

        inductor.emulate_precision_casts = True  # bf16: round where autocast and the rollout do
        self.step, self.cuda = step, device.type == "cuda"
        mode = "reduce-overhead" if self.cuda else None
        self.compiled = torch.compile(step, backend=backend, mode=mode, dynamic=False)
        self.seconds, self.eager = None, False

    def __call__(self, *args):
        if self.eager:
            return self.step(*args)
        if self.cuda:  # a new step: the last one's outputs were copied out, their memory is reused
            torch.compiler.cudagraph_mark_step_begin()
        if self.seconds is not None:
            return self.compiled(*args)
        optimizers = [arg for arg in args if isinstance(arg, torch.optim.Optimizer)]
        weights = [(p, p.detach().clone()) for o in optimizers for group in o.param_groups for p in group["params"]]
        states = [(o, {p: copy.deepcopy(state) for p, state in o.state.items()}) for o in optimizers]
        start = time.perf_counter()
        try:
            out = self.compiled(*args)
        except Exception as e:
            while getattr(e, "inner_exception", None) or e.__cause__:  # the backend's own error
                e = getattr(e, "inner_exception", None) or e.__cause__
            reason = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            reason = f"{type(e).__name__}: {reason}"[:300]
        else:
            self.seconds = time.perf_counter() - start
            return out
        with torch.no_grad():  # its graphs ran as they compiled: the optimizer's may have stepped
            for p, saved in weights:
                p.copy_(saved)
        for optimizer, state in states:
            optimizer.state.clear()
            optimizer.state.update(state)
        out = self.step(*args)  # outside the handler: an error of the step itself raises as it does eagerly
        self.eager = True
        print(f"warning: --compile: {reason}; the update runs eagerly", file=sys.stderr, flush=True)
        return out

    def text(self) -> str:
        """For the first progress line: the compile's time, or that it failed."""
        if self.eager:
            return ", compile failed: eager"
        return "" if self.seconds is None else f", compile {self.seconds:.1f} s"


# ----------------------------------------------------------------------------- the graphed update
class GraphedStep:
    """The update's step replayed from CUDA graphs (on CUDA with --cuda-graphs, without --compile):
    `step(*args)` (forward, loss, backward, clip, optimizer step) runs eagerly at its first call, is
    captured then, and every later call is one replay (docs/update.md, "The graphed update").

    A graph reads its inputs where they lay at its capture: every tensor argument must be the same
    memory at every call (checked), but those named in `copied`, which are copied into the graph's
    own buffer at each call; other arguments are frozen into the graph (checked too). Each replay
    overwrites the last one's outputs: the caller copies them out at once.

    The capture: after the first call (eager: the first step is eager's, and the optimizer's state
    exists), `warmup` more calls on a side stream, as PyTorch asks; then the weights, buffers and
    optimizer state are put back as the first call left them, and the gradients set to None, so that
    backward makes them in the graph's pool and each replay refills them. Where the step calls
    `between_graphs(fn, ...)` (torchrun's all-reduce) the capture ends a graph and begins the next:
    a replay runs the graphs in turn, fn eagerly between them.

    Off CUDA nothing is captured and the rest runs, for the tests: the first call, the warm-up and
    the restore, the checks and copies, then the step eagerly on the graph's inputs at every call."""

    capturing = None  # the GraphedStep whose capture is running now: between_graphs splits its graph

    def __init__(self, step, device: torch.device, copied=(), warmup=2):
        names = list(inspect.signature(step).parameters)
        self.step, self.device, self.warmup = step, device, warmup
        self.names, self.copied = names, {names.index(name) for name in copied}
        self.inputs = self.graphs = self.replays = self.outputs = None

    def __call__(self, *args):
        if self.inputs is None:
            return self._first_call(args)
        for i, (arg, captured) in enumerate(zip(args, self.inputs, strict=True)):
            if not self._same(i, arg, captured):
                name = self.names[i] if i < len(self.names) else i
                raise ValueError(f"{self.step.__name__}'s argument {name} is not the one its CUDA graph reads")
        for i in self.copied:
            self.inputs[i].copy_(args[i])
        if self.replays is None:  # off CUDA
            return self.step(*self.inputs)
        for replay in self.replays:
            replay()
        return self.outputs

    def _same(self, i, arg, captured):
        if i in self.copied:
            return (arg.shape, arg.dtype, arg.device) == (captured.shape, captured.dtype, captured.device)
        if isinstance(captured, torch.Tensor):
            return isinstance(arg, torch.Tensor) and (arg.data_ptr(), arg.shape, arg.stride(), arg.dtype) == (
                captured.data_ptr(), captured.shape, captured.stride(), captured.dtype
            )  # fmt: skip
        return arg is captured or (not isinstance(arg, torch.Tensor) and arg == captured)

    def _first_call(self, args):
        optimizers = [arg for arg in args if isinstance(arg, torch.optim.Optimizer)]
        modules = [arg for arg in args if isinstance(arg, torch.nn.Module)]
        with warnings.catch_warnings():  # a capturable optimizer warns at a step outside a capture, as these are
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
            out = self.step(*args)
            state = [p for o in optimizers for group in o.param_groups for p in group["params"]]
            state += [
                t for o in optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)
            ]
            state += [b for m in modules for b in m.buffers()]
            with torch.no_grad():
                saved = [t.clone() for t in state]
            self.inputs = [arg.clone() if i in self.copied else arg for i, arg in enumerate(args)]
            stream = new_stream(self.device)
            fork_streams([stream])
            with on_stream(stream):
                for _ in range(self.warmup):
                    self.step(*self.inputs)
            join_streams([stream])
        with torch.no_grad():  # the warm-up stepped: as the first call left them
            for t, value in zip(state, saved):
                t.copy_(value)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        if stream is not None:
            self._capture(stream)
        return out

    def _capture(self, stream):
        torch.cuda.synchronize(self.device)  # as torch.cuda.graph does: no other work, no garbage freed in it
        gc.collect()
        torch.cuda.empty_cache()
        torch._C._cuda_clearCublasWorkspaces()  # cuBLAS then makes its workspace in the graph's pool
        self.pool, self.graphs, self.replays = torch.cuda.graph_pool_handle(), [], []
        GraphedStep.capturing = self
        try:
            with torch.cuda.stream(stream):
                self._begin()
                try:
                    self.outputs = self.step(*self.inputs)
                except BaseException:
                    with contextlib.suppress(Exception):
                        self.graphs[-1].capture_end()
                    raise
                self._end()
        except Exception as e:
            reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise RuntimeError(
                f"the update's step cannot be captured in a CUDA graph ({reason}): a sync with the host in it? "
                "--no-cuda-graphs runs it eagerly"
            ) from e
        finally:
            GraphedStep.capturing = None
        join_streams([stream])

    def _begin(self):
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(pool=self.pool)

    def _end(self):
        self.graphs[-1].capture_end()
        self.replays.append(self.graphs[-1].replay)

    def split(self, fn, *args):
        """In the capture: end the graph here, run fn(*args) eagerly after it at every replay, begin the next."""
        self._end()
        self.replays.append(functools.partial(fn, *args))
        self._begin()


def between_graphs(fn, *args):
    """fn(*args) now; in a GraphedStep's capture, eagerly at this point of every replay, between two graphs
    (torchrun's all-reduce: with any backend, no collective in a graph)."""
    if GraphedStep.capturing is None:
        return fn(*args)
    GraphedStep.capturing.split(fn, *args)


# ----------------------------------------------------------------------------- the optimizer
def optimizer_options(device: torch.device, compile: bool, has_fused=True, graphs=False) -> dict:
    """A torch optimizer's implementation: eager, fused on CUDA where there is one; --compile, capturable
    foreach on CUDA, single-tensor on the CPU; graphed (CUDA graphs, on CUDA only), capturable, fused as
    eagerly where there is a fused one, else foreach (docs/update.md). Every key is set: a resume imposes them."""
    cuda = device.type == "cuda"
    if compile:
        return dict(foreach=cuda, capturable=cuda) | (dict(fused=None) if has_fused else {})
    if graphs and cuda:
        return dict(foreach=None if has_fused else True, capturable=True) | (dict(fused=True) if has_fused else {})
    return dict(foreach=None, capturable=False) | (dict(fused=cuda or None) if has_fused else {})


def load_optimizer(optimizer, saved: dict, hyper: dict):
    """Restore a checkpoint's optimizer state under this run's `hyper` (rate, implementation), set before
    loading too, so that eager, --compile and graphed runs resume each other's checkpoints."""
    optimizer.load_state_dict(saved | {"param_groups": [group | hyper for group in saved["param_groups"]]})
    optimizer.param_groups[0].update(hyper)  # the rate tensor itself, not the copy loading made


def set_lr(optimizer, lr: float):
    """The optimizer's rate, in place where it is a tensor (annealing recompiles and recaptures nothing)."""
    group = optimizer.param_groups[0]
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


# ----------------------------------------------------------------------------- reliability
def save_checkpoint(path, state: dict):
    """Write atomically (temp file, fsync, rename): a crash mid-write leaves the old file whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a second Ctrl-C: leave no half-written temp file
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# what every checkpoint holds, and what a resumable one adds: key -> type (plain data only,
# so that torch.load(weights_only=True) reads it without running code)
CHECKPOINT_KEYS = {"script": str, "env_id": str, "num_actions": int, "model": dict, "args": dict}
RESUME_KEYS = {"optimizer": dict, "iteration": int, "global_step": int, "rng": dict}


def checkpoint_path(path) -> Path:
    """A checkpoint file, or a run directory meaning its checkpoint.pt."""
    path = Path(path)
    return path / "checkpoint.pt" if path.is_dir() else path


def load_checkpoint(path, script: str, env_id: str | None = None, make_agent=None, resume=False) -> dict:
    """Load a checkpoint of `script` without running code from it; refuse with one line a
    missing, corrupt or foreign file, another script's or game's, missing keys, weights that
    do not fit make_agent(num_actions), and (resume=True) optimizer or RNG states that do not fit."""
    path = checkpoint_path(path)
    name = repr(str(path))
    if not path.is_file():
        raise UsageError(f"checkpoint {name} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # a global outside plain data names code it would have run; anything else is no pickle
        found = re.search(r"GLOBAL (\S+)|got <class '([^']+)'>", str(e))
        if found is None:
            raise UsageError(f"checkpoint {name} is corrupt or unreadable ({type(e).__name__})")
        what = found.group(1) or found.group(2)
        raise UsageError(f"checkpoint {name} holds more than plain data ({what}): refused, loading it could run code")
    except Exception as e:  # a truncated or foreign file
        raise UsageError(f"checkpoint {name} is corrupt or unreadable ({type(e).__name__})")
    if not isinstance(state, dict) or not {"model", "script", "env_id"} <= state.keys():
        raise UsageError(f"checkpoint {name} was not written by these scripts")
    if state["script"] != script:
        raise UsageError(f"checkpoint {name} is from {state['script']}, not {script}")
    if env_id is not None and game_name(state["env_id"]) != game_name(env_id):
        raise UsageError(f"checkpoint {name} is for {state['env_id']}, not {env_id}")
    for key, kind in (CHECKPOINT_KEYS | (RESUME_KEYS if resume else {})).items():
        if not isinstance(state.get(key), kind) or (kind is int and isinstance(state[key], bool)):
            got = "missing" if key not in state else f"a {type(state[key]).__name__}"
            raise UsageError(f"checkpoint {name} is not a complete checkpoint of {script}: {key!r} is {got}")
    agent, game = None, game_name(state["env_id"])
    if make_agent is not None:
        actions = num_actions(state["env_id"], state["args"].get("full_action_space") is True)
        if state["num_actions"] != actions:
            raise UsageError(f"checkpoint {name} has {state['num_actions']} actions, {game} has {actions}")
        agent = make_agent(actions, state["args"].get("frame_stack", 4), state["args"].get("screen_size", 84))
        try:
            agent.load_state_dict(state["model"])
        except (RuntimeError, TypeError, ValueError, AttributeError) as e:
            first = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
            raise UsageError(f"checkpoint {name}: its weights do not fit the network for {game} ({first})")
    if resume:
        check_optimizer_state(state["optimizer"], list(agent.parameters()) if agent is not None else None, name)
        try:  # restore them into throwaway generators: what set_rng_states will do
            random.Random().setstate(tuple(state["rng"]["python"]))
            np.random.RandomState().set_state(numpy_rng_state(state["rng"]["numpy"]))
            torch.Generator().set_state(state["rng"]["torch"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise UsageError(f"checkpoint {name}: its RNG states cannot be restored ({type(e).__name__})")
    return state


def check_optimizer_state(optimizer_state: dict, parameters, name):
    """Per parameter, every saved tensor is a scalar or has its shape (load_state_dict would not notice)."""
    groups = optimizer_state.get("param_groups")
    if not isinstance(optimizer_state.get("state"), dict) or not isinstance(groups, list):
        raise UsageError(f"checkpoint {name}: its optimizer state is not an optimizer's")
    if parameters is None:
        return
    if sum(len(group.get("params", [])) for group in groups) != len(parameters):
        raise UsageError(f"checkpoint {name}: its optimizer state is for another network")
    for index, values in optimizer_state["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(parameters) or not isinstance(values, dict):
            raise UsageError(f"checkpoint {name}: its optimizer state is for another network")
        for value in values.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1 and value.shape != parameters[index].shape:
                raise UsageError(f"checkpoint {name}: its optimizer state is for another network")


# what a resumed run keeps: what maps iterations to steps and sets the LR schedule, and the game
RESUME_ARGS = ("num_envs", "num_steps", "total_timesteps", *GAME)


def check_resume_args(checkpoint: dict, args, names=RESUME_ARGS):
    """A resumed run keeps `names` as the checkpoint has them; a finished one cannot resume."""
    saved = checkpoint["args"]
    for name in names:
        if name in saved and saved[name] != getattr(args, name):
            flag, value = f"--{name.replace('_', '-')}", getattr(args, name)
            raise UsageError(f"{flag} {value} differs from the checkpoint's {saved[name]}: resume with the same value")
    if checkpoint["iteration"] >= args.num_iterations:
        steps = checkpoint["global_step"]
        raise UsageError(f"checkpoint {str(args.resume)!r} ends a finished run ({steps:,} steps): nothing to resume")


def play_checkpoint_game(args, checkpoint: dict):
    """Evaluation plays the game a checkpoint was trained on: its game and settings go into args."""
    args.env_id = canonical_env_id(checkpoint["env_id"])
    vars(args).update({name: value for name, value in checkpoint["args"].items() if name in GAME})


def rng_states(device: torch.device) -> dict:
    """Python's, numpy's, torch's and this device's RNG states, as plain data."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    states = {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), position, has_gauss, cached_gaussian],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":  # only this run's device: a machine with fewer GPUs can resume it
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def numpy_rng_state(saved):
    name, keys, *rest = saved
    return (name, np.asarray(keys, dtype=np.uint32), *rest)


def set_rng_states(states: dict, device: torch.device):
    random.setstate(tuple(states["python"]))
    np.random.set_state(numpy_rng_state(states["numpy"]))
    torch.set_rng_state(states["torch"])
    if device.type == "cuda" and states.get("cuda") is not None:
        torch.cuda.set_rng_state(states["cuda"], device)


class StopSignal:
    """SIGINT/SIGTERM set a flag the train loop checks; a second SIGINT stops at once."""

    def __init__(self, checkpoint_path):
        self.received, self.checkpoint_path = None, Path(checkpoint_path)
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            import multiprocessing

            for child in multiprocessing.active_children():  # the baseline's env workers, which
                child.kill()  # inherited this handler: SIGTERM would only set their flag
            last = self.checkpoint_path if self.checkpoint_path.is_file() else "none written yet"
            print(f"stopped at once by a second SIGINT; last checkpoint: {last}", file=sys.stderr, flush=True)
            os._exit(130)
        self.received = signal.Signals(signum).name

    def __bool__(self):
        return self.received is not None


def stopped_message(stop, global_step, checkpoint_path) -> str:
    """One line saying how to continue: the same command with --resume, the script named from the
    repository's root (benchmarks/ppo_atari_slm.py) if it lies in it, else by its file name."""
    argv, skip = [], False
    for arg in sys.argv[1:]:  # drop an earlier --resume
        if skip or arg == "--resume" or arg.startswith("--resume="):
            skip = arg == "--resume"
            continue
        argv.append(arg)
    script, root = Path(sys.argv[0]).resolve(), Path(__file__).resolve().parent
    name = str(script.relative_to(root)) if script.is_relative_to(root) else script.name
    command = shlex.join(["python", name, *argv, "--resume", str(checkpoint_path)])
    return f"stopped by {stop.received} at step {global_step:,}; resume with: {command}"


# The run-long guard: the largest mean |difference| between the rollout's stored log-probs and
# the learner's, for the same weights and actions, that rounding explains (README, "The guard").
LOGPROB_GAP_BOUND = {"fp32": 1e-3, "bf16": 2e-2}


@torch.no_grad()
def nonfinite_policy(agent, obs) -> torch.Tensor:
    """A device bool, not synced: are any weights, or the policy's outputs on `obs`, non-finite?
    (The next rollout would sample from them, and a checkpoint keep them.)"""
    actions = torch.zeros(obs.shape[0], dtype=torch.long, device=obs.device)
    _, logprob, entropy, value = agent.get_action_and_value(obs, actions)
    weights = torch.stack([torch.isfinite(p).all() for p in agent.parameters()]).all()
    return ~(weights & torch.isfinite(torch.cat([logprob, entropy, value.view(-1)])).all())


def check_logprob_gap(gap: float, precision: str, iteration: int, checkpoint_path, *to_close):
    """The run-long guard: stop as fail_diverged does where the rollout's log-probs are farther
    from the learner's (same weights, same actions) than rounding explains."""
    bound = LOGPROB_GAP_BOUND[precision]
    if not gap <= bound:
        what = f"the rollout sampled another policy than the learner's (log-probs {gap:.2g} apart, bound {bound:g})"
        fail_diverged(what, iteration, checkpoint_path, *to_close)


def fail_diverged(what: str, iteration: int, checkpoint_path, *to_close):
    """Training went non-finite: flush the logs, name the last good checkpoint, exit 1."""
    for resource in to_close:
        resource.close()
    last = "no checkpoint was written yet"
    if Path(checkpoint_path).is_file():
        last = f"the last good checkpoint is {checkpoint_path}"
    fail(f"{what} at iteration {iteration}; {last}", code=1)


# ----------------------------------------------------------------------------- the game in gymnasium
class AleGameStart(gym.Wrapper):
    """ale-py's vector-env game start for a gymnasium ALE env made with frameskip=1: FIRE for one
    frame where the action set has it (fire_reset), then max(0, U{0..noop_max-1} - 1) noop frames."""

    def __init__(self, env, noop_max, fire_reset):
        super().__init__(env)
        meanings = env.unwrapped.get_action_meanings()
        self.fire = meanings.index("FIRE") if fire_reset and "FIRE" in meanings else None
        self.noop_max = max(noop_max, 1)  # 0 draws no noop, as 1 does

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        if self.fire is not None:
            obs, _, _, _, info = self.env.step(self.fire)
        noops = int(self.env.unwrapped.np_random.integers(0, self.noop_max)) - (self.fire is not None)
        for _ in range(noops):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


class LifeLossTerminal(gym.Wrapper):
    """A lost life is terminal for the learner while the game goes on, as with ale-py's life_loss_info:
    a reset after one returns the last observation and takes no step; one with a seed or options restarts."""

    def __init__(self, env):
        super().__init__(env)
        self.lives, self.game_over, self.last = 0, True, None

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.env.unwrapped.ale.lives()
        terminated = terminated or 0 < lives < self.lives
        self.lives, self.last = lives, (obs, info)
        return obs, reward, terminated, truncated, info

    def reset(self, *, seed=None, options=None):
        if not self.game_over and seed is None and options is None:
            return self.last
        self.game_over = False
        obs, info = self.env.reset(seed=seed, options=options)
        self.lives = self.env.unwrapped.ale.lives()
        return obs, info


def make_env(env_id, seed, game, video_dir=None):
    """A thunk that makes one gymnasium env playing `game` as ThreadedAtariEnvs does (the baseline's envs;
    with video_dir, evaluation's recorded games): grayscale stacks of frame_stack screen_size-square
    frames, full-game statistics in info["episode"]."""

    def thunk():
        import multiprocessing

        import ale_py

        if multiprocessing.parent_process() is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a worker: Ctrl-C is for the main process
        gym.register_envs(ale_py)
        # frameskip=1 here: AtariPreprocessing skips the frames, max-pooling the last two
        env = gym.make(
            f"ALE/{game_name(env_id)}-v5", frameskip=1, repeat_action_probability=game["repeat_action_probability"],
            full_action_space=game["full_action_space"], max_num_frames_per_episode=game["max_episode_frames"],
            render_mode=None if video_dir is None else "rgb_array",
        )  # fmt: skip
        if video_dir is not None:
            env = gym.wrappers.RecordVideo(env, str(video_dir), episode_trigger=lambda e: True)
        env = AleGameStart(env, game["noop_max"], game["fire_reset"])
        env = gym.wrappers.AtariPreprocessing(
            env, noop_max=0, frame_skip=game["frame_skip"], screen_size=game["screen_size"]
        )
        env = gym.wrappers.RecordEpisodeStatistics(env)  # full games, unclipped, agent steps
        env = gym.wrappers.FrameStackObservation(env, game["frame_stack"], padding_type="zero")
        if game["life_loss_terminal"]:
            env = LifeLossTerminal(env)
        if game["clip_rewards"]:
            env = gym.wrappers.ClipReward(env, -1, 1)
        env.action_space.seed(seed)
        return env

    return thunk


# ----------------------------------------------------------------------------- evaluation
def evaluate_checkpoint(make_agent, evaluated, args, device):
    """--eval-checkpoint: play its games, print the mean, std and human-normalized score, exit."""
    agent = make_agent(evaluated["num_actions"], args.frame_stack, args.screen_size).to(device)
    agent.load_state_dict(evaluated["model"])
    act = lambda obs: agent.get_action_and_value(obs)[0]  # noqa: E731
    video_dir = Path(args.eval_checkpoint).parent / "videos"
    game = game_settings(args)
    returns = evaluate(args.env_id, game, act, args.eval_episodes, args.seed, device, args.capture_video, video_dir)
    mean, std = float(np.mean(returns)), float(np.std(returns))
    hns = human_normalized(game_name(args.env_id), mean)
    hns_text = f"{hns:.3f}" if hns is not None else "n/a (no human score for this game)"
    print(
        f"evaluation {args.env_id}: {len(returns)} games  mean {mean:.2f}  std {std:.2f}  human-normalized {hns_text}"
    )
    sys.exit(0)


def human_normalized(game: str, score: float) -> float | None:
    with open(SCORES_CSV) as f:
        for row in csv.DictReader(f):
            if row["game"] == game and row["human"]:
                random_score, human = float(row["random"]), float(row["human"])
                return (score - random_score) / (human - random_score)
    return None


def evaluate(env_id, game, act, episodes, seed, device, capture_video=False, video_dir=None):
    """The full-game, unclipped returns of `episodes` games of `game`, played by act(uint8 [n, stack, size,
    size]) -> [n] on up to 16 envs (env i seeded seed + i), each counting its first games, its share."""
    if capture_video:
        return evaluate_with_video(env_id, game, act, episodes, seed, device, video_dir)
    n = min(episodes, 16)
    share = [episodes // n + (i < episodes % n) for i in range(n)]
    envs = ThreadedAtariEnvs(env_id, n, 1, min(n, os.cpu_count()), seed, game)
    obs = np.zeros((n, game["frame_stack"], *envs.frame_shape), dtype=np.uint8)
    obs[:, -1] = envs.reset()
    rewards, dones, returns = np.zeros(n, np.float32), np.zeros(n, np.float32), []
    while len(returns) < episodes:
        with torch.no_grad():
            envs.send(0, act(torch.from_numpy(obs).to(device)).cpu().numpy())
        frames, ended = envs.recv(0, rewards, dones)
        obs[:, :-1] = obs[:, 1:]
        obs[ended, :-1] = 0  # a new game's older frames are zero
        obs[:, -1] = frames
        for i, episodic_return, *_ in envs.pop_finished():
            if share[i] > 0:  # games an env begins beyond its share are not counted
                share[i] -= 1
                returns.append(episodic_return)
    envs.close()
    return returns


def evaluate_with_video(env_id, game, act, episodes, seed, device, video_dir):
    """evaluate, one game at a time through the gymnasium pipeline, which can render and record
    (with moviepy, which check_args has checked for)."""
    env = make_env(env_id, seed, game | dict(life_loss_terminal=False), video_dir=video_dir)()
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done = False
        while not done:
            with torch.no_grad():
                action = act(torch.from_numpy(np.asarray(obs)[None]).to(device))
            obs, _, terminated, truncated, info = env.step(int(action[0]))
            done = terminated or truncated
        returns.append(float(info["episode"]["r"]))  # the full game's unclipped return
    env.close()
    return returns


# ----------------------------------------------------------------------------- profiling
class Profiler:
    """--profile: a table of time per phase over iterations 2-4 (the first only where it is the last)
    and a torch.profiler trace of them (trace.json, for Perfetto); docs/rollout.md, "Profiling". Free
    when off, never syncs the device: a batch-step's GPU time comes from events on its stream."""

    def __init__(self, enabled: bool, run_dir=None, device=torch.device("cpu")):
        self.enabled, self.cuda = enabled, enabled and device.type == "cuda"
        self.totals, self.pending, self.lock = {}, [], threading.Lock()
        self.done, self.null = 0, contextlib.nullcontext()
        self.wall_start = None  # the end of the first iteration
        if enabled:
            activities = [torch.profiler.ProfilerActivity.CPU]
            activities += [torch.profiler.ProfilerActivity.CUDA] if self.cuda else []
            self.trace = str(Path(run_dir) / "trace.json")
            self.torch_profiler = torch.profiler.profile(activities=activities)

    def __call__(self, name):
        """Around a host phase: its wall time, added to `name`."""
        return self._phase(name) if self.enabled else self.null

    @contextlib.contextmanager
    def _phase(self, name):
        start = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - start)

    def add(self, name, seconds):
        with self.lock:
            self.totals[name] = self.totals.get(name, 0.0) + seconds

    def gpu(self, stream):
        """Around the device work of one batch-step: its GPU time, from events on its stream."""
        return self._gpu(stream) if self.cuda else self.null

    @contextlib.contextmanager
    def _gpu(self, stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        with self.lock:
            self.pending.append((start, end))

    def step(self, last=False):
        """After each iteration (its rollout waited for): read its GPU times; at the end, the table."""
        if not self.enabled:
            return
        with self.lock:
            pending, self.pending = self.pending, []
        if pending:
            self.add("GPU: batch-steps", sum(start.elapsed_time(end) for start, end in pending) / 1000)
        self.done += 1
        if self.done == 1 and not last:  # the warm-up's times go; the wall clock starts
            self.totals.clear()
            self.wall_start = time.perf_counter()
        if self.done == 1:
            self.torch_profiler.start()  # after the first iteration, and after any CUDA graph capture
        if self.done == 4 or last:
            self.torch_profiler.stop()
            self.torch_profiler.export_chrome_trace(self.trace)
            self.enabled = self.cuda = False
            print(f"profiler trace: {self.trace} (open in https://ui.perfetto.dev)", flush=True)
            print(self.table(), flush=True)

    def table(self) -> str:
        host = {k: v for k, v in self.totals.items() if not k.startswith("GPU:")}
        total = sum(host.values()) or 1.0
        lines = [f"{'phase':<22}{'seconds':>10}{'share':>8}"]
        for name, seconds in sorted(self.totals.items(), key=lambda kv: (kv[0] not in host, -kv[1])):
            share = f"{seconds / total:>8.1%}" if name in host else f"{'':>8}"
            lines.append(f"{name:<22}{seconds:>10.3f}{share}")
        # threads' phases overlap, so the update's share is of the wall time since the first iteration
        if self.wall_start is not None and "training" in host:
            wall = time.perf_counter() - self.wall_start
            lines.append(f"wall time {wall:.3f} s, of which the update (training) {host['training'] / wall:.1%}")
        return "\n".join(lines)
