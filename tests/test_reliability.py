"""Reliability, for every training script: stop on SIGINT/SIGTERM and resume to the same end,
atomic checkpoints, one clear line for each bad input, evaluation, and a clean stop when
training goes non-finite."""

import functools
import hashlib
import importlib
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, default_game, read_scalars, run_dir_of, run_script, script_env

import utils

# per script: tiny arguments (several iterations), the batch, and how often it logs (iterations)
CONFIGS = {
    "ppo_atari_baseline.py": SimpleNamespace(
        args=["--num-envs", "4", "--num-steps", "16", "--num-minibatches", "2", "--total-timesteps", "320"],
        batch=64, log_every=1, minibatches=True, gpu_batches=False,
    ),
    "ppo_atari_native.py": SimpleNamespace(
        args=["--num-envs", "4", "--num-steps", "16", "--num-minibatches", "2", "--total-timesteps", "320"],
        batch=64, log_every=1, minibatches=True, gpu_batches=True,
    ),
    "a2c_atari.py": SimpleNamespace(
        args=["--num-envs", "4", "--num-steps", "5", "--total-timesteps", "2000", "--log-interval", "20",
              "--anneal-lr"],  # on, as in the PPO scripts: a resume must continue the schedule
        batch=20, log_every=20, minibatches=False, gpu_batches=True,
    ),
}  # fmt: skip
SCRIPTS = [s for s in CONFIGS if (ROOT / s).exists()]
# what each tiny run records in its checkpoint's args (check_resume_args compares these)
CONFIGS_ARGS = {
    script: {
        "num_envs": int(c.args[c.args.index("--num-envs") + 1]),
        "num_steps": int(c.args[c.args.index("--num-steps") + 1]),
        "total_timesteps": int(c.args[c.args.index("--total-timesteps") + 1]),
    }
    for script, c in CONFIGS.items()
}
# the values every script logs once per logged iteration
PER_ITERATION_TAGS = [
    "charts/SPS", "charts/learning_rate", "losses/value_loss", "losses/policy_loss", "losses/entropy",
    "losses/explained_variance",
]  # fmt: skip
STOPPED = re.compile(r"stopped by (SIGINT|SIGTERM) at step ([\d,]+); resume with: (.+)")


def budget(script) -> int:
    config = CONFIGS[script]
    total = int(config.args[config.args.index("--total-timesteps") + 1])
    return total // config.batch * config.batch


def logged_steps(script) -> list:
    """The steps at which an uninterrupted tiny run logs its per-iteration values."""
    config = CONFIGS[script]
    iterations = budget(script) // config.batch
    return [i * config.batch for i in range(1, iterations + 1) if i % config.log_every == 0 or i == iterations]


