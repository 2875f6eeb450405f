"""The native rollout (utils.BatchedRollout, as ppo_atari_native.py and a2c_atari.py run it) as the
learner sees it: each step's action drawn from that step's uniform under that step's policy,
actions independent over steps and envs, and rewards and terminals at the steps where the
envs returned them, in the default game and in one a copy changes."""

import numpy as np
import pytest
import torch
from conftest import default_game, rollout_storage

import kernels
import ppo_atari_native as native
import utils

# Chi-square critical values at p = 0.001 (scipy.stats.chi2.ppf(0.999, dof)), by dof.
CHI2_CRITICAL_P001 = {3: 16.266, 15: 37.697}
# the default game, and a copy's: no sticky actions, all 18 actions, unclipped rewards (MsPacman scores
# 10 a pellet), a lost life not terminal
GAMES = {
    "default": ("Breakout-v5", default_game()),
    "changed": ("MsPacman-v5", default_game(repeat_action_probability=0.0, full_action_space=True,
                                            clip_rewards=False, life_loss_terminal=False)),
}  # fmt: skip


def collect(agent, num_envs, num_batches, num_steps, iterations, seed, game="default", choice="fused"):
    """Run BatchedRollout on the CPU for `iterations` rollouts of GAMES[game] with the fused policy step
    (or `choice`), as the scripts run it (it draws every uniform of the horizon before each rollout);
    returns each rollout's storage and uniforms, copied."""
    T, N, cpu = num_steps, num_envs, torch.device("cpu")
    env_id, settings = GAMES[game]
    envs = utils.ThreadedAtariEnvs(env_id, N, num_batches, num_batches, seed, settings)
    frames = utils.probe_frames(env_id, settings, 2, cpu)
    policy = kernels.rollout_policy(choice, agent, torch.float32, frames, envs.num_actions)
    storage = rollout_storage(T, N)
    driver = utils.resolve_driver("auto", cpu, num_batches)
    rollout = utils.BatchedRollout(
        envs, policy, **storage, driver=driver, cuda_graphs=False, profiler=utils.Profiler(False)
    )
    rollout.start()
    torch.manual_seed(seed)
    copies = []
    try:
        for _ in range(iterations):
            assert rollout.collect()
            copies.append(
                {name: tensor.clone() for name, tensor in storage.items()} | {"uniforms": rollout.uniforms.clone()}
            )
    finally:
        rollout.close()
        envs.close()
    for copy in copies:
        copy["rewards"], copy["dones"] = copy["rewards"].numpy(), copy["dones"].numpy()
    return copies


def inverse_cdf(logits, uniform):
    """The action whose float64 CDF interval holds each uniform, and whether the uniform lies
    within 1e-5 of an interval's end (where float32 rounding may pick the neighbour)."""
    cdf = torch.softmax(logits.double(), dim=1).cumsum(dim=1)
    u = uniform.double()[:, None]
    action = (cdf <= u).sum(dim=1).clamp(max=logits.shape[1] - 1)
    return action, ((cdf - u).abs() < 1e-5).any(dim=1)


def state_dependent_agent(num_actions):
    """An Agent whose probabilities vary with the state (actor weights larger than their initial 0.01 scale)."""
    torch.manual_seed(0)
    agent = native.Agent(num_actions).to(memory_format=torch.channels_last)
    with torch.no_grad():
        agent.actor.weight.normal_(std=0.3)
    return agent


@pytest.fixture(scope="module", params=GAMES)
def random_policy_rollout(request):
    """Three rollouts of 8 envs x 64 steps of each game (MsPacman: 96, past its intro) under a
    state-dependent policy."""
    env_id, settings = GAMES[request.param]
    agent = state_dependent_agent(utils.num_actions(env_id, settings["full_action_space"]))
    steps = 64 if request.param == "default" else 96
    return request.param, agent, collect(agent, 8, 2, steps, iterations=3, seed=3, game=request.param)


def test_each_action_is_the_inverse_cdf_of_its_own_steps_uniform(random_policy_rollout):
    """Recomputed from the stored stacks by the training network: every (step, env)'s action is
    where its own uniform falls in its policy's CDF, and its stored log-prob is that action's."""
    _, agent, storage = random_policy_rollout
    checked = 0
    for rollout in storage:
        with torch.no_grad():
            logits, value = agent(rollout["obs"].reshape(-1, 4, 84, 84))
        expected, boundary = inverse_cdf(logits, rollout["uniforms"].reshape(-1))
        actions = rollout["actions"].reshape(-1)
        assert torch.equal(actions[~boundary], expected[~boundary])
        logprob = torch.log_softmax(logits, dim=1).gather(1, actions[:, None])[:, 0]
        torch.testing.assert_close(rollout["logprobs"].reshape(-1), logprob, rtol=0, atol=1e-5)
        torch.testing.assert_close(rollout["values"].reshape(-1), value[:, 0], rtol=0, atol=1e-5)
        checked += int((~boundary).sum())
    assert checked >= 0.99 * sum(rollout["actions"].numel() for rollout in storage)
    # the policy really depends on the state, so a stack from another step would change actions
    probs = torch.softmax(logits, dim=1)
    assert (probs.max(dim=0).values - probs.min(dim=0).values).max() > 0.2


