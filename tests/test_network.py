"""Change the network in a copy of a native script, as a researcher would, and the rollout runs
that network: the fused step only for the network it mirrors, else the Agent's own forward,
whose log-probs equal the learner's. Copies of ppo_atari_native.py and a2c_atari.py with an
edited Agent: GELU -> ReLU, a LayerNorm appended, hidden width 256, a fourth convolution, a
different activation between the convolutions."""

import functools
import importlib.util
import re
import shlex
import signal

import pytest
import torch
from conftest import (
    ROOT,
    default_game,
    read_scalars,
    rollout_storage,
    run_dir_of,
    run_script,
    stop_after_first_progress,
)

import kernels
import ppo_atari_native as native
import utils

SCRIPTS = ["ppo_atari_native.py", "a2c_atari.py"]
# the Agent's __init__ and forward, which some edits rewrite whole
BODY = ("    def __init__(self, num_actions, frame_stack=4, screen_size=84):\n", "    def get_action_and_value")
# name -> (replacements in the script, the first difference the fused check names)
EDITS = {
    "relu-hidden": (
        [("            nn.GELU(),\n", "            nn.ReLU(),\n")],
        "network[8] is ReLU, the fused step computes GELU",
    ),
    "layernorm": (
        [("            nn.GELU(),\n        )", "            nn.GELU(),\n            nn.LayerNorm(512),\n        )")],
        "network[9] is LayerNorm, after the layers the fused step computes",
    ),
    "hidden-256": (
        [("side * side, 512)", "side * side, 256)"), ("nn.Linear(512, ", "nn.Linear(256, ")],
        "network[7] is Linear(in_features=3136, out_features=256, bias=True), the fused step computes "
        "Linear(in_features=3136, out_features=512, bias=True)",
    ),
    "fourth-conv": (
        [
            (
                "            layer_init(nn.Conv2d(64, 64, 3, stride=1)),\n            nn.ReLU(),\n",
                "            layer_init(nn.Conv2d(64, 64, 3, stride=1)),\n            nn.ReLU(),\n"
                "            layer_init(nn.Conv2d(64, 64, 3, stride=1, padding=1)),\n            nn.ReLU(),\n",
            )
        ],
        "network[6] is Conv2d, the fused step computes Flatten",
    ),
    "elu-between-convs": (
        [("            nn.ReLU(),\n", "            nn.ELU(),\n", 1)],
        "network[1] is ELU, the fused step computes ReLU",
    ),
}  # fmt: skip

