"""The algorithm itself: each script's advantages and update against references written here
from the published algorithms (CleanRL's ppo_atari.py, Stable-Baselines3's A2C with its
RMSpropTFLike), in float64 from the same weights and data, never with the scripts' code. The
scripts run in float32 on the CPU and must agree within float32 rounding; each optimizer step
is checked from the script's weights before it, so that the rounding does not compound."""

import copy
import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import a2c_atari as a2c
import ppo_atari_baseline as baseline
import ppo_atari_native as native

T, N, NUM_ACTIONS = 4, 4, 4
# terminal[t, n] = 1: env n's episode ended with step t's transition (no bootstrap from obs[t + 1]):
# env 0 mid-horizon, env 1 at the horizon, env 2 at the first step and again, env 3 never
TERMINAL = torch.tensor([[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0]], dtype=torch.float32)
# whether obs[0] follows a terminal (the last rollout's): it must change nothing
BEFORE = torch.tensor([[0, 0, 0, 1]], dtype=torch.float32)


# ----------------------------------------------------------------------------- references
def reference_advantages(rewards, values, terminal, gamma, lam):
    """GAE by its definition, on plain floats: A_t = sum over s >= t of (gamma lam)^(s - t) delta_s,
    delta_s = r_s + gamma V(s + 1) - V(s), where the sum stops at the first terminal and a terminal's
    delta has no bootstrap. rewards and terminal [T][N], values [T + 1][N]."""
    steps, envs = len(rewards), len(rewards[0])
    advantages = [[0.0] * envs for _ in range(steps)]
    for n in range(envs):
        for t in range(steps):
            weight = 1.0
            for s in range(t, steps):
                bootstrap = 0.0 if terminal[s][n] else gamma * values[s + 1][n]
                advantages[t][n] += weight * (rewards[s][n] + bootstrap - values[s][n])
                if terminal[s][n]:
                    break
                weight *= gamma * lam
    return advantages


def script_advantages(script, rewards, values, terminal, before, gamma, lam):
    """The script's advantages and returns. Every script stores dones[t] = 1 when obs[t] follows a
    terminal (native and A2C: T + 1 rows; the baseline: T rows and next_done for the obs after)."""
    dones = torch.cat([before, terminal])
    if script == "baseline":
        next_value, next_done = values[-1:], dones[-1]  # as the script's main block shapes them
        return baseline.gae(rewards, values[:-1], dones[:-1], next_value, next_done, gamma, lam)
    return {"native": native, "a2c": a2c}[script].gae(rewards, values, dones, gamma, lam)


