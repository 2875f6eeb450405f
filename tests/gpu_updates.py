"""The updates compiled with mode="reduce-overhead" and replayed from CUDA graphs against eager
ones on CUDA, in fp32 (no TF32, cuDNN deterministic as the scripts run it), for a few updates
from fixed weights and a random batch (A2C: new advantages each update), the rate annealed in
place between them. Run by tests/test_gpu.py in a fresh process (as tests/gpu_kernels.py is),
so that no test keeps a CUDA context in the pytest process: under an exclusive compute mode
every later script would be refused the GPU. Also runnable alone: python tests/gpu_updates.py
native | a2c (a2c: both optimizers, in this one process, so that the second meets Inductor's
cache of their shared forward and backward).

Checked for each: compiled once (no graph after the first update), no CUDA graph skipped, the
eager fallback unused; each step's losses close to eager's (the batch's old log-probs and values
are jittered, so that the first step clips already), PPO's clipfrac within CLIP_SAMPLES samples
(a ratio on the clip boundary may fall either side); and the weights, held to what the update
moved: the compiled change (after - before) may differ from eager's by TENSOR_CHANGE of eager's
change in each tensor and MODEL_CHANGE over the whole model (in norm), plus a float32 step of
every weight (a weight moving less than its step may round either way). So an optimizer that
moves weights by 1e-5 (RMSpropTF) is held as tightly as Adam at 1e-3, and no tensor is too
small to hold. Rounding alone - a ReLU input near 0 flipping sign, which
Adam's normalization carries on - moved PPO's weights up to 1.6% of eager's change over 50 CPU
runs from weights a float32 step apart; a rate 10% off, an unannealed rate, a missed clip,
zero_grad or step fail (benchmarks/check_power.py, benchmarks/results/gpu_check_power.md).
Prints one line per check and exits 1 if any failed.

python tests/gpu_updates.py graphed: the graphed update (utils.GraphedStep, on by default on CUDA)
against the same update eagerly, each with the optimizer its script makes with and without CUDA graphs,
from the same weights and batch, in fp32: PPO (fused Adam reads the same tensor rate either way: the
same kernels), PPO at world size 2 on a one-rank NCCL group (the all-reduce eagerly between two graphs),
A2C with either optimizer. Checked: one graph replayed per step (two under torchrun), the same number
of steps, each step's losses within 1e-5 relative plus 1e-5 and the weights within 1e-5 relative plus
1e-6 (float32 rounding; whether they are equal to the bit is printed); and printed, the host's time per
PPO minibatch eagerly and graphed (issue 59's target: 1 ms or less graphed).
"""

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SCRIPTS = {"native": ["native"], "a2c": ["a2c-rmsprop", "a2c-rmsprop-tf"]}
FIRST_STEP = dict(rtol=1e-4, atol=1e-4)  # one update from the same weights: rounding only
LATER_STEPS = dict(rtol=2e-3, atol=1e-3)  # after updates whose rounding differs
CLIPFRAC = 5  # its index in the PPO step's losses
CLIP_SAMPLES = 2  # clipfrac may differ by this many samples of a minibatch
MODEL_CHANGE, TENSOR_CHANGE = 0.04, 0.1  # the weights' change: its error against eager's norm
UNIT = 2.0**-23  # a float32 step, relative


def change_error(got_before, got, want_before, want):
    """(error, change, rounding) for one tensor: the norm of the difference between a run's weight
    change (after - before) and eager's, the norm of eager's change, and one float32 step of
    each weight in norm (where a weight moves by less than its step, how it rounds decides)."""
    got_change = got.double() - got_before.double()
    want_change = want.double() - want_before.double()
    rounding = UNIT * want.double().norm().item()
    return (got_change - want_change).norm().item(), want_change.norm().item(), rounding


def weight_errors(compiled, eager):
    """(name, error, tolerance) for each tensor's weight change against eager's, relative to
    TENSOR_CHANGE, and for the whole model's, relative to MODEL_CHANGE (each plus rounding)."""
    parts = []
    for i, tensors in enumerate(zip(compiled.before, compiled.after, eager.before, eager.after)):
        error, change, rounding = change_error(*tensors)
        parts.append((error, change, rounding))
        yield f"weights {i} {tuple(tensors[3].shape)}", error, TENSOR_CHANGE * change + rounding
    error, change, rounding = (sum(part[k] ** 2 for part in parts) ** 0.5 for k in range(3))
    yield "weights, whole model", error, MODEL_CHANGE * change + rounding


