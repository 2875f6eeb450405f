"""A2C on Atari with SLM Lab's settings, on ppo_atari_native.py's fast rollout.

16 envs x 32 steps, GAE with lambda 0.95, one gradient step per rollout, PyTorch's RMSprop (lr
7e-4, alpha 0.99, eps 1e-5) at a constant rate, value coefficient 0.5 on the plain squared error,
entropy 0.01, gradient norm 0.5, no advantage normalization: SLM Lab's ALE v5 A2C
(kengz/SLM-Lab, slm_lab/spec/benchmark_arc/a2c/a2c_atari_arc.yaml). The update is
Stable-Baselines3's A2C. rl-zoo's Atari A2C is one set of flags away:
--num-steps 5 --gae-lambda 1 --vf-coef 0.25 --optimizer rmsprop-tf
(n-step returns, TensorFlow's RMSprop); under sticky actions it hardly learns in 3M steps
(benchmarks/results/a2c_3M.md). Logged every --log-interval iterations (an iteration is 512
agent steps). The rollout: docs/rollout.md.
Run: python a2c_atari.py --env-id Breakout-v5
"""

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

import kernels
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
    save_interval: int = 400
    """write a checkpoint every this many iterations (and at the end); at least 1"""
    log_interval: int = 16
    """write losses, SPS and the progress line every this many iterations (and at the end), at least 1"""
    resume: str | None = None
    """a checkpoint.pt, or its run directory, to continue from (in that run directory)"""
    eval_checkpoint: str | None = None
    """evaluate this checkpoint or model.pt instead of training"""
    eval_episodes: int = 10
    """number of full games played by --eval-checkpoint; at least 1"""
    capture_video: bool = False
    """record the evaluation games to videos/ in the run directory (needs moviepy)"""
    num_gpu_batches: int = 2
    """split the envs into this many independent batches, each on its own CUDA stream (at least 1; divides num_envs)"""
    num_env_threads: int | None = None
    """C++ env threads in all, at least 1 (default: CUDA: the cores but the driver's; CPU: min(cores, batch) each)"""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 where the GPU or CPU has it natively, fp32 elsewhere"""
    cuda_graphs: bool = True
    """on CUDA, replay each batch-step's device work and each update as captured CUDA graphs (off: launch their
    kernels one by one); docs/update.md"""
    policy: Literal["auto", "fused", "module"] = "auto"
    """the rollout's policy step: fused (the kernels, for the network they mirror), module (Agent.forward), auto"""
    driver: Literal["auto", "single", "threads", "sequential"] = "auto"
    """who serves the env batches: single (one thread in turn), threads (one each), auto (CUDA: single; else
    threads), sequential (for debugging: one env thread, each batch stepped to completion, no overlap)"""
    compile: bool = False
    """compile the update's optimizer step with torch.compile (on CUDA replayed from CUDA graphs); docs/update.md"""
    profile: bool = False
    """trace iterations 2-4 with torch.profiler (trace.json, for Perfetto) and print a table of time per phase"""
    # Algorithm specific arguments
    env_id: str | None = None
    """the game: Breakout-v5 (default), ALE/Breakout-v5 or breakout-v5; evaluation: the checkpoint's game"""
    total_timesteps: int = 10_000_000
    """total agent steps (4 frames each), at least one batch; runs a whole number of iterations"""
    learning_rate: float = 7e-4
    """the learning rate of the optimizer (finite, > 0)"""
    num_envs: int = 16
    """the number of parallel game environments; at least 1"""
    num_steps: int = 32
    """the number of steps to run in each environment per policy rollout; at least 1"""
    anneal_lr: bool = False
    """toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma, in [0, 1]"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation, in [0, 1]"""
    norm_adv: bool = False
    """toggles advantages normalization"""
    ent_coef: float = 0.01
    """coefficient of the entropy (finite, >= 0)"""
    vf_coef: float = 0.5
    """coefficient of the value function's squared error (finite, >= 0)"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping (finite, > 0)"""
    optimizer: Literal["rmsprop", "rmsprop-tf"] = "rmsprop"
    """rmsprop: PyTorch's (SLM Lab's); rmsprop-tf: TensorFlow's (rl-zoo's): squared-gradient average from ones"""
    rms_alpha: float = 0.99
    """RMSprop's smoothing constant (decay of the squared-gradient average), in [0, 1)"""
    rms_eps: float = 1e-5
    """RMSprop's epsilon (rmsprop: added to the root; rmsprop-tf: inside it); finite, >= 0"""

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
    num_iterations: int = field(default=0, init=False)
    """the number of iterations (computed in runtime)"""