def reference_forward(params, obs, actions):
    """The scripts' network (the Nature CNN of CleanRL's ppo_atari.py, GELU after its Linear):
    log-prob of `actions`, entropy and value, in float64."""
    x = obs.double() / 255.0
    x = F.relu(F.conv2d(x, params["network.0.weight"], params["network.0.bias"], stride=4))
    x = F.relu(F.conv2d(x, params["network.2.weight"], params["network.2.bias"], stride=2))
    x = F.relu(F.conv2d(x, params["network.4.weight"], params["network.4.bias"], stride=1))
    hidden = F.gelu(F.linear(x.flatten(1), params["network.7.weight"], params["network.7.bias"]))
    log_probs = F.log_softmax(F.linear(hidden, params["actor.weight"], params["actor.bias"]), dim=-1)
    value = F.linear(hidden, params["critic.weight"], params["critic.bias"]).view(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(1, actions[:, None]).view(-1), entropy, value


def loss_and_gradients(params, loss_fn):
    """loss_fn(leaves) -> (loss, terms); returns the terms and the gradient by parameter name."""
    leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
    loss, terms = loss_fn(leaves)
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    return terms, grads


def clip_by_global_norm(grads, max_norm):
    """Scale all gradients by max_norm / (their global norm + 1e-6) where that is below 1."""
    norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
    scale = min(1.0, (max_norm / (norm + 1e-6)).item())
    return {name: g * scale for name, g in grads.items()}, norm.item()


def reference_ppo(weights_before, batch, args, permutations):
    """CleanRL's ppo_atari.py update in float64: per minibatch, its losses and diagnostics and the
    gradient before and after clipping. Minibatch i starts from weights_before[i], the script's
    weights before its step i, so that float32 rounding does not compound over steps (where the
    script stopped early there are none: the reference stops one step past the script's last)."""
    c = args.clip_coef
    records = []
    for epoch in range(args.update_epochs):
        for start in range(0, args.batch_size, args.minibatch_size):
            if len(records) == len(weights_before):
                return records
            params = {name: p.double() for name, p in weights_before[len(records)].items()}
            idx = permutations[epoch][start : start + args.minibatch_size]
            returns, old_values = batch["returns"][idx], batch["values"][idx]

            def loss_fn(leaves, idx=idx, returns=returns, old_values=old_values):
                logprob, entropy, value = reference_forward(leaves, batch["obs"][idx], batch["actions"][idx])
                logratio = logprob - batch["logprobs"][idx]
                ratio = logratio.exp()
                advantages = batch["advantages"][idx]
                if args.norm_adv:
                    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
                # L^CLIP of the PPO paper: the pessimistic bound of the clipped and unclipped surrogates
                surrogate = advantages * ratio
                clipped = advantages * ratio.clamp(1 - c, 1 + c)
                pg_loss = -torch.minimum(surrogate, clipped).mean()
                unclipped_error = (value - returns) ** 2
                clipped_error = (old_values + (value - old_values).clamp(-c, c) - returns) ** 2
                if args.clip_vloss:
                    v_loss = 0.5 * torch.maximum(unclipped_error, clipped_error).mean()
                else:
                    v_loss = 0.5 * unclipped_error.mean()
                entropy_loss = entropy.mean()
                terms = dict(
                    v_loss=v_loss, pg_loss=pg_loss, entropy=entropy_loss, old_approx_kl=(-logratio).mean(),
                    approx_kl=((ratio - 1) - logratio).mean(), clipfrac=((ratio - 1).abs() > c).double().mean(),
                    clip_binds_above=((clipped < surrogate) & (ratio > 1)).sum(),
                    clip_binds_below=((clipped < surrogate) & (ratio < 1)).sum(),
                    v_clip_binds=(clipped_error > unclipped_error).sum(),
                )  # fmt: skip
                terms = {k: v.detach() for k, v in terms.items()}
                return pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss, terms

            terms, grads = loss_and_gradients(params, loss_fn)
            clipped_grads, terms["grad_norm"] = clip_by_global_norm(grads, args.max_grad_norm)
            records.append(dict(terms=terms, grads=grads, clipped=clipped_grads))
        if args.target_kl is not None and terms["approx_kl"] > args.target_kl:
            break
    return records


def reference_a2c(weights_before, batch, args, updates):
    """Stable-Baselines3's A2C.train() in float64, `updates` times on the same batch: the losses
    and the gradient before and after clipping, update i from weights_before[i] (as in
    reference_ppo)."""
    records = []
    for weights in weights_before[:updates]:
        params = {name: p.double() for name, p in weights.items()}

        def loss_fn(leaves):
            log_prob, entropy, values = reference_forward(leaves, batch["obs"], batch["actions"])
            advantages = batch["advantages"]
            if args.norm_adv:
                advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
            policy_loss = -(advantages * log_prob).mean()
            value_loss = F.mse_loss(batch["returns"], values)
            entropy_loss = -torch.mean(entropy)
            loss = policy_loss + args.ent_coef * entropy_loss + args.vf_coef * value_loss
            terms = dict(v_loss=value_loss, pg_loss=policy_loss, entropy=-entropy_loss)
            return loss, {k: v.detach() for k, v in terms.items()}

        terms, grads = loss_and_gradients(params, loss_fn)
        clipped_grads, terms["grad_norm"] = clip_by_global_norm(grads, args.max_grad_norm)
        records.append(dict(terms=terms, grads=grads, clipped=clipped_grads))
    return records


def adam_steps(weights_before, applied, lr, beta1=0.9, beta2=0.999, eps=1e-5):
    """Adam with CleanRL's eps, in float64: the weights after each step, step i from the script's
    weights before it and the gradient it applied (itself checked against the reference's)."""
    first, second, after = {}, {}, []
    for step, (weights, grads) in enumerate(zip(weights_before, applied), start=1):
        after.append({})
        for name, g in grads.items():
            g = g.double()
            first[name] = beta1 * first.get(name, 0.0) + (1 - beta1) * g
            second[name] = beta2 * second.get(name, 0.0) + (1 - beta2) * g**2
            m_hat, v_hat = first[name] / (1 - beta1**step), second[name] / (1 - beta2**step)
            after[-1][name] = weights[name].double() - lr * m_hat / (v_hat.sqrt() + eps)
    return after


def rmsprop_steps(weights_before, applied, args):
    """RMSprop in float64, as adam_steps. PyTorch's (SB3's A2C default): the square average starts
    at zeros, eps is added to the root; TensorFlow's (SB3's RMSpropTFLike, rl-zoo's): the square
    average starts at ones, eps goes inside the root."""
    tf = args.optimizer == "rmsprop-tf"
    square_avg, after = {}, []
    for weights, grads in zip(weights_before, applied):
        after.append({})
        for name, g in grads.items():
            g = g.double()
            start = 1.0 if tf else 0.0
            square_avg[name] = args.rms_alpha * square_avg.get(name, start) + (1 - args.rms_alpha) * g**2
            if tf:
                denominator = (square_avg[name] + args.rms_eps).sqrt()
            else:
                denominator = square_avg[name].sqrt() + args.rms_eps
            after[-1][name] = weights[name].double() - args.learning_rate * g / denominator
    return after


# ----------------------------------------------------------------------------- the scripts' side
def make_agent(module):
    """The script's Agent with fixed weights; the actor's far from its tiny initial scale, so the
    policy is not uniform and the entropy has a gradient."""
    return copy.deepcopy(_initial_agent(module))


@functools.cache
def _initial_agent(module):
    torch.manual_seed(0)
    agent = module.Agent(NUM_ACTIONS)  # a second of orthogonal init: made once per script
    with torch.no_grad():
        agent.actor.weight.normal_(std=0.05)
    if module is not baseline:
        agent = agent.to(memory_format=torch.channels_last)  # as the native scripts hold it
    return agent


def fixed_batch(agent, perturb, seed=3):
    """Random frames, actions and rewards for T steps of N envs, with the terminals above; values
    and log-probs the agent's own (as a rollout stores them) or, with perturb, moved off them by up
    to 0.3 so that the first step already clips."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randint(0, 256, (T + 1, N, 4, 84, 84), dtype=torch.uint8, generator=g)
    actions = torch.randint(0, NUM_ACTIONS, (T + 1, N), generator=g)
    rewards = torch.randint(-1, 2, (T, N), generator=g).float()
    with torch.no_grad():
        _, logprobs, _, values = agent.get_action_and_value(obs.flatten(0, 1), actions.flatten())
    logprobs, values = logprobs.view(T + 1, N)[:T], values.view(T + 1, N)
    if perturb:
        logprobs = logprobs + 0.6 * torch.rand(T, N, generator=g) - 0.3
        values = values + 0.6 * torch.rand(T + 1, N, generator=g) - 0.3
    return SimpleNamespace(obs=obs[:T], actions=actions[:T], logprobs=logprobs, rewards=rewards, values=values)


def reference_batch(data, gamma, lam):
    """The flat batch, in float64, with the reference's advantages."""
    advantages = torch.tensor(
        reference_advantages(data.rewards.tolist(), data.values.tolist(), TERMINAL.tolist(), gamma, lam),
        dtype=torch.float64,
    )
    values = data.values[:T].double()
    return dict(
        obs=data.obs.flatten(0, 1), actions=data.actions.flatten(), logprobs=data.logprobs.double().flatten(),
        values=values.flatten(), advantages=advantages.flatten(), returns=(advantages + values).flatten(),
    )  # fmt: skip


def record_steps(agent, optimizer):
    """Per optimizer step of the script: the gradient backward left (before clipping), the one the
    step applies, and the parameters after it."""
    names = {p: name for name, p in agent.named_parameters()}
    records, grads = [], {}

    def on_grad(p):
        grads[names[p]] = p.grad.detach().clone()

    def before_step(*_):
        clipped = {name: p.grad.detach().clone() for name, p in agent.named_parameters()}
        records.append(dict(grads=dict(grads), clipped=clipped))

    def after_step(*_):
        records[-1]["params"] = {name: p.detach().clone() for name, p in agent.named_parameters()}

    for p in agent.parameters():
        p.register_post_accumulate_grad_hook(on_grad)
    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
    return records


def assert_float32_close(actual, expected, what, atol=None, floor=0.0):
    """float32 against float64: within 2e-4 of each entry, plus 2e-5 of the tensor's largest entry
    (sums of thousands of float32 products, and entries that nearly cancel), plus `floor`."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    actual = torch.as_tensor(actual).double()
    atol = 2e-5 * expected.abs().max().item() if atol is None else atol
    error, tolerance = (actual - expected).abs(), 2e-4 * expected.abs() + atol + floor
    worst = (error - tolerance).argmax()
    assert (error <= tolerance).all(), (
        f"{what}: {int((error > tolerance).sum())} of {error.numel()} entries off; the worst: "
        f"{actual.flatten()[worst].item():.9g}, expected {expected.flatten()[worst].item():.9g}"
    )


def assert_steps_equal(steps, expected, weights_before, after):
    """Every optimizer step of the script: the gradient before and after clipping, and the step
    taken (the weights after it less those before; one ulp of the weights allowed on top, for
    rounding the sum to float32)."""
    assert len(steps) == len(expected), f"{len(steps)} optimizer steps, the reference takes {len(expected)}"
    for i, (got, want) in enumerate(zip(steps, expected)):
        for name, before in weights_before[i].items():
            before = before.double()
            assert_float32_close(got["grads"][name], want["grads"][name], f"step {i}: gradient of {name}")
            assert_float32_close(got["clipped"][name], want["clipped"][name], f"step {i}: clipped gradient of {name}")
            taken, expected_step = got["params"][name] - before, after[i][name] - before
            assert_float32_close(taken, expected_step, f"step {i}: step of {name}", floor=2**-23 * before.abs())


# ----------------------------------------------------------------------------- 2. advantages
@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize("script", ["native", "baseline", "a2c"])
def test_advantages_equal_the_definition(script, lam):
    """Each env of a 5-step horizon ends at one step (every position, the horizon's last
    included), one never ends, one ends at every step, one twice; obs[0] follows a terminal in
    some envs (that must change nothing). gamma 0.9, so that a step too far shows."""
    steps, gamma = 5, 0.9
    envs = steps + 3
    terminal = torch.zeros(steps, envs)
    for k in range(steps):
        terminal[k, k] = 1
    terminal[:, steps + 1] = 1
    terminal[[1, steps - 1], steps + 2] = 1
    before = torch.zeros(1, envs)
    before[0, [0, steps, steps + 2]] = 1
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(steps, envs, generator=g), torch.randn(steps + 1, envs, generator=g)
    expected = torch.tensor(reference_advantages(rewards.tolist(), values.tolist(), terminal.tolist(), gamma, lam))

    advantages, returns = script_advantages(script, rewards, values, terminal, before, gamma, lam)
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns, expected + values[:steps], rtol=1e-5, atol=1e-5)

    # the reference, written out at both ends of lambda
    r, v = rewards[:, steps], values[:, steps]  # the env that never ends
    if lam == 0.0:  # one-step TD errors
        assert expected[2, steps].item() == pytest.approx((r[2] + gamma * v[3] - v[2]).item(), abs=1e-5)
        assert expected[2, 2].item() == pytest.approx((rewards[2, 2] - values[2, 2]).item(), abs=1e-5)
    if lam == 1.0:  # n-step returns: rewards to the episode's end or the horizon, then its value
        n_step = sum(gamma**s * r[s] for s in range(steps)) + gamma**steps * v[steps]
        assert (expected[0, steps] + v[0]).item() == pytest.approx(n_step.item(), abs=1e-5)
        ends_at_3 = sum(gamma**s * rewards[s, 3] for s in range(4))
        assert (expected[0, 3] + values[0, 3]).item() == pytest.approx(ends_at_3.item(), abs=1e-5)


# ----------------------------------------------------------------------------- 1. the updates
# ent_coef 0.2, twenty times the scripts' default: the entropy's share of the gradient then stands far
# above float32 rounding, so that its sign and coefficient show. No two coefficients are equal, so
# that one written in place of another shows too.
PPO_ARGS = dict(
    learning_rate=1e-4, gamma=0.99, gae_lambda=0.95, update_epochs=1, num_minibatches=1, norm_adv=True,
    clip_coef=0.1, clip_vloss=True, ent_coef=0.2, vf_coef=0.5, max_grad_norm=0.4, target_kl=None,
)  # fmt: skip


def ppo_args(**changes):
    args = SimpleNamespace(**{**PPO_ARGS, **changes})
    args.batch_size = T * N
    args.minibatch_size = args.batch_size // args.num_minibatches
    return args


def run_ppo(script, args, perturb, shuffle_seed=3):
    """The script's advantages and update on the fixed batch, with hooks on every step: its last
    minibatch's losses, its clip fractions, its steps and the weights before each, the
    reference's steps and Adam's. The test seeds the RNG the script shuffles with and draws the
    same permutations for the reference."""
    module = {"native": native, "baseline": baseline}[script]
    agent = make_agent(module)
    data = fixed_batch(agent, perturb)
    weights = {name: p.detach().clone() for name, p in agent.named_parameters()}
    gamma, lam = args.gamma, args.gae_lambda
    advantages, returns = script_advantages(script, data.rewards, data.values, TERMINAL, BEFORE, gamma, lam)
    batch = (data.obs.flatten(0, 1), data.actions.flatten(), data.logprobs.flatten())
    batch += (advantages.flatten(), returns.flatten(), data.values[:T].flatten())
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    steps = record_steps(agent, optimizer)
    names = ["v_loss", "pg_loss", "entropy", "old_approx_kl", "approx_kl"]
    if script == "native":
        torch.manual_seed(shuffle_seed)
        stats, nonfinite = native.update(agent, optimizer, *batch, args, torch.float32, 1)
        assert not nonfinite
        losses, clipfracs = dict(zip(names, stats[:5].tolist())), (stats[5].item(), stats[6].item())
        torch.manual_seed(shuffle_seed)
        permutations = [torch.randperm(args.batch_size) for _ in range(args.update_epochs)]
    else:
        np.random.seed(shuffle_seed)
        *last, clipfracs = baseline.update(agent, optimizer, *batch, args)
        losses = dict(zip(names, [x.item() for x in last]))
        np.random.seed(shuffle_seed)
        indices, permutations = np.arange(args.batch_size), []
        for _ in range(args.update_epochs):
            np.random.shuffle(indices)  # CleanRL shuffles one index array in place, epoch after epoch
            permutations.append(torch.as_tensor(indices.copy()))
    weights_before = [weights] + [step["params"] for step in steps]
    expected = reference_ppo(weights_before, reference_batch(data, gamma, lam), args, permutations)
    after = adam_steps(weights_before, [step["clipped"] for step in steps], args.learning_rate)
    return SimpleNamespace(
        losses=losses, clipfracs=clipfracs, steps=steps, expected=expected, weights_before=weights_before, after=after
    )


def assert_losses_equal(losses, terms):
    """Each loss term to 2e-6 (the KL estimates are means of log-ratios that nearly cancel)."""
    for name, value in losses.items():
        assert_float32_close(value, terms[name], name, atol=2e-6)


@pytest.mark.parametrize("norm_adv, clip_vloss", [(True, True), (False, False)])
@pytest.mark.parametrize("script", ["native", "baseline"])
def test_ppo_step_equals_cleanrl(script, norm_adv, clip_vloss):
    """One epoch of one minibatch, the old log-probs and values moved off the network's so that
    the policy clip binds on both sides and the value clip binds, and the gradient norm is
    clipped: every loss term, the gradients before and after clipping, Adam's step."""
    args = ppo_args(norm_adv=norm_adv, clip_vloss=clip_vloss)
    run = run_ppo(script, args, perturb=True)
    terms = run.expected[0]["terms"]
    assert 0 < terms["clipfrac"] < 1 and terms["clip_binds_above"] > 0 and terms["clip_binds_below"] > 0
    assert terms["v_clip_binds"] > 0
    assert terms["grad_norm"] > 2 * args.max_grad_norm
    assert_losses_equal(run.losses, terms)
    if script == "native":
        assert run.clipfracs == (pytest.approx(terms["clipfrac"].item()), 1)
    else:
        assert run.clipfracs == [pytest.approx(terms["clipfrac"].item())]
    assert_steps_equal(run.steps, run.expected, run.weights_before, run.after)


@pytest.mark.parametrize("script", ["native", "baseline"])
def test_ppo_epochs_of_minibatches_equal_cleanrl(script):
    """Epochs of 2 shuffled minibatches from the network's own log-probs and values: ratio 1 at
    the first step, then clipped by what the earlier steps changed; target_kl 0.15 lies between
    the approx_kl of the first and the second epoch's last minibatch, so the second of 3 epochs
    is the last: every step, the last losses and the clip fractions."""
    args = ppo_args(update_epochs=3, num_minibatches=2, target_kl=0.15)
    run = run_ppo(script, args, perturb=False)
    expected = run.expected
    kls = [r["terms"]["approx_kl"] for r in expected]
    assert len(run.steps) == len(expected), f"the script took {len(run.steps)} steps, the reference {len(expected)}"
    assert len(expected) == 4 and kls[1] < args.target_kl < kls[3]
    assert expected[0]["terms"]["clipfrac"] == 0
    clipping = [r["terms"]["clip_binds_above"] + r["terms"]["clip_binds_below"] > 0 for r in expected]
    assert sum(clipping) >= 2 and sum(r["terms"]["v_clip_binds"] > 0 for r in expected) >= 2
    assert_losses_equal(run.losses, expected[-1]["terms"])
    if script == "native":
        assert run.clipfracs == (pytest.approx(sum(r["terms"]["clipfrac"].item() for r in expected)), len(expected))
    else:
        assert run.clipfracs == pytest.approx([r["terms"]["clipfrac"].item() for r in expected])
    assert_steps_equal(run.steps, expected, run.weights_before, run.after)


# SLM Lab's Atari A2C (the script's defaults) but ent_coef 0.1 (see PPO_ARGS), gamma 0.98 and
# max_grad_norm 0.4, so that no two coefficients are equal (SLM Lab's are vf_coef's 0.5 and rms_alpha's 0.99)
A2C_ARGS = dict(
    learning_rate=7e-4, gamma=0.98, gae_lambda=0.95, norm_adv=False, ent_coef=0.1, vf_coef=0.5, max_grad_norm=0.4,
    optimizer="rmsprop", rms_alpha=0.99, rms_eps=1e-5,
)  # fmt: skip
RL_ZOO = dict(optimizer="rmsprop-tf", gae_lambda=1.0, vf_coef=0.25)  # n-step returns, TensorFlow's RMSprop


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(rms_alpha=0.6, rms_eps=0.05),
        RL_ZOO,
        dict(RL_ZOO, norm_adv=True, gae_lambda=0.95, rms_alpha=0.6, rms_eps=0.05),
    ],
)
def test_a2c_updates_equal_stable_baselines3(changes):
    """Two updates on the same batch, with the script's optimizer as its main block makes it: SLM
    Lab's settings (GAE, PyTorch's RMSprop), then an RMSprop whose eps and alpha matter; rl-zoo's
    (n-step returns, TensorFlow's RMSprop), then with advantage normalization, GAE and such an
    RMSprop: the losses, the gradients before and after clipping and the weights after each step."""
    args = SimpleNamespace(**{**A2C_ARGS, **changes})
    agent = make_agent(a2c)
    data = fixed_batch(agent, perturb=False)
    weights = {name: p.detach().clone() for name, p in agent.named_parameters()}
    gamma, lam = args.gamma, args.gae_lambda
    advantages, returns = script_advantages("a2c", data.rewards, data.values, TERMINAL, BEFORE, gamma, lam)
    hyper = dict(lr=args.learning_rate, alpha=args.rms_alpha, eps=args.rms_eps)
    optimizer = (torch.optim.RMSprop if args.optimizer == "rmsprop" else a2c.RMSpropTF)(agent.parameters(), **hyper)
    steps = record_steps(agent, optimizer)
    batch = (data.obs.flatten(0, 1), data.actions.flatten(), data.logprobs.flatten())
    batch += (advantages.flatten(), returns.flatten())
    updates = []
    for _ in range(2):
        losses, nonfinite = a2c.update(agent, optimizer, *batch, args, torch.float32)
        assert not nonfinite
        updates.append(dict(zip(["v_loss", "pg_loss", "entropy"], losses[:3].tolist())))
    weights_before = [weights] + [step["params"] for step in steps]
    expected = reference_a2c(weights_before, reference_batch(data, gamma, lam), args, updates=2)
    after = rmsprop_steps(weights_before, [step["clipped"] for step in steps], args)
    assert all(r["terms"]["grad_norm"] > 2 * args.max_grad_norm for r in expected)
    for losses, reference in zip(updates, expected):
        assert_losses_equal(losses, reference["terms"])
    assert_steps_equal(steps, expected, weights_before, after)


