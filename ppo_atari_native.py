"""PPO on Atari with a rollout built for speed; the same PPO as ppo_atari_baseline.py.

What is different from the baseline, and why:
- Envs are stepped by ale-py's C++ threads (utils.ThreadedAtariEnvs), which release the GIL.
- The envs are split into --num-gpu-batches fixed batches, each with its own CUDA stream and
  buffers: while one batch's envs step, Python runs inference for the next batch.
- Only the newest 84x84 frame crosses to the device; the 4-frame stack lives there.
- Inference has no autograd and allocates nothing: convolutions write into preallocated
  buffers, then three fused Triton kernels (kernels.py) do Linear+GELU, both heads, and
  sampling from uniforms drawn once per iteration, straight into the rollout storage.
- GAE is vectorized over time on the device; the update never syncs per minibatch.
- --precision bf16 runs inference and training in bfloat16 (autocast, channels_last).
Run: python ppo_atari_native.py --env-id Breakout-v5 --num-gpu-batches 8
"""

import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import tyro
from torch.distributions.categorical import Categorical
from torch.utils.tensorboard import SummaryWriter

import kernels
import utils


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """the name of this experiment (part of the run directory's name)"""
    seed: int = 1
    """seed of the experiment (python, numpy, torch and the envs)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    device: str = "auto"
    """auto (CUDA if available, else CPU), cpu, cuda or cuda:N"""
    runs_dir: str = "runs"
    """where run directories are created"""
    save_interval: int = 50
    """write a checkpoint every this many iterations (and at the end)"""
    resume: str | None = None
    """path of a checkpoint.pt to continue from, in its own run directory"""
    eval_checkpoint: str | None = None
    """evaluate this checkpoint or model.pt instead of training"""
    eval_episodes: int = 10
    """number of full games played by --eval-checkpoint"""
    capture_video: bool = False
    """record the evaluation games to videos/ in the run directory (needs moviepy)"""
    num_gpu_batches: int = 2
    """split the envs into this many independent batches, each on its own CUDA stream"""
    num_env_threads: int = os.cpu_count() or 1
    """C++ threads stepping each batch's envs"""
    precision: str = "fp32"
    """fp32 or bf16 (autocast and channels_last, for inference and training)"""
    profile: bool = False
    """trace iterations 2-4 with torch.profiler (trace.json, for Perfetto) and print a table of time per phase"""
    single_threaded: bool = False
    """step each batch's envs to completion before the next (one env thread, no overlap), for debugging"""
    backend: str | None = None
    """torch.distributed backend under torchrun (default: nccl on CUDA, gloo on CPU)"""

    # Algorithm specific arguments
    env_id: str = "Breakout-v5"
    """the id of the game: Breakout-v5 or ALE/Breakout-v5 (any ale-py game)"""
    total_timesteps: int = 10_000_000
    """total agent steps of the experiment (each is 4 frames; under torchrun, of all ranks together)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 16
    """the number of parallel game environments (under torchrun, per rank)"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 8
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy (0: collect only, used to time the rollout)"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold"""
    life_loss_terminal: bool = True
    """treat a lost life as terminal for the learner (returns are still logged per full game)"""

    # to be filled in runtime
    batch_size: int = 0
    """the batch size (computed in runtime)"""
    minibatch_size: int = 0
    """the mini-batch size (computed in runtime)"""
    num_iterations: int = 0
    """the number of iterations (computed in runtime)"""


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Nature CNN -> Linear(3136, 512) + GELU -> actor and critic heads (all scripts share it)."""

    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.GELU(),
        )
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def get_action_and_value(self, x, action=None):
        x = x.contiguous(memory_format=torch.channels_last)
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        probs = Categorical(logits=logits, validate_args=False)  # NaNs reach the non-finite checks
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def inference_weights(agent, dtype):
    """Copies of the weights in the layout the rollout wants; refreshed in place each iteration.

    conv1 gets the 1/255 input scale folded in, so no float observation is ever built. The
    convs run channels_last, so their output flattens in (h, w, c) order: Linear(3136, 512)'s
    columns are permuted to match, and the last conv's output feeds it without a copy.
    """
    conv1, conv2, conv3, fc = agent.network[0], agent.network[2], agent.network[4], agent.network[7]
    cl = torch.channels_last
    w = SimpleNamespace(
        conv_weight=[torch.empty_like(c.weight, dtype=dtype, memory_format=cl) for c in (conv1, conv2, conv3)],
        conv_bias=[torch.empty_like(c.bias, dtype=dtype) for c in (conv1, conv2, conv3)],
        fc_weight=torch.empty_like(fc.weight),
        agent=agent,
    )
    refresh_inference_weights(w)
    return w


@torch.no_grad()
def refresh_inference_weights(w):
    network = w.agent.network
    for i, conv in enumerate((network[0], network[2], network[4])):
        w.conv_weight[i].copy_(conv.weight)
        w.conv_bias[i].copy_(conv.bias)
    w.conv_weight[0].mul_(1.0 / 255.0)
    fc = network[7]
    w.fc_weight.copy_(fc.weight.view(512, 64, 7, 7).permute(0, 2, 3, 1).reshape(512, 3136))


def inference_buffers(batch, num_actions, dtype, device):
    """Everything one env batch's inference writes into, allocated once."""
    cl = torch.channels_last
    b = SimpleNamespace(
        x=torch.empty((batch, 4, 84, 84), dtype=dtype, device=device, memory_format=cl),
        c1=torch.empty((batch, 32, 20, 20), dtype=dtype, device=device, memory_format=cl),
        c2=torch.empty((batch, 64, 9, 9), dtype=dtype, device=device, memory_format=cl),
        c3=torch.empty((batch, 64, 7, 7), dtype=dtype, device=device, memory_format=cl),
        hidden=torch.empty((batch, 512), device=device),
        logits=torch.empty((batch, num_actions), device=device),
        entropy=torch.empty(batch, device=device),
    )
    b.c3_flat = b.c3.permute(0, 2, 3, 1).reshape(batch, 3136)  # a view: channels_last is (h, w, c)
    b.features = b.c3_flat if dtype == torch.float32 else torch.empty((batch, 3136), device=device)
    return b


