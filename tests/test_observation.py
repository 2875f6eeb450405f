"""The observation is the script's: --frame-stack and --screen-size (fields of each script's game
block) set what the network sees. Each script trains two iterations on a stack of 1, of 2 and of
8 frames, of 64x64 or 96x96 pixels (the native scripts by the fused step, and once each by the
module step), run in this process so that the actions it sent can be replayed: its stored stacks
are the other pipeline's (the native envs' against utils.make_env's gymnasium pipeline, and the
other way round) on the same actions, the run-long guard holds within its bound, and each
checkpoint is evaluated on its own stack and size with no flag saying so.

Sticky actions and noops are off, so that the same actions give the same game in both pipelines
(tests/test_protocol.py), and games are cut at 160 frames, so that one ends inside the run.
"""

import runpy
import signal
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import ROOT, default_game, read_scalars

import kernels
import utils

GAME = ["--repeat-action-probability", "0", "--noop-max", "0", "--max-episode-frames", "160"]
TINY = {
    "ppo_atari_native.py": ["--num-minibatches", "1", "--update-epochs", "1", "--precision", "fp32"],
    "a2c_atari.py": ["--log-interval", "1", "--precision", "fp32"],
    "ppo_atari_baseline.py": ["--num-minibatches", "1", "--update-epochs", "1", "--vector-mode", "sync"],
}
# (script, frame stack, screen size, the rollout's policy step)
CASES = [
    ("ppo_atari_native.py", 1, 64, "fused"),
    ("ppo_atari_native.py", 2, 96, "module"),
    ("ppo_atari_native.py", 8, 96, "fused"),
    ("a2c_atari.py", 1, 96, "fused"),
    ("a2c_atari.py", 2, 64, "module"),
    ("a2c_atari.py", 8, 64, "fused"),
    ("ppo_atari_baseline.py", 1, 64, None),
    ("ppo_atari_baseline.py", 2, 96, None),
    ("ppo_atari_baseline.py", 8, 64, None),
]
T, N = 32, 2  # steps per iteration, envs


def native_stacks(game, actions):
    """The stacks [steps + 1, N, stack, size, size] that utils.ThreadedAtariEnvs and the native
    scripts' kernels.stage_frames and kernels.push_frames make from these actions [steps, N]."""
    envs = utils.ThreadedAtariEnvs("Breakout-v5", N, 1, 1, 0, game)
    stacks = torch.zeros((len(actions) + 1, N, game["frame_stack"], *envs.frame_shape), dtype=torch.uint8)
    buf = kernels.inference_buffers(stacks[0].shape, envs.num_actions, torch.float32, torch.device("cpu"))
    kernels.stage_frames(buf.staged.numpy(), envs.reset(), slice(None))
    kernels.push_frames(stacks[0], buf.staged, stacks[0], buf.x)
    rewards, dones = np.zeros(N, np.float32), np.zeros(N, np.float32)
    for step, action in enumerate(actions, 1):
        envs.send(0, action)
        frames, ended = envs.recv(0, rewards, dones)
        kernels.stage_frames(buf.staged.numpy(), frames, ended)
        kernels.push_frames(stacks[step - 1], buf.staged, stacks[step], buf.x)
    envs.close()
    return stacks


def gymnasium_stacks(game, actions):
    """The same from utils.make_env's gymnasium pipeline (the baseline's envs)."""
    stacks = []
    for i in range(N):
        env = utils.make_env("Breakout-v5", i, game)()
        obs, _ = env.reset(seed=i)
        stacks.append([np.asarray(obs)])
        for action in actions[:, i]:
            obs, _, terminated, truncated, _ = env.step(int(action))
            if terminated or truncated:  # a new game after a game over; the same one after a lost life
                obs, _ = env.reset()
            stacks[-1].append(np.asarray(obs))
        env.close()
    return torch.from_numpy(np.stack(stacks, axis=1))


