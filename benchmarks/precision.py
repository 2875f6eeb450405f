"""bf16 against fp32 in ppo_atari_native.py's update, on one rollout of a checkpoint's own policy:
where bf16 autocast's rounding enters (the values, the log-probs, the advantages, each layer's
gradient) beside the noise PPO's gradients carry anyway (two minibatches of the same rollout).

    python benchmarks/precision.py runs/.../model.pt [--num-envs 8 --num-steps 128 --seed 1]

The rollout is played in fp32 by the gymnasium pipeline (utils.make_env, the checkpoint's game);
each precision then computes its values and log-probs of it (what its rollout would store), its
advantages, and one minibatch_step's clipped gradient (with a zero learning rate: nothing moves).
"""

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ppo_atari_native as native  # noqa: E402
import utils  # noqa: E402

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def play(agent, game, env_id, num_envs, num_steps, seed):
    """obs [T + 1, N, ...] uint8, actions [T, N], rewards [T, N] (as the learner sees them), dones [T + 1, N]."""
    env_fns = [utils.make_env(env_id, seed + i, game) for i in range(num_envs)]
    # as the baseline: a game's last step returns the next game's first frame, no step is spent resetting
    envs = gym.vector.SyncVectorEnv(env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    frame, _ = envs.reset(seed=seed)
    obs, actions, rewards, dones = [torch.from_numpy(frame)], [], [], [torch.zeros(num_envs)]
    for _ in range(num_steps):
        with torch.no_grad():
            action = agent.get_action_and_value(obs[-1])[0]
        frame, reward, terminated, truncated, _ = envs.step(action.numpy())
        obs.append(torch.from_numpy(frame))
        actions.append(action)
        rewards.append(torch.as_tensor(reward, dtype=torch.float32))
        dones.append(torch.as_tensor(np.logical_or(terminated, truncated), dtype=torch.float32))
    envs.close()
    return torch.stack(obs), torch.stack(actions), torch.stack(rewards), torch.stack(dones)


def under(dtype, agent, obs, actions):
    """Log-probs and values of the taken actions, as a rollout in this precision stores them."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        _, logprob, _, value = agent.get_action_and_value(obs.flatten(0, 1), actions.flatten())
    return logprob.float().view(actions.shape), value.float().view(actions.shape)


def gradient(agent, dtype, batch, mb_inds, args):
    """minibatch_step's clipped gradient, per parameter, under this precision."""
    optimizer = torch.optim.SGD(agent.parameters(), lr=0.0)
    native.minibatch_step(agent, optimizer, *batch, mb_inds, args, dtype, 1)
    return {name: p.grad.detach().clone().flatten() for name, p in agent.named_parameters()}


def cosine(a, b):
    a, b = a.double(), b.double()
    return float(torch.dot(a, b) / (a.norm() * b.norm() + 1e-30))


def relative(a, b):
    """|a - b| / |b|"""
    return float((a - b).norm() / (b.norm() + 1e-30))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a model.pt or checkpoint.pt of ppo_atari_native.py")
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    cli = parser.parse_args()
    try:
        state = utils.load_checkpoint(cli.checkpoint, "ppo_atari_native.py", None, native.Agent)
    except utils.UsageError as e:
        utils.fail(str(e))
    args = SimpleNamespace(**{**vars(native.Args()), **state["args"]})  # the run's flags
    game = utils.game_settings(args)
    agent = native.Agent(state["num_actions"], game["frame_stack"], game["screen_size"])
    agent.load_state_dict(state["model"])
    torch.manual_seed(cli.seed)
    obs, actions, rewards, dones = play(agent, game, state["env_id"], cli.num_envs, cli.num_steps, cli.seed)
    T, N = actions.shape
    batch_size = T * N
    minibatch = batch_size // args.num_minibatches
    order = torch.randperm(batch_size)
    first, second = order[:minibatch], order[minibatch : 2 * minibatch]

    rows, grads = {}, {}
    for name, dtype in PRECISIONS.items():
        logprobs, values = under(dtype, agent, obs[:T], actions)
        _, bootstrap = under(dtype, agent, obs[T:], actions[:1])
        values = torch.cat([values, bootstrap])
        advantages, returns = native.gae(rewards, values, dones, args.gamma, args.gae_lambda)
        batch = (obs[:T].flatten(0, 1), actions.flatten(), logprobs.flatten(), advantages.flatten(),
                 returns.flatten(), values[:T].flatten())  # fmt: skip
        rows[name] = dict(logprobs=logprobs, values=values, advantages=advantages)
        grads[name] = gradient(agent, dtype, batch, first, args)
        if name == "fp32":
            grads["fp32, other minibatch"] = gradient(agent, dtype, batch, second, args)

    fp32, bf16 = rows["fp32"], rows["bf16"]
    deltas = rewards + args.gamma * fp32["values"][1:] * (1 - dones[1:]) - fp32["values"][:-1]
    print(f"# bf16 against fp32: {cli.checkpoint}, a rollout of {N} envs x {T} steps (seed {cli.seed})\n")
    print("| quantity | fp32: mean abs | bf16 - fp32: mean abs | max abs | relative (norm of the difference / norm) |")
    print("|---|---|---|---|---|")
    for quantity in ("values", "logprobs", "advantages"):
        a, b = fp32[quantity], bf16[quantity]
        gap = (b - a).abs()
        print(f"| {quantity} | {a.abs().mean():.4g} | {gap.mean():.3g} | {gap.max():.3g} | {relative(b, a):.3g} |")
    print(f"| TD residuals (fp32) | {deltas.abs().mean():.4g} | - | - | - |")
    print("\n| parameter | gradient norm (fp32) | bf16: cosine to fp32 | bf16: relative difference | "
          "another minibatch (fp32): relative difference |")  # fmt: skip
    print("|---|---|---|---|---|")
    grads = {
        kind: {**by_parameter, "all": torch.cat(list(by_parameter.values()))} for kind, by_parameter in grads.items()
    }
    for name in grads["fp32"]:
        g, b, other = (grads[kind][name] for kind in ("fp32", "bf16", "fp32, other minibatch"))
        print(f"| {name} | {g.norm():.3g} | {cosine(b, g):.5f} | {relative(b, g):.3g} | {relative(other, g):.3g} |")


if __name__ == "__main__":
    main()
