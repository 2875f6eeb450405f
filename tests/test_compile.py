"""--compile: the compiled update equals the eager one to float32 rounding, compiles once, and
falls back to eager with one line where compiling fails.

In one process (the fast part): from the same weights, batch and shuffle seed, the native PPO
update with its minibatch step compiled and eagerly, and A2C's update compiled and eagerly, give
the same per-step losses and weights to float32 rounding: within 1e-5 of each entry plus 2e-5
(losses: Inductor's convolutions and its 3136-term sums round apart from eager's by up to 8e-6
here) or plus 1e-6 (weights: they agreed to 6e-8). The same compiled functions
serve every test here, so each compiles once per process; Inductor's disk cache makes a second
process's compile quicker. End to end (slow): a PPO run resumed with --compile against the same
resume eagerly, A2C on the general policy step compiled, its compile failing, and eagerly, and
torchrun with two gloo ranks compiled against eagerly.
"""

import functools
import re
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, read_scalars, run_dir_of, run_script, script_env, stop_after_first_progress
from test_algorithm import A2C_ARGS, BEFORE, TERMINAL, fixed_batch, make_agent, ppo_args, script_advantages
from torch._dynamo.utils import counters

import a2c_atari as a2c
import ppo_atari_native as native
import utils

CPU = torch.device("cpu")
LOSSES = dict(rtol=1e-5, atol=2e-5)  # float32 rounding of losses of order 1, through a 3136-term sum
WEIGHTS = dict(rtol=1e-5, atol=1e-6)  # and of a few Adam steps of lr 1e-4 on weights of order 0.1


@functools.cache
def compiled(script):
    """One CompiledStep per script for the whole module: a new one would compile again."""
    return utils.CompiledStep({"native": native.minibatch_step, "a2c": a2c.update}[script], CPU)


def recording(step, losses):
    """`step`, keeping a copy of every call's losses."""

    def record(*args):
        out = step(*args)
        losses.append(out[0].clone())
        return out

    return record


def graphs():
    return counters["stats"]["unique_graphs"]


def ppo_batch(perturb, infinite_returns=False):
    agent = make_agent(native)
    data = fixed_batch(agent, perturb)
    advantages, returns = script_advantages("native", data.rewards, data.values, TERMINAL, BEFORE, 0.99, 0.95)
    if infinite_returns:
        returns = torch.full_like(returns, float("inf"))
    batch = (data.obs.flatten(0, 1), data.actions.flatten(), data.logprobs.flatten())
    return agent, batch + (advantages.flatten(), returns.flatten(), data.values[:4].flatten())


def ppo_updates(compile, args, perturb, updates=2, infinite_returns=False):
    """`updates` native PPO updates from the test's fixed weights and batch, the rate annealed
    between them: the per-minibatch losses, the stats and non-finite flags, the weights after."""
    agent, batch = ppo_batch(perturb, infinite_returns)
    lr = torch.tensor(args.learning_rate) if compile else args.learning_rate
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5, **utils.optimizer_options(CPU, compile))
    losses, results, graphs_after = [], [], []
    step = recording(compiled("native") if compile else native.minibatch_step, losses)
    torch.manual_seed(5)
    for i in range(updates):
        utils.set_lr(optimizer, args.learning_rate * (1 - i / updates))
        results.append(native.update(agent, optimizer, *batch, args, torch.float32, 1, step))
        graphs_after.append(graphs())
    return losses, results, [p.detach().clone() for p in agent.parameters()], graphs_after


