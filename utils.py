"""Shared helpers for the Atari scripts: what more than one script needs, nothing else.

- Conventions: env ids, devices, run directories, the progress line, clear errors.
- Reliability: atomic checkpoints, resume checks, clean stops on SIGINT/SIGTERM.
- Evaluation of a trained policy over full games, with human-normalized scores.
- Threaded env stepping: ale-py's C++ vector env (it releases the GIL while its threads
  step), split into fixed batches, with full-game episode accounting on the host.
- GPU batching: one CUDA stream and pinned host buffers per env batch, and the device
  frame stack (only the newest 84x84 frame crosses host to device).
"""

import contextlib
import csv
import difflib
import os
import random
import re
import shlex
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

SCORES_CSV = Path(__file__).with_name("atari_scores.csv")
FRAME_SHAPE = (84, 84)
STACK = 4
# The ALE v5 protocol, which every script follows: ale-py's own vector env (AtariVectorEnv),
# configured by ALE_V5, and for the baseline's gymnasium pipeline, AleV5GameStart below.
# - An agent step is 4 frames, max-pooled over the last two; sticky actions 0.25 (each frame
#   repeats the previous action with probability 0.25); a game is cut at 108k frames.
# - Game start: the game is reset, FIRE is pressed for one frame where the game has it, then
#   max(0, U{0..29} - 1) noop frames follow: 1 to 29 frames pass before the first observation.
#   The FIRE frame is itself subject to sticky actions (the previous action is NOOP), so
#   Breakout serves the ball at the start of about 75% of games; in the others the agent has
#   to press FIRE, as it must after every lost life.
# - A lost life is terminal for the learner (life_loss_info) while the game goes on: no reset,
#   no extra step, no automatic FIRE. Episode returns and lengths are full games, unclipped.
# - The first observation of a game has its three older stack slots zero.
# Why ale-py's game start: the native scripts step ale-py's C++ vector env, whose reset cannot
# be changed from Python without giving up its speed, and SLM Lab's published v5 scores were
# made on it; so the baseline reproduces it rather than the other way round.
# Rewards come back unclipped (full-game returns are logged; the learner's are clipped apart)
# and autoreset is SameStep. Tests and benchmarks override single fields of it.
ALE_V5 = dict(
    frameskip=4, repeat_action_probability=0.25, noop_max=30, use_fire_reset=True,
    max_num_frames_per_episode=108_000, reward_clipping=False, autoreset_mode="SameStep",
)  # fmt: skip


class AleV5GameStart(gym.Wrapper):
    """ale-py's vector-env game start (the protocol above) for a gymnasium ALE env made with
    frameskip=1: reset, FIRE for one frame where the game has it, then max(0, U{0..29} - 1)
    noop frames. Put it under AtariPreprocessing(noop_max=0), which then only reads the screen.
    """

    def __init__(self, env, noop_max=ALE_V5["noop_max"]):
        super().__init__(env)
        self.noop_max = noop_max
        self.fire = "FIRE" in env.unwrapped.get_action_meanings()

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        if self.fire:
            obs, _, _, _, info = self.env.step(1)
        noops = int(self.env.unwrapped.np_random.integers(0, self.noop_max)) - self.fire
        for _ in range(noops):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


# ----------------------------------------------------------------------------- conventions
class UsageError(Exception):
    """Bad input from the user: reported as one line on stderr with exit code 2."""