def learning_rates(script) -> list:
    """The rates an uninterrupted tiny run logs, at logged_steps: CleanRL's linear annealing,
    the default rate times 1 - (iteration - 1) / iterations."""
    config, rate = CONFIGS[script], importlib.import_module(Path(script).stem).Args().learning_rate
    iterations = budget(script) // config.batch
    return [rate * (1 - (step // config.batch - 1) / iterations) for step in logged_steps(script)]


# ----------------------------------------------------------------------------- processes
def process_table() -> dict:
    """pid -> (parent pid, state, start time) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry)] = (int(fields[1]), fields[0], fields[19])
    return table


def descendants(pid) -> set:
    """(pid, start time) of every process below pid: the start time tells a reused pid apart."""
    table, found, todo = process_table(), set(), [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, _, start) in table.items():
            if ppid == parent and (child, start) not in found:
                found.add((child, start))
                todo.append(child)
    return found


def still_running(processes) -> list:
    table = process_table()
    return [pid for pid, start in processes if pid in table and table[pid][2] == start and table[pid][1] != "Z"]


def start_and_stop(script, args, sig, to_group, timeout=400):
    """Start a training run, wait for its first progress line, send `sig` (to its process
    group, as Ctrl-C in a terminal does, or to the main process only, as `kill` does) and
    wait for it to exit. Returns what happened, with the processes it had started."""
    stderr = io.StringIO()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, env=script_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    reader = threading.Thread(target=lambda: stderr.write(proc.stderr.read()))
    reader.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "SPS:" in line:
                break
        assert proc.poll() is None, f"{script} exited before it could be stopped:\n{''.join(lines)}"
        children = descendants(proc.pid)
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        lines.append(proc.stdout.read())
        proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
        reader.join()
    deadline = time.monotonic() + 10
    while still_running(children) and time.monotonic() < deadline:
        time.sleep(0.2)
    stdout = "".join(lines)
    run_dir = run_dir_of(SimpleNamespace(stdout=stdout))
    try:  # now, before a resumed run overwrites it
        checkpoint = utils.load_checkpoint(run_dir / "checkpoint.pt", script)
    except utils.UsageError as e:
        checkpoint = str(e)
    return SimpleNamespace(
        returncode=proc.returncode, stdout=stdout, stderr=stderr.getvalue(), run_dir=run_dir,
        children=children, orphans=still_running(children), checkpoint=checkpoint,
    )  # fmt: skip


def assert_stopped_cleanly(stopped, script, signame):
    assert stopped.returncode == 0, f"exit {stopped.returncode}\n{stopped.stdout[-2000:]}\n{stopped.stderr[-2000:]}"
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    messages = [line for line in stopped.stdout.splitlines() if line.startswith("stopped by")]
    assert len(messages) == 1, stopped.stdout[-2000:]
    match = STOPPED.fullmatch(messages[0])
    assert match and match.group(1) == signame, messages[0]
    step = int(match.group(2).replace(",", ""))
    checkpoint = stopped.checkpoint
    assert isinstance(checkpoint, dict), checkpoint
    # the unfinished rollout was abandoned: the checkpoint is the last full iteration
    assert checkpoint["global_step"] == step == checkpoint["iteration"] * CONFIGS[script].batch
    assert step < budget(script), "the run ended before the signal: give it a bigger budget"
    assert not stopped.orphans, f"processes left behind: {stopped.orphans}"
    return step, shlex.split(match.group(3))


@pytest.fixture(scope="module", params=SCRIPTS)
def stopped_and_resumed(request, tmp_path_factory):
    """Per script: a run stopped by Ctrl-C (SIGINT to the process group) after its first progress
    line, a copy of the checkpoint that stop wrote, and the printed resume command run to the end."""
    script = request.param
    runs_dir = tmp_path_factory.mktemp(f"stop-{Path(script).stem}")
    stopped = start_and_stop(script, [*CONFIGS[script].args, "--runs-dir", runs_dir], signal.SIGINT, to_group=True)
    pristine = tmp_path_factory.mktemp(f"pristine-{Path(script).stem}") / "checkpoint.pt"
    if (stopped.run_dir / "checkpoint.pt").is_file():
        shutil.copy(stopped.run_dir / "checkpoint.pt", pristine)
    resumed = resumed_again = None
    match = STOPPED.search(stopped.stdout)
    if match:
        command = shlex.split(match.group(3))
        resumed = run_script(command[1], *command[2:], check=False)
        if pristine.is_file():  # the same resume again, from a copy of the checkpoint in a directory of its own
            again = tmp_path_factory.mktemp(f"again-{Path(script).stem}") / "checkpoint.pt"
            shutil.copy(pristine, again)
            resumed_again = run_script(command[1], *command[2:-1], again, check=False)
    return SimpleNamespace(
        script=script, stopped=stopped, resumed=resumed, pristine=pristine, resumed_again=resumed_again
    )


# ----------------------------------------------------------------------------- 1. stop and resume
def test_sigint_then_resume_ends_where_an_uninterrupted_run_does(stopped_and_resumed):
    """Stopped by Ctrl-C and resumed, a run ends at the step an uninterrupted one does and logs
    what it logs: every per-iteration value once, at the same steps, and the learning rate of
    every logged iteration on the annealing schedule (annealing on in every tiny config)."""
    script, stopped, resumed = stopped_and_resumed.script, stopped_and_resumed.stopped, stopped_and_resumed.resumed
    step, command = assert_stopped_cleanly(stopped, script, "SIGINT")
    if script == "ppo_atari_baseline.py":
        assert len(stopped.children) >= 4, "async mode: one worker process per env"
    assert command[:2] == ["python", script] and command[-2:] == ["--resume", str(stopped.run_dir / "checkpoint.pt")]

    assert resumed.returncode == 0, f"{resumed.stdout[-2000:]}\n{resumed.stderr[-3000:]}"
    assert run_dir_of(resumed) == stopped.run_dir  # the same run continues
    assert (stopped.run_dir / "model.pt").is_file()
    assert utils.load_checkpoint(stopped.run_dir / "model.pt", script)["global_step"] == budget(script)

    scalars = read_scalars(stopped.run_dir)
    assert len(list(stopped.run_dir.glob("events.out.tfevents.*"))) == 2
    for tag in PER_ITERATION_TAGS:  # every event, the stopped run's and the resumed run's, as an uninterrupted run
        assert [s for s, _ in scalars[tag]] == logged_steps(script), f"{tag}, stopped at {step}"
    # the schedule goes on where it was: a restarted one would log the first rate again
    rates = [rate for _, rate in scalars["charts/learning_rate"]]
    assert rates == pytest.approx(learning_rates(script), rel=1e-6), f"stopped at {step}"


def test_two_resumes_from_one_checkpoint_end_with_the_same_weights(stopped_and_resumed):
    """A resumed run cannot equal an uninterrupted one in weights: envs cannot be checkpointed,
    so it reseeds them (from the seed and the iteration) and plays new games. What must hold is
    that a resume depends on nothing but the checkpoint and the command line: the same resume
    run twice ends with the same weights and optimizer state, to the bit, at the same step."""
    script, first, again = stopped_and_resumed.script, stopped_and_resumed.resumed, stopped_and_resumed.resumed_again
    if again is None:
        pytest.fail("the stopped run wrote no checkpoint (see the stop-and-resume test)")
    assert first.returncode == 0 and again.returncode == 0, again.stderr[-3000:]
    ends = [utils.load_checkpoint(run_dir_of(run) / "model.pt", script) for run in (first, again)]
    assert ends[0]["global_step"] == ends[1]["global_step"] == budget(script)
    assert ends[0]["iteration"] == ends[1]["iteration"] == budget(script) // CONFIGS[script].batch
    for name, tensor in ends[0]["model"].items():
        assert torch.equal(tensor, ends[1]["model"][name]), name
    for index, state in ends[0]["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ends[1]["optimizer"]["state"][index][key]))


def test_a_resume_continues_the_optimizer_and_the_random_stream(stopped_and_resumed):
    """What a resume must carry over that the weights alone do not show: the optimizer's state
    (Adam's step count covers every update of the whole run, not only the resumed part), and,
    in the native scripts, torch's random stream: their only draws are each iteration's
    uniforms and minibatch orders, so the end state is the checkpoint's advanced by exactly
    the resumed iterations' draws (a resume that did not restore it would replay the seed's)."""
    script, pristine, resumed = stopped_and_resumed.script, stopped_and_resumed.pristine, stopped_and_resumed.resumed
    if resumed is None or not pristine.is_file():
        pytest.fail("no resumed run (see the stop-and-resume test)")
    start = utils.load_checkpoint(pristine, script)
    end = utils.load_checkpoint(run_dir_of(resumed) / "model.pt", script)
    config, module = CONFIGS[script], importlib.import_module(Path(script).stem)
    iterations = budget(script) // config.batch
    if config.minibatches:  # Adam: one step per minibatch of every epoch of every iteration
        minibatches = int(config.args[config.args.index("--num-minibatches") + 1])
        steps = {float(state["step"]) for state in end["optimizer"]["state"].values()}
        assert steps == {float(iterations * module.Args().update_epochs * minibatches)}, steps
    if config.gpu_batches:  # the native scripts
        T, N = (int(config.args[config.args.index(flag) + 1]) for flag in ("--num-steps", "--num-envs"))
        generator = torch.Generator().manual_seed(0)
        generator.set_state(start["rng"]["torch"])
        for _ in range(iterations - start["iteration"]):
            torch.rand((T + 1, N), generator=generator)
            if config.minibatches:
                for _ in range(module.Args().update_epochs):
                    torch.randperm(T * N, generator=generator)
        assert torch.equal(end["rng"]["torch"], generator.get_state())


@pytest.mark.skipif("ppo_atari_baseline.py" not in SCRIPTS, reason="needs the baseline")
def test_sigterm_stops_cleanly_and_ends_the_env_workers(tmp_path):
    """SIGTERM to the main process only (as `kill` or `timeout` send it); the async env
    workers must go with it."""
    script = "ppo_atari_baseline.py"
    args = [*CONFIGS[script].args, "--vector-mode", "async", "--runs-dir", tmp_path]
    stopped = start_and_stop(script, args, signal.SIGTERM, to_group=False)
    assert len(stopped.children) >= 4
    assert_stopped_cleanly(stopped, script, "SIGTERM")


# ----------------------------------------------------------------------------- 2. checkpoints
KILLED_WRITER = r"""
import io, os, signal, sys
import torch
sys.path.insert(0, sys.argv[2])
import utils

def state(marker):
    weights = torch.full((4_000_000,), float(marker))  # 16 MB: a write that takes a while
    return {"script": "ppo_atari_baseline.py", "env_id": "Breakout-v5", "num_actions": 4, "model": {"w": weights},
            "args": {}, "iteration": marker}

utils.save_checkpoint(sys.argv[1], state(1))
real_save = torch.save

def save_half_then_die(obj, f):  # the machine goes down half-way through the write
    buffer = io.BytesIO()
    real_save(obj, buffer)
    f.write(buffer.getvalue()[: buffer.tell() // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = save_half_then_die
utils.save_checkpoint(sys.argv[1], state(2))
"""


def test_checkpoint_write_killed_half_way_leaves_the_previous_one(tmp_path):
    path = tmp_path / "checkpoint.pt"
    child = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(path), str(ROOT)], capture_output=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert [p.name for p in tmp_path.glob(".checkpoint.pt.tmp*")], "the second write never started"
    state = utils.load_checkpoint(path, "ppo_atari_baseline.py", "Breakout-v5")
    assert state["iteration"] == 1 and bool((state["model"]["w"] == 1).all())


def test_checkpoint_write_that_fails_leaves_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    good = {
        "script": "ppo_atari_baseline.py",
        "env_id": "Breakout-v5",
        "num_actions": 4,
        "model": {},
        "args": {},
        "iteration": 1,
    }
    utils.save_checkpoint(path, good)

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError):
        utils.save_checkpoint(path, {**good, "iteration": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert utils.load_checkpoint(path, "ppo_atari_baseline.py")["iteration"] == 1


def test_load_checkpoint_refuses_bad_files_by_name(tmp_path):
    path = tmp_path / "checkpoint.pt"
    utils.save_checkpoint(
        path,
        {
            "script": "ppo_atari_native.py",
            "env_id": "Pong-v5",
            "num_actions": 6,
            "model": {"w": torch.ones(1000)},
            "args": {},
        },
    )
    data = path.read_bytes()
    cases = {
        "truncated.pt": (data[: len(data) // 2], "corrupt"),
        "empty.pt": (b"", "corrupt"),
        "text.pt": (b"not a checkpoint\n", "corrupt"),
    }
    for name, (content, text) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(utils.UsageError, match=text):
            utils.load_checkpoint(tmp_path / name, "ppo_atari_native.py")
    torch.save({"model": {}}, tmp_path / "foreign.pt")
    with pytest.raises(utils.UsageError, match="not written by these scripts"):
        utils.load_checkpoint(tmp_path / "foreign.pt", "ppo_atari_native.py")
    with pytest.raises(utils.UsageError, match="is from ppo_atari_native.py, not ppo_atari_baseline.py"):
        utils.load_checkpoint(path, "ppo_atari_baseline.py", "Pong-v5")
    with pytest.raises(utils.UsageError, match="is for Pong-v5, not Breakout-v5"):
        utils.load_checkpoint(path, "ppo_atari_native.py", "Breakout-v5")
    with pytest.raises(utils.UsageError, match="does not exist"):
        utils.load_checkpoint(tmp_path / "missing.pt", "ppo_atari_native.py")
    assert utils.load_checkpoint(path, "ppo_atari_native.py", "ALE/Pong-v5")["env_id"] == "Pong-v5"


def test_resume_command_survives_spaces_and_drops_the_old_resume(monkeypatch):
    argv = ["/x/ppo_atari_baseline.py", "--runs-dir", "/tmp/my runs", "--resume", "old.pt", "--seed", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    message = utils.stopped_message(SimpleNamespace(received="SIGINT"), 1234, Path("/tmp/my runs/r/checkpoint.pt"))
    match = STOPPED.fullmatch(message)
    assert match and match.group(2) == "1,234"
    assert shlex.split(match.group(3)) == [
        "python", "ppo_atari_baseline.py", "--runs-dir", "/tmp/my runs", "--seed", "2",
        "--resume", "/tmp/my runs/r/checkpoint.pt",
    ]  # fmt: skip
    # a script of the repository's benchmarks/ is named from the root, where the command runs
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "ppo_atari_slm.py"), "--seed", "2"])
    message = utils.stopped_message(SimpleNamespace(received="SIGTERM"), 1234, Path("r/checkpoint.pt"))
    assert shlex.split(STOPPED.fullmatch(message).group(3))[:2] == ["python", "benchmarks/ppo_atari_slm.py"]


# ----------------------------------------------------------------------------- 3. bad input
def bad_inputs(script):
    """(case, arguments, text the one error line must contain); {files} is a folder of fake
    checkpoints made by `bad_input_results`, {runs} the runs directory they all share (which
    must hold no run directory afterwards)."""
    config = CONFIGS[script]
    other = "ppo_atari_native.py" if script == "ppo_atari_baseline.py" else "ppo_atari_baseline.py"
    cases = [
        ("unknown-game", ["--env-id", "Breakoutt-v5"], "did you mean Breakout-v5"),
        ("no-envs", ["--num-envs", "0"], "--num-envs must be at least 1"),
        ("budget-below-one-batch", ["--num-steps", "8", "--total-timesteps", "16"], "below one batch"),
        ("device-tpu", ["--device", "tpu"], "--device 'tpu'"),
        ("resume-missing", ["--resume", "{files}/missing.pt"], "does not exist"),
        ("resume-corrupt", ["--resume", "{files}/corrupt.pt"], "corrupt"),
        ("resume-other-script", ["--resume", f"{{files}}/{other}"], f"is from {other}"),
        ("resume-other-game", ["--resume", f"{{files}}/pong-{script}"], "is for Pong-v5"),
        ("resume-other-num-envs", ["--resume", f"{{files}}/8-envs-{script}"], "--num-envs 4 differs"),  # tiny: 4
        ("resume-other-game-settings", ["--resume", f"{{files}}/no-sticky-{script}"],
         "--repeat-action-probability 0.25 differs from the checkpoint's 0.0: resume with the same value"),
        ("resume-other-frame-size", ["--resume", f"{{files}}/64-pixels-{script}"],
         "--screen-size 84 differs from the checkpoint's 64: resume with the same value"),
        ("resume-finished-run", ["--resume", f"{{files}}/finished-{script}"], "ends a finished run"),
        ("eval-missing", ["--eval-checkpoint", "{files}/missing.pt"], "does not exist"),
        ("video-without-eval", ["--capture-video"], "--eval-checkpoint"),
        # a checkpoint never runs code, and what is not a checkpoint of the script is refused
        ("eval-payload", ["--eval-checkpoint", "{files}/payload.pt"], "refused, loading it could run code"),
        ("resume-payload", ["--resume", "{files}/payload.pt"], "refused, loading it could run code"),
        ("eval-incomplete", ["--eval-checkpoint", f"{{files}}/incomplete-{script}"], "'num_actions' is missing"),
        ("resume-incomplete", ["--resume", f"{{files}}/no-optimizer-{script}"], "'optimizer' is missing"),
        ("eval-wrong-type", ["--eval-checkpoint", f"{{files}}/string-model-{script}"], "'model' is a str"),
        ("eval-wrong-actions", ["--eval-checkpoint", f"{{files}}/6-actions-{script}"], "has 6 actions, Breakout has 4"),
        ("eval-wrong-shape", ["--eval-checkpoint", f"{{files}}/bad-shape-{script}"], "do not fit the network"),
        ("resume-bad-optimizer", ["--resume", f"{{files}}/bad-optimizer-{script}"], "optimizer state is for another"),
        ("resume-bad-rng", ["--resume", f"{{files}}/bad-rng-{script}"], "RNG states cannot be restored"),
        # every flag checked before anything starts
        ("gamma-2", ["--gamma", "2"], "--gamma must be in [0, 1], got 2.0"),
        ("frame-skip-0", ["--frame-skip", "0"], "--frame-skip must be at least 1, got 0"),
        ("screen-size-35", ["--screen-size", "35"], "--screen-size 35: the network cannot take 35x35 frames"),
        ("exp-name-escapes", ["--exp-name", "../../../escaped"], "not a path"),
        ("misspelled-flag", ["--gama", "0.9"], "perhaps you meant --gamma"),
    ]  # fmt: skip
    if config.minibatches:
        cases += [
            ("minibatches", ["--num-envs", "4", "--num-steps", "5", "--num-minibatches", "3"], "--num-minibatches 3"),
        ]
    if not torch.cuda.is_available():
        cases.append(("device-cuda", ["--device", "cuda"], "CUDA is not available"))
    if importlib.util.find_spec("moviepy") is None:
        cases.append(
            ("video-without-moviepy", ["--eval-checkpoint", f"{{files}}/{script}", "--capture-video"], "moviepy")
        )
    if config.gpu_batches:
        cases.append(("gpu-batches", ["--num-envs", "6", "--num-gpu-batches", "4"], "--num-gpu-batches 4"))
        cases.append(("precision-fp16", ["--precision", "fp16"], "invalid choice 'fp16' for argument '--precision'"))
        cases.append(("driver-unknown", ["--driver", "fibers"], "invalid choice 'fibers' for argument '--driver'"))
        cases.append(("policy-unknown", ["--policy", "triton"], "invalid choice 'triton' for argument '--policy'"))
    if script == "a2c_atari.py":
        cases.append(("rms-alpha-1", ["--rms-alpha", "1"], "--rms-alpha must be in [0, 1)"))
    return cases


BAD_INPUTS = [(script, *case) for script in SCRIPTS for case in bad_inputs(script)]
# the cases also run as users run them, one interpreter each: tests/main_blocks.py, which runs
# the others' main blocks in one interpreter per script, must give what these give
OWN_PROCESS = ("unknown-game", "misspelled-flag", "resume-payload")
# two runs at a time on two cores: OpenMP threads spin while they wait for each other, and the
# check's probe network (its orthogonal init) took seconds instead of milliseconds
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PAYLOAD_MARKER = "payload-ran"


class Payload:
    """Unpickling this runs a shell command that creates a file: what a malicious model.pt does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@functools.cache
def network_of(script, actions):
    """The script's Agent and an Adam over it, made once: a checkpoint is written of each many times."""
    agent = importlib.import_module(Path(script).stem).Agent(actions)
    return agent, torch.optim.Adam(agent.parameters())


def valid_checkpoint(script, actions=4, **changes):
    """A checkpoint of `script` as the script writes it (for Breakout-v5, 4 actions), with
    `changes` applied (None removes a key); `actions` sizes the network and num_actions."""
    agent, optimizer = network_of(script, actions)
    state = {
        "script": script, "env_id": "Breakout-v5", "args": {"num_envs": 4, "num_steps": 16, "total_timesteps": 320},
        "num_actions": actions, "model": agent.state_dict(), "optimizer": optimizer.state_dict(),
        "iteration": 1, "global_step": 64, "env_seed": 1, "rng": utils.rng_states(torch.device("cpu")),
    }  # fmt: skip
    for key, value in changes.items():
        if value is None:
            state.pop(key)
        else:
            state[key] = value
    return state


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory):
    """Every bad-input run: a script's cases in one interpreter (tests/main_blocks.py: a start-up
    each would cost the suite minutes), OWN_PROCESS's also as their own processes. Each gets the
    tiny arguments first (a later flag wins), so a missing check ends in a short run, not a long one."""
    files = tmp_path_factory.mktemp("fake-checkpoints")
    runs_dir = tmp_path_factory.mktemp("bad-input-runs")
    (files / "corrupt.pt").write_bytes(b"PK\x03\x04 not really a zip file")
    torch.save({"script": "ppo_atari_native.py", "model": Payload(files / PAYLOAD_MARKER)}, files / "payload.pt")
    for script in CONFIGS:
        torch.save(valid_checkpoint(script), files / script)
        torch.save(valid_checkpoint(script, env_id="Pong-v5"), files / f"pong-{script}")
        args = {"num_envs": 8, "num_steps": 16, "total_timesteps": 320}
        torch.save(valid_checkpoint(script, args=args), files / f"8-envs-{script}")
        no_sticky = dict(CONFIGS_ARGS[script], repeat_action_probability=0.0)
        torch.save(valid_checkpoint(script, args=no_sticky), files / f"no-sticky-{script}")
        small = dict(CONFIGS_ARGS[script], screen_size=64)  # weights that fit: the size alone differs
        model = importlib.import_module(Path(script).stem).Agent(4, 4, 64).state_dict()
        torch.save(valid_checkpoint(script, args=small, model=model), files / f"64-pixels-{script}")
        finished = valid_checkpoint(script, args=dict(CONFIGS_ARGS[script]), iteration=10**6)
        torch.save(finished, files / f"finished-{script}")
        torch.save(valid_checkpoint(script, num_actions=None), files / f"incomplete-{script}")
        torch.save(valid_checkpoint(script, optimizer=None), files / f"no-optimizer-{script}")
        torch.save(valid_checkpoint(script, model="weights"), files / f"string-model-{script}")
        torch.save(valid_checkpoint(script, actions=6), files / f"6-actions-{script}")
        six = valid_checkpoint(script, actions=6)["model"]
        torch.save(valid_checkpoint(script, model=six), files / f"bad-shape-{script}")
        optimizer = valid_checkpoint(script)["optimizer"]
        optimizer["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 3)}}
        torch.save(valid_checkpoint(script, optimizer=optimizer), files / f"bad-optimizer-{script}")
        torch.save(valid_checkpoint(script, rng={"python": "not a state"}), files / f"bad-rng-{script}")

    def args_of(case):
        script, name, args, _ = case
        return [*map(str, CONFIGS[script].args), "--runs-dir", str(runs_dir), *(a.format(files=files) for a in args)]

    def in_one_process(script):  # every case of the script, its main block run in one interpreter
        cases = [case for case in BAD_INPUTS if case[0] == script]
        given, got = files / f"{Path(script).stem}-cases.json", files / f"{Path(script).stem}-results.json"
        given.write_text(json.dumps([args_of(case) for case in cases]))
        command = [sys.executable, ROOT / "tests" / "main_blocks.py", script, given, got]
        env = script_env(**ONE_THREAD)
        child = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
        done = json.loads(got.read_text())
        return {(script, case[1]): (SimpleNamespace(**run), run["seconds"]) for case, run in zip(cases, done)}

    def in_its_own_process(case):
        start = time.monotonic()
        result = run_script(case[0], *args_of(case), timeout=300, check=False, env=ONE_THREAD)
        return (case[0], case[1]), (result, time.monotonic() - start)

    with ThreadPoolExecutor(2) as pool:
        batches = list(pool.map(in_one_process, SCRIPTS))
        own = dict(pool.map(in_its_own_process, [case for case in BAD_INPUTS if case[1] in OWN_PROCESS]))
    results = {key: value for batch in batches for key, value in batch.items()}
    return SimpleNamespace(results=results, own=own, files=files, runs_dir=runs_dir)


@pytest.mark.parametrize("script, case, args, text", BAD_INPUTS, ids=[f"{s}-{c}" for s, c, *_ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(bad_input_results, script, case, args, text):
    result, seconds = bad_input_results.results[script, case]
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert text in lines[0], lines[0]
    assert "run directory" not in result.stdout  # nothing was started
    assert seconds < 15, f"took {seconds:.1f}s: the check must come before the envs start"


@pytest.mark.parametrize("script, case", [(s, c) for s, c, *_ in BAD_INPUTS if c in OWN_PROCESS])
def test_a_case_run_as_its_own_process_gives_what_the_shared_process_gave(bad_input_results, script, case):
    own, _ = bad_input_results.own[script, case]
    shared, _ = bad_input_results.results[script, case]
    assert (own.returncode, own.stderr, own.stdout) == (shared.returncode, shared.stderr, shared.stdout)


def test_no_bad_input_made_a_run_directory_or_ran_a_payload(bad_input_results):
    assert list(bad_input_results.runs_dir.iterdir()) == []
    assert not (bad_input_results.files / PAYLOAD_MARKER).exists(), "loading a checkpoint ran code from it"
    assert not (ROOT.parent / "escaped").exists()


# the rest of the checks, made in-process through the scripts' own parse and check (the same
# utils.cli and utils.check_args every script's main calls first): a subprocess per value would
# cost the suite minutes and test nothing more
FLAG_CASES = [
    ("runs-dir-is-a-file", ["--runs-dir", "{file}"], "is not a directory"),
    ("runs-dir-under-a-file", ["--runs-dir", "{file}/runs"], "is not a directory"),
    ("exp-name-with-slash", ["--exp-name", "a/b"], "not a path"),
    ("exp-name-dot-dot", ["--exp-name", ".."], "not a path"),
    ("type-error", ["--num-envs", "four"], "--num-envs"),
    ("computed-field", ["--batch-size", "64"], "Unrecognized options: --batch-size"),
    ("screen-size-35", ["--screen-size", "35"], "--screen-size 35: the network cannot take 35x35 frames"),
    ("frame-stack-above-16", ["--frame-stack", "17"], "--frame-stack must be in [1, 16], got 17"),
]
FLAG_INPUTS = [
    (script, *case)
    for script in SCRIPTS
    for case in FLAG_CASES
    if case[1][0].lstrip("-").replace("-", "_") in vars(importlib.import_module(Path(script).stem).Args())
    or case[0] in ("type-error", "computed-field")
]


@pytest.mark.parametrize("script, case, args, text", FLAG_INPUTS, ids=[f"{s}-{c}" for s, c, *_ in FLAG_INPUTS])
def test_bad_flags_are_refused_by_the_scripts_checks(script, case, args, text, tmp_path, monkeypatch, capsys):
    module = importlib.import_module(Path(script).stem)
    (tmp_path / "file").write_text("not a directory")
    args = [a.format(file=tmp_path / "file") for a in args]
    monkeypatch.setattr(sys, "argv", [script, *CONFIGS[script].args, "--runs-dir", str(tmp_path / "runs"), *args])
    with pytest.raises((utils.UsageError, SystemExit)) as raised:
        utils.check_args(utils.cli(module.Args), module.Agent)
    if isinstance(raised.value, SystemExit):  # tyro's own errors: utils.cli printed one line
        assert raised.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        message = lines[0]
    else:
        message = str(raised.value)
    assert text in message, message
    assert not (tmp_path / "runs").exists()


# every range of utils.RANGES at each of its ends: (values accepted, values refused). A closed
# end is accepted and the nearest value past it refused; an open end has the value next to it
# accepted and the end refused; "finite" ranges refuse inf past their open top end, and every
# float range refuses nan
SMALLEST, LARGE, PAST_ZERO, PAST_ONE = "5e-324", "1e300", "-0.000001", "1.000001"
POSITIVE = ([SMALLEST, LARGE], ["0", "nan", "inf"])
NON_NEGATIVE = (["0", LARGE], [PAST_ZERO, "nan", "inf"])
AT_LEAST_1 = [
    "total_timesteps", "num_envs", "num_steps", "num_minibatches", "num_gpu_batches", "num_env_threads",
    "save_interval", "log_interval", "eval_episodes", "frame_skip", "max_episode_frames",
]  # fmt: skip
RANGE_ENDS = {
    "seed": (["0", "4294967295"], ["-1", "4294967296"]),
    **{name: (["1"], ["0"]) for name in AT_LEAST_1},
    "update_epochs": (["0"], ["-1"]),
    "frame_stack": (["1", "16"], ["0", "17"]),
    "screen_size": (["16", "256"], ["15", "257"]),
    "noop_max": (["0"], ["-1"]),
    "repeat_action_probability": (["0", "1"], [PAST_ZERO, PAST_ONE, "nan"]),
    "learning_rate": (POSITIVE[0], [*POSITIVE[1], "-1"]),
    "gamma": (["0", "1"], [PAST_ZERO, PAST_ONE, "nan"]),
    "gae_lambda": (["0", "1"], [PAST_ZERO, PAST_ONE, "nan"]),
    "clip_coef": POSITIVE,
    "ent_coef": NON_NEGATIVE,
    "vf_coef": NON_NEGATIVE,
    "max_grad_norm": POSITIVE,
    "target_kl": POSITIVE,
    "rms_alpha": (["0", "0.999999"], [PAST_ZERO, "1", "nan"]),
    "rms_eps": NON_NEGATIVE,
}
RANGE_INPUTS = [
    (script, name)
    for script in SCRIPTS
    for name in RANGE_ENDS
    if hasattr(importlib.import_module(Path(script).stem).Args(), name)
]


def any_network(num_actions, frame_stack, screen_size):
    """A network that takes frames of any size: the ranges alone decide."""
    return SimpleNamespace(eval=lambda: SimpleNamespace(get_action_and_value=lambda x: None))


def test_every_range_has_its_ends_tested():
    assert RANGE_ENDS.keys() == utils.RANGES.keys()
    assert {name for _, name in RANGE_INPUTS} == set(RANGE_ENDS)


@pytest.mark.parametrize("script, name", RANGE_INPUTS, ids=[f"{s}-{n}" for s, n in RANGE_INPUTS])
def test_flag_ranges_hold_at_both_ends(script, name, tmp_path, monkeypatch):
    module = importlib.import_module(Path(script).stem)
    flag = "--" + name.replace("_", "-")
    accepted, refused = RANGE_ENDS[name]
    for value in accepted + refused:
        argv = [script, *CONFIGS[script].args, "--runs-dir", str(tmp_path / "runs"), flag, value]
        monkeypatch.setattr(sys, "argv", argv)
        args = utils.cli(module.Args)
        if value in accepted:
            utils.check_args(args, any_network)
            assert getattr(args, name) == type(getattr(args, name))(float(value))
        else:
            with pytest.raises(utils.UsageError, match=f"^{flag} must be .*, got "):
                utils.check_args(args, any_network)


def test_precision_resolves_by_hardware_and_bf16_is_refused_where_missing(monkeypatch):
    """Simulated CUDA devices: auto is bf16 on sm_80 and newer, fp32 on a T4 (sm_75), where an
    explicit bf16 is refused naming the device; on a CPU auto follows its bf16 instructions."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))
    cuda = torch.device("cuda", 0)
    with pytest.raises(utils.UsageError, match="--precision bf16: not supported by Tesla T4"):
        utils.resolve_precision("bf16", cuda)
    assert utils.resolve_precision("auto", cuda) == "fp32"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    assert utils.resolve_precision("auto", cuda) == "bf16"
    assert utils.resolve_precision("fp32", cuda) == "fp32"
    cpu = torch.device("cpu")
    assert utils.resolve_precision("auto", cpu) == ("bf16" if utils.cpu_has_bf16() else "fp32")
    assert utils.resolve_precision("bf16", cpu) == "bf16"  # CPUs run bf16 (slowly without AVX-512 BF16)


# ----------------------------------------------------------------------------- 4. evaluation
EVALUATION = re.compile(
    r"evaluation Breakout-v5: (\d+) games  mean (-?[\d.]+)  std ([\d.]+)  human-normalized (-?[\d.]+)"
)


def test_evaluation_reports_mean_std_and_human_normalized_score(stopped_and_resumed):
    script, run_dir = stopped_and_resumed.script, stopped_and_resumed.stopped.run_dir
    if not (run_dir / "model.pt").is_file():
        pytest.fail("the resumed run wrote no model.pt (see the stop-and-resume test)")
    result = run_script(script, "--eval-checkpoint", run_dir / "model.pt", "--eval-episodes", "2", timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("evaluation ")]
    assert len(lines) == 1, result.stdout[-2000:]
    match = EVALUATION.fullmatch(lines[0])
    assert match, lines[0]
    games, mean, std, normalized = int(match.group(1)), *map(float, match.groups()[1:])
    # two Breakout games: mean +- std are their scores, whole points (the returns themselves
    # are checked against ale-py in test_evaluation_returns_are_full_game_unclipped_sums)
    assert games == 2 and all(score >= 0 and score == int(score) for score in (mean + std, mean - std))
    # Breakout: random 1.7, human 30.5; the mean is printed to 2 decimals, the score to 3
    assert normalized == pytest.approx((mean - 1.7) / (30.5 - 1.7), abs=0.0005 + 0.005 / 28.8)


def test_evaluation_returns_are_full_game_unclipped_sums():
    """utils.evaluate (what --eval-checkpoint reports) under a scripted policy, an action read
    off the screen, against plain ale-py envs with the protocol's settings, seeded as its envs
    are, stepped with the same policy and summing raw rewards to the game over. MsPacman: its
    games lose lives and its rewards are 10 and more, so per-life or clipped returns differ."""
    from ale_py.vector_env import AtariVectorEnv

    def act(obs):  # deterministic, and not the same from game to game
        return obs[:, -1].sum(dim=(1, 2)) % 9

    episodes, seed = 3, 5
    returns = utils.evaluate("MsPacman-v5", default_game(), act, episodes, seed, torch.device("cpu"))
    expected, clipped, lives_lost = [], [], 0
    for i in range(episodes):  # evaluate's env i is seeded seed + i and plays one game
        env = AtariVectorEnv("ms_pacman", 1, **utils.ale_options(default_game()), stack_num=4, num_threads=1)
        obs, info = utils.seeded_reset(env, seed + i)
        total, total_clipped, lives = 0.0, 0.0, info["lives"][0]
        while True:
            obs, reward, terminated, truncated, info = env.step(act(torch.from_numpy(obs)).numpy())
            total, total_clipped = total + reward[0], total_clipped + min(reward[0], 1.0)
            if terminated[0] or truncated[0]:  # (info is the next game's from here)
                break
            lives_lost, lives = lives_lost + lives - info["lives"][0], info["lives"][0]
        expected.append(total)
        clipped.append(total_clipped)
        env.close()
    assert sorted(returns) == sorted(expected)
    assert lives_lost >= 2 * episodes and all(c < e for c, e in zip(clipped, expected)), (lives_lost, clipped)


@pytest.mark.parametrize("script", SCRIPTS)
def test_evaluation_plays_the_game_the_checkpoint_was_trained_on(script, tmp_path, monkeypatch, capsys):
    """A checkpoint of a changed game (MsPacman, all 18 actions, no sticky actions, 3 frames a step)
    is evaluated on that game with no flag saying so: the first line names it and utils.evaluate is
    given its settings (run in this process, utils.evaluate recording what it is asked to play)."""
    changed = dict(repeat_action_probability=0.0, frame_skip=3, full_action_space=True)
    args = dict(CONFIGS_ARGS[script], **changed)
    torch.save(valid_checkpoint(script, actions=18, env_id="MsPacman-v5", args=args), tmp_path / "model.pt")
    played = []
    monkeypatch.setattr(utils, "evaluate", lambda env_id, game, *rest, **kw: played.append((env_id, game)) or [3.0])
    monkeypatch.setattr(sys, "argv", [script, "--eval-checkpoint", str(tmp_path / "model.pt"), "--eval-episodes", "1"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exited.value.code == 0
    assert played == [("MsPacman-v5", default_game(**changed))]
    assert (
        "evaluating " in (out := capsys.readouterr().out)
        and " on MsPacman-v5 (18 actions, full set) for 1 games" in out
    )


def test_evaluation_with_video_records_every_game_and_scores_it_as_without(tmp_path):
    """--capture-video plays through utils.make_env's gymnasium pipeline: one video per game,
    and the same full-game, unclipped returns as the vector envs give (NOOP throughout, so that
    the pipelines' different random draws do not matter: MsPacman scores 60 in each game)."""
    pytest.importorskip("moviepy")

    def act(obs):
        return torch.zeros(obs.shape[0], dtype=torch.long)

    cpu = torch.device("cpu")
    recorded = utils.evaluate(
        "MsPacman-v5", default_game(), act, 2, 0, cpu, capture_video=True, video_dir=tmp_path / "videos"
    )
    assert recorded == utils.evaluate("MsPacman-v5", default_game(), act, 2, 0, cpu) and min(recorded) >= 10
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == [f"rl-video-episode-{i}.mp4" for i in range(2)]


# ----------------------------------------------------------------------------- 5. non-finite
def test_non_finite_training_stops_and_keeps_the_last_good_checkpoint(stopped_and_resumed, tmp_path):
    """Resume a good checkpoint with --learning-rate 1e30: the first update sends the weights to
    about 1e30, and the next forward overflows. The run must stop in that iteration, before the
    next rollout or a checkpoint (--save-interval 1) uses those weights. --no-anneal-lr: the
    command line's rate applies on resume even when no schedule sets it each iteration."""
    script, pristine = stopped_and_resumed.script, stopped_and_resumed.pristine
    if not pristine.is_file():
        pytest.fail("the stopped run wrote no checkpoint (see the stop-and-resume test)")
    checkpoint = tmp_path / "checkpoint.pt"
    shutil.copy(pristine, checkpoint)
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    good = utils.load_checkpoint(checkpoint, script)
    args = [*CONFIGS[script].args, "--learning-rate", "1e30", "--no-anneal-lr", "--save-interval", "1"]
    result = run_script(script, *args, "--resume", checkpoint, check=False)
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    iteration = good["iteration"] + 1
    assert re.fullmatch(rf"error: non-finite .* at iteration {iteration}; the last good checkpoint is .*", errors[0])
    assert str(checkpoint) in errors[0]
    assert hashlib.sha256(checkpoint.read_bytes()).hexdigest() == digest
    assert utils.load_checkpoint(checkpoint, script)["iteration"] == good["iteration"]
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.skipif("ppo_atari_baseline.py" not in SCRIPTS, reason="needs the baseline")
def test_non_finite_after_the_last_minibatch_is_caught_before_the_rollout(runs_dir):
    """One optimizer step per iteration: the loss that made the weights huge was finite, so only
    the check after the update stands between them and the baseline's sampler (which raises on
    NaN probabilities). Nothing was saved yet, and the message says so."""
    args = ["--num-minibatches", "1", "--update-epochs", "1", "--learning-rate", "1e30", "--save-interval", "1"]
    result = run_script(
        "ppo_atari_baseline.py", *CONFIGS["ppo_atari_baseline.py"].args, *args, "--runs-dir", runs_dir, check=False
    )
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: non-finite weights or outputs at iteration 1; no checkpoint was written yet"]
    assert not list(run_dir_of(result).glob("*.pt"))


def test_nonfinite_policy_sees_nan_weights_and_overflowing_outputs():
    from ppo_atari_baseline import Agent

    torch.manual_seed(0)
    agent, obs = Agent(4), torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    assert not utils.nonfinite_policy(agent, obs)
    with torch.no_grad():
        for p in agent.parameters():
            p.copy_(p.sign() * 1e30)  # finite weights, overflowing outputs
    assert all(p.isfinite().all() for p in agent.parameters()) and utils.nonfinite_policy(agent, obs)
    with torch.no_grad():
        agent.critic.bias.fill_(float("nan"))
    assert utils.nonfinite_policy(agent, obs)


# ----------------------------------------------------------------------------- 6. checkpoints hold plain data
def test_rng_states_survive_the_weights_only_round_trip(tmp_path):
    """What a resumed run restores is exactly what was saved: the next draws of Python's, numpy's
    and torch's generators after loading equal those after saving."""
    import random

    import numpy as np

    device = torch.device("cpu")
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    random.random(), np.random.normal(), torch.rand(3)  # numpy: a cached gaussian in the state too
    states = utils.rng_states(device)
    expected = (random.random(), np.random.normal(size=3).tolist(), torch.rand(3))
    utils.save_checkpoint(tmp_path / "c.pt", valid_checkpoint("ppo_atari_native.py", rng=states))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    state = utils.load_checkpoint(tmp_path / "c.pt", "ppo_atari_native.py", "Breakout-v5", resume=True)
    utils.set_rng_states(state["rng"], device)
    assert (random.random(), np.random.normal(size=3).tolist()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


def test_a_checkpoint_in_the_old_format_is_refused_with_one_line(tmp_path):
    """The format before plain-data checkpoints kept numpy's RNG state as an array, whose numpy
    globals weights_only loading does not allow: it is refused, naming what it holds."""
    import numpy as np

    old = valid_checkpoint("a2c_atari.py")
    old["rng"]["numpy"] = np.random.get_state()
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(utils.UsageError, match=r"holds more than plain data \(numpy.*refused"):
        utils.load_checkpoint(tmp_path / "old.pt", "a2c_atari.py", "Breakout-v5", resume=True)


def test_loading_a_payload_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"script": "a2c_atari.py", "env_id": "Breakout-v5", "model": Payload(marker)}, tmp_path / "model.pt")
    with pytest.raises(utils.UsageError, match=r"holds more than plain data \(posix.system\)"):
        utils.load_checkpoint(tmp_path / "model.pt", "a2c_atari.py")
    assert not marker.exists()


# ----------------------------------------------------------------------------- 7. runs and names
def test_two_runs_in_the_same_second_get_two_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.5)
    args = SimpleNamespace(env_id="ALE/breakout-v5", exp_name="sweep", seed=1, runs_dir=str(tmp_path))
    first, second, third = (utils.make_run_dir(args) for _ in range(3))
    assert [first.name, second.name, third.name] == [
        "Breakout-v5__sweep__1__1700000000",
        "Breakout-v5__sweep__1__1700000000-2",
        "Breakout-v5__sweep__1__1700000000-3",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, second.name, third.name]


def test_two_runs_launched_together_write_two_directories(tmp_path):
    """As a shell sweep launches them (`&`): same game, exp-name and seed, started together."""
    script = "ppo_atari_baseline.py"
    command = [sys.executable, str(ROOT / script), *CONFIGS[script].args, "--vector-mode", "sync"]
    command += ["--total-timesteps", "64", "--runs-dir", str(tmp_path)]
    procs = [subprocess.Popen(command, cwd=ROOT, env=script_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    dirs = sorted(tmp_path.iterdir())
    assert len(dirs) == 2 and all((d / "model.pt").is_file() for d in dirs), dirs
    assert {run_dir_of(SimpleNamespace(stdout=out)) for out, _ in outputs} == set(dirs)


def test_the_first_line_says_where_it_runs_and_how_many_steps():
    """The device (no CUDA here), the precision, the envs, the game's action set, and the steps that
    will really run: a budget of 127 with a batch of 64 runs 64."""
    args = SimpleNamespace(eval_checkpoint=None, env_id="Breakout-v5", batch_size=64, num_iterations=127 // 64,
                           frame_stack=4, screen_size=84)  # fmt: skip
    line = utils.describe_run(SimpleNamespace(**vars(args), full_action_space=False), torch.device("cpu"), "4 envs")
    if not torch.cuda.is_available():
        assert line.startswith("cpu (no CUDA found), fp32, 4 envs;")
    assert line.endswith("; Breakout-v5 (4 actions), 1 iteration of 64 steps = 64 agent steps")
    line = utils.describe_run(SimpleNamespace(**vars(args), full_action_space=True), torch.device("cpu"), "4 envs")
    assert line.endswith("; Breakout-v5 (18 actions, full set), 1 iteration of 64 steps = 64 agent steps")
    vars(args).update(frame_stack=2, screen_size=64)  # named only where it is not the protocol's 4 x 84 x 84
    line = utils.describe_run(SimpleNamespace(**vars(args), full_action_space=False), torch.device("cpu"), "4 envs")
    assert line.endswith("; Breakout-v5 (4 actions, 2x64x64 frames), 1 iteration of 64 steps = 64 agent steps")


def test_a_lowercase_game_id_trains_under_the_canonical_name_and_evaluates(tmp_path):
    script = "a2c_atari.py"
    result = run_script(script, *CONFIGS[script].args, "--env-id", "ALE/breakout-v5", "--runs-dir", tmp_path)
    run_dir = run_dir_of(result)
    assert run_dir.name.startswith("Breakout-v5__a2c_atari__1__")
    assert utils.load_checkpoint(run_dir / "model.pt", script)["env_id"] == "Breakout-v5"
    # the checkpoint says its game: no --env-id needed, and the score is human-normalized
    evaluated = run_script(script, "--eval-checkpoint", run_dir / "model.pt", "--eval-episodes", "1")
    assert re.search(r"evaluation Breakout-v5: 1 games .* human-normalized -?\d", evaluated.stdout)


def test_resume_takes_a_run_directory_and_refuses_a_finished_run(stopped_and_resumed):
    script, run_dir = stopped_and_resumed.script, stopped_and_resumed.stopped.run_dir
    model = run_dir / "model.pt"
    if not model.is_file():
        pytest.fail("the resumed run wrote no model.pt (see the stop-and-resume test)")
    before = model.read_bytes()
    result = run_script(script, *CONFIGS[script].args, "--resume", run_dir, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint {str(run_dir)!r} ends a finished run ({budget(script):,} steps): nothing to resume"
    ]
    assert model.read_bytes() == before


@pytest.mark.parametrize("script", [s for s in ("ppo_atari_native.py", "ppo_atari_baseline.py") if s in SCRIPTS])
def test_a_second_ctrl_c_stops_at_once_with_one_line(script, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / script), *CONFIGS[script].args, "--total-timesteps", "100000",
         "--runs-dir", str(tmp_path)],
        cwd=ROOT, env=script_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if "SPS:" in line:
                break
        children = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.02)  # long enough for the first handler to run, far shorter than a clean stop
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pytest.fail("the run had already stopped cleanly before the second SIGINT")
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("stopped at once")]
    assert len(lines) == 1 and re.fullmatch(r"stopped at once by a second SIGINT; last checkpoint: .+", lines[0])
    deadline = time.monotonic() + 10
    while still_running(children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not still_running(children), "env workers left behind"