@pytest.mark.slow
@pytest.mark.parametrize("target_kl", [None, 0.15])
def test_compiled_ppo_update_equals_eager(target_kl):
    """Two updates of 3 epochs x 2 minibatches (target_kl 0.15: the first stops after its second
    epoch, the second after its first), the rate annealed between them: every minibatch's losses, the stats and the
    weights, compiled as eagerly; no compile after the first update's first step."""
    args = ppo_args(update_epochs=3, num_minibatches=2, target_kl=target_kl)
    eager = ppo_updates(False, args, perturb=False)
    compiled_ = ppo_updates(True, args, perturb=False)
    assert compiled("native").seconds is not None and not compiled("native").eager
    assert len(compiled_[0]) == len(eager[0]) == (6 if target_kl else 12)
    for i, (got, want) in enumerate(zip(compiled_[0], eager[0])):
        torch.testing.assert_close(got, want, **LOSSES, msg=lambda m, i=i: f"minibatch {i}: {m}")
    for (got, got_nonfinite), (want, want_nonfinite) in zip(compiled_[1], eager[1]):
        torch.testing.assert_close(got, want, **LOSSES)
        assert not got_nonfinite and not want_nonfinite
    for got, want in zip(compiled_[2], eager[2]):
        torch.testing.assert_close(got, want, **WEIGHTS)
    first, last = compiled_[3]
    assert first == last, f"compiled again after the first update: {first} graphs, then {last}"


@pytest.mark.slow
def test_compiled_ppo_update_flags_a_non_finite_loss():
    """Infinite returns: the compiled update flags the loss, as the eager one does (the main
    block then fails the run)."""
    args = ppo_args(update_epochs=3, num_minibatches=2)
    _, results, _, _ = ppo_updates(True, args, perturb=True, updates=1, infinite_returns=True)
    stats, nonfinite = results[0]
    assert nonfinite and stats[6] == 6


def a2c_batch(args):
    """The test's fixed A2C weights and batch: (agent, batch)."""
    agent = make_agent(a2c)
    data = fixed_batch(agent, perturb=True)
    advantages, returns = script_advantages("a2c", data.rewards, data.values, TERMINAL, BEFORE, args.gamma, 1.0)
    batch = (data.obs.flatten(0, 1), data.actions.flatten(), data.logprobs.flatten())
    return agent, batch + (advantages.flatten(), returns.flatten())


def a2c_optimizer(name, agent, args, compile):
    """The optimizer --optimizer `name` makes, as a2c_atari.py's main block makes it."""
    hyper = dict(lr=torch.tensor(args.learning_rate) if compile else args.learning_rate)
    hyper |= dict(alpha=args.rms_alpha, eps=args.rms_eps)
    if name == "rmsprop":
        return torch.optim.RMSprop(
            agent.parameters(), **hyper, **utils.optimizer_options(CPU, compile, has_fused=False)
        )
    return a2c.RMSpropTF(agent.parameters(), **hyper)


def a2c_updates(compile, changes, updates=3):
    """`updates` A2C updates from the test's fixed weights and batch, the rate annealed between
    them: each one's losses, the weights after, the graphs compiled after each."""
    args = SimpleNamespace(**{**A2C_ARGS, **changes})
    agent, batch = a2c_batch(args)
    optimizer = a2c_optimizer("rmsprop-tf", agent, args, compile)
    step = compiled("a2c") if compile else a2c.update
    losses, graphs_after = [], []
    for i in range(updates):
        utils.set_lr(optimizer, args.learning_rate * (1 - i / updates))
        out, nonfinite = step(agent, optimizer, *batch, args, torch.float32)
        assert not nonfinite
        losses.append(out.clone())
        graphs_after.append(graphs())
    return losses, [p.detach().clone() for p in agent.parameters()], graphs_after


@pytest.mark.slow
def test_compiled_a2c_update_equals_eager():
    """Three A2C updates (normalized advantages), the rate annealed between them: the losses and
    log-prob gap of each, and the weights after, compiled as eagerly; compiled once."""
    eager = a2c_updates(False, dict(norm_adv=True))
    compiled_ = a2c_updates(True, dict(norm_adv=True))
    for i, (got, want) in enumerate(zip(compiled_[0], eager[0])):
        torch.testing.assert_close(got, want, **LOSSES, msg=lambda m, i=i: f"update {i}: {m}")
    for got, want in zip(compiled_[1], eager[1]):
        torch.testing.assert_close(got, want, **WEIGHTS)
    assert compiled_[2][0] == compiled_[2][-1], f"compiled again: graphs after each update {compiled_[2]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rmsprop", "rmsprop-tf"])