@pytest.mark.parametrize("script", ["native", "baseline", "a2c"])
def test_a_non_finite_loss_is_reported(script):
    """Infinite returns: native and A2C flag the loss on the device and go on (their main blocks
    fail the run at the iteration's one sync); the baseline raises before any step on it."""
    module = {"native": native, "baseline": baseline, "a2c": a2c}[script]
    agent = make_agent(module)
    data = fixed_batch(agent, perturb=False)
    b_obs, b_actions, b_logprobs = data.obs.flatten(0, 1), data.actions.flatten(), data.logprobs.flatten()
    b_values = b_advantages = data.values[:T].flatten()
    b_returns = torch.full_like(b_values, float("inf"))
    before = [p.detach().clone() for p in agent.parameters()]
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-4, eps=1e-5)
    args = ppo_args(update_epochs=2, num_minibatches=2)
    if script == "a2c":
        args = SimpleNamespace(**A2C_ARGS)
        _, nonfinite = a2c.update(
            agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, args, torch.float32
        )
        assert nonfinite
    elif script == "native":
        batch = (b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values)
        stats, nonfinite = native.update(agent, optimizer, *batch, args, torch.float32, 1)
        assert nonfinite and stats[6] == 4
    else:
        with pytest.raises(FloatingPointError, match="non-finite loss"):
            baseline.update(agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values, args)
        assert all(torch.equal(p, q) for p, q in zip(agent.parameters(), before))


@pytest.mark.parametrize("script", ["native", "a2c"])
def test_logprob_gap_is_the_mean_absolute_difference(script):
    """The rollout's log-probs stored 0.3 off the network's, up or down by env: the update reports
    their mean |difference| from the learner's, 0.3 (PPO: of its first minibatch, before any step)."""
    module = {"native": native, "a2c": a2c}[script]
    agent = make_agent(module)
    data = fixed_batch(agent, perturb=False)
    b_obs, b_actions = data.obs.flatten(0, 1), data.actions.flatten()
    signs = torch.tensor([1.0, -1.0]).repeat(T * N // 2)
    b_logprobs = data.logprobs.flatten() + 0.3 * signs
    b_values = b_advantages = b_returns = data.values[:T].flatten()
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-2, eps=1e-5)
    if script == "a2c":
        args = SimpleNamespace(**A2C_ARGS)
        losses, _ = a2c.update(
            agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, args, torch.float32
        )
        gap = losses[3]
    else:
        args = ppo_args(update_epochs=2, num_minibatches=2)
        batch = (b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values)
        stats, _ = native.update(agent, optimizer, *batch, args, torch.float32, 1)
        gap = stats[7]
    assert gap.item() == pytest.approx(0.3, abs=1e-5)