def weight_checks(compiled, eager):
    """(name, ok, detail) for the weights: each tensor's change within TENSOR_CHANGE of eager's
    change (plus rounding), and the whole model's within MODEL_CHANGE."""
    for name, error, tolerance in weight_errors(compiled, eager):
        yield name, error <= tolerance, f"change off by {error:.2e}, {error / tolerance:.2f} of the tolerance"


def agent_and_batch(module, device, batch, memory_format=torch.channels_last):
    """`module`'s Agent from seed 0, a generator seeded 1 and a random batch drawn from it: frames,
    actions, the agent's own log-probs and values, advantages, and returns = values + advantages."""
    torch.manual_seed(0)
    agent = module.Agent(4).to(device, memory_format=memory_format)
    g = torch.Generator(device=device).manual_seed(1)
    obs = torch.randint(0, 256, (batch, 4, 84, 84), dtype=torch.uint8, device=device, generator=g)
    actions = torch.randint(0, 4, (batch,), device=device, generator=g)
    with torch.no_grad():
        _, logprobs, _, values = agent.get_action_and_value(obs, actions)
    values = values.view(-1)
    advantages = torch.randn(batch, device=device, generator=g)
    return agent, g, (obs, actions, logprobs, values, advantages, values + advantages)


def updates(script, compile, device, count=3, memory_format=torch.channels_last):
    """`count` updates of `script` (native: Adam; a2c-rmsprop, a2c-rmsprop-tf: A2C's --optimizer)
    on `device` in fp32: each step's losses, the weights before and after, Dynamo's graphs after
    each update, the step function, the optimizer's step count and the minibatch size."""
    from torch._dynamo.utils import counters

    import a2c_atari as a2c
    import ppo_atari_native as native
    import utils

    utils.use_device(device, "fp32")
    module = native if script == "native" else a2c
    B = 16 * 32  # either script's default batch
    agent, g, (obs, actions, logprobs, values, advantages, returns) = agent_and_batch(module, device, B, memory_format)
    before = [p.detach().cpu().clone() for p in agent.parameters()]
    # the rollout's log-probs and values a little off the learner's: the first step clips some
    # ratios and values already (its losses are not fixed by ratio 1)
    logprobs = logprobs + 0.1 * torch.randn(B, device=device, generator=g)
    old_values = values + 0.1 * torch.randn(B, device=device, generator=g)
    lr = torch.tensor(2.5e-4, device=device) if compile else 2.5e-4
    losses, graphs = [], []
    if script == "native":
        args = SimpleNamespace(
            update_epochs=2, batch_size=B, minibatch_size=B // 4, clip_coef=0.1, norm_adv=True, clip_vloss=True,
            ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, target_kl=None,
        )  # fmt: skip
        optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5, **utils.optimizer_options(device, compile))
        step = utils.CompiledStep(native.minibatch_step, device) if compile else native.minibatch_step

        def record(*a):
            out = step(*a)
            losses.append(out[0].clone())
            return out

        batch = (obs, actions, logprobs, advantages, returns, old_values)
        torch.manual_seed(2)
        for i in range(count):
            utils.set_lr(optimizer, 2.5e-4 * (1 - i / count))
            _, nonfinite = native.update(agent, optimizer, *batch, args, torch.float32, 1, record)
            assert not nonfinite
            graphs.append(counters["stats"]["unique_graphs"])
        steps, minibatch = count * args.update_epochs * (B // args.minibatch_size), args.minibatch_size
    else:
        args = SimpleNamespace(norm_adv=False, ent_coef=0.01, vf_coef=0.25, max_grad_norm=0.5)
        hyper = dict(lr=lr, alpha=0.99, eps=1e-5)
        if script == "a2c-rmsprop":  # as a2c_atari.py makes either of its optimizers
            hyper |= utils.optimizer_options(device, compile, has_fused=False)
            optimizer = torch.optim.RMSprop(agent.parameters(), **hyper)
        else:
            optimizer = a2c.RMSpropTF(agent.parameters(), **hyper)
        step = utils.CompiledStep(a2c.update, device) if compile else a2c.update
        for i in range(count):
            if i > 0:  # another batch's advantages each update, as in training: a gradient left over shows
                advantages = torch.randn(B, device=device, generator=g)
                returns = values + advantages
            utils.set_lr(optimizer, 7e-4 * (1 - i / count))
            out, nonfinite = step(agent, optimizer, obs, actions, logprobs, advantages, returns, args, torch.float32)
            assert not nonfinite
            losses.append(out.clone())
            graphs.append(counters["stats"]["unique_graphs"])
        steps, minibatch = count, B
    if device.type == "cuda":
        torch.cuda.synchronize()
    after = [p.detach().cpu() for p in agent.parameters()]
    return SimpleNamespace(
        script=script, losses=losses, before=before, after=after, graphs=graphs, step=step, steps=steps,
        minibatch=minibatch,
    )  # fmt: skip


def loss_checks(compiled, eager):
    """(name, ok, detail) for each step's losses; PPO's clipfrac to CLIP_SAMPLES samples."""
    yield (
        "as many steps",
        len(compiled.losses) == len(eager.losses),
        f"{len(compiled.losses)} against {len(eager.losses)}",
    )
    for i, (got, want) in enumerate(zip(compiled.losses, eager.losses)):
        tolerance = FIRST_STEP if i == 0 else LATER_STEPS
        got, want = got.double(), want.double()
        if eager.script == "native":
            clipped = abs(got[CLIPFRAC] - want[CLIPFRAC]).item() * eager.minibatch
            yield f"step {i} clipfrac", clipped <= CLIP_SAMPLES + 1e-6, f"{clipped:.0f} samples apart"
            got, want = got[torch.arange(len(got)) != CLIPFRAC], want[torch.arange(len(want)) != CLIPFRAC]
        error = (got - want).abs().max().item()
        yield f"step {i} losses", bool(torch.allclose(got, want, **tolerance)), f"max error {error:.2e}"


def compare(eager, compiled):
    """(name, ok, detail) for each check of a compiled run against the eager one (as updates returns them)."""
    step = compiled.step
    yield "compiled, no eager fallback", not step.eager and step.seconds is not None, f"compile {step.seconds} s"
    yield "compiled once", compiled.graphs[0] == compiled.graphs[-1], f"graphs after each update {compiled.graphs}"
    yield from loss_checks(compiled, eager)
    yield from weight_checks(compiled, eager)


# ----------------------------------------------------------------------------- the graphed update
GRAPHED = ["native", "native-torchrun", "a2c-rmsprop", "a2c-rmsprop-tf"]
GRAPHED_LOSSES = dict(rtol=1e-5, atol=1e-5)  # float32 rounding of losses of order 1
GRAPHED_WEIGHTS = dict(rtol=1e-5, atol=1e-6)  # and of a few optimizer steps on weights of order 0.1


def graphed_updates(script, graphed, device, count=3, batch=512, timed=2):
    """`count` updates of `script` (GRAPHED) on `device` in fp32, eagerly or through utils.GraphedStep,
    with the optimizer its main block makes without or with CUDA graphs; then `timed` more, unrecorded,
    for the host's time. Returns each step's losses, the weights after the recorded updates, the step,
    and the host's seconds per step of the timed updates (nothing syncs in them)."""
    from types import SimpleNamespace

    import a2c_atari as a2c
    import ppo_atari_native as native
    import utils

    utils.use_device(device, "fp32")
    cuda_graphs = graphed and device.type == "cuda"  # as the main blocks' `graphs`
    module = a2c if script.startswith("a2c") else native
    agent, _, (obs, actions, logprobs, values, advantages, returns) = agent_and_batch(module, device, batch)
    losses = []
    if module is native:
        args = SimpleNamespace(
            update_epochs=2, batch_size=batch, minibatch_size=batch // 4, clip_coef=0.1, norm_adv=True,
            clip_vloss=True, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, target_kl=None,
        )  # fmt: skip
        lr = torch.tensor(2.5e-4, device=device) if device.type == "cuda" else 2.5e-4
        options = utils.optimizer_options(device, False, graphs=cuda_graphs)
        optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5, **options)
        step = (
            utils.GraphedStep(native.minibatch_step, device, copied=["mb_inds"]) if graphed else native.minibatch_step
        )
        world_size = 2 if script == "native-torchrun" else 1
        data = (obs, actions, logprobs, advantages, returns, values)

        def run(i, optimize):
            utils.set_lr(optimizer, 2.5e-4 * (1 - i / (count + timed)))
            assert not native.update(agent, optimizer, *data, args, torch.float32, world_size, optimize)[1]

        steps_per_update = args.update_epochs * 4
        torch.manual_seed(2)
    else:
        args = SimpleNamespace(norm_adv=False, ent_coef=0.01, vf_coef=0.25, max_grad_norm=0.5)
        hyper = dict(lr=torch.tensor(7e-4, device=device) if cuda_graphs else 7e-4, alpha=0.99, eps=1e-5)
        if script == "a2c-rmsprop":
            hyper |= utils.optimizer_options(device, False, has_fused=False, graphs=cuda_graphs)
            optimizer = torch.optim.RMSprop(agent.parameters(), **hyper)
        else:
            optimizer = a2c.RMSpropTF(agent.parameters(), **hyper)
        step = utils.GraphedStep(a2c.update, device) if graphed else a2c.update

        def run(i, optimize):
            utils.set_lr(optimizer, 7e-4 * (1 - i / (count + timed)))
            assert not optimize(agent, optimizer, obs, actions, logprobs, advantages, returns, args, torch.float32)[1]

        steps_per_update = 1

    def record(*a):  # the step as `run` calls it, its losses kept
        out = step(*a)
        losses.append(out[0].clone())
        return out

    for i in range(count):
        run(i, record)
    weights = [p.detach().cpu() for p in agent.parameters()]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    host = 0.0
    for i in range(count, count + timed):
        start = time.perf_counter()
        run(i, step)
        host += time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    host = host / (timed * steps_per_update) if timed else None
    return SimpleNamespace(losses=losses, weights=weights, step=step, host=host)


