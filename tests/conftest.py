"""Helpers for the tests: run a script as a user would, read what it wrote to TensorBoard."""

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TAGS = [
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/learning_rate",
    "charts/SPS",
    "losses/value_loss",
    "losses/policy_loss",
    "losses/entropy",
    "losses/old_approx_kl",
    "losses/approx_kl",
    "losses/clipfrac",
    "losses/explained_variance",
]

# tiny budgets: a few iterations, enough for full Breakout games to end in them
TINY = ["--num-envs", "4", "--num-steps", "64", "--num-minibatches", "4", "--total-timesteps", "1024"]


def script_env(**extra):
    """The environment for running a script: test_kernels sets TRITON_INTERPRET=1 for this
    process, but scripts must run as users run them (the interpreter would be very slow)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env.update(extra)
    return env


def stop_after_first_progress(script, args, sig, timeout=300, env=None):
    """Run `python script args`, send `sig` at its first progress line (the end of its first
    iteration), and wait for it to exit; returns its returncode, stdout and stderr. stderr goes
    to a file: a child that filled an unread pipe (TORCH_LOGS) would block before that line."""
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, env=script_env(**(env or {})),
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "SPS:" in line:
                    proc.send_signal(sig)
                    break
            out, _ = proc.communicate(timeout=timeout)
        finally:
            proc.kill()
        stderr.seek(0)
        err = stderr.read()
    return SimpleNamespace(returncode=proc.returncode, stdout="".join(lines) + out, stderr=err)


def run_script(script, *args, timeout=600, env=None, check=True):
    """Run `python script args` from the repository root; returns the CompletedProcess."""
    full_env = script_env(**(env or {}))
    result = subprocess.run(
        [sys.executable, str(ROOT / script), *map(str, args)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(f"{script} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def run_dir_of(result) -> Path:
    for line in result.stdout.splitlines():
        if line.startswith("run directory: "):
            return Path(line.removeprefix("run directory: "))
    raise AssertionError(f"no run directory printed:\n{result.stdout[-2000:]}")


def read_scalars(run_dir) -> dict:
    """tag -> list of (step, value) over every event file in run_dir, in file order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    scalars = {}
    for path in sorted(Path(run_dir).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.HasField("tensor") or value.HasField("simple_value"):
                    if value.metadata.plugin_data.plugin_name not in ("", "scalars"):
                        continue
                    number = value.simple_value if value.HasField("simple_value") else _tensor(value.tensor)
                    scalars.setdefault(value.tag, []).append((event.step, number))
    return scalars


def _tensor(tensor):
    from tensorboard.util import tensor_util

    return float(tensor_util.make_ndarray(tensor))


def assert_all_tags(scalars, tags=TAGS):
    missing = [tag for tag in tags if tag not in scalars]
    assert not missing, f"missing tags {missing}; have {sorted(scalars)}"
    for tag in tags:
        bad = [v for _, v in scalars[tag] if not math.isfinite(v)]
        assert not bad, f"{tag} has non-finite values {bad[:5]}"


def default_game(**changes) -> dict:
    """The game every script plays by default (its Args' game block), with `changes`: utils.game_settings."""
    import ppo_atari_baseline
    import utils

    return utils.game_settings(ppo_atari_baseline.Args(**changes))


def rollout_storage(T, N):
    """A native script's rollout storage on CPU (utils.BatchedRollout's keywords), zeroed."""
    import torch

    return dict(
        obs=torch.zeros((T + 1, N, 4, 84, 84), dtype=torch.uint8),
        actions=torch.zeros((T + 1, N), dtype=torch.long),
        logprobs=torch.zeros((T + 1, N)),
        values=torch.zeros((T + 1, N)),
        rewards=torch.zeros((T, N)),
        dones=torch.zeros((T + 1, N)),
    )


def profile_table(stdout):
    """--profile's table in a run's output: (its line index, the progress lines' indices, and
    phase -> share of the host's time in percent, None for a GPU-time row). Exactly one table."""
    lines = stdout.splitlines()
    header = [i for i, line in enumerate(lines) if re.fullmatch(r"phase\s+seconds\s+share", line)]
    assert len(header) == 1, stdout
    rows = {}
    for line in lines[header[0] + 1 :]:
        row = re.fullmatch(r"(.{22})\s*\d+\.\d{3}(?:\s+(\d+\.\d)%|\s*)", line)
        if row is None:
            break
        rows[row[1].strip()] = None if row[2] is None else float(row[2])
    progress = [i for i, line in enumerate(lines) if line.startswith("iter ")]
    return header[0], progress, rows


def worker_cores(worker, workers, cores):
    """The cores pytest-xdist's worker `worker` ("gw0", "gw1", ...) of `workers` keeps to: an
    equal slice of `cores`, the first slices a core larger where they do not divide evenly."""
    cores, index = sorted(cores), int(worker.removeprefix("gw"))
    q, r = divmod(len(cores), workers)
    if q == 0:
        return set(cores)  # fewer cores than workers: all share them
    first = index * q + min(index, r)
    return set(cores[first : first + q + (index < r)])


def tier_cores(worker, workers):
    """The cores GPU-tier worker `worker` of `workers` keeps to: its slice (worker_cores) of as
    many of this process's cores as utils.usable_cores allows, a cgroup CPU quota included."""
    import utils

    usable, _ = utils.usable_cores()
    return worker_cores(worker, workers, sorted(os.sched_getaffinity(0))[:usable])


@pytest.fixture
def runs_dir(tmp_path):
    return tmp_path / "runs"