TRUNKS = """    def __init__(self, num_actions, frame_stack=4, screen_size=84):
        super().__init__()

        def trunk():
            return nn.Sequential(
                layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
                layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
                layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
                nn.Flatten(), layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
            )

        self.actor = nn.Sequential(trunk(), layer_init(nn.Linear(512, num_actions), std=0.01))
        self.critic = nn.Sequential(trunk(), layer_init(nn.Linear(512, 1), std=1))

    def forward(self, x):
        x = x * (1.0 / 255.0)
        return self.actor(x), self.critic(x)

"""
IMPALA = """    def __init__(self, num_actions, frame_stack=4, screen_size=84):
        super().__init__()

        def residual(channels):
            return Residual(nn.Sequential(
                nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1),
                nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1),
            ))

        layers, channels = [], 4
        for out in (16, 32, 32):
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.MaxPool2d(3, 2, 1), residual(out), residual(out)]
            channels = out
        self.network = nn.Sequential(*layers, nn.Flatten(), nn.ReLU(), nn.Linear(32 * 11 * 11, 256), nn.ReLU())
        self.actor = layer_init(nn.Linear(256, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(256, 1), std=1)

    def forward(self, x):
        hidden = self.network(x * (1.0 / 255.0))
        return self.actor(hidden), self.critic(hidden)

"""
RESIDUAL = """class Residual(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return x + self.block(x)


class Agent(nn.Module):"""
RETURN = "            return self.actor(hidden), self.critic(hidden)"
FORWARD_EDITED = "Agent.forward differs from kernels.FUSED_FORWARD"
# The edits of issue-style reports: name -> (replacements, the first line's reason when the
# general step runs them, or the one line a refusal prints)
MORE_EDITS = {
    "mlp-actor": (
        [("self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)",
          "self.actor = nn.Sequential(layer_init(nn.Linear(512, 256)), nn.Tanh(), "
          "layer_init(nn.Linear(256, num_actions), std=0.01))")],
        "agent.actor is Sequential, the fused step computes Linear(in_features=512, out_features=4, bias=True)",
    ),
    "separate-trunks": ([(BODY, TRUNKS)], "the agent has no .network"),
    "no-network-attribute": ([("self.network", "self.body")], "the agent has no .network"),
    "impala": ([(BODY, IMPALA), ("class Agent(nn.Module):", RESIDUAL)], "network[0] is Conv2d(4, 16, kernel_size="
               "(3, 3), stride=(1, 1), padding=(1, 1)), the fused step computes Conv2d(4, 32, kernel_size=(8, 8), "
               "stride=(4, 4))"),
    "temperature-2": ([(RETURN, RETURN.replace("self.actor(hidden)", "self.actor(hidden) / 2"))], FORWARD_EDITED),
    "temperature-1.02": ([(RETURN, RETURN.replace("self.actor(hidden)", "self.actor(hidden) / 1.02"))],
                         FORWARD_EDITED),
    # a clamp that an untrained policy's logits never reach: only training would show it
    "clamped-logits": ([(RETURN, RETURN.replace("self.actor(hidden)", "self.actor(hidden).clamp(-4, 4)"))],
                       FORWARD_EDITED),
    "dropout": (
        [("            nn.GELU(),\n        )", "            nn.GELU(),\n            nn.Dropout(0.1),\n        )")],
        "error: policy: Agent.forward gives different outputs for the same frames (a random layer, such as dropout?)",
    ),
    "batchnorm": (
        [("            nn.GELU(),\n        )", "            nn.GELU(),\n            nn.BatchNorm1d(512),\n        )")],
        "error: policy: Agent.forward's output for a frame depends on the other frames in its batch (BatchNorm?)",
    ),
    "learner-clamps-logits": (
        [("Categorical(logits=logits.float(),", "Categorical(logits=logits.float().clamp(-4, 4),")],
        "error: policy: Agent.get_action_and_value: its log-probs are 0.9 from those of forward()'s logits, or its "
        "value is not forward()'s; get_action_and_value must sample from forward()'s logits",
    ),
}  # fmt: skip
ALL_EDITS = EDITS | MORE_EDITS


def edited_copy(script, edit, where):
    """The script with the edit applied, written to `where` (it imports kernels and utils from
    the repository, as a copy beside them would)."""
    text = (ROOT / script).read_text()
    for old, new, *count in ALL_EDITS[edit][0]:
        if old == BODY:
            old = text[text.index(BODY[0]) : text.index(BODY[1])]
        assert old in text, f"{edit}: {old!r} not in {script}"
        text = text.replace(old, new, *count)
    path = where / f"{script.removesuffix('.py')}_{edit.replace('-', '_').replace('.', '_')}.py"
    path.write_text(text)
    return path


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def frames():
    return utils.probe_frames("Breakout-v5", default_game(), 4, torch.device("cpu"))


