"""ppo_atari_native.py at SLM Lab's settings: the PPO behind its ALE v5 Breakout score (326.47, 10M).

A copy of ppo_atari_native.py (README "Changing things") whose every setting that differs from
SLM Lab's spec is set to SLM Lab's value, so that a run of it is the comparison SLM Lab's table
makes. SLM Lab's settings come from kengz/SLM-Lab slm_lab/spec/benchmark_arc/ppo/ppo_atari_arc.yaml
(spec ppo_atari_lam70_arc, its Breakout row in docs/BENCHMARKS.md) and its PPO loss from
slm_lab/agent/algorithm/ppo.py; docs/protocol.md has the field-by-field table. The differences
from ppo_atari_native.py, and nothing else (tests/test_protocol.py holds them to this list):

- GAE lambda 0.70, not 0.95: `lam: 0.70` of ppo_atari_lam70_arc (its ppo_atari_arc has 0.95).
- AdamW with PyTorch's default weight decay 0.01, not Adam: `optim_spec: {name: AdamW, lr: 2.5e-4,
  eps: 1.0e-5}` (no weight_decay given, so torch.optim.AdamW's 0.01); lr and eps are the same.
- ReLU after the 512-unit hidden layer, not GELU: the spec's arc ends `LazyLinear: {out_features:
  512}` then `ReLU`. The fused Triton step computes the GELU network only, so the rollout runs
  Agent.forward (the first line says `policy module (network[8] is ReLU, ...)`).

The same as ppo_atari_native.py already (not changed here): 16 envs x 128 steps, minibatches of
256 (8), 4 epochs, gamma 0.99, clip 0.1 with value clipping, entropy 0.01, gradient norm 0.5,
lr 2.5e-4 annealed linearly to 0 (`LinearToZero` over 1e7 frames: its agent steps), advantages
normalized per minibatch, orthogonal init (gain sqrt(2), heads 0.01 and 1), frames / 255, and
the value loss: SLM Lab's clipped value loss is `0.5 * val_loss_coef * max(unclipped,
clipped).mean()` with `val_loss_coef: 0.5`, CleanRL's (here) `vf_coef * 0.5 * max(...).mean()`
with vf_coef 0.5: the same weight. The game is SLM Lab's too (docs/protocol.md).
Run: python benchmarks/ppo_atari_slm.py --env-id Breakout-v5 --num-gpu-batches 8
     (or as learning.py's variant benchmarks/ppo_atari_slm.py, labelled ppo_atari_slm)
"""