def fail(message: str, code: int = 2):
    """Print one line on stderr and exit: no traceback for the user's mistakes."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def game_name(env_id: str) -> str:
    """'Breakout-v5' or 'ALE/Breakout-v5' -> 'Breakout'."""
    match = re.fullmatch(r"(?:ALE/)?([A-Za-z0-9]+)-v5", env_id)
    if match is None:
        raise UsageError(f"--env-id {env_id!r}: expected a name like Breakout-v5 or ALE/Breakout-v5")
    return match.group(1)


def rom_id(env_id: str) -> str:
    """'MsPacman-v5' -> 'ms_pacman', checked against the ROMs ale-py ships (close matches named)."""
    from ale_py import roms

    name = game_name(env_id)
    rom = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    known = roms.get_all_rom_ids()
    if rom not in known:
        camel = {"".join(part.capitalize() for part in r.split("_")): r for r in known}
        close = difflib.get_close_matches(name, list(camel), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(c + '-v5' for c in close)}?" if close else ""
        raise UsageError(f"--env-id {env_id!r}: unknown Atari game {name!r}{hint}")
    return rom


def resolve_device(spec: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU; asking for CUDA without it is an error."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", spec):
        raise UsageError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_positive(**values):
    for name, value in values.items():
        if value is None or value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")


def check_capture_video(capture_video: bool, eval_checkpoint):
    """--capture-video records --eval-checkpoint games: fail before anything starts, not after."""
    if not capture_video:
        return
    if eval_checkpoint is None:
        raise UsageError("--capture-video records evaluation games: use it with --eval-checkpoint")
    import importlib.util

    if importlib.util.find_spec("moviepy") is None:
        raise UsageError("--capture-video needs moviepy: pip install moviepy")


def check_precision(precision: str, device: torch.device):
    if precision not in ("fp32", "bf16"):
        raise UsageError(f"--precision {precision!r}: expected fp32 or bf16")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError(f"--precision bf16: not supported by {torch.cuda.get_device_name(device)}")


def run_name(args) -> str:
    return f"{game_name(args.env_id)}-v5__{args.exp_name}__{args.seed}__{int(time.time())}"


def hyperparameters_text(args) -> str:
    rows = "\n".join(f"|{key}|{value}|" for key, value in sorted(vars(args).items()))
    return f"|param|value|\n|-|-|\n{rows}"


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """One compact line per iteration; built from host-side numbers only (no GPU sync)."""

    def __init__(self, total_steps: int, start_step: int):
        self.total_steps = total_steps
        self.start_step = start_step
        self.start_time = time.time()
        self.recent_returns = deque(maxlen=20)

    def sps(self, global_step: int) -> int:
        return int((global_step - self.start_step) / max(time.time() - self.start_time, 1e-9))

    def line(self, iteration: int, num_iterations: int, global_step: int) -> str:
        sps = self.sps(global_step)
        eta = format_duration((self.total_steps - global_step) / max(sps, 1))
        ret = f"{np.mean(self.recent_returns):.1f}" if self.recent_returns else "-"
        return (
            f"iter {iteration}/{num_iterations}  step {global_step:,}/{self.total_steps:,}  "
            f"SPS: {sps}  ETA {eta}  return {ret} (last {len(self.recent_returns)} games)"
        )


# ----------------------------------------------------------------------------- reliability
def save_checkpoint(path, state: dict):
    """Write atomically: temp file, fsync, rename. A crash mid-write leaves the old file intact."""
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


def load_checkpoint(path, script: str, env_id: str | None = None) -> dict:
    """Load a checkpoint written by `script`, refusing missing, corrupt or foreign files."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {str(path)!r} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file: say so in one line
        raise UsageError(f"checkpoint {str(path)!r} is corrupt or unreadable ({type(e).__name__})")
    if not isinstance(state, dict) or not {"model", "script", "env_id"} <= state.keys():
        raise UsageError(f"checkpoint {str(path)!r} was not written by these scripts")
    if state["script"] != script:
        raise UsageError(f"checkpoint {str(path)!r} is from {state['script']}, not {script}")
    if env_id is not None and game_name(state["env_id"]) != game_name(env_id):
        raise UsageError(f"checkpoint {str(path)!r} is for {state['env_id']}, not {env_id}")
    return state