def collect(agent, policy, driver, num_envs=4, num_batches=2, T=6, seed=3):
    """One rollout of T steps on CPU through utils.BatchedRollout; returns its storage and
    the uniforms it drew."""
    envs = utils.ThreadedAtariEnvs("Breakout-v5", num_envs, num_batches, num_envs, seed, default_game())
    storage = rollout_storage(T, num_envs)
    rollout = utils.BatchedRollout(
        envs, policy, **storage, driver=driver, cuda_graphs=False, profiler=utils.Profiler(False)
    )
    rollout.start()
    torch.manual_seed(seed)
    assert rollout.collect()
    rollout.close()
    envs.close()
    return storage["obs"], storage["actions"], storage["logprobs"], storage["values"], rollout.uniforms


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_unedited_agent_takes_the_fused_step(script, frames):
    module = load(ROOT / script)
    torch.manual_seed(0)
    policy = kernels.rollout_policy("auto", module.Agent(4), torch.float32, frames, 4)
    assert policy.name == "fused" and policy.reason is None
    assert kernels.rollout_policy("module", module.Agent(4), torch.float32, frames, 4).name == "module"


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_edited_network_runs_its_own_forward_in_the_rollout(script, edit, frames, tmp_path):
    """auto takes the module path and says why; fused is refused with that reason; a rollout
    (each driver) stores the log-probs and values the edited learner computes for its actions,
    and each step's actions are the inverse CDF of that step's uniforms."""
    module = load(edited_copy(script, edit, tmp_path))
    torch.manual_seed(0)
    agent = module.Agent(4).to(memory_format=torch.channels_last)
    policy = kernels.rollout_policy("auto", agent, torch.float32, frames, 4)
    assert policy.name == "module" and policy.reason == EDITS[edit][1]
    with pytest.raises(kernels.PolicyMismatch, match=re.escape(f"--policy fused: {EDITS[edit][1]}; use")):
        kernels.rollout_policy("fused", agent, torch.float32, frames, 4)
    runs = [collect(agent, policy, driver) for driver in ("threads", "single", "sequential")]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0])), "the drivers differ"
    obs, actions, logprobs, values, uniforms = runs[0]
    T, N = actions.shape[0] - 1, actions.shape[1]
    with torch.no_grad():
        _, newlogprob, _, newvalue = agent.get_action_and_value(obs.flatten(0, 1), actions.flatten())
        logits, _ = agent(obs.flatten(0, 1))
    torch.testing.assert_close(newlogprob.view(T + 1, N), logprobs, rtol=0, atol=1e-5)  # PPO's first ratio is 1
    torch.testing.assert_close(newvalue.view(T + 1, N), values, rtol=1e-5, atol=1e-5)
    cdf = logits.softmax(-1).cumsum(-1)
    expected = torch.searchsorted(cdf, uniforms.flatten()[:, None] * cdf[:, -1:], right=True).view(T + 1, N)
    assert torch.equal(expected.clamp(max=3), actions)


def test_get_action_and_value_that_samples_from_other_logits_is_refused(frames, tmp_path):
    """The module path samples from Agent.forward's logits: a learner whose get_action_and_value
    uses other ones (here a temperature) would train another policy, so the run stops."""
    path = tmp_path / "native_temperature.py"
    text = (ROOT / "ppo_atari_native.py").read_text()
    path.write_text(text.replace("Categorical(logits=logits.float(),", "Categorical(logits=logits.float() / 2,"))
    agent = load(path).Agent(4)
    for choice in ("auto", "module"):
        with pytest.raises(kernels.PolicyMismatch, match="get_action_and_value must sample from forward"):
            kernels.rollout_policy(choice, agent, torch.float32, frames, 4)


def test_an_edited_network_in_bf16_runs_under_autocast_as_the_learner(frames, tmp_path):
    module = load(edited_copy("ppo_atari_native.py", "layernorm", tmp_path))
    torch.manual_seed(0)
    agent = module.Agent(4).to(memory_format=torch.channels_last)
    policy = kernels.rollout_policy("auto", agent, torch.bfloat16, frames, 4)
    obs, actions, logprobs, _, _ = collect(agent, policy, "threads")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, newlogprob, _, _ = agent.get_action_and_value(obs.flatten(0, 1), actions.flatten())
    torch.testing.assert_close(newlogprob.view_as(logprobs), logprobs, rtol=0, atol=1e-5)


TINY_PPO = ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "1", "--update-epochs", "1"]


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_native_ppo_trains_with_first_ratio_one(edit, tmp_path):
    """End to end, fp32: every update's single minibatch starts at ratio 1."""
    path = edited_copy("ppo_atari_native.py", edit, tmp_path)
    args = [*TINY_PPO, "--total-timesteps", "256", "--precision", "fp32", "--runs-dir", tmp_path / "runs"]
    result = run_script(path, *args, env={"PYTHONPATH": str(ROOT)})
    assert f", policy module ({EDITS[edit][1]});" in result.stdout.splitlines()[0]
    kls = [kl for _, kl in read_scalars(run_dir_of(result))["losses/old_approx_kl"]]
    assert len(kls) == 2 and all(abs(kl) < 1e-5 for kl in kls), kls


@pytest.mark.parametrize("edit", ["relu-hidden", "fourth-conv"])
def test_an_edited_a2c_trains_end_to_end(edit, tmp_path):
    path = edited_copy("a2c_atari.py", edit, tmp_path)
    args = ["--num-envs", "4", "--num-steps", "5", "--total-timesteps", "200", "--runs-dir", tmp_path / "runs"]
    result = run_script(path, *args, "--precision", "fp32", env={"PYTHONPATH": str(ROOT)})
    assert f", policy module ({EDITS[edit][1]});" in result.stdout.splitlines()[0]
    assert (run_dir_of(result) / "model.pt").is_file()