def test_the_compiled_a2c_update_sees_its_optimizer_state_at_static_addresses(name):
    """CUDA graph trees replay a graph that updates an input in place only where Dynamo marked
    that input a static address; else they skip the graph and launch its kernels one by one
    every time. Dynamo marks an optimizer's state when the step fills its tensor lists through
    `_init_group` (torch's optimizers do): so for both A2C optimizers, after a compiled update
    (traced by Dynamo, no backend compile), every state tensor is marked."""
    args = SimpleNamespace(**A2C_ARGS)
    agent, batch = a2c_batch(args)
    optimizer = a2c_optimizer(name, agent, args, compile=True)
    utils.CompiledStep(a2c.update, CPU, backend="eager")(agent, optimizer, *batch, args, torch.float32)
    state = [(key, t) for tensors in optimizer.state.values() for key, t in tensors.items()]
    assert {key for key, _ in state} >= {"square_avg"} and len(state) >= len(list(agent.parameters()))
    unmarked = {key for key, t in state if getattr(t, "_dynamo_static_input_type", None) is None}
    assert not unmarked, f"not static addresses: {unmarked}"


@pytest.mark.slow
@pytest.mark.xfail(
    torch.__version__ < "2.12",  # TorchVersion compares as a version
    reason="torch 2.11's CPU Inductor (the GPU image's torch) ignores emulate_precision_casts (docs/update.md)",
    strict=True,
)
def test_a_compiled_bf16_step_rounds_where_autocast_does():
    """Inductor fuses a bf16 layer with its GELU and skips the roundings between them that
    autocast makes eagerly, and that the rollout's step makes: the learner's log-probs would move
    off the rollout's (the guard's gap grew 100-fold on these CPUs, docs/update.md). Compiled,
    such a layer gives eager's result to the bit."""
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(64, 32), torch.randn(16, 64)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = torch.nn.functional.gelu(layer(x))
        return hidden.float().sum(dim=1)

    assert torch.equal(utils.CompiledStep(step, CPU)(x), step(x))


def test_a_failed_compile_runs_the_step_eagerly(capsys):
    """A backend that fails (as Inductor does on what it cannot compile): the step runs eagerly,
    its result the eager one's, and one line on stderr says why, once."""

    def failing_backend(graph, example_inputs):
        raise RuntimeError("cannot lower this edit\nsecond line")

    def step(x, y):
        return (x * y).sum() + 1

    wrapped = utils.CompiledStep(step, CPU, backend=failing_backend)
    x, y = torch.arange(4.0), torch.ones(4)
    assert wrapped(x, y).item() == 7 and wrapped(x, y).item() == 7
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --compile: "), err
    assert "cannot lower this edit" in err[0] and err[0].endswith("; the update runs eagerly"), err
    assert wrapped.eager and wrapped.text() == ", compile failed: eager"


def test_a_compile_failing_after_the_optimizer_stepped_still_steps_once(capsys):
    """The first call's graphs run as they compile: where the last one fails to compile, after the
    optimizer's graph ran, the eager run that follows starts from the weights and optimizer state
    before the call, so the minibatch's update is applied once, not twice."""

    def backend(graph, example_inputs):
        if any(node.target is torch.sin for node in graph.graph.nodes):
            raise RuntimeError("cannot lower the last graph")
        return graph.forward

    def step(w, optimizer):
        optimizer.zero_grad()
        (w * w).sum().backward()
        optimizer.step()
        return torch.sin(w).sum()

    runs = []
    for wrapped in (step, utils.CompiledStep(step, CPU, backend=backend)):
        w = torch.nn.Parameter(torch.arange(4.0))
        optimizer = torch.optim.Adam([w], lr=0.1)
        wrapped(w, optimizer)
        runs.append((w.detach(), optimizer.state[w]["step"], optimizer.state[w]["exp_avg_sq"]))
    assert "cannot lower the last graph" in capsys.readouterr().err
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, want)


