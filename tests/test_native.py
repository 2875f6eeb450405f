"""ppo_atari_native.py and utils' env machinery: the fast path must compute what the plain one does."""

import re

import numpy as np
import pytest
import torch
from conftest import TINY, assert_all_tags, default_game, profile_table, read_scalars, run_dir_of, run_script

import kernels
import ppo_atari_native as native
import utils


def play(envs, num_batches, steps, seed=0):
    """Step ThreadedAtariEnvs round-robin with random actions, stacking frames as the native
    scripts do (kernels.stage_frames, then kernels.push_frames from the last stacks).

    Yields (step, obs [num_envs, 4, 84, 84], rewards, dones, actions) after every step."""
    n, batch = envs.num_envs, envs.batch_size
    obs = torch.zeros((2, n, 4, 84, 84), dtype=torch.uint8)
    staged = torch.empty((batch, kernels.staged_row(84 * 84)), dtype=torch.uint8)
    x = torch.empty((batch, 4, 84, 84)).contiguous(memory_format=torch.channels_last)

    def push(b, frames, ended):
        sl = envs.slices[b]
        kernels.stage_frames(staged.numpy(), frames, ended)
        kernels.push_frames(obs[0, sl], staged, obs[1, sl], x)

    for b, frames in enumerate(np.split(envs.reset(seed=seed), num_batches)):
        push(b, frames, slice(None))  # new games: older slots zero
    obs[0].copy_(obs[1])
    rng = np.random.default_rng(seed)
    rewards, dones = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32)
    yield 0, obs[0].clone(), rewards, dones, None
    for step in range(1, steps + 1):
        actions = rng.integers(envs.num_actions, size=n)
        for b, sl in enumerate(envs.slices):
            envs.send(b, actions[sl])
        for b, sl in enumerate(envs.slices):
            frames, ended = envs.recv(b, rewards[sl], dones[sl])
            push(b, frames, ended)
        obs[0].copy_(obs[1])
        yield step, obs[1].clone(), rewards, dones, actions


def test_device_frame_stack_matches_ale_stack_num_4():
    """The device stack equals ale-py's own stack_num=4 observations, across life losses and
    game overs, for the same seeds and actions."""
    from ale_py.vector_env import AtariVectorEnv

    n, num_batches = 4, 2
    envs = utils.ThreadedAtariEnvs("Breakout-v5", n, num_batches, 2, 7, default_game())
    reference = [
        AtariVectorEnv(
            "breakout", n // num_batches, **utils.ale_options(default_game()), life_loss_info=True, num_threads=1
        )
        for _ in range(num_batches)
    ]
    game_overs = 0
    for step, obs, _, _, actions in play(envs, num_batches, 400, seed=7):
        if actions is None:
            expected = np.concatenate([utils.seeded_reset(ref, 7 + b * 2)[0] for b, ref in enumerate(reference)])
        else:
            expected = np.concatenate([ref.step(actions[b * 2 : b * 2 + 2])[0] for b, ref in enumerate(reference)])
        np.testing.assert_array_equal(obs.numpy(), expected, err_msg=f"step {step}")
        game_overs += len(envs.pop_finished())
    assert game_overs >= 4, "the test must cross several game overs"
    envs.close()


# (game, settings changed from the default game)
PIPELINE_GAMES = [
    ("Breakout", {}),
    ("MsPacman", {}),
    ("MsPacman", dict(frame_skip=3, full_action_space=True, clip_rewards=False, life_loss_terminal=False)),
]


