"""Change the network in a copy of a native script, as a researcher would, and the rollout runs
that network: the fused step only for the network it mirrors, else the Agent's own forward,
whose log-probs equal the learner's. Copies of ppo_atari_native.py and a2c_atari.py with an
edited Agent: GELU -> ReLU, a LayerNorm appended, hidden width 256, a fourth convolution, a
different activation between the convolutions."""

import importlib.util
import re
import shlex
import signal

import pytest
import torch
from conftest import ROOT, read_scalars, rollout_storage, run_dir_of, run_script, stop_after_first_progress

import kernels
import utils

SCRIPTS = ["ppo_atari_native.py", "a2c_atari.py"]
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
        [("nn.Linear(64 * 7 * 7, 512)", "nn.Linear(64 * 7 * 7, 256)"), ("nn.Linear(512, ", "nn.Linear(256, ")],
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


def edited_copy(script, edit, where):
    """The script with the edit applied, written to `where` (it imports kernels and utils from
    the repository, as a copy beside them would)."""
    text = (ROOT / script).read_text()
    for old, new, *count in EDITS[edit][0]:
        assert old in text, f"{edit}: {old!r} not in {script}"
        text = text.replace(old, new, *count)
    path = where / f"{script.removesuffix('.py')}_{edit.replace('-', '_')}.py"
    path.write_text(text)
    return path


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def frames():
    return utils.probe_frames("Breakout-v5", 4, torch.device("cpu"))


def collect(agent, policy, driver, num_envs=4, num_batches=2, T=6, seed=3):
    """One rollout of T steps on CPU through utils.BatchedRollout; returns its storage and
    the uniforms it drew."""
    envs = utils.ThreadedAtariEnvs("Breakout-v5", num_envs, num_batches, num_envs, seed)
    storage = rollout_storage(T, num_envs)
    rollout = utils.BatchedRollout(envs, policy, **storage, driver=driver, cuda_graphs=False)
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
    policy = kernels.rollout_policy("auto", module.Agent(4), torch.float32, frames)
    assert policy.name == "fused" and policy.reason is None
    assert kernels.rollout_policy("module", module.Agent(4), torch.float32, frames).name == "module"


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_edited_network_runs_its_own_forward_in_the_rollout(script, edit, frames, tmp_path):
    """auto takes the module path and says why; fused is refused with that reason; a rollout
    (each driver) stores the log-probs and values the edited learner computes for its actions,
    and each step's actions are the inverse CDF of that step's uniforms."""
    module = load(edited_copy(script, edit, tmp_path))
    torch.manual_seed(0)
    agent = module.Agent(4).to(memory_format=torch.channels_last)
    policy = kernels.rollout_policy("auto", agent, torch.float32, frames)
    assert policy.name == "module" and policy.reason == EDITS[edit][1]
    with pytest.raises(kernels.PolicyMismatch, match=re.escape(f"--policy fused: {EDITS[edit][1]}; use")):
        kernels.rollout_policy("fused", agent, torch.float32, frames)
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
    path.write_text(text.replace("Categorical(logits=logits,", "Categorical(logits=logits / 2,"))
    agent = load(path).Agent(4)
    for choice in ("auto", "module"):
        with pytest.raises(kernels.PolicyMismatch, match="get_action_and_value must sample from forward"):
            kernels.rollout_policy(choice, agent, torch.float32, frames)


def test_an_edited_network_in_bf16_runs_under_autocast_as_the_learner(frames, tmp_path):
    module = load(edited_copy("ppo_atari_native.py", "layernorm", tmp_path))
    torch.manual_seed(0)
    agent = module.Agent(4).to(memory_format=torch.channels_last)
    policy = kernels.rollout_policy("auto", agent, torch.bfloat16, frames)
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
