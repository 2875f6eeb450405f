"""a2c_atari.py: the optimizer against a hand computation, and the script end to end (its returns and
update: tests/test_algorithm.py)."""

import re
import shlex
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import assert_all_tags, read_scalars, run_dir_of, run_script, stop_after_first_progress

import a2c_atari as a2c

A2C_TAGS = [
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/learning_rate",
    "charts/SPS",
    "losses/value_loss",
    "losses/policy_loss",
    "losses/entropy",
    "losses/explained_variance",
]


@pytest.mark.parametrize("alpha, eps", [(0.99, 1e-5), (0.5, 0.1)])
def test_rmsprop_tf_equals_hand_computation(alpha, eps):
    """v starts at ones, v = alpha v + (1 - alpha) g^2, p -= lr g / sqrt(v + eps): three steps
    checked against float64 numpy. The second case makes eps and the start value matter."""
    torch.manual_seed(0)
    lr = 0.05
    params = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    optimizer = a2c.RMSpropTF(params, lr=lr, alpha=alpha, eps=eps)
    expected = [p.detach().double().numpy().copy() for p in params]
    square_avg = [np.ones_like(e) for e in expected]
    for _ in range(3):
        grads = [torch.randn_like(p) * 0.3 for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        for i, g in enumerate(grads):
            g = g.double().numpy()
            square_avg[i] = alpha * square_avg[i] + (1 - alpha) * g * g
            expected[i] = expected[i] - lr * g / np.sqrt(square_avg[i] + eps)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), torch.from_numpy(e), rtol=1e-6, atol=1e-7)
    # and it is not PyTorch's RMSprop (zeros start, eps outside the root)
    torch_params = [torch.zeros(3, requires_grad=True)]
    torch_params[0].grad = torch.full((3,), 0.3)
    torch.optim.RMSprop(torch_params, lr=lr, alpha=alpha, eps=eps).step()
    ours = [torch.zeros(3, requires_grad=True)]
    ours[0].grad = torch.full((3,), 0.3)
    a2c.RMSpropTF(ours, lr=lr, alpha=alpha, eps=eps).step()
    assert not torch.allclose(ours[0], torch_params[0])


def test_a2c_runs_and_writes_every_tag(runs_dir):
    """4 envs x 500 steps: enough for random-ish Breakout games (about 200 steps) to end."""
    args = ["--num-envs", "4", "--num-steps", "5", "--total-timesteps", "2000", "--log-interval", "20"]
    result = run_script("a2c_atari.py", *args, "--runs-dir", runs_dir)
    run_dir = run_dir_of(result)
    assert run_dir.name.startswith("Breakout-v5__a2c_atari__1__")
    scalars = read_scalars(run_dir)
    assert_all_tags(scalars, A2C_TAGS)
    assert [step for step, _ in scalars["charts/SPS"]] == [400, 800, 1200, 1600, 2000]
    assert [value for _, value in scalars["charts/learning_rate"]] == pytest.approx([7e-4] * 5)  # constant
    assert (run_dir / "model.pt").is_file()
    assert (run_dir / "checkpoint.pt").is_file()
    state = torch.load(run_dir / "model.pt", weights_only=False)
    assert state["script"] == "a2c_atari.py" and state["iteration"] == 100 and state["global_step"] == 2000


def test_a2c_bf16_stop_and_resume_as_tensorboard_shows_it(runs_dir):
    """bf16 runs; Ctrl-C after the first progress line, then the printed resume command: what
    TensorBoard shows (it hides steps >= the resumed writer's purge_step) is one point per
    iteration, the checkpointed iteration's included, as in an uninterrupted run, and with
    --anneal-lr every iteration's rate on the schedule, 7e-4 * (1 - (iteration - 1) / 20)."""
    args = ["--num-envs", "4", "--num-steps", "5", "--total-timesteps", "400", "--log-interval", "1", "--anneal-lr"]
    stopped = stop_after_first_progress(
        "a2c_atari.py", [*args, "--precision", "bf16", "--runs-dir", runs_dir], signal.SIGINT, timeout=120
    )
    stdout, err = stopped.stdout, stopped.stderr
    assert stopped.returncode == 0 and "Traceback" not in err, err[-2000:]
    match = re.search(r"stopped by SIGINT at step ([\d,]+); resume with: python a2c_atari.py (.+)", stdout)
    assert match and int(match.group(1).replace(",", "")) < 400, stdout[-2000:]
    resumed = run_script("a2c_atari.py", *shlex.split(match.group(2)))
    run_dir = run_dir_of(resumed)
    assert run_dir == run_dir_of(SimpleNamespace(stdout=stdout)) and (run_dir / "model.pt").is_file()
    assert_all_tags(read_scalars(run_dir), [t for t in A2C_TAGS if not t.startswith("charts/episodic")])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shown = EventAccumulator(str(run_dir)).Reload()
    assert [e.step for e in shown.Scalars("charts/SPS")] == list(range(20, 401, 20))
    rates = shown.Scalars("charts/learning_rate")
    assert [e.step for e in rates] == list(range(20, 401, 20))
    assert [e.value for e in rates] == pytest.approx([7e-4 * (1 - i / 20) for i in range(20)], rel=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-envs", "6", "--num-gpu-batches", "4"], "--num-envs 6 is not divisible by --num-gpu-batches 4"),
        (["--env-id", "Breakoutt-v5"], "did you mean Breakout-v5"),
        (["--log-interval", "0"], "--log-interval must be at least 1"),
        (["--total-timesteps", "50"], "below one batch (512 steps)"),
        (["--optimizer", "adam"], "--optimizer"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    result = run_script("a2c_atari.py", *args, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