@pytest.mark.parametrize("game, changes", PIPELINE_GAMES)
def test_native_and_baseline_env_pipelines_play_the_same_game(game, changes):
    """utils.ThreadedAtariEnvs (the native scripts' envs) and utils.make_env (the baseline's) give the
    same frames, rewards and terminals for the same actions, across lost lives and game overs, with
    the default game and with other settings: a copy's game is the same in both. Sticky actions and
    noops off (their random draws differ between the two) to compare frame by frame."""
    settings = default_game(repeat_action_probability=0.0, noop_max=0, **changes)
    envs = utils.ThreadedAtariEnvs(f"{game}-v5", 1, 1, 1, 0, settings)
    env = utils.make_env(f"{game}-v5", 0, settings)()
    assert envs.num_actions == env.action_space.n == (18 if settings["full_action_space"] else envs.num_actions)
    frame = envs.reset()[0]
    obs, _ = env.reset(seed=0)
    rewards, dones = np.zeros(1, np.float32), np.zeros(1, np.float32)
    rng = np.random.default_rng(0)
    lives_lost = game_overs = terminals = 0
    biggest = 0.0
    for step in range(5000):
        np.testing.assert_array_equal(frame, np.asarray(obs)[-1], err_msg=f"step {step}")
        action = int(rng.integers(envs.num_actions))
        lives = env.unwrapped.ale.lives()
        obs, reward, terminated, truncated, _ = env.step(action)
        envs.send(0, np.array([action]))
        frames, ended = envs.recv(0, rewards, dones)
        frame = frames[0]
        assert (rewards[0], bool(dones[0])) == (reward, terminated or truncated), f"step {step}"
        biggest, terminals = max(biggest, reward), terminals + bool(dones[0])
        lives_lost += 0 < env.unwrapped.ale.lives() < lives
        game_overs += len(ended)
        if game_overs == 2:
            break
        if terminated or truncated:
            obs, _ = env.reset()  # after a game over a new game; after a lost life the same one
    assert game_overs == 2 and lives_lost >= 2
    assert terminals == game_overs + (lives_lost if settings["life_loss_terminal"] else 0)
    assert (biggest > 1) == (not settings["clip_rewards"])  # MsPacman scores 10 a pellet
    env.close()
    envs.close()


def test_threaded_envs_episode_accounting():
    """Full-game returns from unclipped rewards, clipped rewards and life-loss terminals for the
    learner: checked against a plain ale-py env with the same seed and actions."""
    from ale_py.vector_env import AtariVectorEnv

    envs = utils.ThreadedAtariEnvs("SpaceInvaders-v5", 1, 1, 1, 3, default_game())
    plain = AtariVectorEnv(
        "space_invaders", 1, repeat_action_probability=0.25, stack_num=1, reward_clipping=False, num_threads=1
    )
    utils.seeded_reset(plain, 3)
    raw_total, raw_max, length, terminals, clipped = 0.0, 0.0, 0, 0, []
    for step, _, rewards, dones, actions in play(envs, 1, 5000, seed=3):
        if actions is None:
            continue
        _, raw, terminated, truncated, _ = plain.step(actions)
        raw_total, raw_max, length = raw_total + raw[0], max(raw_max, raw[0]), length + 1
        clipped.append(rewards[0])
        terminals += int(dones[0])
        finished = envs.pop_finished()
        if terminated[0] or truncated[0]:
            assert finished == [(0, raw_total, length, 1)]  # ended at the step since the last pop
            break
        assert finished == []
    else:
        pytest.fail("no game over")
    assert raw_max > 1 and set(clipped) <= {0.0, 1.0}
    assert terminals == 3  # every lost life is terminal for the learner
    envs.close()


def real_frames(n=8, steps=60):
    """Stacks [n, 4, 84, 84] from real Breakout play."""
    envs = utils.ThreadedAtariEnvs("Breakout-v5", n, 1, 2, 1, default_game())
    for _, obs, *_ in play(envs, 1, steps, seed=1):
        pass
    envs.close()
    return obs