def compare_graphed(script, eager, graphed):
    """(name, ok, detail) for each check of a graphed run against the eager one (as graphed_updates returns them)."""
    if graphed.step.replays is not None:  # on CUDA
        want = 2 if script == "native-torchrun" else 1
        got = len(graphed.step.graphs)
        yield "replayed from its graphs", got == want, f"{got} graph(s) a step, {len(graphed.step.replays)} replays"
    yield (
        "as many steps",
        len(graphed.losses) == len(eager.losses),
        f"{len(graphed.losses)} against {len(eager.losses)}",
    )
    for i, (got, want) in enumerate(zip(graphed.losses, eager.losses)):
        error = (got.double() - want.double()).abs().max().item()
        equal = "equal to the bit" if torch.equal(got, want) else f"max error {error:.2e}"
        yield f"step {i} losses", bool(torch.allclose(got, want, **GRAPHED_LOSSES)), equal
    for i, (got, want) in enumerate(zip(graphed.weights, eager.weights)):
        error = (got.double() - want.double()).abs().max().item()
        equal = "equal to the bit" if torch.equal(got, want) else f"max error {error:.2e}"
        yield f"weights {i} {tuple(want.shape)}", bool(torch.allclose(got, want, **GRAPHED_WEIGHTS)), equal


def graphed_main(device):
    import torch.distributed as dist

    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)  # for native-torchrun
    failures = []
    for script in GRAPHED:
        eager, graphed = graphed_updates(script, False, device), graphed_updates(script, True, device)
        for name, ok, detail in compare_graphed(script, eager, graphed):
            print(f"{'ok  ' if ok else 'FAIL'} graphed {script} {name}: {detail}", flush=True)
            if not ok:
                failures.append(f"{script} {name}")
        what = "minibatch" if script.startswith("native") else "update"
        print(f"host time per {what}, {script}: eager {eager.host * 1e3:.2f} ms, graphed {graphed.host * 1e3:.2f} ms")
    dist.destroy_process_group()
    if failures:
        print(f"{len(failures)} failed: {', '.join(failures[:10])}")
        sys.exit(1)
    print("all graphed update checks passed")