def test_after_its_first_call_a_compiled_step_raises_what_fails():
    """Only the first call compiles the update's graphs (tests above count them): an error after
    it, compiling or not, raises instead of switching to eager half-way through a run."""

    def backend(graph, example_inputs):
        if example_inputs[0].shape[0] == 5:
            raise RuntimeError("a recompile failed")
        return graph.forward

    wrapped = utils.CompiledStep(lambda x: (x * 2).sum(), CPU, backend=backend)
    assert wrapped(torch.ones(4)).item() == 8
    with pytest.raises(Exception, match="a recompile failed"):
        wrapped(torch.ones(5))
    assert not wrapped.eager


def test_an_error_of_the_step_itself_raises_as_it_does_eagerly():
    def step(x):
        raise ValueError("a bug in the step")

    with pytest.raises(ValueError, match="a bug in the step"):
        utils.CompiledStep(step, CPU)(torch.ones(1))


@pytest.mark.parametrize("name", ["adam", "rmsprop"])
@pytest.mark.parametrize("written_by, resumed_by", [("eager", "--compile"), ("--compile", "eager")])
def test_a_resume_runs_this_runs_optimizer_implementation(name, written_by, resumed_by):
    """A checkpoint's param_groups keep the writer's implementation flags (fused, foreach,
    capturable), which load_state_dict would restore. Written on CUDA eagerly (Adam fused) or with
    --compile (capturable foreach), then resumed the other way on the CPU: the loaded optimizer
    has this run's flags and rate tensor, and steps."""
    optimizer_class, has_fused = {"adam": (torch.optim.Adam, True), "rmsprop": (torch.optim.RMSprop, False)}[name]
    layer = torch.nn.Linear(3, 2)
    writer = optimizer_class(layer.parameters(), lr=1e-3, **utils.optimizer_options(CPU, False, has_fused))
    layer(torch.ones(1, 3)).sum().backward()
    writer.step()
    saved = writer.state_dict()
    written = utils.optimizer_options(torch.device("cuda", 0), written_by == "--compile", has_fused)
    saved["param_groups"] = [group | written for group in saved["param_groups"]]
    compile = resumed_by == "--compile"
    hyper = dict(lr=torch.tensor(1e-3) if compile else 1e-3) | utils.optimizer_options(CPU, compile, has_fused)
    optimizer = optimizer_class(layer.parameters(), **hyper)
    utils.load_optimizer(optimizer, saved, hyper)
    group = optimizer.param_groups[0]
    assert {key: group[key] for key in hyper if key != "lr"} == {key: hyper[key] for key in hyper if key != "lr"}
    assert group["lr"] is hyper["lr"]
    optimizer.step()


# ----------------------------------------------------------------------------- end to end
TINY = ["--num-envs", "4", "--num-steps", "64", "--num-minibatches", "4", "--precision", "fp32"]


def model_of(run_dir, name="model.pt"):
    return torch.load(run_dir / name, map_location="cpu", weights_only=True)["model"]


def assert_models_close(got, want, what, off=0.0):
    """Every weight within WEIGHTS; with `off`, that share of them may lie up to 1e-4 off (a tenth
    of a step under a ReLU that rounding switched, or an action sampled apart after it)."""
    outside = 0
    for name in want:
        if not off:
            torch.testing.assert_close(got[name], want[name], **WEIGHTS, msg=lambda m, n=name: f"{what}, {n}: {m}")
            continue
        error = (got[name] - want[name]).abs()
        assert error.max() <= 1e-4, f"{what}, {name}: {error.max().item():.3g} off"
        outside += (error > WEIGHTS["atol"] + WEIGHTS["rtol"] * want[name].abs()).sum().item()
    total = sum(w.numel() for w in want.values())
    assert outside <= off * total, f"{what}: {outside} of {total} weights outside {WEIGHTS}"


def assert_losses_close(got_dir, want_dir, tags=("losses/value_loss", "losses/policy_loss", "losses/entropy")):
    got, want = read_scalars(got_dir), read_scalars(want_dir)
    for tag in tags:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        torch.testing.assert_close(
            torch.tensor([v for _, v in got[tag]]), torch.tensor([v for _, v in want[tag]]), **LOSSES
        )


def first_progress_line(stdout):
    return next(line for line in stdout.splitlines() if line.startswith("iter "))