def rollout_step(agent, frames, dtype, uniform):
    """kernels.policy_step on the CPU for one batch, from stacks obs[0] to obs[1]; returns the
    storage it wrote: (obs[1], action, logprob, value)."""
    batch = len(frames)
    weights = kernels.inference_weights(agent, dtype)
    buf = kernels.inference_buffers((batch, 4, 84, 84), 4, dtype, torch.device("cpu"))
    obs = torch.zeros((2, batch, 4, 84, 84), dtype=torch.uint8)
    obs[0] = frames
    kernels.stage_frames(buf.staged.numpy(), frames[:, 3].numpy(), ())  # the newest frame again
    action, logprob, value = (
        torch.empty(batch, dtype=torch.long),
        torch.full((batch,), float("nan")),
        torch.empty(batch),
    )
    kernels.policy_step(weights, buf, obs[0], obs[1], uniform, action, logprob, value)
    return obs[1], action, logprob, value, buf


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_inference_equals_training_forward(precision):
    """The rollout's policy_step and the training network (Agent.forward) compute the same
    logits and values from the same stacks, in fp32 and in bf16 (there: the network as bf16
    autocast runs it, heads in float32, in both, so only summation order differs)."""
    torch.manual_seed(0)
    agent = native.Agent(4).to(memory_format=torch.channels_last)
    for p in agent.parameters():  # random weights, not the small initial heads
        torch.nn.init.normal_(p, std=0.05)
    frames = real_frames()
    assert frames.float().std() > 0
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    stacks, _, _, value, buf = rollout_step(agent, frames, dtype, torch.rand(8))
    expected_stacks = torch.cat([frames[:, 1:], frames[:, 3:]], dim=1)
    assert torch.equal(stacks, expected_stacks)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits, expected_value = agent(stacks)
    tolerance = 1e-5 if precision == "fp32" else 1e-4
    torch.testing.assert_close(buf.logits, logits, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(value, expected_value.view(-1), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rollout_logprobs_equal_training_logprobs(precision):
    """PPO's first minibatch must have ratio 1: the rollout's log-probs (policy_step: the stack
    pushed, x / 255 in its kernel, the permuted Linear) equal the training network's on the
    stacks the rollout stored, in float32, and in bf16 under autocast as the update runs it."""
    torch.manual_seed(0)
    agent = native.Agent(4).to(memory_format=torch.channels_last)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    stacks, action, logprob, value, _ = rollout_step(agent, real_frames(), dtype, torch.rand(8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        _, newlogprob, _, newvalue = agent.get_action_and_value(stacks, action)
    ratio = (newlogprob - logprob).exp()
    tolerance = 1e-5 if precision == "fp32" else 1e-4
    torch.testing.assert_close(ratio, torch.ones(8), rtol=0, atol=tolerance)
    torch.testing.assert_close(value, newvalue.view(-1), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_native_runs_and_writes_every_tag(precision, runs_dir):
    result = run_script("ppo_atari_native.py", *TINY, "--precision", precision, "--runs-dir", runs_dir)
    run_dir = run_dir_of(result)
    assert run_dir.name.startswith("Breakout-v5__ppo_atari_native__1__")
    scalars = read_scalars(run_dir)
    assert_all_tags(scalars)
    assert [step for step, _ in scalars["charts/SPS"]] == [256, 512, 768, 1024]
    # games are logged at the step they ended (4 envs per step), in order, as the baseline does
    game_steps = [step for step, _ in scalars["charts/episodic_return"]]
    assert game_steps == sorted(game_steps) and all(step % 4 == 0 for step in game_steps)
    assert any(step % 256 for step in game_steps), "games logged only at iteration ends"
    assert (run_dir / "model.pt").is_file()


@pytest.mark.parametrize("extra", [["--num-gpu-batches", "1"], ["--num-gpu-batches", "8"], ["--driver", "sequential"]])
def test_native_gpu_batches_and_the_sequential_driver(extra, runs_dir):
    args = ["--num-envs", "8", "--num-steps", "32", "--num-minibatches", "4", "--total-timesteps", "512"]
    result = run_script("ppo_atari_native.py", *args, *extra, "--runs-dir", runs_dir)
    scalars = read_scalars(run_dir_of(result))
    assert_all_tags(scalars, [t for t in scalars if t.startswith("losses/")] + ["charts/SPS"])
    assert [step for step, _ in scalars["charts/SPS"]] == [256, 512]


def test_first_ratio_is_one_in_the_script(runs_dir):
    """In fp32 every update starts at ratio 1: old_approx_kl and clipfrac of a single-minibatch,
    single-epoch update are zero up to rounding, in the first iteration and in the later ones,
    whose rollouts run on the inference weights refreshed from the updated network."""
    args = ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "1", "--update-epochs", "1"]
    result = run_script(
        "ppo_atari_native.py", *args, "--total-timesteps", "384", "--precision", "fp32", "--runs-dir", runs_dir
    )
    scalars = read_scalars(run_dir_of(result))
    assert len(scalars["losses/old_approx_kl"]) == 3
    for (_, kl), (_, clipfrac), (_, approx_kl) in zip(
        scalars["losses/old_approx_kl"], scalars["losses/clipfrac"], scalars["losses/approx_kl"], strict=True
    ):
        assert abs(kl) < 1e-5 and abs(approx_kl) < 1e-6
        assert clipfrac == 0.0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rollout_step_allocates_nothing_outside_convs_and_launches_at_most_14(precision):
    """Steady state: a batch-step's own work allocates zero bytes (the conv primitives allocate
    their outputs; the fused kernels' CPU torch reference is one Triton launch on a GPU), the
    same bytes from one window of steps to the next, and at most 14 launches, 4 of them fused."""
    from benchmarks import rollout_profile

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    first, second = rollout_profile.native_allocations(8, steps=24, dtype=dtype)
    assert first[2] == 0 and second[2] == 0, f"allocations outside the convs: {first[3]} {second[3]}"
    assert first[:2] == second[:2], "bytes per step changed between windows"
    assert first[0] > 0  # the measurement sees the conv primitives' buffers, so it does measure
    ops = rollout_profile.count_native(8, dtype=dtype)
    assert len(ops) <= 14, ops
    assert sum(op.startswith("triton:") for op in ops) == 4


def test_drivers_compute_the_same_run(runs_dir):
    """One driver thread serving the batches in turn, a worker thread per batch, and the
    sequential debugging mode give the same actions: the weights after two updates are equal
    to the bit (the uniforms are drawn before the rollout, the envs are seeded per batch)."""
    args = ["--num-envs", "8", "--num-steps", "32", "--num-minibatches", "4", "--total-timesteps", "512"]
    models = []
    for mode in (["--driver", "single"], ["--driver", "threads"], ["--driver", "sequential"]):
        result = run_script("ppo_atari_native.py", *args, "--num-gpu-batches", "4", *mode, "--runs-dir", runs_dir)
        models.append(torch.load(run_dir_of(result) / "model.pt", weights_only=True)["model"])
    for model in models[1:]:
        assert all(torch.equal(model[k], models[0][k]) for k in model)


@pytest.mark.parametrize("script,iterations", [("ppo_atari_native.py", 6), ("a2c_atari.py", 2), ("a2c_atari.py", 1)])
def test_profile_writes_a_trace_and_one_table_of_phases(script, iterations, runs_dir):
    """--profile traces iterations 2-4 (or up to the last) and prints one table of time per
    phase, after the 4th iteration's line (or the last's), with the update's share of the wall
    time of iterations 2-4 where there are any."""
    args = ["--num-envs", "4", "--num-steps", "32", "--total-timesteps", str(128 * iterations), "--profile"]
    args += ["--num-minibatches", "4"] if script == "ppo_atari_native.py" else ["--log-interval", "1"]
    result = run_script(script, *args, "--runs-dir", runs_dir)
    assert (run_dir_of(result) / "trace.json").is_file()
    header, progress, rows = profile_table(result.stdout)
    assert progress[min(4, iterations) - 1] < header
    assert iterations <= 4 or header < progress[4]
    assert {"env wait", "launch", "GPU wait", "training"} <= rows.keys(), rows
    assert None not in rows.values(), rows  # on CPU every phase is the host's
    assert abs(sum(rows.values()) - 100) < 0.5
    share = re.search(r"of which the update \(training\) ([\d.]+)%", result.stdout)
    assert (share is not None) == (iterations > 1) and (share is None or 0 < float(share[1]) <= 100), share
    assert "profiler trace: " in result.stdout
