"""PPO on Atari the conventional way: the yardstick for learning and speed.

This is PPO as a careful researcher writes it without speed tricks (after CleanRL's
ppo_atari.py): a gymnasium vector env of ale-py v5 envs with gymnasium's Atari
preprocessing, the Nature CNN, and the standard clipped PPO update. Defaults follow the
SLM Lab PPO Atari spec. Run: python ppo_atari_baseline.py --env-id Breakout-v5
"""

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

import utils


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """the name of this experiment (part of the run directory's name: letters, digits, _ . + = -)"""
    seed: int = 1
    """seed of the experiment (python, numpy, torch and the envs), in [0, 2**32 - 1]"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    device: str = "auto"
    """auto (CUDA if available, else CPU), cpu, cuda or cuda:N"""
    runs_dir: str = "runs"
    """where run directories are created (made if missing)"""
    save_interval: int = 50
    """write a checkpoint every this many iterations (and at the end); at least 1"""
    resume: str | None = None
    """a checkpoint.pt, or its run directory, to continue from (in that run directory)"""
    eval_checkpoint: str | None = None
    """evaluate this checkpoint or model.pt instead of training"""
    eval_episodes: int = 10
    """number of full games played by --eval-checkpoint; at least 1"""
    capture_video: bool = False
    """record the evaluation games to videos/ in the run directory (needs moviepy)"""
    vector_mode: Literal["async", "sync"] = "async"
    """async: one process per env (gymnasium AsyncVectorEnv); sync: all in this process"""

    # Algorithm specific arguments
    env_id: str | None = None
    """the game: Breakout-v5 (default), ALE/Breakout-v5 or breakout-v5; evaluation: the checkpoint's game"""
    total_timesteps: int = 10_000_000
    """total agent steps (4 frames each), at least one batch; runs a whole number of iterations"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer (finite, > 0)"""
    num_envs: int = 16
    """the number of parallel game environments; at least 1"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout; at least 1"""
    anneal_lr: bool = True
    """toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma, in [0, 1]"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation, in [0, 1]"""
    num_minibatches: int = 8
    """the number of mini-batches (at least 1; it divides num_envs x num_steps)"""
    update_epochs: int = 4
    """the K epochs to update the policy (at least 0; 0: collect only, used to time the rollout)"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient (finite, > 0)"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function"""
    ent_coef: float = 0.01
    """coefficient of the entropy (finite, >= 0)"""
    vf_coef: float = 0.5
    """coefficient of the value function (finite, >= 0)"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping (finite, > 0)"""
    target_kl: float | None = None
    """the target KL divergence threshold (finite, > 0; unset: no early stop)"""

    # the game (ALE v5 protocol; README "The game")
    repeat_action_probability: float = 0.25
    """sticky actions: each frame repeats the previous action with this probability, in [0, 1]"""
    frame_skip: int = 4
    """frames per agent step, the observation max-pooled over the last two; at least 1"""
    frame_stack: int = 4
    """the newest observations the network sees, stacked (zeros before a game's first); in [1, 16]"""
    screen_size: int = 84
    """the observations' side in pixels, grayscale, resized (the Nature CNN needs 36 or more); in [16, 256]"""
    noop_max: int = 30
    """a game starts after U{0..noop_max-1} noop frames, one fewer after a FIRE frame; at least 0"""
    fire_reset: bool = True
    """press FIRE for one frame at the start of every game, where the action set has it (not after a lost life)"""
    max_episode_frames: int = 108_000
    """a game is cut after this many frames (108,000: 30 minutes), a terminal for the learner; at least 1"""
    full_action_space: bool = False
    """all 18 joystick actions; off: the game's minimal action set"""
    clip_rewards: bool = True
    """the learner's rewards clipped to [-1, 1] (returns are logged unclipped)"""
    life_loss_terminal: bool = True
    """treat a lost life as terminal for the learner (returns are still logged per full game)"""

    # to be filled in runtime (not flags)
    batch_size: int = field(default=0, init=False)
    """the batch size (computed in runtime)"""
    minibatch_size: int = field(default=0, init=False)
    """the mini-batch size (computed in runtime)"""
    num_iterations: int = field(default=0, init=False)
    """the number of iterations (computed in runtime)"""


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Nature CNN -> Linear(64 * side**2, 512) + GELU -> actor and critic heads (all scripts share it)."""

    def __init__(self, num_actions, frame_stack=4, screen_size=84):
        super().__init__()
        side = screen_size  # the frames' side after each convolution: 84 -> 20 -> 9 -> 7
        for kernel, stride in ((8, 4), (4, 2), (3, 1)):
            side = (side - kernel) // stride + 1
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(frame_stack, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * side * side, 512)),
            nn.GELU(),
        )
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def get_value(self, x):
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        probs = Categorical(logits=logits, validate_args=False)  # NaNs reach the non-finite checks
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """CleanRL's GAE loop. rewards, values and dones [T, N], where dones[t] = 1 when obs[t]
    follows a terminal; next_value and next_done are those of the observation after the horizon.
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal = 1.0 - next_done
            nextvalues = next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    return advantages, advantages + values