def check_resume_args(checkpoint: dict, args, names=("num_envs", "num_steps", "total_timesteps")):
    """A resumed run keeps what maps iterations to steps and sets the learning-rate schedule."""
    saved = checkpoint.get("args", {})
    for name in names:
        if name in saved and saved[name] != getattr(args, name):
            flag, value = f"--{name.replace('_', '-')}", getattr(args, name)
            raise UsageError(f"{flag} {value} differs from the checkpoint's {saved[name]}: resume with the same value")


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state()}
    states["torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict):
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class StopSignal:
    """SIGINT/SIGTERM set a flag that the train loop checks; a second SIGINT stops at once."""

    def __init__(self):
        self.received = None
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __bool__(self):
        return self.received is not None


def stopped_message(stop, global_step, checkpoint_path) -> str:
    """One line saying how to continue: the same command with --resume."""
    argv, skip = [], False
    for arg in sys.argv[1:]:  # drop an earlier --resume
        if skip or arg == "--resume" or arg.startswith("--resume="):
            skip = arg == "--resume"
            continue
        argv.append(arg)
    command = shlex.join(["python", Path(sys.argv[0]).name, *argv, "--resume", str(checkpoint_path)])
    return f"stopped by {stop.received} at step {global_step:,}; resume with: {command}"


def all_finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


@torch.no_grad()
def nonfinite_policy(agent, obs) -> torch.Tensor:
    """A bool tensor, on the device and not synced: are any weights, or the policy's log-probs,
    entropies and values on `obs`, non-finite? Checked after every update: a diverged update
    can leave weights so large that the next forward overflows, and the rollout would then
    sample from NaNs and a checkpoint keep them."""
    actions = torch.zeros(obs.shape[0], dtype=torch.long, device=obs.device)
    _, logprob, entropy, value = agent.get_action_and_value(obs, actions)
    weights = torch.stack([torch.isfinite(p).all() for p in agent.parameters()]).all()
    return ~(weights & torch.isfinite(torch.cat([logprob, entropy, value.view(-1)])).all())


def fail_diverged(what: str, iteration: int, checkpoint_path, *to_close):
    """Training went non-finite: close the writer and envs (flushing the logs), say where the
    last good checkpoint is, if there is one yet, and exit 1."""
    for resource in to_close:
        resource.close()
    if Path(checkpoint_path).is_file():
        last = f"the last good checkpoint is {checkpoint_path}"
    else:
        last = "no checkpoint was written yet"
    fail(f"{what} at iteration {iteration}; {last}", code=1)


# ----------------------------------------------------------------------------- evaluation
def human_normalized(game: str, score: float) -> float | None:
    with open(SCORES_CSV) as f:
        for row in csv.DictReader(f):
            if row["game"] == game and row["human"]:
                random_score, human = float(row["random"]), float(row["human"])
                return (score - random_score) / (human - random_score)
    return None


def evaluate(env_id, act, episodes, seed, device, capture_video=False, video_dir=None):
    """Play `episodes` full games (v5 protocol, no life-loss terminals) with `act`.

    `act(obs)` maps a uint8 tensor [n, 4, 84, 84] on `device` to actions [n].
    Returns the list of full-game, unclipped returns.
    """
    if capture_video:
        return _evaluate_with_video(env_id, act, episodes, seed, device, video_dir)
    from ale_py.vector_env import AtariVectorEnv

    num_envs = min(episodes, 8)
    envs = AtariVectorEnv(
        rom_id(env_id), num_envs, **ALE_V5, stack_num=STACK, num_threads=min(num_envs, os.cpu_count())
    )
    obs, info = seeded_reset(envs, seed)
    returns, current = [], np.zeros(num_envs)
    started = np.zeros(num_envs, dtype=np.int64) + 1  # how many games each env has begun
    quota = np.array([episodes // num_envs + (i < episodes % num_envs) for i in range(num_envs)])
    frame_number = info["episode_frame_number"].copy()
    while len(returns) < episodes:
        with torch.no_grad():
            actions = act(torch.from_numpy(obs).to(device)).cpu().numpy()
        obs, reward, terminated, truncated, info = envs.step(actions)
        current += reward
        game_over = truncated | (terminated & (info["episode_frame_number"] < frame_number))
        frame_number = info["episode_frame_number"].copy()
        for i in np.flatnonzero(game_over):
            if started[i] <= quota[i]:  # games begun beyond the quota are not counted
                returns.append(float(current[i]))
            started[i] += 1
            current[i] = 0
    envs.close()
    return returns


def _evaluate_with_video(env_id, act, episodes, seed, device, video_dir):
    try:
        import moviepy  # noqa: F401  (gymnasium's RecordVideo needs it)
    except ImportError:
        raise UsageError("--capture-video needs moviepy: pip install moviepy")
    import ale_py

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game_name(env_id)}-v5", frameskip=1, render_mode="rgb_array")
    env = gym.wrappers.RecordVideo(env, str(video_dir), episode_trigger=lambda e: True)
    env = AleV5GameStart(env)
    env = gym.wrappers.AtariPreprocessing(env, noop_max=0, frame_skip=4, screen_size=84)
    env = gym.wrappers.FrameStackObservation(env, STACK, padding_type="zero")
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, total = False, 0.0
        while not done:
            with torch.no_grad():
                action = act(torch.from_numpy(np.asarray(obs)[None]).to(device))
            obs, reward, terminated, truncated, _ = env.step(int(action[0]))
            total += reward
            done = terminated or truncated
        returns.append(total)
    env.close()
    return returns


def report_evaluation(env_id, returns) -> str:
    mean, std = float(np.mean(returns)), float(np.std(returns))
    hns = human_normalized(game_name(env_id), mean)
    hns_text = f"{hns:.3f}" if hns is not None else "n/a (no human score for this game)"
    return f"evaluation {env_id}: {len(returns)} games  mean {mean:.2f}  std {std:.2f}  human-normalized {hns_text}"


# ----------------------------------------------------------------------------- profiling
class PhaseTimer:
    """Wall time per rollout phase for --profile; a free no-op otherwise.

    On CUDA each phase synchronizes so that time lands in the phase that caused it: that
    changes the overlap being measured, which is why it only runs under --profile. With one
    worker thread per env batch the phases of different batches overlap; their times add up.
    """

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.totals = {}
        self.lock = threading.Lock()
        self.null = contextlib.nullcontext()

    def __call__(self, name):
        return self._phase(name) if self.enabled else self.null

    @contextlib.contextmanager
    def _phase(self, name):
        self.sync()
        start = time.perf_counter()
        yield
        self.sync()
        with self.lock:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def table(self) -> str:
        total = sum(self.totals.values()) or 1.0
        lines = [f"{'phase':<16}{'seconds':>10}{'share':>8}"]
        for name, seconds in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            lines.append(f"{name:<16}{seconds:>10.3f}{seconds / total:>8.1%}")
        return "\n".join(lines)


def make_profiler(enabled: bool, run_dir, device: torch.device):
    """torch.profiler over iterations 2-4 (the first warms up); trace.json opens in Perfetto."""
    if not enabled:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace = str(Path(run_dir) / "trace.json")

    def on_trace_ready(profiler):
        profiler.export_chrome_trace(trace)
        print(f"profiler trace: {trace} (open in https://ui.perfetto.dev)", flush=True)

    schedule = torch.profiler.schedule(wait=1, warmup=0, active=3, repeat=1)
    profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready)
    profiler.start()
    return profiler


# ----------------------------------------------------------------------------- threaded envs
def seeded_reset(envs, seed):
    """Seed an ale-py AtariVectorEnv and start its games; returns (obs, info) of the start.

    ale-py seeds each env's noop generator and ALE's sticky-action generator with the same
    seed, so their first draws agree: the first game's FIRE frame was dropped exactly when its
    noop count was small (seen here, Breakout: no ball served iff at most 7 frames before the
    first observation). A second reset, unseeded, draws both from unrelated positions.
    """
    envs.reset(seed=seed)
    return envs.reset()


class ThreadedAtariEnvs:
    """`num_envs` ale-py envs (v5 protocol) split into `num_batches` fixed, independent batches.

    Each batch is one `AtariVectorEnv`: its C++ threads step the envs with the GIL released,
    so Python can run inference for one batch while another batch's envs step. The envs return
    only the newest 84x84 frame (stack_num=1); stacking happens on the device. Rewards come
    back unclipped: full-game returns are summed here, the learner gets them clipped.
    Autoreset is SameStep: at a game over the returned frame is already the new game's first.

    With serial=True (for debugging) send() steps the batch to completion before returning.
    """

    def __init__(self, env_id, num_envs, num_batches, num_threads, seed, life_loss_terminal=True, serial=False):
        from ale_py.vector_env import AtariVectorEnv

        assert num_envs % num_batches == 0
        self.num_envs, self.num_batches = num_envs, num_batches
        self.batch_size = num_envs // num_batches
        self.slices = [slice(b * self.batch_size, (b + 1) * self.batch_size) for b in range(num_batches)]
        self.life_loss_terminal = life_loss_terminal
        # each batch gets the threads it can use; all batches share the machine's cores
        threads = max(1, min(num_threads, self.batch_size))
        self.envs = [
            AtariVectorEnv(
                rom_id(env_id),
                self.batch_size,
                **ALE_V5,
                num_threads=threads,
                stack_num=1,
                life_loss_info=life_loss_terminal,
            )
            for _ in range(num_batches)
        ]
        self.num_actions = int(self.envs[0].single_action_space.n)
        self.seed = seed
        # full-game accounting, on the host where the data already is
        self.episode_return = np.zeros(num_envs, dtype=np.float64)
        self.episode_length = np.zeros(num_envs, dtype=np.int64)
        self.frame_number = np.zeros(num_envs, dtype=np.int64)
        self.finished = []  # (env index, full-game return, length in agent steps, step it ended)
        self.steps = np.zeros(num_batches, dtype=np.int64)  # vector steps per batch since pop_finished
        self.serial = serial
        self.results = [None] * num_batches

    def reset(self, seed=None) -> np.ndarray:
        """Reset every env; returns the first frames, uint8 [num_envs, 84, 84]."""
        seed = self.seed if seed is None else seed
        frames = np.empty((self.num_envs, *FRAME_SHAPE), dtype=np.uint8)
        for b, env in enumerate(self.envs):
            obs, info = seeded_reset(env, seed + b * self.batch_size)
            frames[self.slices[b]] = obs[:, -1]
            self.frame_number[self.slices[b]] = info["episode_frame_number"]
        self.episode_return[:] = 0
        self.episode_length[:] = 0
        return frames

    def send(self, b: int, actions: np.ndarray):
        self.envs[b].send(actions)
        if self.serial:
            self.results[b] = self.envs[b].recv()

    def recv(self, b: int, rewards_out: np.ndarray, dones_out: np.ndarray):
        """Wait for batch b; write clipped rewards and learner terminals (float) in place.

        Returns (frames uint8 [batch, 84, 84], indices in the batch whose game ended).
        """
        if self.serial:
            obs, reward, terminated, truncated, info = self.results[b]
        else:
            obs, reward, terminated, truncated, info = self.envs[b].recv()
        sl = self.slices[b]
        self.steps[b] += 1
        self.episode_return[sl] += reward
        self.episode_length[sl] += 1
        np.clip(reward, -1, 1, out=rewards_out, casting="unsafe")
        # a real game over restarts the episode frame counter; a lost life does not
        new_frame_number = info["episode_frame_number"]
        game_over = truncated | (terminated & (new_frame_number < self.frame_number[sl]))
        self.frame_number[sl] = new_frame_number
        np.logical_or(terminated if self.life_loss_terminal else game_over, truncated, out=dones_out, casting="unsafe")
        ended = np.flatnonzero(game_over)
        for i in ended:
            j = sl.start + i
            self.finished.append((j, float(self.episode_return[j]), int(self.episode_length[j]), int(self.steps[b])))
            self.episode_return[j] = 0
            self.episode_length[j] = 0
        return obs[:, 0], ended

    def pop_finished(self):
        """The games that ended since the last call, in the order they ended. Each game's last
        field counts the vector steps since that call (1 = the first step), so a script can log
        it at the step where it ended, as the baseline does, even though batches run apart."""
        finished = sorted(self.finished, key=lambda game: game[3])
        self.finished = []
        self.steps[:] = 0
        return finished

    def close(self):
        for env in self.envs:
            env.close()


# ----------------------------------------------------------------------------- GPU batching
def new_stream(device: torch.device):
    """A CUDA stream for one env batch; None on CPU, where streams are no-ops."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def host_buffer(shape, dtype, device: torch.device) -> torch.Tensor:
    """Page-locked host memory when a GPU is used, so copies can be asynchronous."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


class DeviceFrameStack:
    """The 4-frame stacks of one env batch, kept in the device rollout storage.

    `obs_views[t]` is this batch's uint8 [batch, 4, 84, 84] slice of obs[t]; all the views
    the rollout needs are made here once, so stepping makes no new tensors. Per step exactly
    one uint8 84x84 frame per env crosses host to device, asynchronously from pinned memory.
    Games that just ended restart with zeros in the older slots, as ale-py's stack_num=4
    does; the host knows which games ended, so no flag has to cross to the device.
    """

    def __init__(self, obs_views, device, stream):
        self.obs = obs_views
        self.older_src = [o[:, 1:] for o in obs_views]
        self.older_dst = [o[:, : STACK - 1] for o in obs_views]
        self.newest = [o[:, STACK - 1] for o in obs_views]
        self.staging = host_buffer((obs_views[0].shape[0], *FRAME_SHAPE), torch.uint8, device)
        self.staging_np = self.staging.numpy()
        self.stream = stream

    def push(self, t, frames, ended=()):
        """obs[t] = obs[t-1] shifted by one frame, plus the new frames [batch, 84, 84]."""
        np.copyto(self.staging_np, frames)
        with on_stream(self.stream):
            self.older_dst[t].copy_(self.older_src[t - 1])
            self.newest[t].copy_(self.staging, non_blocking=True)
            for i in ended:
                self.obs[t][i, : STACK - 1].zero_()

    def start(self, t, frames):
        """obs[t] = first frames of new games: older slots zero."""
        np.copyto(self.staging_np, frames)
        with on_stream(self.stream):
            self.older_dst[t].zero_()
            self.newest[t].copy_(self.staging, non_blocking=True)