def test_rewards_and_terminals_are_stored_at_the_step_the_envs_returned_them(random_policy_rollout):
    """Plain ale-py envs playing the game as its settings say, seeded as utils.ThreadedAtariEnvs seeds
    its batches and given the rollout's actions, return at agent step t the frame stored as obs[t + 1]'s
    newest, the reward stored as rewards[t] (clipped, or not) and the terminal stored as dones[t + 1]
    (a lost life, or not)."""
    from ale_py.vector_env import AtariVectorEnv

    game, _, storage = random_policy_rollout
    env_id, settings = GAMES[game]
    num_envs, num_batches, seed = 8, 2, 3
    batch = num_envs // num_batches
    bound = 1 if settings["clip_rewards"] else np.inf
    plain = [
        AtariVectorEnv(utils.rom_id(env_id), batch, **utils.ale_options(settings), stack_num=1, num_threads=1,
                       life_loss_info=settings["life_loss_terminal"])
        for _ in range(num_batches)
    ]  # fmt: skip
    first = np.concatenate([utils.seeded_reset(env, seed + b * batch)[0][:, 0] for b, env in enumerate(plain)])
    np.testing.assert_array_equal(storage[0]["obs"][0, :, 3].numpy(), first)
    terminals = lives_lost = 0
    lives = np.full(num_envs, -1)
    for i, rollout in enumerate(storage):
        for t in range(rollout["rewards"].shape[0]):
            steps = [
                env.step(rollout["actions"][t, b * batch : (b + 1) * batch].numpy()) for b, env in enumerate(plain)
            ]
            frames, reward, terminated, truncated = (np.concatenate([s[k] for s in steps]) for k in range(4))
            where = f"rollout {i}, step {t}"
            np.testing.assert_array_equal(rollout["obs"][t + 1, :, 3].numpy(), frames[:, 0], err_msg=where)
            np.testing.assert_array_equal(rollout["rewards"][t], np.clip(reward, -bound, bound), err_msg=where)
            np.testing.assert_array_equal(rollout["dones"][t + 1], terminated | truncated, err_msg=where)
            terminals += int((terminated | truncated).sum())
            now = np.concatenate([s[4]["lives"] for s in steps])
            lives_lost, lives = lives_lost + int(((now < lives) & ~terminated).sum()), now
        if i > 0:  # a rollout starts where the last one ended
            np.testing.assert_array_equal(rollout["dones"][0], storage[i - 1]["dones"][-1])
            assert torch.equal(rollout["obs"][0], storage[i - 1]["obs"][-1])
    assert terminals + lives_lost >= 10, "the rollouts must cross several lost lives"
    # lost lives are terminal in the default game only; MsPacman's pellets reach the learner as 10
    assert (terminals > 0) == settings["life_loss_terminal"] and (lives_lost > 0) != settings["life_loss_terminal"]
    rewards = np.concatenate([rollout["rewards"] for rollout in storage])
    assert rewards.max() == 1 if settings["clip_rewards"] else (rewards == 10).any()
    for env in plain:
        env.close()


def chi_square(observed, expected):
    return float(((observed - expected) ** 2 / expected).sum())