class RMSpropTF(torch.optim.Optimizer):
    """RMSprop as TensorFlow (and so the original A2C and rl-zoo) does it:

        v = alpha * v + (1 - alpha) * g^2;   p -= lr * g / sqrt(v + eps)

    with v starting at ones. PyTorch's RMSprop starts v at zeros and adds eps outside the
    root, which makes the first steps huge at eps=1e-5. This follows stable-baselines3's
    RMSpropTFLike (stable_baselines3/common/sb2_compat/rmsprop_tf_like.py), which rl-zoo's
    Atari A2C uses: `state["square_avg"] = torch.ones_like(p)` and
    `avg = square_avg.add(eps).sqrt_()`. No momentum, no weight decay, not centered.
    """

    def __init__(self, params, lr=7e-4, alpha=0.99, eps=1e-5):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps))
        for group in self.param_groups:  # here, not at the first step: a compiled step then compiles once
            for p in group["params"]:
                self.state[p]["square_avg"] = torch.ones_like(p, memory_format=torch.preserve_format)

    def _init_group(self, group, params, grads, square_avgs):
        """Fill the lists with one group's tensors: named as torch's optimizers name it, so that
        Dynamo runs it in Python and marks the state a static address (CUDA graphs update it in place)."""
        for p in group["params"]:
            if p.grad is not None:
                params.append(p)
                grads.append(p.grad)
                square_avgs.append(self.state[p]["square_avg"])

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, alpha, eps = group["lr"], group["alpha"], group["eps"]
            params, grads, square_avgs = [], [], []
            self._init_group(group, params, grads, square_avgs)
            # one launch per op for all parameters (foreach), not one per parameter
            torch._foreach_mul_(square_avgs, alpha)
            torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - alpha)
            denominators = torch._foreach_add(square_avgs, eps)
            torch._foreach_sqrt_(denominators)
            if isinstance(lr, torch.Tensor):  # compiled or graphed: a tensor rate (addcdiv's value must be a number)
                torch._foreach_div_(denominators, lr)
                torch._foreach_addcdiv_(params, grads, denominators, value=-1.0)
            else:
                torch._foreach_addcdiv_(params, grads, denominators, value=-lr)


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Nature CNN -> Linear(64 * side**2, 512) + GELU -> actor and critic heads. The rollout's fused step
    (kernels.policy_step) computes exactly this network; edit it, and the rollout runs forward()."""

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

    def forward(self, x):
        """Logits and value of uint8 frame stacks; under bf16 autocast the heads stay float32."""
        hidden = self.network(x.contiguous(memory_format=torch.channels_last) * (1.0 / 255.0))
        with torch.autocast(x.device.type, enabled=False):
            hidden = hidden.float()
            return self.actor(hidden), self.critic(hidden)

    def get_action_and_value(self, x, action=None):
        logits, value = self(x)
        # float32 as the rollout's sampler, whatever forward() returns; NaNs reach the non-finite checks
        probs = Categorical(logits=logits.float(), validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), value


def gae(rewards, values, dones, gamma, gae_lambda):
    """GAE vectorized over time (no Python loop over the horizon): rewards [T, N], values and dones
    [T + 1, N]. A_t = sum_s (gamma lambda)^(s - t) delta_s over s >= t with no terminal in between,
    i.e. where the running count of terminals is the same at s as at t. With gae_lambda=1 the
    returns are A2C's n-step returns: rewards up to the horizon, then the bootstrap value."""
    num_steps = rewards.shape[0]
    next_nonterminal = 1.0 - dones[1:]
    deltas = rewards + gamma * values[1:] * next_nonterminal - values[:-1]
    terminals_so_far = torch.cumsum(dones[1:], dim=0) - dones[1:]  # terminals in dones[1..t]
    t = torch.arange(num_steps, device=rewards.device, dtype=torch.float64)
    lag = t[None, :] - t[:, None]  # s - t
    decay = torch.where(lag >= 0, (gamma * gae_lambda) ** lag.clamp(min=0), 0.0).to(rewards.dtype)
    same_episode = terminals_so_far[None, :, :] == terminals_so_far[:, None, :]  # [t, s, N]
    advantages = torch.einsum("ts,tsn,sn->tn", decay, same_episode.to(rewards.dtype), deltas)
    return advantages, advantages + values[:-1]