@pytest.mark.slow
def test_a_run_resumed_with_compile_equals_the_eager_resume(runs_dir, tmp_path):
    """Stopped after its first of 3 iterations, a PPO run (the fused policy step) resumed with
    --compile and eagerly: the same losses and weights; the compile's time on the first line. The
    frames' storage is a static input of the compiled graphs (under CUDA graphs read in place, not
    copied at every replay), as AOTAutograd logs it."""
    args = [*TINY, "--total-timesteps", 3 * 256, "--runs-dir", runs_dir]
    stopped = stop_after_first_progress("ppo_atari_native.py", args, signal.SIGINT)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    run_dir = run_dir_of(stopped)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    run_script("ppo_atari_native.py", *args, "--resume", run_dir)  # eagerly
    resumed = run_script(
        "ppo_atari_native.py", *args, "--resume", copy, "--compile", env={"TORCH_LOGS": "cudagraph_static_inputs"}
    )
    assert "warning" not in resumed.stderr, resumed.stderr[-2000:]
    assert re.search(r"Adding static input pos \d+ for source L\['b_obs'\]", resumed.stderr), resumed.stderr[-2000:]
    assert ", compile " in first_progress_line(resumed.stdout) and "policy fused" in resumed.stdout.splitlines()[0]
    assert_models_close(model_of(copy), model_of(run_dir), "resumed with --compile")
    assert_losses_close(copy, run_dir)


@pytest.mark.slow
def test_a2c_compiled_on_the_general_policy_step_equals_eager(runs_dir, tmp_path):
    """A2C on the general policy step (--policy module) for 3 iterations with the rate annealed:
    compiled, eagerly, and with its compile failing (no C++ compiler for Inductor, an empty cache):
    the same losses and weights; the failed one says so in one line and runs to the end. The
    frames' storage is a static input of the compiled graph, as AOTAutograd logs it."""
    args = ["--num-envs", "8", "--num-steps", "5", "--log-interval", "1", "--total-timesteps", 3 * 40]
    args += ["--policy", "module", "--anneal-lr", "--precision", "fp32", "--runs-dir", runs_dir]
    eager = run_script("a2c_atari.py", *args)
    compiled_run = run_script("a2c_atari.py", *args, "--compile", env={"TORCH_LOGS": "cudagraph_static_inputs"})
    assert re.search(r"Adding static input pos \d+ for source L\['b_obs'\]", compiled_run.stderr)
    assert "warning" not in compiled_run.stderr, compiled_run.stderr[-2000:]
    assert ", compile " in first_progress_line(compiled_run.stdout)
    no_compiler = {"CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    failed = run_script("a2c_atari.py", *args, "--compile", env=no_compiler)
    warnings = [line for line in failed.stderr.splitlines() if line.startswith("warning: --compile: ")]
    assert len(warnings) == 1 and warnings[0].endswith("; the update runs eagerly"), failed.stderr[-2000:]
    assert "Traceback" not in failed.stderr
    assert ", compile failed: eager" in first_progress_line(failed.stdout)
    for run in (compiled_run, failed):
        assert_models_close(model_of(run_dir_of(run)), model_of(run_dir_of(eager)), "a2c --compile")
        assert_losses_close(run_dir_of(run), run_dir_of(eager))


@pytest.mark.slow
def test_torchrun_two_gloo_ranks_compiled_equal_eager(tmp_path):
    """Two CPU ranks, the gradients averaged eagerly between the compiled backward and Adam's
    step: every rank ends with rank 0's weights, which are the eager run's (at most 0.1% of them
    further apart, by under 1e-4: in one run here 32 of network.0's, by up to 1.4e-5)."""
    args = ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "512"]
    models = []
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(ROOT / "ppo_atari_native.py"), *args, "--runs-dir", str(tmp_path / name), "--num-env-threads", "1",
            "--device", "cpu", "--backend", "gloo", "--precision", "fp32", *extra,
        ]  # fmt: skip
        result = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "weights identical on all 2 ranks: True" in result.stdout.splitlines(), result.stdout[-2000:]
        assert "warning" not in result.stderr, result.stderr[-2000:]
        models.append(model_of(run_dir_of(result)))
    assert_models_close(models[1], models[0], "torchrun --compile", off=0.001)