def test_actions_under_a_fixed_policy_are_independent_over_steps_and_envs():
    """A policy with the same probabilities p in every state: the actions the envs were sent
    (steps 0..T-1 of each rollout, in order) are draws from p, and consecutive actions of one
    env, and the actions of two envs at one step, are independent pairs with probabilities
    p_i p_j (chi-square tests at p = 0.001 on 500-1000 pairs: a step that reused another
    step's uniforms repeats actions, a chi-square of many times the critical value)."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    agent = native.Agent(4).to(memory_format=torch.channels_last)
    with torch.no_grad():
        agent.actor.weight.zero_()
        agent.actor.bias.copy_(p.log())
    storage = collect(agent, num_envs=8, num_batches=2, num_steps=32, iterations=4, seed=1)
    taken = torch.cat([rollout["actions"][:-1] for rollout in storage])  # [steps, envs], in time order
    counts = torch.bincount(taken.reshape(-1), minlength=4).double()
    statistics = {"actions": (chi_square(counts, p * taken.numel()), CHI2_CRITICAL_P001[3])}
    pairs = {
        "consecutive steps of one env": (taken[:-1], taken[1:]),
        "two envs at one step": (taken[:, 0::2], taken[:, 1::2]),
    }
    for name, (a, b) in pairs.items():
        observed = torch.bincount((4 * a + b).reshape(-1), minlength=16).double()
        statistics[name] = (chi_square(observed, torch.outer(p, p).reshape(-1) * a.numel()), CHI2_CRITICAL_P001[15])
    assert all(statistic < critical for statistic, critical in statistics.values()), statistics


def test_the_full_action_set_runs_on_the_module_step_as_on_the_fused_one():
    """--full-action-space with an edited network (--policy module): the general step serves the 18
    actions as the fused one does (test_each_action_is_the_inverse_cdf_of_its_own_steps_uniform):
    the same actions from the same uniforms, the same log-probs and values, some beyond MsPacman's
    minimal set of 9."""
    agent = state_dependent_agent(18)
    (fused,), (module,) = (collect(agent, 4, 2, 32, 1, seed=3, game="changed", choice=c) for c in ("fused", "module"))
    assert torch.equal(fused["actions"], module["actions"]) and fused["actions"].max() >= 9
    for name in ("logprobs", "values"):
        torch.testing.assert_close(module[name], fused[name], rtol=1e-5, atol=1e-5)


def test_a_cpu_rollout_makes_no_cuda_call_where_cuda_is_available(monkeypatch):
    """On a GPU machine a --device cpu run's streams are None: entering one must not touch CUDA
    (torch.cuda.stream(None) asks for the current device, which initializes CUDA)."""
    calls = []

    def no_cuda(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a CUDA call from a CPU rollout")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("current_device", "_lazy_init", "current_stream", "set_device"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    agent = state_dependent_agent(4)
    (storage,) = collect(agent, 4, 2, 8, 1, seed=3)
    assert not calls and storage["actions"].shape == (9, 4)


def test_the_batches_reset_at_once_start_the_games_a_serial_reset_starts():
    """ThreadedAtariEnvs.reset resets its batches on threads at once: each batch starts the games
    that batch's own seeded reset alone starts (the same first frames and noop starts)."""
    from ale_py.vector_env import AtariVectorEnv

    env_id, settings = GAMES["default"]
    envs = utils.ThreadedAtariEnvs(env_id, 8, 4, 4, 5, settings)
    try:
        frames, numbers = envs.reset(), envs.frame_number.copy()
    finally:
        envs.close()
    for b in range(4):
        alone = AtariVectorEnv(utils.rom_id(env_id), 2, **utils.ale_options(settings), num_threads=1, stack_num=1)
        obs, info = utils.seeded_reset(alone, 5 + 2 * b)
        alone.close()
        assert np.array_equal(frames[2 * b : 2 * b + 2], obs[:, -1]), b
        assert np.array_equal(numbers[2 * b : 2 * b + 2], info["episode_frame_number"]), b
    assert len(set(numbers.tolist())) > 1, numbers  # the seeds' noop starts differ: the check can tell them apart


@pytest.mark.parametrize("life_loss_terminal", [True, False])
def test_the_lean_env_calls_give_what_the_plain_ones_gave(life_loss_terminal):
    """ThreadedAtariEnvs's send and recv (ale-py's bound calls, the bookkeeping on views) against
    the plain ones kept in benchmarks/rollout_cost.py (AtariVectorEnv's, the bookkeeping on
    slices): the same frames, clipped rewards, terminals, ended games and finished games, step for
    step, over lost lives, rewards beyond the clip and games cut by max_episode_frames."""
    from benchmarks import rollout_cost

    settings = default_game(max_episode_frames=1200, life_loss_terminal=life_loss_terminal)
    lean = utils.ThreadedAtariEnvs("SpaceInvaders-v5", 4, 2, 2, 7, settings)
    plain = rollout_cost.BeforeEnvs("SpaceInvaders-v5", 4, 2, 2, 7, settings)
    plain.profiler = utils.Profiler(False)
    out = {envs: (np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32)) for envs in (lean, plain)}
    try:
        assert np.array_equal(lean.reset(), plain.reset())
        actions = np.random.default_rng(0).integers(lean.num_actions, size=(700, 2, 2))
        clipped = ended_games = 0
        for t in range(len(actions)):
            got = {}
            for envs in (lean, plain):
                for b in range(2):
                    envs.send(b, actions[t, b])
                rewards, dones = out[envs]
                got[envs] = [envs.recv(b, rewards[b], dones[b]) for b in range(2)]
            for (frames, ended), (plain_frames, plain_ended) in zip(got[lean], got[plain]):
                assert np.array_equal(frames, plain_frames) and np.array_equal(ended, plain_ended), t
            assert np.array_equal(out[lean][0], out[plain][0]) and np.array_equal(out[lean][1], out[plain][1]), t
            clipped += int((out[lean][0] == 1).sum())
            if t % 50 == 49:
                finished = lean.pop_finished()
                assert finished == plain.pop_finished(), t
                ended_games += len(finished)
    finally:
        lean.close()
        plain.close()
    assert clipped > 0 and ended_games >= 4  # rewards were clipped and games ended (lost, or cut at 300 steps)