@torch.no_grad()
def policy_forward(w, buf, obs, value_out):
    """Logits (into buf.logits) and values for one env batch: 10 launches in fp32, 11 in bf16.

    obs uint8 [batch, 4, 84, 84]; value_out is a view of the rollout storage. Nothing is
    allocated here except inside the convolution primitives.
    """
    conv = torch.ops.aten.convolution.out
    buf.x.copy_(obs)  # uint8 -> float, and NCHW -> channels_last, in one copy
    conv(buf.x, w.conv_weight[0], w.conv_bias[0], [4, 4], [0, 0], [1, 1], False, [0, 0], 1, out=buf.c1)
    buf.c1.relu_()
    conv(buf.c1, w.conv_weight[1], w.conv_bias[1], [2, 2], [0, 0], [1, 1], False, [0, 0], 1, out=buf.c2)
    buf.c2.relu_()
    conv(buf.c2, w.conv_weight[2], w.conv_bias[2], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, out=buf.c3)
    buf.c3.relu_()
    if buf.features is not buf.c3_flat:
        buf.features.copy_(buf.c3_flat)  # bf16 -> fp32 for the fp32 head kernels
    agent = w.agent
    fc = agent.network[7]
    kernels.linear_gelu(buf.features, w.fc_weight, fc.bias, out=buf.hidden)
    kernels.policy_value_heads(
        buf.hidden, agent.actor.weight, agent.actor.bias, agent.critic.weight, agent.critic.bias,
        logits_out=buf.logits, value_out=value_out,
    )  # fmt: skip