@pytest.mark.parametrize("script", SCRIPTS)
def test_policy_fused_on_an_edited_network_exits_2_with_one_line(script, tmp_path):
    path = edited_copy(script, "relu-hidden", tmp_path)
    result = run_script(path, "--policy", "fused", "--runs-dir", tmp_path / "runs", env={"PYTHONPATH": str(ROOT)},
                        check=False)  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: --policy fused: {EDITS['relu-hidden'][1]}; use --policy auto or module"
    ]
    assert not (tmp_path / "runs").exists()


def test_an_edited_network_stops_and_resumes(tmp_path, monkeypatch):
    """Ctrl-C after the first iteration, then the printed resume command, on the module path."""
    path = edited_copy("ppo_atari_native.py", "layernorm", tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    args = [*TINY_PPO, "--total-timesteps", "512", "--precision", "fp32", "--runs-dir", tmp_path / "runs"]
    stopped = stop_after_first_progress(path, args, signal.SIGINT)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    match = re.search(r"resume with: python \S+ (.+)", stopped.stdout)
    assert match, stopped.stdout[-2000:]
    resumed = run_script(path, *shlex.split(match.group(1)))
    assert "policy module" in resumed.stdout.splitlines()[0]
    state = torch.load(run_dir_of(resumed) / "model.pt", weights_only=True)
    assert state["global_step"] == 512


# ----------------------------------------------------------------------------- every edit, both precisions
def learner_gap(agent, obs, actions, logprobs, dtype):
    """What the run-long guard measures: the mean |difference| between the rollout's stored
    log-probs and the learner's for the same actions (bf16: under autocast, as the update runs);
    and the approx_kl of ratio = exp(difference)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        _, newlogprob, _, _ = agent.get_action_and_value(obs.flatten(0, 1), actions.flatten())
    logratio = newlogprob.view_as(logprobs) - logprobs
    return logratio.abs().mean().item(), ((logratio.exp() - 1) - logratio).mean().item()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("edit", MORE_EDITS)
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_edit_runs_its_own_network_or_is_refused_in_one_line(script, edit, precision, frames, tmp_path):
    """--policy auto routes each edit to the general step with its reason, and its first rollout's
    log-probs are the learner's (the guard's gap within its bound, approx_kl ~0); or it refuses
    the network with one line. --policy fused refuses every edit."""
    module = load(edited_copy(script, edit, tmp_path))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    agent = module.Agent(4).to(memory_format=torch.channels_last)
    expected = MORE_EDITS[edit][1]
    if expected.startswith("error: "):
        for choice in ("auto", "fused", "module"):
            with pytest.raises(kernels.PolicyMismatch) as refused:
                kernels.rollout_policy(choice, agent, dtype, frames, 4)
            assert "error: " + re.sub(r"are \d\S* from", "are 0.9 from", str(refused.value)) == expected
        return
    policy = kernels.rollout_policy("auto", agent, dtype, frames, 4)
    assert (policy.name, policy.reason) == ("module", expected)
    with pytest.raises(kernels.PolicyMismatch, match=re.escape(f"--policy fused: {expected}; use")):
        kernels.rollout_policy("fused", agent, dtype, frames, 4)
    obs, actions, logprobs, _, _ = collect(agent, policy, "threads")
    gap, approx_kl = learner_gap(agent, obs, actions, logprobs, dtype)
    print(f"{script} {edit} {precision}: gap {gap:.2e} approx_kl {approx_kl:.2e}")
    assert gap <= utils.LOGPROB_GAP_BOUND[precision] and abs(approx_kl) < 1e-7, (gap, approx_kl)


# end to end: PPO runs every edit (each in one precision, the in bf16), A2C three of them
TRAINED = [("ppo_atari_native.py", edit, "bf16" if edit in ("mlp-actor", "temperature-2", "impala", "dropout")
            else "fp32") for edit in MORE_EDITS]  # fmt: skip
TRAINED += [("a2c_atari.py", "mlp-actor", "bf16"), ("a2c_atari.py", "separate-trunks", "fp32"),
            ("a2c_atari.py", "dropout", "fp32")]  # fmt: skip
A2C_TINY = ["--num-envs", "4", "--num-steps", "5", "--total-timesteps", "40"]


@pytest.mark.parametrize("script, edit, precision", TRAINED)
def test_an_edited_copy_trains_with_the_learners_policy_or_exits_2(script, edit, precision, tmp_path):
    """The user's command on an edited copy: the first line names the general step and why, and
    the first iteration's losses/rollout_logprob_gap is within its bound (PPO: old_approx_kl ~0);
    or one error line, exit code 2, and no run directory."""
    path = edited_copy(script, edit, tmp_path)
    tiny = [*TINY_PPO, "--total-timesteps", "256"] if script.startswith("ppo") else A2C_TINY
    args = [*tiny, "--precision", precision, "--runs-dir", tmp_path / "runs"]
    result = run_script(path, *args, env={"PYTHONPATH": str(ROOT)}, check=False)
    expected = MORE_EDITS[edit][1]
    if expected.startswith("error: "):
        assert result.returncode == 2, result.stderr[-2000:]
        assert [re.sub(r"are \d\S* from", "are 0.9 from", line) for line in result.stderr.splitlines()] == [expected]
        assert not (tmp_path / "runs").exists()
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert f", {precision}, " in result.stdout.splitlines()[0]
    assert f", policy module ({expected});" in result.stdout.splitlines()[0]
    scalars = read_scalars(run_dir_of(result))
    gap = scalars["losses/rollout_logprob_gap"][0][1]
    assert gap <= utils.LOGPROB_GAP_BOUND[precision], gap
    if script.startswith("ppo"):
        assert abs(scalars["losses/old_approx_kl"][0][1]) < 1e-6


# from iteration 2 on, the rollout acts with other weights than the learner trains
OTHER_WEIGHTS = """        if iteration == 2:  # (the test's fault)
            import copy, functools
            other = copy.deepcopy(agent)
            torch.nn.init.normal_(other.actor.weight, std=0.1)
            policy.step = functools.partial(kernels.module_policy_step, other)
        rollout_start = time.perf_counter()
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_guard_stops_a_rollout_that_samples_other_weights_at_that_iteration(script, tmp_path):
    """A rollout that samples from other weights than the learner's (here from iteration 2) is
    stopped in that iteration: one line naming it and the gap, exit code 1, the checkpoint of
    iteration 1 kept; iteration 1's gap was logged and within the bound."""
    path = tmp_path / f"faulty_{script}"
    text = (ROOT / script).read_text()
    assert text.count("        rollout_start = time.perf_counter()\n") == 1
    path.write_text(text.replace("        rollout_start = time.perf_counter()\n", OTHER_WEIGHTS))
    tiny = [*TINY_PPO, "--total-timesteps", "512"] if script.startswith("ppo") else [*A2C_TINY, "--log-interval", "1"]
    args = [*tiny, "--precision", "fp32", "--save-interval", "1", "--runs-dir", tmp_path / "runs"]
    result = run_script(path, *args, env={"PYTHONPATH": str(ROOT)}, check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    run_dir = next((tmp_path / "runs").iterdir())
    line = (
        r"error: the rollout sampled another policy than the learner's \(log-probs (\S+) apart, bound 0\.001\) "
        rf"at iteration 2; the last good checkpoint is {re.escape(str(run_dir / 'checkpoint.pt'))}"
    )
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(line, lines[0]), lines
    assert float(re.fullmatch(line, lines[0])[1]) > 0.01
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["iteration"] == 1
    gaps = read_scalars(run_dir)["losses/rollout_logprob_gap"]
    assert len(gaps) == 2 and gaps[0][1] < 1e-6 and gaps[1][1] > 0.01, gaps


# ----------------------------------------------------------------------------- the fused check
def _extra_parameter(agent):
    agent.temperature = torch.nn.Parameter(torch.ones(()))


def _head_parameter(agent):
    agent.actor.register_parameter("scale", torch.nn.Parameter(torch.ones(())))


def _subclassed_layer(agent):
    class Conv2d(torch.nn.Conv2d):  # the same repr as torch's
        pass

    old = agent.network[4]
    agent.network[4] = Conv2d(64, 64, 3, stride=1)
    agent.network[4].load_state_dict(old.state_dict())


CHANGES = {
    "parameter": (_extra_parameter, "agent.temperature is a parameter the fused step does not read"),
    "head parameter": (_head_parameter, "agent.actor.scale is a parameter the fused step does not read"),
    "buffer": (lambda agent: agent.register_buffer("scale", torch.ones(())),
               "agent.scale is a buffer the fused step does not read"),
    "hook": (lambda agent: agent.network[7].register_forward_hook(lambda m, i, o: o * 2),
             "agent.network.7 has a forward hook, which the fused step does not run"),
    "pre-hook": (lambda agent: agent.register_forward_pre_hook(lambda m, i: None),
                 "the agent has a forward hook, which the fused step does not run"),
    "instance forward": (lambda agent: setattr(agent.critic, "forward", lambda x: x.sum(1, keepdim=True)),
                         "agent.critic has a forward of its own"),
    "subclassed layer": (_subclassed_layer, "agent.network.4 is a _subclassed_layer.<locals>.Conv2d from "
                         "test_network, not torch's layer"),
}  # fmt: skip


@pytest.mark.parametrize("change", CHANGES)
def test_the_fused_check_reads_the_whole_agent(change, frames):
    """A change outside the layer list (an agent-level parameter or buffer, a hook, a forward of
    an instance's own, a subclassed layer) takes the general step and is named."""
    torch.manual_seed(0)
    agent = native.Agent(4).to(memory_format=torch.channels_last)
    assert kernels.fused_mismatch(agent, 4) is None
    apply, reason = CHANGES[change]
    apply(agent)
    assert kernels.fused_mismatch(agent, 4) == reason
    policy = kernels.rollout_policy("auto", agent, torch.float32, frames, 4)
    assert (policy.name, policy.reason) == ("module", reason)


def test_the_fused_check_sees_a_patched_layer_class_and_a_global_hook(frames, monkeypatch):
    agent = native.Agent(4)
    monkeypatch.setattr(torch.nn.GELU, "forward", lambda self, x: torch.nn.functional.gelu(x).clamp(max=6))
    assert kernels.fused_mismatch(agent, 4) == "agent.network.8's class GELU has an edited forward"
    monkeypatch.undo()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        reason = kernels.fused_mismatch(agent, 4)
        assert reason == "a global forward hook is registered, which the fused step does not run"
    finally:
        handle.remove()
    assert kernels.fused_mismatch(agent, 4) is None


def test_the_fused_check_follows_the_frame_stack_and_size():
    """The fused step computes the Nature CNN for the run's stack and frame size: the Agent built
    for them, not one built for other frames (the first layer's channels, the flattened size)."""
    assert kernels.fused_mismatch(native.Agent(4, 2, 96), 4, (2, 96, 96)) is None
    assert kernels.fused_mismatch(native.Agent(4), 4, (2, 96, 96)) == (
        "network[0] is Conv2d(4, 32, kernel_size=(8, 8), stride=(4, 4)), the fused step computes "
        "Conv2d(2, 32, kernel_size=(8, 8), stride=(4, 4))"
    )
    assert kernels.fused_mismatch(native.Agent(4, 4, 64), 4, (4, 84, 84)) == (
        "network[7] is Linear(in_features=1024, out_features=512, bias=True), the fused step computes "
        "Linear(in_features=3136, out_features=512, bias=True)"
    )


def test_the_probe_compares_where_policies_differ_not_at_the_untrained_policy(frames, monkeypatch):
    """A fused step that computes logits / 1.02 (wrong only where logits differ): on the untrained
    agent it is within the probe's tolerance, so the probe runs on a copy whose logits span
    several units, in float32, and auto takes the general step."""
    heads = kernels.policy_value_heads

    def tempered(*args, **kwargs):
        logits, value = heads(*args, **kwargs)
        return logits.div_(1.02), value

    monkeypatch.setattr(kernels, "policy_value_heads", tempered)
    torch.manual_seed(0)
    agent = native.Agent(4).to(memory_format=torch.channels_last)
    fused = functools.partial(kernels.policy_step, kernels.inference_weights(agent, torch.float32))
    assert kernels.probe_mismatch(fused, agent, frames, torch.float32, 1e-4, 4) is None  # hidden at init
    policy = kernels.rollout_policy("auto", agent, torch.float32, frames, 4)
    assert policy.name == "module" and policy.reason.startswith("the fused step and Agent.forward give log-probs 0.0")
    spread = kernels.spread_copy(agent, frames)
    with torch.no_grad():
        assert spread(frames)[0].std(1).mean() > 2  # logits that span several units