def update(agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, args, dtype):
    """Stable-Baselines3's A2C update: one gradient step on the whole batch (--compile compiles it; on
    CUDA it is replayed from a CUDA graph).

    Returns a device tensor [4]: the value, policy and entropy losses and the mean |log-prob -
    rollout's log-prob|; and a device bool: is the loss non-finite. Never syncs with the host.
    """
    optimizer.zero_grad()  # first: a compiled attempt that failed half-way leaves no gradient behind
    if args.norm_adv:
        b_advantages = (b_advantages - b_advantages.mean()) / (b_advantages.std() + 1e-8)

    # the rollout's log-probs and values again, from the training network (same weights)
    with torch.autocast(b_obs.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs, b_actions)
    newvalue = newvalue.view(-1)

    pg_loss = -(b_advantages * newlogprob).mean()
    # Value loss: the plain mean squared error, as SB3's and SLM Lab's A2C (no 1/2 as in the PPO scripts)
    v_loss = ((newvalue - b_returns) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
    nonfinite = ~torch.isfinite(loss)
    with torch.no_grad():
        logprob_gap = (newlogprob - b_logprobs).abs().mean()  # the learner's log-probs against the rollout's

    loss.backward()
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return torch.stack([v_loss, pg_loss, entropy_loss, logprob_gap]).detach(), nonfinite


def parse_args() -> Args:
    args = utils.cli(Args)  # tyro.cli, with its errors as one line
    utils.check_args(args, Agent)  # ranges, the network, the game's name, --exp-name, --runs-dir, video
    if args.num_envs % args.num_gpu_batches:
        raise utils.UsageError(
            f"--num-envs {args.num_envs} is not divisible by --num-gpu-batches {args.num_gpu_batches}"
        )
    args.batch_size = int(args.num_envs * args.num_steps)
    if args.eval_checkpoint is None and args.total_timesteps < args.batch_size:
        raise utils.UsageError(f"--total-timesteps {args.total_timesteps} is below one batch ({args.batch_size} steps)")
    args.num_iterations = args.total_timesteps // args.batch_size
    return args


if __name__ == "__main__":
    script = Path(__file__).name
    try:
        args = parse_args()
        device = utils.resolve_device(args.device)
        precision = utils.resolve_precision(args.precision, device)
        driver = utils.resolve_driver(args.driver, device, args.num_gpu_batches)
        checkpoint = None
        if args.resume is not None:
            checkpoint = utils.load_checkpoint(args.resume, script, args.env_id, Agent, resume=True)
            utils.check_resume_args(checkpoint, args, (*utils.RESUME_ARGS, "optimizer"))
        if args.eval_checkpoint is not None:
            evaluated = utils.load_checkpoint(args.eval_checkpoint, script, args.env_id, Agent)
            utils.play_checkpoint_game(args, evaluated)  # its game and settings
    except utils.UsageError as e:
        utils.fail(str(e))
    dtype = utils.use_device(device, precision)  # fp32: no TF32 either, so rollout and learner agree

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    if args.eval_checkpoint is not None:
        print(utils.describe_run(args, device, "evaluation envs"), flush=True)
        utils.evaluate_checkpoint(Agent, evaluated, args, device)

    # C++ env threads per env batch, and who serves the batches
    num_batches, batch = args.num_gpu_batches, args.num_envs // args.num_gpu_batches
    requested = 1 if args.driver == "sequential" else args.num_env_threads
    threads_per_batch, first_core = utils.env_threads(requested, device, num_batches, batch)
    graphs = args.cuda_graphs and device.type == "cuda"
    game = utils.game_settings(args)  # the game block of Args, as the envs play it
    # the rollout's policy step: the fused kernels if they compute this Agent, else Agent.forward
    num_actions = utils.num_actions(args.env_id, args.full_action_space)
    agent = Agent(num_actions, args.frame_stack, args.screen_size).to(device, memory_format=torch.channels_last)
    try:
        frames = utils.probe_frames(args.env_id, game, batch, device)  # real frame stacks
        policy = kernels.rollout_policy(args.policy, agent, dtype, frames, num_actions)
    except kernels.PolicyMismatch as e:
        utils.fail(str(e))
    envs_text = utils.rollout_text(args, threads_per_batch, first_core, driver, graphs, policy)
    print(utils.describe_run(args, device, envs_text, precision), flush=True)

    # log setup: a resume continues in its run directory
    run_dir, writer, stop, start_iteration, global_step = utils.start_run(args, checkpoint)

    # env setup: envs cannot be checkpointed, so a resume reseeds them
    env_seed = args.seed + 1_000_003 * start_iteration
    envs = utils.ThreadedAtariEnvs(
        args.env_id, args.num_envs, num_batches, sum(threads_per_batch), env_seed, game,
        serial=args.driver == "sequential", first_core=first_core,
    )  # fmt: skip

    # optimizer; compiled or graphed: a tensor rate, annealed in place, so that the step never recompiles or recaptures
    lr = torch.tensor(args.learning_rate, device=device) if args.compile or graphs else args.learning_rate
    hyper = dict(lr=lr, alpha=args.rms_alpha, eps=args.rms_eps)
    if args.optimizer == "rmsprop":
        hyper |= utils.optimizer_options(device, args.compile, has_fused=False, graphs=graphs)
        optimizer = optim.RMSprop(agent.parameters(), **hyper)
    else:
        optimizer = RMSpropTF(agent.parameters(), **hyper)
    if checkpoint is not None:
        agent.load_state_dict(checkpoint["model"])
        utils.load_optimizer(optimizer, checkpoint["optimizer"], hyper)
        utils.set_rng_states(checkpoint["rng"], device)

    def save(iteration, step, path=run_dir / "checkpoint.pt"):
        state = {
            "script": script, "env_id": args.env_id, "args": vars(args),
            "num_actions": num_actions, "model": agent.state_dict(),
            "optimizer": optimizer.state_dict(), "iteration": iteration, "global_step": step,
            "env_seed": env_seed, "rng": utils.rng_states(device),
        }  # fmt: skip
        utils.save_checkpoint(path, state)

    # ALGO LOGIC: storage setup. Row T is the step after the horizon: obs[T] starts the next
    # rollout and values[T] bootstraps. dones[t] = 1 when obs[t] follows a terminal.
    T, N = args.num_steps, args.num_envs
    obs_shape = (args.frame_stack, args.screen_size, args.screen_size)  # a frame stack
    obs = torch.zeros((T + 1, N, *obs_shape), dtype=torch.uint8, device=device)
    actions = torch.zeros((T + 1, N), dtype=torch.long, device=device)
    logprobs = torch.zeros((T + 1, N), device=device)
    values = torch.zeros((T + 1, N), device=device)
    rewards = torch.zeros((T, N), device=device)
    dones = torch.zeros((T + 1, N), device=device)
    advantages = torch.zeros((T, N), device=device)  # GAE's, stored: a CUDA graph reads its inputs in place
    returns = torch.zeros((T, N), device=device)
    # summed on the device between log lines: the losses, and values and returns for explained variance
    stats = torch.zeros(3, device=device)
    interval_values = torch.zeros((args.log_interval, T, N), device=device)
    interval_returns = torch.zeros((args.log_interval, T, N), device=device)
    logged_iterations = 0

    # the rollout (utils.BatchedRollout): per env batch a stream, buffers and CUDA graphs
    profiler = utils.Profiler(args.profile, run_dir, device)  # --profile: time per phase, a trace
    rollout = utils.BatchedRollout(
        envs, policy, obs=obs, actions=actions, logprobs=logprobs, values=values, rewards=rewards, dones=dones,
        driver=driver, cuda_graphs=graphs, profiler=profiler,
    )  # fmt: skip

    # the update: --compile compiles it (its own CUDA graphs; eager where that fails), else on CUDA one CUDA
    # graph replays it (docs/update.md)
    optimize = update
    progress = utils.Progress(args.total_timesteps, global_step)
    if args.compile:
        optimize = progress.compiled = utils.CompiledStep(update, device)
    elif graphs:
        optimize = utils.GraphedStep(update, device)

    # TRY NOT TO MODIFY: start the game
    rollout.start()
    iteration = start_iteration
    print(f"run directory: {run_dir}", flush=True)

    for iteration in range(start_iteration + 1, args.num_iterations + 1):
        # annealing the rate if instructed to do so.
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            utils.set_lr(optimizer, frac * args.learning_rate)

        # ALGO LOGIC: the rollout, T steps into the storage
        rollout_start = time.perf_counter()
        # a stop abandons the rollout
        if not rollout.collect(should_stop=lambda: stop):
            iteration = iteration - 1
            break
        progress.rollout_time += time.perf_counter() - rollout_start
        # a game is logged at the step where it ended
        for _, episodic_return, episodic_length, step in envs.pop_finished():
            progress.recent_returns.append(episodic_return)
            writer.add_scalar("charts/episodic_return", episodic_return, global_step + step * N)
            writer.add_scalar("charts/episodic_length", episodic_length, global_step + step * N)
        global_step += T * N

        with profiler("training"):
            # ALGO LOGIC: advantages (gae_lambda=1: n-step returns, bootstrapped from values[T])
            with torch.no_grad():
                advantages[:], returns[:] = gae(rewards, values, dones, args.gamma, args.gae_lambda)

            # flatten the batch
            b_obs = obs[:T].reshape((-1, *obs_shape))
            if args.compile:  # fixed storage: CUDA graphs read it in place, not copied at every replay
                torch._dynamo.mark_static_address(b_obs)
            b_actions = actions[:T].reshape(-1)
            b_logprobs = logprobs[:T].reshape(-1)
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)

            # ALGO LOGIC: one gradient step on the whole batch (update, above)
            losses, nonfinite = optimize(
                agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, args, dtype
            )
            with torch.no_grad():  # summed until the next log line, no sync
                stats += losses[:3]
                interval_values[logged_iterations].copy_(values[:T])
                interval_returns[logged_iterations].copy_(returns)
                logged_iterations += 1

        # TRY NOT TO MODIFY: record losses for plotting purposes, every --log-interval iterations;
        # every iteration (one sync) the non-finite check and the guard: did the rollout sample the
        # policy the learner trains? (checkpoints check the weights themselves, below)
        diverged, logprob_gap = torch.stack([nonfinite.float(), losses[3]]).tolist()
        if diverged:
            utils.fail_diverged("non-finite loss", iteration, run_dir / "checkpoint.pt", writer, envs)
        writer.add_scalar("losses/rollout_logprob_gap", logprob_gap, global_step)
        utils.check_logprob_gap(logprob_gap, precision, iteration, run_dir / "checkpoint.pt", writer, envs)
        if iteration % args.log_interval == 0 or iteration == args.num_iterations:
            v_loss, pg_loss, entropy_loss = (stats / logged_iterations).tolist()
            y_pred = interval_values[:logged_iterations].cpu().numpy()
            y_true = interval_returns[:logged_iterations].cpu().numpy()
            var_y = np.var(y_true)
            explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
            writer.add_scalar("charts/learning_rate", float(optimizer.param_groups[0]["lr"]), global_step)
            writer.add_scalar("losses/value_loss", v_loss, global_step)
            writer.add_scalar("losses/policy_loss", pg_loss, global_step)
            writer.add_scalar("losses/entropy", entropy_loss, global_step)
            writer.add_scalar("losses/explained_variance", explained_var, global_step)
            writer.add_scalar("charts/SPS", progress.sps(global_step), global_step)
            print(progress.line(iteration, args.num_iterations, global_step), flush=True)
            stats.zero_()
            logged_iterations = 0
        profiler.step(last=iteration == args.num_iterations)

        if iteration % args.save_interval == 0 or iteration == args.num_iterations:
            if bool(utils.nonfinite_policy(agent, obs[T])):
                utils.fail_diverged("non-finite weights or outputs", iteration, run_dir / "checkpoint.pt", writer, envs)
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
    rollout.close()
    envs.close()
    writer.close()