import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's kernels and utils
import kernels  # noqa: E402
import utils  # noqa: E402


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
    num_gpu_batches: int = 2
    """split the envs into this many independent batches, each on its own CUDA stream (at least 1; divides num_envs)"""
    num_env_threads: int | None = None
    """C++ env threads in all, at least 1 (default: CUDA: the cores but the driver's; CPU: min(cores, batch) each)"""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 where the GPU or CPU has it natively, fp32 elsewhere"""
    cuda_graphs: bool = True
    """on CUDA, replay each batch-step's device work and each update minibatch as captured CUDA graphs (off: launch
    their kernels one by one); docs/update.md"""
    policy: Literal["auto", "fused", "module"] = "auto"
    """the rollout's policy step: fused (the kernels, for the network they mirror), module (Agent.forward), auto"""
    driver: Literal["auto", "single", "threads", "sequential"] = "auto"
    """who serves the env batches: single (one thread in turn), threads (one each), auto (CUDA: single; else
    threads), sequential (for debugging: one env thread, each batch stepped to completion, no overlap)"""
    compile: bool = False
    """compile the update's optimizer step with torch.compile (on CUDA replayed from CUDA graphs); docs/update.md"""
    profile: bool = False
    """trace iterations 2-4 with torch.profiler (trace.json, for Perfetto) and print a table of time per phase"""
    backend: Literal["gloo", "nccl", "mpi"] | None = None
    """torch.distributed backend under torchrun (default: nccl on CUDA, gloo on CPU)"""

    # Algorithm specific arguments
    env_id: str | None = None
    """the game: Breakout-v5 (default), ALE/Breakout-v5 or breakout-v5; evaluation: the checkpoint's game"""
    total_timesteps: int = 10_000_000
    """total agent steps (4 frames each; under torchrun, of all ranks), at least one batch; whole iterations"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer (finite, > 0)"""
    num_envs: int = 16
    """the number of parallel game environments (under torchrun, per rank); at least 1"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout; at least 1"""
    anneal_lr: bool = True
    """toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma, in [0, 1]"""
    gae_lambda: float = 0.70
    """the lambda for the general advantage estimation, in [0, 1] (SLM Lab's ppo_atari_lam70_arc)"""
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
    """Nature CNN -> Linear(64 * side**2, 512) + ReLU (SLM Lab's) -> actor and critic heads. The fused step
    (kernels.policy_step) computes the GELU network, so the rollout runs forward()."""

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
            nn.ReLU(),  # SLM Lab's hidden activation (ppo_atari_native.py: GELU)
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
    i.e. where the running count of terminals is the same at s as at t."""
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


def parse_args() -> Args:
    args = utils.cli(Args)  # tyro.cli, with its errors as one line
    utils.check_args(args, Agent)  # ranges, the network, the game's name, --exp-name, --runs-dir, video
    if args.num_envs % args.num_gpu_batches:
        raise utils.UsageError(
            f"--num-envs {args.num_envs} is not divisible by --num-gpu-batches {args.num_gpu_batches}"
        )
    args.batch_size = int(args.num_envs * args.num_steps)
    if args.batch_size % args.num_minibatches:
        raise utils.UsageError(
            f"batch size {args.batch_size} (num_envs x num_steps) is not divisible by "
            f"--num-minibatches {args.num_minibatches}"
        )
    # under torchrun every rank collects a batch per iteration
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.eval_checkpoint is None and args.total_timesteps < args.batch_size * world_size:
        raise utils.UsageError(
            f"--total-timesteps {args.total_timesteps} is below one batch ({args.batch_size * world_size} steps)"
        )
    args.minibatch_size = int(args.batch_size // args.num_minibatches)
    args.num_iterations = args.total_timesteps // (args.batch_size * world_size)
    return args


def minibatch_step(agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values, mb_inds, args,
                   dtype, world_size):  # fmt: skip
    """One PPO minibatch: the loss, backward, the gradient clip and Adam's step (--compile compiles
    this function; on CUDA it is replayed from a CUDA graph: no sync with the host in it). Returns, on
    the device, [v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, logprob_gap] and
    whether the loss is non-finite."""
    optimizer.zero_grad()  # first: a compiled attempt that failed half-way leaves no gradient behind
    with torch.autocast(b_obs.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
    logratio = newlogprob - b_logprobs[mb_inds]
    ratio = logratio.exp()
    with torch.no_grad():
        # calculate approx_kl http://joschu.net/blog/kl-approx.html
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
        logprob_gap = logratio.abs().mean()  # the learner's log-probs against the rollout's

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

    loss.backward()
    if world_size > 1:  # torchrun: every rank steps with the mean gradient
        utils.all_reduce_gradients(agent.parameters(), world_size)
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    losses = torch.stack([v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, logprob_gap])
    return losses.detach(), ~torch.isfinite(loss)


def update(agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values, args, dtype, world_size,
           optimize=minibatch_step):  # fmt: skip
    """CleanRL's PPO update, shuffled by torch's RNG, a minibatch at a time by `optimize` (minibatch_step,
    or it compiled or graphed); only target_kl syncs with the host. Returns, on the device, stats [8] (the last
    minibatch's value, policy and entropy losses, old_approx_kl, approx_kl; the clip fractions' sum
    and count; the first minibatch's mean |log-prob - rollout's|) and whether any loss was non-finite."""
    device = b_obs.device
    stats = torch.zeros(8, device=device)
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)
    for epoch in range(args.update_epochs):
        b_inds = torch.randperm(args.batch_size, device=device)
        for start in range(0, args.batch_size, args.minibatch_size):
            end = start + args.minibatch_size
            mb_inds = b_inds[start:end]
            losses, mb_nonfinite = optimize(
                agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values, mb_inds,
                args, dtype, world_size,
            )  # fmt: skip
            # copied out at once: a step replayed from CUDA graphs overwrites its outputs the next time
            nonfinite |= mb_nonfinite
            stats[:5] = losses[:5]  # the last minibatch's losses, every minibatch's clipfrac
            stats[5] += losses[5]
            stats[6] += 1
            if epoch == 0 and start == 0:
                stats[7] = losses[6]
        approx_kl = stats[4]
        if args.target_kl is not None and approx_kl > args.target_kl:
            break
    return stats, nonfinite


if __name__ == "__main__":
    script = Path(__file__).name
    try:
        args = parse_args()
        device = utils.resolve_device(args.device)
        # any torchrun process joins a process group, even a lone one
        torchrun = "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1
        distributed = torchrun and args.eval_checkpoint is None
        if distributed:
            device = utils.torchrun_device(device)  # rank r on cuda:LOCAL_RANK
        precision = utils.resolve_precision(args.precision, device)
        driver = utils.resolve_driver(args.driver, device, args.num_gpu_batches)
        checkpoint = None
        if args.resume is not None:
            checkpoint = utils.load_checkpoint(args.resume, script, args.env_id, Agent, resume=True)
            utils.check_resume_args(checkpoint, args)
        if args.eval_checkpoint is not None:
            evaluated = utils.load_checkpoint(args.eval_checkpoint, script, args.env_id, Agent)
            utils.play_checkpoint_game(args, evaluated)  # its game and settings
    except utils.UsageError as e:
        utils.fail(str(e))
    dtype = utils.use_device(device, precision)  # fp32: no TF32 either, so rollout and learner agree

    # torchrun: a process per GPU, each with its own envs; rank 0 logs
    rank, world_size, local_rank, local_world_size = 0, 1, 0, 1
    if distributed:
        rank, world_size, local_rank, local_world_size = utils.init_distributed(args.backend, device)

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
    threads_per_batch, first_core = utils.env_threads(
        requested, device, num_batches, batch, local_rank, local_world_size
    )
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
    if rank == 0:
        envs_text = utils.rollout_text(args, threads_per_batch, first_core, driver, graphs, policy)
        print(utils.describe_run(args, device, envs_text, precision, world_size), flush=True)

    # log setup: a resume continues in its run directory; only rank 0 logs
    run_dir, writer, stop, start_iteration, global_step = utils.start_run(args, checkpoint, rank, distributed)

    # env setup: envs cannot be checkpointed, so a resume reseeds them
    env_seed = args.seed + 1_000_003 * start_iteration + 10_007 * rank
    envs = utils.ThreadedAtariEnvs(
        args.env_id, args.num_envs, num_batches, sum(threads_per_batch), env_seed, game,
        serial=args.driver == "sequential", first_core=first_core,
    )  # fmt: skip

    # optimizer; a tensor rate, annealed in place, where the step is compiled or graphed (so that it never
    # recompiles or recaptures), and so on CUDA: --no-cuda-graphs then launches the same fused Adam
    tensor_rate = args.compile or device.type == "cuda"
    lr = torch.tensor(args.learning_rate, device=device) if tensor_rate else args.learning_rate
    # SLM Lab's AdamW, whose spec leaves PyTorch's weight decay (0.01)
    hyper = dict(lr=lr, eps=1e-5, weight_decay=0.01) | utils.optimizer_options(device, args.compile, graphs=graphs)
    optimizer = optim.AdamW(agent.parameters(), **hyper)
    if checkpoint is not None:
        agent.load_state_dict(checkpoint["model"])
        utils.load_optimizer(optimizer, checkpoint["optimizer"], hyper)
        utils.set_rng_states(checkpoint["rng"], device)
    if distributed:  # rank 0's weights everywhere, each rank its own samples
        for tensor in agent.state_dict().values():
            dist.broadcast(tensor, src=0)
        torch.manual_seed(args.seed + 7_919 * rank + start_iteration)

    def save(iteration, step, path=run_dir / "checkpoint.pt"):
        if rank != 0:
            return
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

    # the rollout (utils.BatchedRollout): per env batch a stream, buffers and CUDA graphs
    profiler = utils.Profiler(args.profile, run_dir, device)  # --profile: time per phase, a trace
    rollout = utils.BatchedRollout(
        envs, policy, obs=obs, actions=actions, logprobs=logprobs, values=values, rewards=rewards, dones=dones,
        driver=driver, cuda_graphs=graphs, profiler=profiler,
    )  # fmt: skip

    # the minibatch step: --compile compiles it (its own CUDA graphs; eager where that fails), else on CUDA
    # one CUDA graph replays it, the minibatch's indices copied in: one graph, not one per position (docs/update.md)
    optimize = minibatch_step
    progress = utils.Progress(args.total_timesteps, global_step)
    if args.compile:
        optimize = progress.compiled = utils.CompiledStep(minibatch_step, device)
    elif graphs:
        optimize = utils.GraphedStep(minibatch_step, device, copied=["mb_inds"])

    # TRY NOT TO MODIFY: start the game
    rollout.start()
    iteration = start_iteration
    if rank == 0:
        print(f"run directory: {run_dir}", flush=True)

    for iteration in range(start_iteration + 1, args.num_iterations + 1):
        # annealing the rate if instructed to do so.
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            utils.set_lr(optimizer, frac * args.learning_rate)

        # ALGO LOGIC: the rollout, T steps into the storage
        rollout_start = time.perf_counter()
        # a stop abandons the rollout; under torchrun the ranks stop together, after the update
        if not rollout.collect(should_stop=lambda: stop and not distributed):
            iteration = iteration - 1
            break
        progress.rollout_time += time.perf_counter() - rollout_start
        # a game is logged at the step where it ended
        for _, episodic_return, episodic_length, step in envs.pop_finished():
            progress.recent_returns.append(episodic_return)
            writer.add_scalar("charts/episodic_return", episodic_return, global_step + step * N * world_size)
            writer.add_scalar("charts/episodic_length", episodic_length, global_step + step * N * world_size)
        global_step += T * N * world_size

        with profiler("training"):
            # ALGO LOGIC: advantages
            with torch.no_grad():
                advantages[:], returns[:] = gae(rewards, values, dones, args.gamma, args.gae_lambda)

            # flatten the batch
            b_obs = obs[:T].reshape((-1, *obs_shape))
            if args.compile:  # fixed storage: CUDA graphs read it in place, not copied at every replay
                torch._dynamo.mark_static_address(b_obs)
            b_logprobs = logprobs[:T].reshape(-1)
            b_actions = actions[:T].reshape(-1)
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values[:T].reshape(-1)

            # ALGO LOGIC: optimizing the policy and value network (update, above)
            stats, nonfinite = update(
                agent, optimizer, b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values,
                args, dtype, world_size, optimize,
            )  # fmt: skip
            if args.update_epochs > 0:  # nor may the next rollout sample from non-finite outputs
                nonfinite |= utils.nonfinite_policy(agent, obs[T])

        if distributed:  # every rank stops, diverges or fails the guard together
            nonfinite, stats[7] = utils.agree(stop, nonfinite, stats[7])

        # TRY NOT TO MODIFY: record losses for plotting purposes (one sync)
        writer.add_scalar("charts/learning_rate", float(optimizer.param_groups[0]["lr"]), global_step)
        if args.update_epochs > 0:
            if bool(nonfinite):
                utils.fail_diverged(
                    "non-finite loss, weights or outputs", iteration, run_dir / "checkpoint.pt", writer, envs
                )
            v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfracs, count, logprob_gap = stats.tolist()
            y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
            var_y = np.var(y_true)
            explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
            writer.add_scalar("losses/value_loss", v_loss, global_step)
            writer.add_scalar("losses/policy_loss", pg_loss, global_step)
            writer.add_scalar("losses/entropy", entropy_loss, global_step)
            writer.add_scalar("losses/old_approx_kl", old_approx_kl, global_step)
            writer.add_scalar("losses/approx_kl", approx_kl, global_step)
            writer.add_scalar("losses/clipfrac", clipfracs / count, global_step)
            writer.add_scalar("losses/explained_variance", explained_var, global_step)
            writer.add_scalar("losses/rollout_logprob_gap", logprob_gap, global_step)
            # the guard: did the rollout sample the policy the learner trains?
            utils.check_logprob_gap(logprob_gap, precision, iteration, run_dir / "checkpoint.pt", writer, envs)
        writer.add_scalar("charts/SPS", progress.sps(global_step), global_step)
        if rank == 0:
            print(progress.line(iteration, args.num_iterations, global_step), flush=True)
        profiler.step(last=iteration == args.num_iterations)

        if iteration % args.save_interval == 0 or iteration == args.num_iterations:
            save(iteration, global_step)
        if stop:
            break

    # close: a stop saves and says how to resume; an ended run saves model.pt
    if stop and iteration < args.num_iterations:
        save(iteration, global_step)
        if rank == 0:
            print(utils.stopped_message(stop, global_step, run_dir / "checkpoint.pt"), flush=True)
    elif rank == 0:
        save(iteration, global_step, run_dir / "model.pt")
        print(f"saved {run_dir / 'model.pt'}", flush=True)
    if distributed:
        utils.finish_distributed(agent, rank, world_size)
    rollout.close()
    envs.close()
    writer.close()
