"""The native rollout (utils.BatchedRollout, as ppo_atari_native.py and a2c_atari.py run it) as the
learner sees it: each step's action drawn from that step's uniform under that step's policy,
actions independent over steps and envs, and rewards and terminals at the steps where the
envs returned them."""

import numpy as np
import pytest
import torch
from conftest import rollout_storage

import kernels
import ppo_atari_native as native
import utils

# Chi-square critical values at p = 0.001 (scipy.stats.chi2.ppf(0.999, dof)), by dof.
CHI2_CRITICAL_P001 = {3: 16.266, 15: 37.697}


def collect(agent, num_envs, num_batches, num_steps, iterations, seed):
    """Run BatchedRollout on the CPU for `iterations` rollouts with the fused policy step, as
    the scripts run it (it draws every uniform of the horizon before each rollout); returns
    each rollout's storage and uniforms, copied."""
    T, N, cpu = num_steps, num_envs, torch.device("cpu")
    envs = utils.ThreadedAtariEnvs("Breakout-v5", N, num_batches, num_batches, seed)
    policy = kernels.rollout_policy("fused", agent, torch.float32, utils.probe_frames("Breakout-v5", 2, cpu), 4)
    storage = rollout_storage(T, N)
    driver = utils.resolve_driver("auto", cpu, num_batches)
    rollout = utils.BatchedRollout(envs, policy, **storage, driver=driver, cuda_graphs=False)
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


@pytest.fixture(scope="module")
def random_policy_rollout():
    """Three rollouts of 8 envs x 64 steps under a policy whose probabilities vary with the
    state (actor weights larger than their initial 0.01 scale)."""
    torch.manual_seed(0)
    agent = native.Agent(4).to(memory_format=torch.channels_last)
    with torch.no_grad():
        agent.actor.weight.normal_(std=0.3)
    return agent, collect(agent, num_envs=8, num_batches=2, num_steps=64, iterations=3, seed=3)


def test_each_action_is_the_inverse_cdf_of_its_own_steps_uniform(random_policy_rollout):
    """Recomputed from the stored stacks by the training network: every (step, env)'s action is
    where its own uniform falls in its policy's CDF, and its stored log-prob is that action's."""
    agent, storage = random_policy_rollout
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
    assert checked >= 0.99 * 3 * 65 * 8
    # the policy really depends on the state, so a stack from another step would change actions
    probs = torch.softmax(logits, dim=1)
    assert (probs.max(dim=0).values - probs.min(dim=0).values).max() > 0.2


def test_rewards_and_terminals_are_stored_at_the_step_the_envs_returned_them(random_policy_rollout):
    """Plain ale-py envs, seeded as utils.ThreadedAtariEnvs seeds its batches and given the
    rollout's actions, return at agent step t the frame stored as obs[t + 1]'s newest, the
    reward stored (clipped) as rewards[t] and the terminal stored as dones[t + 1]."""
    from ale_py.vector_env import AtariVectorEnv

    _, storage = random_policy_rollout
    num_envs, num_batches, seed = 8, 2, 3
    batch = num_envs // num_batches
    plain = [
        AtariVectorEnv("breakout", batch, **utils.ALE_V5, stack_num=1, life_loss_info=True, num_threads=1)
        for _ in range(num_batches)
    ]
    first = np.concatenate([utils.seeded_reset(env, seed + b * batch)[0][:, 0] for b, env in enumerate(plain)])
    np.testing.assert_array_equal(storage[0]["obs"][0, :, 3].numpy(), first)
    terminals = 0
    for i, rollout in enumerate(storage):
        for t in range(rollout["rewards"].shape[0]):
            steps = [
                env.step(rollout["actions"][t, b * batch : (b + 1) * batch].numpy()) for b, env in enumerate(plain)
            ]
            frames, reward, terminated, truncated = (np.concatenate([s[k] for s in steps]) for k in range(4))
            where = f"rollout {i}, step {t}"
            np.testing.assert_array_equal(rollout["obs"][t + 1, :, 3].numpy(), frames[:, 0], err_msg=where)
            np.testing.assert_array_equal(rollout["rewards"][t], np.clip(reward, -1, 1), err_msg=where)
            np.testing.assert_array_equal(rollout["dones"][t + 1], terminated | truncated, err_msg=where)
            terminals += int((terminated | truncated).sum())
        if i > 0:  # a rollout starts where the last one ended
            np.testing.assert_array_equal(rollout["dones"][0], storage[i - 1]["dones"][-1])
            assert torch.equal(rollout["obs"][0], storage[i - 1]["obs"][-1])
    assert terminals >= 10, "the rollouts must cross several lost lives"
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