def main():
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    # as the scripts run (--torch-deterministic): cuDNN's algorithms, and so the rounding, the
    # same from run to run; cuBLAS's reduction order fixed by its workspace
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if sys.argv[1:] == ["graphed"]:
        device = torch.device("cuda", 0)
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
        return graphed_main(device)
    if len(sys.argv) != 2 or sys.argv[1] not in SCRIPTS:
        print(f"usage: python tests/gpu_updates.py [{' | '.join(SCRIPTS)} | graphed]", file=sys.stderr)
        sys.exit(2)
    from torch._dynamo.utils import counters

    device = torch.device("cuda", 0)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    failures = []
    for script in SCRIPTS[sys.argv[1]]:
        eager = updates(script, False, device)
        skips = counters["inductor"]["cudagraph_skips"]
        compiled = updates(script, True, device)
        checks = list(compare(eager, compiled))
        skipped = counters["inductor"]["cudagraph_skips"] - skips
        checks.append(("no CUDA graph skipped", skipped == 0, f"{skipped} skipped (TORCH_LOGS=cudagraphs says why)"))
        for name, ok, detail in checks:
            print(f"{'ok  ' if ok else 'FAIL'} {script} {name}: {detail}", flush=True)
            if not ok:
                failures.append(f"{script} {name}")
    if failures:
        print(f"{len(failures)} failed: {', '.join(failures[:10])}")
        sys.exit(1)
    print("all update checks passed")


if __name__ == "__main__":
    main()