def gae(rewards, values, dones, gamma, gae_lambda):
    """GAE vectorized over time: no Python loop over the horizon.

    rewards [T, N]; values and dones [T + 1, N], where dones[t] = 1 when obs[t] follows a
    terminal. A_t = sum_s (gamma lambda)^(s - t) delta_s over s >= t with no terminal in
    between, i.e. where the running count of terminals is the same at s as at t.
    """
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
    args = tyro.cli(Args)
    utils.rom_id(args.env_id)  # unknown games fail here, with close matches
    utils.check_capture_video(args.capture_video, args.eval_checkpoint)
    utils.check_positive(
        num_envs=args.num_envs, num_gpu_batches=args.num_gpu_batches,
        num_env_threads=args.num_env_threads, eval_episodes=args.eval_episodes,
    )  # fmt: skip
    if args.num_envs % args.num_gpu_batches:
        raise utils.UsageError(
            f"--num-envs {args.num_envs} is not divisible by --num-gpu-batches {args.num_gpu_batches}"
        )
    if args.eval_checkpoint is None:
        utils.check_positive(
            total_timesteps=args.total_timesteps, num_steps=args.num_steps,
            num_minibatches=args.num_minibatches, save_interval=args.save_interval,
        )  # fmt: skip
        if args.update_epochs < 0:
            raise utils.UsageError(f"--update-epochs must be >= 0, got {args.update_epochs}")
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
    if args.backend not in (None, "gloo", "nccl", "mpi"):
        raise utils.UsageError(f"--backend {args.backend!r}: expected gloo, nccl or mpi")
    args.minibatch_size = int(args.batch_size // args.num_minibatches)
    args.num_iterations = args.total_timesteps // (args.batch_size * world_size)
    return args


class NoWriter:
    """What ranks other than 0 get instead of a SummaryWriter: only rank 0 logs."""

    def add_scalar(self, *args, **kwargs):
        pass

    def add_text(self, *args, **kwargs):
        pass

    def close(self):
        pass


def all_reduce_gradients(parameters, world_size):
    """Average the gradients over the ranks: one all-reduce of one flat buffer per minibatch."""
    grads = [p.grad for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


if __name__ == "__main__":
    try:
        args = parse_args()
        device = utils.resolve_device(args.device)
        utils.check_precision(args.precision, device)
        checkpoint = None
        if args.resume is not None:
            checkpoint = utils.load_checkpoint(args.resume, Path(__file__).name, args.env_id)
            utils.check_resume_args(checkpoint, args)
        if args.eval_checkpoint is not None:
            evaluated = utils.load_checkpoint(args.eval_checkpoint, Path(__file__).name, args.env_id)
    except utils.UsageError as e:
        utils.fail(str(e))
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    # torchrun: one process per GPU (or per CPU process), each with its own envs; gradients
    # are averaged every minibatch, only rank 0 logs and saves. Without torchrun: one process.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.eval_checkpoint is None
    rank, world_size = 0, 1
    if distributed:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        # before init_process_group: torch.optim imports torch._dynamo lazily, and imported after
        # it, torch._dynamo keeps the process group and gloo's threads alive past
        # destroy_process_group; a gloo thread that frees a collective's tensors while Python
        # shuts down then aborts the process (SIGABRT after a finished run, seen under load)
        import torch._dynamo  # noqa: F401

        dist.init_process_group(args.backend or ("nccl" if device.type == "cuda" else "gloo"))
        rank, world_size = dist.get_rank(), dist.get_world_size()

    # seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    if args.eval_checkpoint is not None:
        agent = Agent(evaluated["num_actions"]).to(device)
        agent.load_state_dict(evaluated["model"])
        video_dir = Path(args.eval_checkpoint).parent / "videos"
        act = lambda obs: agent.get_action_and_value(obs.float())[0]  # noqa: E731
        try:
            returns = utils.evaluate(
                args.env_id, act, args.eval_episodes, args.seed, device, args.capture_video, video_dir
            )
        except utils.UsageError as e:
            utils.fail(str(e))
        print(utils.report_evaluation(args.env_id, returns))
        sys.exit(0)

    # log setup: a resumed run continues in its own directory and step count
    if checkpoint is not None:
        run_dir = Path(args.resume).parent
        start_iteration, global_step = checkpoint["iteration"], checkpoint["global_step"]
    else:
        run_dir = Path(args.runs_dir) / utils.run_name(args)
        start_iteration, global_step = 0, 0
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        # purge_step drops events a crashed run wrote after its last checkpoint
        writer = SummaryWriter(str(run_dir), purge_step=global_step + 1 if checkpoint else None)
        if checkpoint is None:
            writer.add_text("hyperparameters", utils.hyperparameters_text(args))
    else:
        writer = NoWriter()
    stop = utils.StopSignal()

    # env setup: envs cannot be checkpointed, so a resumed run reseeds them afresh
    env_seed = args.seed + 1_000_003 * start_iteration + 10_007 * rank
    envs = utils.ThreadedAtariEnvs(
        args.env_id, args.num_envs, args.num_gpu_batches,
        1 if args.single_threaded else args.num_env_threads, env_seed,
        life_loss_terminal=args.life_loss_terminal, serial=args.single_threaded,
    )  # fmt: skip
    num_actions = envs.num_actions
    num_batches, batch = args.num_gpu_batches, envs.batch_size

    # agent and optimizer
    agent = Agent(num_actions).to(device, memory_format=torch.channels_last)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    if checkpoint is not None:
        agent.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        optimizer.param_groups[0]["lr"] = args.learning_rate  # the command line's rate, not the saved one
        utils.set_rng_states(checkpoint["rng"])
    if distributed:  # identical weights everywhere, then each rank samples its own actions
        for tensor in agent.state_dict().values():
            dist.broadcast(tensor, src=0)
        torch.manual_seed(args.seed + 7_919 * rank + start_iteration)
    weights = inference_weights(agent, dtype)

    def save(iteration, step, path=run_dir / "checkpoint.pt"):
        if rank != 0:
            return
        state = {
            "script": Path(__file__).name, "env_id": args.env_id, "args": vars(args),
            "num_actions": num_actions, "model": agent.state_dict(),
            "optimizer": optimizer.state_dict(), "iteration": iteration, "global_step": step,
            "env_seed": env_seed, "rng": utils.rng_states(),
        }  # fmt: skip
        utils.save_checkpoint(path, state)

    # storage: obs and values have one more step, the one after the horizon (for bootstrap)
    T, N = args.num_steps, args.num_envs
    obs = torch.zeros((T + 1, N, 4, 84, 84), dtype=torch.uint8, device=device)
    actions = torch.zeros((T + 1, N), dtype=torch.long, device=device)
    logprobs = torch.zeros((T + 1, N), device=device)
    values = torch.zeros((T + 1, N), device=device)
    uniforms = torch.zeros((T + 1, N), device=device)
    rewards = torch.zeros((T, N), device=device)
    dones = torch.zeros((T + 1, N), device=device)
    # rewards and terminals stay on the host, where they arrive, until the horizon is done
    rewards_host = utils.host_buffer((T, N), torch.float32, device)
    dones_host = utils.host_buffer((T + 1, N), torch.float32, device)
    rewards_host_np, dones_host_np = rewards_host.numpy(), dones_host.numpy()

    # per env batch: a stream, pinned buffers, inference buffers and every view it will touch
    streams = [utils.new_stream(device) for _ in range(num_batches)]
    slices = envs.slices
    stacks = [
        utils.DeviceFrameStack([obs[t, sl] for t in range(T + 1)], device, streams[b]) for b, sl in enumerate(slices)
    ]
    buffers = [inference_buffers(batch, num_actions, dtype, device) for _ in range(num_batches)]
    step_views = [
        [(obs[t, sl], uniforms[t, sl], actions[t, sl], logprobs[t, sl], values[t, sl]) for sl in slices]
        for t in range(T + 1)
    ]
    actions_host = [utils.host_buffer((batch,), torch.long, device) for _ in range(num_batches)]
    actions_host_np = [a.numpy() for a in actions_host]

    def act(t, b):
        """Inference and sampling for batch b at step t, straight into the rollout storage,
        then the actions to the host: 13 launches per batch and step (14 in bf16)."""
        obs_t, uniform_t, action_t, logprob_t, value_t = step_views[t][b]
        buf = buffers[b]
        with utils.on_stream(streams[b]):
            with timer("inference"):
                policy_forward(weights, buf, obs_t, value_t)
            with timer("sampling"):
                kernels.sample_logits(buf.logits, uniform_t, action_t, logprob_t, buf.entropy)
            with timer("device to host"):
                actions_host[b].copy_(action_t, non_blocking=True)
                if streams[b] is not None:
                    streams[b].synchronize()

    def rollout_batch(b):
        """Env batch b through the horizon, in its own worker thread (sequentially with
        --single-threaded or one batch). Returns the steps done: fewer when a stop came."""
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        for step in range(T + 1):
            if stop and not distributed:  # ranks stay in lockstep: they stop after the update
                return step
            if step > 0:
                with timer("env wait"):
                    frames, ended = envs.recv(b, rewards_host_np[step - 1, slices[b]], dones_host_np[step, slices[b]])
                with timer("host to device"):
                    stacks[b].push(step, frames, ended)
            act(step, b)
            if step < T:  # the step after the horizon only gives the bootstrap value
                envs.send(b, actions_host_np[b])
        return T + 1

    # worker threads, one per env batch (measured faster than round-robin in one thread:
    # benchmarks/batch_workers.py)
    threaded = num_batches > 1 and not args.single_threaded
    pool = ThreadPoolExecutor(num_batches, thread_name_prefix="env-batch") if threaded else None

    # start the game: the first frames go to the slot after the horizon, which each
    # iteration moves to step 0
    progress = utils.Progress(args.total_timesteps, global_step)
    training_threads = torch.get_num_threads()
    for b, frames in enumerate(np.split(envs.reset(), num_batches)):
        stacks[b].start(T, frames)
    dones_host_np[T] = 0
    iteration = start_iteration
    if rank == 0:
        print(f"run directory: {run_dir}", flush=True)
    profiler = utils.make_profiler(args.profile, run_dir, device)
    timer = utils.PhaseTimer(args.profile, device)

    for iteration in range(start_iteration + 1, args.num_iterations + 1):
        # annealing the rate if instructed to do so.
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # rollout: one worker thread per env batch; while a batch's envs step in C++ (GIL
        # released), the other workers run inference (torch releases the GIL too)
        refresh_inference_weights(weights)
        if device.type == "cpu":
            # one OpenMP thread per op while env threads run: idle OpenMP threads spin-wait and
            # would take the env threads' cores (utils' env stepping beside a 2-thread torch ran
            # at 0.64x of ale-py alone, measured here); training gets every thread back
            torch.set_num_threads(1)
        torch.rand(uniforms.shape, out=uniforms, device=device)  # every sample of the horizon
        obs[0].copy_(obs[T])
        dones_host_np[0] = dones_host_np[T]
        if pool is None:
            completed = [rollout_batch(b) for b in range(num_batches)]
        else:
            completed = list(pool.map(rollout_batch, range(num_batches)))
        if min(completed) <= T:  # a stop came: abandon the rollout, the checkpoint is the last full iteration
            iteration = iteration - 1
            break
        # each game is logged at the step where it ended, as the baseline logs it
        for _, episodic_return, episodic_length, step in envs.pop_finished():
            progress.recent_returns.append(episodic_return)
            writer.add_scalar("charts/episodic_return", episodic_return, global_step + step * N * world_size)
            writer.add_scalar("charts/episodic_length", episodic_length, global_step + step * N * world_size)
        global_step += T * N * world_size

        if device.type == "cpu":
            torch.set_num_threads(training_threads)
        with timer("training"):
            # advantages: terminals and rewards cross to the device once per iteration
            rewards.copy_(rewards_host, non_blocking=True)
            dones.copy_(dones_host, non_blocking=True)
            with torch.no_grad():
                advantages, returns = gae(rewards, values, dones, args.gamma, args.gae_lambda)

            # flatten the batch
            b_obs = obs[:T].reshape((-1, 4, 84, 84))
            b_logprobs = logprobs[:T].reshape(-1)
            b_actions = actions[:T].reshape(-1)
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values[:T].reshape(-1)

            # Optimizing the policy and value network; statistics stay on the device until the end
            stats = torch.zeros(8, device=device)
            nonfinite = torch.zeros((), dtype=torch.bool, device=device)
            for epoch in range(args.update_epochs):
                b_inds = torch.randperm(args.batch_size, device=device)
                for start in range(0, args.batch_size, args.minibatch_size):
                    end = start + args.minibatch_size
                    mb_inds = b_inds[start:end]

                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                        _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                            b_obs[mb_inds], b_actions[mb_inds]
                        )
                    newlogprob, entropy, newvalue = newlogprob.float(), entropy.float(), newvalue.float()
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()

                    with torch.no_grad():
                        # calculate approx_kl http://joschu.net/blog/kl-approx.html
                        old_approx_kl = (-logratio).mean()
                        approx_kl = ((ratio - 1) - logratio).mean()
                        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()

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
                    nonfinite |= ~torch.isfinite(loss)

                    optimizer.zero_grad()
                    loss.backward()
                    if distributed:
                        all_reduce_gradients(agent.parameters(), world_size)
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                    with torch.no_grad():  # the last minibatch's losses, the epoch's clipfracs
                        last = torch.stack([v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl])
                        stats[:5] = last.detach()
                        stats[5] += clipfrac
                        stats[6] += 1

                if args.target_kl is not None and approx_kl > args.target_kl:
                    break
            if args.update_epochs > 0:  # and the next rollout must not start from non-finite outputs
                nonfinite |= utils.nonfinite_policy(agent, obs[T])

        if distributed:  # every rank stops, or diverges, together
            flags = torch.stack([torch.tensor(float(bool(stop)), device=device), nonfinite.float()])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            nonfinite = flags[1] > 0
            if flags[0] > 0 and not stop:
                stop.received = "a signal on another rank"

        # logging: one sync per iteration
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        if args.update_epochs > 0:
            if bool(nonfinite):
                utils.fail_diverged(
                    "non-finite loss, weights or outputs", iteration, run_dir / "checkpoint.pt", writer, envs
                )
            v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfracs, count, _ = stats.tolist()
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
        writer.add_scalar("charts/SPS", progress.sps(global_step), global_step)
        if rank == 0:
            print(progress.line(iteration, args.num_iterations, global_step), flush=True)
        if profiler is not None:
            profiler.step()
            if iteration in (start_iteration + 4, args.num_iterations):
                profiler.stop()
                print(timer.table(), flush=True)
                profiler = None

        if iteration % args.save_interval == 0 or iteration == args.num_iterations:
            if not utils.all_finite(agent):
                utils.fail_diverged("non-finite weights", iteration, run_dir / "checkpoint.pt", writer, envs)
            save(iteration, global_step)
        if stop:
            break

    # close: a stop saves where it is and says how to continue (unless the last iteration is done)
    if stop and iteration < args.num_iterations:
        save(iteration, global_step)
        if rank == 0:
            print(utils.stopped_message(stop, global_step, run_dir / "checkpoint.pt"), flush=True)
    elif rank == 0:
        save(iteration, global_step, run_dir / "model.pt")
        print(f"saved {run_dir / 'model.pt'}", flush=True)
    if distributed:  # a cheap guard against silent desync: compare every rank's weights
        flat = torch.cat([p.detach().reshape(-1) for p in agent.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        if rank == 0:
            identical = all(torch.equal(g, gathered[0]) for g in gathered)
            print(f"weights identical on all {world_size} ranks: {identical}", flush=True)
        dist.destroy_process_group()
    if pool is not None:
        pool.shutdown()
    envs.close()
    writer.close()