def record_actions(monkeypatch, envs_class, method):
    """A list that gets (env batch, actions) for every call of envs_class.method(b, actions) or
    envs_class.method(actions) (batch 0): the actions a run sends its envs, in order."""
    sent, original = [], getattr(envs_class, method)

    def recording(envs, *args):
        sent.append((args[0] if len(args) == 2 else 0, args[-1].copy()))
        return original(envs, *args)

    monkeypatch.setattr(envs_class, method, recording)
    return sent


def run(script, argv, monkeypatch, capsys):
    """The script run in this process: (its globals, its stdout)."""
    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # no stop handlers in pytest's process
    capsys.readouterr()
    try:
        return runpy.run_path(str(ROOT / script), run_name="__main__"), capsys.readouterr().out
    except SystemExit as e:  # evaluation, and refusals
        captured = capsys.readouterr()
        return e.code, captured.out + captured.err


@pytest.mark.parametrize("script, stack, size, step", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
def test_a_copy_trains_and_evaluates_on_its_own_observation(script, stack, size, step, tmp_path, monkeypatch, capsys):
    if script == "ppo_atari_baseline.py":
        sent = record_actions(monkeypatch, gym.vector.SyncVectorEnv, "step")
    else:
        sent = record_actions(monkeypatch, utils.ThreadedAtariEnvs, "send")
    tiny = ["--num-envs", str(N), "--num-steps", str(T), "--total-timesteps", str(2 * T * N), *TINY[script], *GAME]
    tiny += ["--runs-dir", str(tmp_path)]
    observation = ["--frame-stack", str(stack), "--screen-size", str(size), *(["--policy", step] if step else [])]
    trained, out = run(script, [*tiny, *observation], monkeypatch, capsys)
    first = out.splitlines()[0]
    assert f"; Breakout-v5 (4 actions, {stack}x{size}x{size} frames), 2 iterations of {T * N} steps" in first, first
    assert step is None or f", policy {step}" in first, first
    assert trained["agent"].network[0].in_channels == stack
    game = default_game(repeat_action_probability=0.0, noop_max=0, max_episode_frames=160, frame_stack=stack,
                        screen_size=size)  # fmt: skip
    assert trained["game"] == game

    # the second iteration's stored stacks are the other pipeline's on the same actions
    batches = sorted({b for b, _ in sent})
    actions = np.concatenate([np.stack([a for b, a in sent if b == batch]) for batch in batches], axis=1)
    assert actions.shape == (2 * T, N)
    obs = trained["obs"]
    if script == "ppo_atari_baseline.py":
        assert tuple(obs.shape) == (T, N, stack, size, size)
        expected = native_stacks(game, actions)[T : 2 * T]
    else:
        assert tuple(obs.shape) == (T + 1, N, stack, size, size)
        expected = gymnasium_stacks(game, actions)[T:]
    differs = (obs.cpu() != expected).flatten(1).any(1).nonzero()
    assert len(differs) == 0, f"the stored stacks differ from the other pipeline's from step {T + int(differs[0])} on"
    assert expected[:, :, -1].flatten(2).amax(2).min() > 0  # every newest frame is a real one
    assert stack == 1 or (expected[:, :, 0].flatten(2).amax(2) == 0).any()  # and a game began in the window

    # the guard: the rollout sampled the policy the learner trains, within rounding
    if script != "ppo_atari_baseline.py":
        gaps = [gap for _, gap in read_scalars(trained["run_dir"])["losses/rollout_logprob_gap"]]
        assert len(gaps) == 2 and max(gaps) <= utils.LOGPROB_GAP_BOUND["fp32"], gaps

    # evaluation plays the checkpoint's stack and size; a resume under another size is refused
    model = trained["run_dir"] / "model.pt"
    code, out = run(script, ["--eval-checkpoint", str(model), "--eval-episodes", "1"], monkeypatch, capsys)
    assert code == 0, out
    assert f"on Breakout-v5 (4 actions, {stack}x{size}x{size} frames) for 1 games" in out, out
    assert "evaluation Breakout-v5: 1 games" in out, out
    code, out = run(script, [*tiny, "--resume", str(trained["run_dir"])], monkeypatch, capsys)
    assert code == 2, out
    assert out.strip() == f"error: --frame-stack 4 differs from the checkpoint's {stack}: resume with the same value"