def parse_args() -> Args:
    args = utils.cli(Args)  # tyro.cli, with its errors as one line
    utils.check_args(args, Agent)  # ranges, the network, the game's name, --exp-name, --runs-dir, video
    args.batch_size = int(args.num_envs * args.num_steps)
    if args.batch_size % args.num_minibatches:
        raise utils.UsageError(
            f"batch size {args.batch_size} (num_envs x num_steps) is not divisible by "
            f"--num-minibatches {args.num_minibatches}"
        )
    if args.eval_checkpoint is None and args.total_timesteps < args.batch_size:
        raise utils.UsageError(f"--total-timesteps {args.total_timesteps} is below one batch ({args.batch_size} steps)")
    args.minibatch_size = int(args.batch_size // args.num_minibatches)
    args.num_iterations = args.total_timesteps // args.batch_size
    return args


def update(agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values, args):
    """CleanRL's PPO update: args.update_epochs (at least 1) passes over the batch, shuffled by
    numpy's global RNG, in minibatches; stops after an epoch past args.target_kl.

    Returns the last minibatch's value, policy and entropy losses, old_approx_kl and approx_kl,
    and every minibatch's clip fraction. Raises FloatingPointError at a non-finite loss.
    """
    b_inds = np.arange(args.batch_size)
    clipfracs = []
    for epoch in range(args.update_epochs):
        np.random.shuffle(b_inds)
        for start in range(0, args.batch_size, args.minibatch_size):
            end = start + args.minibatch_size
            mb_inds = b_inds[start:end]

            _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
            logratio = newlogprob - b_logprobs[mb_inds]
            ratio = logratio.exp()

            with torch.no_grad():
                # calculate approx_kl http://joschu.net/blog/kl-approx.html
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]

            mb_advantages = b_advantages[mb_inds]
            if args.norm_adv:
                mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

            # Policy loss
            pg_loss1 = -mb_advantages * ratio
            pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()

            # Value loss
            newvalue = newvalue.view(-1)
            if args.clip_vloss:
                v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                v_clipped = b_values[mb_inds] + torch.clamp(
                    newvalue - b_values[mb_inds],
                    -args.clip_coef,
                    args.clip_coef,
                )
                v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
                v_loss = 0.5 * v_loss_max.mean()
            else:
                v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

            entropy_loss = entropy.mean()
            loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
            if not torch.isfinite(loss):
                raise FloatingPointError("non-finite loss")  # before any step on it

            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()

        if args.target_kl is not None and approx_kl > args.target_kl:
            break
    return v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfracs


if __name__ == "__main__":
    script = Path(__file__).name
    try:
        args = parse_args()
        device = utils.resolve_device(args.device)
        checkpoint = None
        if args.resume is not None:
            checkpoint = utils.load_checkpoint(args.resume, script, args.env_id, Agent, resume=True)
            utils.check_resume_args(checkpoint, args)
        if args.eval_checkpoint is not None:
            evaluated = utils.load_checkpoint(args.eval_checkpoint, script, args.env_id, Agent)
            utils.play_checkpoint_game(args, evaluated)  # its game and settings
    except utils.UsageError as e:
        utils.fail(str(e))
    print(utils.describe_run(args, device, f"{args.num_envs} envs ({args.vector_mode} vector env)"), flush=True)

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    if args.eval_checkpoint is not None:
        utils.evaluate_checkpoint(Agent, evaluated, args, device)

    # log setup: a resume continues in its run directory
    run_dir, writer, stop, start_iteration, global_step = utils.start_run(args, checkpoint)

    # env setup: envs cannot be checkpointed, so a resume reseeds them
    env_seed = args.seed + 1_000_003 * start_iteration
    game = utils.game_settings(args)  # the game block of Args, as the envs play it
    env_fns = [utils.make_env(args.env_id, env_seed + i, game) for i in range(args.num_envs)]
    autoreset = gym.vector.AutoresetMode.SAME_STEP
    if args.vector_mode == "async":
        envs = gym.vector.AsyncVectorEnv(env_fns, autoreset_mode=autoreset)
    else:
        envs = gym.vector.SyncVectorEnv(env_fns, autoreset_mode=autoreset)
    num_actions = int(envs.single_action_space.n)

    # agent and optimizer
    agent = Agent(num_actions, args.frame_stack, args.screen_size).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    if checkpoint is not None:
        agent.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        optimizer.param_groups[0]["lr"] = args.learning_rate  # the command line's rate, not the saved one
        utils.set_rng_states(checkpoint["rng"], device)

    def save(iteration, step, path=run_dir / "checkpoint.pt"):
        state = {
            "script": script, "env_id": args.env_id, "args": vars(args),
            "num_actions": num_actions, "model": agent.state_dict(),
            "optimizer": optimizer.state_dict(), "iteration": iteration, "global_step": step,
            "env_seed": env_seed, "rng": utils.rng_states(device),
        }  # fmt: skip
        utils.save_checkpoint(path, state)

    # storage
    obs = torch.zeros((args.num_steps, args.num_envs) + envs.single_observation_space.shape, dtype=torch.uint8).to(
        device
    )
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long).to(device)
    logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    # TRY NOT TO MODIFY: start the game
    progress = utils.Progress(args.total_timesteps, global_step)
    next_obs, _ = envs.reset(seed=env_seed)
    next_obs = torch.tensor(next_obs, device=device)
    next_done = torch.zeros(args.num_envs).to(device)
    iteration = start_iteration
    print(f"run directory: {run_dir}", flush=True)

    for iteration in range(start_iteration + 1, args.num_iterations + 1):
        iteration_start_step = global_step
        # annealing the rate if instructed to do so.
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # ALGO LOGIC: rollout
        rollout_start = time.perf_counter()
        for step in range(0, args.num_steps):
            if stop:
                break
            global_step += args.num_envs
            obs[step] = next_obs
            dones[step] = next_done

            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob

            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            next_done = np.logical_or(terminations, truncations)
            rewards[step] = torch.tensor(reward).to(device).view(-1)
            next_obs, next_done = torch.tensor(next_obs, device=device), torch.Tensor(next_done).to(device)

            # full games end inside the stack of wrappers; SameStep autoreset moves their
            # statistics to final_info
            for info in (infos, infos.get("final_info", {})):
                if "episode" in info:
                    for i in np.flatnonzero(info["_episode"]):
                        episodic_return = float(info["episode"]["r"][i])
                        progress.recent_returns.append(episodic_return)
                        writer.add_scalar("charts/episodic_return", episodic_return, global_step)
                        writer.add_scalar("charts/episodic_length", int(info["episode"]["l"][i]), global_step)
        if stop:  # abandon the unfinished rollout: the checkpoint is the last full iteration
            iteration, global_step = iteration - 1, iteration_start_step
            break
        progress.rollout_time += time.perf_counter() - rollout_start  # action.cpu() synced each step

        # bootstrap value if not done
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages, returns = gae(rewards, values, dones, next_value, next_done, args.gamma, args.gae_lambda)

        # flatten the batch
        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        # ALGO LOGIC: optimizing the policy and value network (update, above)
        if args.update_epochs > 0:
            try:
                v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfracs = update(
                    agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values, args
                )
            except FloatingPointError as e:
                utils.fail_diverged(str(e), iteration, run_dir / "checkpoint.pt", writer, envs)
            # the next rollout must not sample from non-finite outputs
            if utils.nonfinite_policy(agent, next_obs):
                utils.fail_diverged("non-finite weights or outputs", iteration, run_dir / "checkpoint.pt", writer, envs)

        # TRY NOT TO MODIFY: record losses for plotting purposes
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        if args.update_epochs > 0:
            y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
            var_y = np.var(y_true)
            explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
            writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
            writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
            writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
            writer.add_scalar("losses/old_approx_kl", old_approx_kl.item(), global_step)
            writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
            writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
            writer.add_scalar("losses/explained_variance", explained_var, global_step)
        writer.add_scalar("charts/SPS", progress.sps(global_step), global_step)
        print(progress.line(iteration, args.num_iterations, global_step), flush=True)

        if iteration % args.save_interval == 0 or iteration == args.num_iterations:
            save(iteration, global_step)
        if stop:
            break

    # close: a stop saves and says how to resume; an ended run saves model.pt
    if stop and iteration < args.num_iterations:
        save(iteration, global_step)
        print(utils.stopped_message(stop, global_step, run_dir / "checkpoint.pt"), flush=True)
    else:
        save(iteration, global_step, run_dir / "model.pt")
        print(f"saved {run_dir / 'model.pt'}", flush=True)
    envs.close()
    writer.close()
