"""The GPU tier: what runs only on CUDA, run on CUDA. Selected with `pytest -m cuda`; skipped,
with the reason, where no GPU is present (so the CPU suite is unchanged); run with every other
test by the README's test command on a GPU machine. benchmarks/gpu_check.sh runs it and writes
a report.

- The headline command for 2 iterations, fp32 and bf16: one driver thread, a worker thread
  per batch, --driver sequential and --no-cuda-graphs all compute the same run (the weights after
  two updates are equal to the bit, so every action was too; --no-cuda-graphs also runs the
  update eagerly, which the others replay from a CUDA graph per minibatch).
- The graphed update against eager, in a child process (tests/gpu_updates.py graphed): PPO, PPO
  at world size 2 (the all-reduce between two graphs), A2C with either optimizer; the host's
  time per minibatch printed. A run stopped eagerly resumes graphed, and the other way round.
- Stacks of 1 and 8 frames of 64x64 and 96x96 pixels: the fused step from CUDA graphs computes
  the run it computes without them.
- A rollout under PyTorch's CUDA sanitizer reports no race between the streams.
- Every Triton kernel compiled for this GPU equals its reference (tests/gpu_kernels.py).
- PPO's first ratio on CUDA: 1 within 1e-5 in fp32, within 1e-3 in bf16 (the same recipe in
  rollout and learner; bf16 convolutions may round apart where cuDNN adds up in another order).
- --profile: the trace, and the batch-steps' GPU time beside the host phases.
- a2c_atari.py, evaluation, stop and resume, and torchrun with NCCL (world size 1).
- --compile (the first four tests, so that their compiles start first, one on each xdist
  worker): the PPO and A2C updates (A2C with either optimizer) compiled and replayed from CUDA
  graphs equal eager ones for a few updates, with no CUDA graph skipped and no recompile (in a
  child process, tests/gpu_updates.py); the headline command with --compile runs, its compile
  time on the first line, the guard's gap within its bound and printed beside the eager one;
  a2c_atari.py --compile --policy module runs, stops, and resumes eagerly.
- benchmarks/gpu_sweep.py finishes every configuration of its --quick grid.
"""

import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch
from conftest import (
    ROOT,
    assert_all_tags,
    profile_table,
    read_scalars,
    run_dir_of,
    run_script,
    script_env,
    stop_after_first_progress,
    tier_cores,
)

import utils

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU tier: pytest -m cuda)"),
]

HEADLINE = ["--env-id", "Breakout-v5", "--num-gpu-batches", "8"]
TWO_ITERATIONS = ["--total-timesteps", str(2 * 16 * 128)]
# cuBLAS picks its reduction order by workspace: this makes it the same in every run
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@pytest.fixture(autouse=True, scope="module")
def own_cores():
    """Each pytest-xdist worker (gpu_check.sh runs this tier with -n) and the scripts it starts
    keep to their own slice of the usable cores (conftest.tier_cores: a CPU quota counts), as
    under a cpuset: several runs would otherwise each pin their env threads to the same cores
    (utils.env_threads pins only a whole machine), and each compile pool would count them all."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", "gw0"), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    cores = tier_cores(worker, int(workers))
    os.sched_setaffinity(0, cores)
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(len(cores))  # Inductor's compile pool, in the scripts too


def model_of(result):
    return torch.load(run_dir_of(result) / "model.pt", map_location="cpu", weights_only=True)["model"]


# ----------------------------------------------------------------------------- --compile, first
# Their cold Inductor compiles (a minute or two each) start first, one on each xdist worker, and
# the other tests follow them (benchmarks/gpu_check.sh, its timeline).


@pytest.mark.parametrize("script", ["native", "a2c"])
def test_compiled_update_replayed_from_cuda_graphs_equals_eager(script):
    """A few updates compiled with mode="reduce-overhead" against eager, in fp32, in a child
    process (tests/gpu_updates.py says what is checked): compiled once, no CUDA graph skipped,
    no eager fallback, the same losses and weights up to rounding. A2C: both optimizers."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu_updates.py"), script], cwd=ROOT, env=script_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(result.stdout)  # the compile times and the largest differences, in gpu_check.sh's report
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "all update checks passed" in result.stdout


def test_headline_command_with_compile(runs_dir):
    """--compile on the headline command for 3 iterations, in bf16 where the GPU has it: the
    compile's time on the first progress line, no fallback, every loss logged, and the guard's
    gap within its bound. Inductor fuses bf16 ops without autocast's intermediate roundings,
    which the rollout makes: the gap is printed (gpu_check.sh's report shows it) beside the
    eager one that the same-run test prints, to see how far it moves."""
    precision = "bf16" if torch.cuda.get_device_capability() >= (8, 0) else "fp32"
    args = [*HEADLINE, "--total-timesteps", str(3 * 2048), "--precision", precision, "--runs-dir", runs_dir]
    result = run_script("ppo_atari_native.py", *args, "--compile")
    scalars = read_scalars(run_dir_of(result))
    gaps = [gap for _, gap in scalars["losses/rollout_logprob_gap"]]
    assert "warning: --compile" not in result.stderr, result.stderr[-3000:]
    first = next(line for line in result.stdout.splitlines() if line.startswith("iter "))
    assert ", compile " in first, first
    assert_all_tags(scalars, ["charts/SPS", "losses/value_loss", "losses/approx_kl"])
    print(f"the guard's gap in {precision} with --compile, iterations 1-3: {gaps}")
    assert len(gaps) == 3 and max(gaps) <= utils.LOGPROB_GAP_BOUND[precision], gaps


def test_a2c_compiled_on_the_module_step_stops_and_resumes_eagerly(runs_dir):
    """a2c_atari.py --compile --policy module (the general policy step captured in CUDA graphs
    beside Inductor's, the frames a static input, capturable RMSprop with a tensor rate) for two
    iterations, stopped by SIGTERM, then resumed eagerly from its checkpoint to the end."""
    args = ["--log-interval", "2", "--total-timesteps", str(4 * 512), "--policy", "module", "--runs-dir", runs_dir]
    logs = {"TORCH_LOGS": "cudagraphs,cudagraph_static_inputs"}
    stopped = stop_after_first_progress("a2c_atari.py", [*args, "--compile"], signal.SIGTERM, env=logs)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "policy module" in stopped.stdout.splitlines()[0], stopped.stdout[:2000]
    first = next(line for line in stopped.stdout.splitlines() if line.startswith("iter "))
    assert ", compile " in first, first
    assert "warning" not in stopped.stderr and "skipping cudagraphs" not in stopped.stderr, stopped.stderr[-3000:]
    assert re.search(r"Adding static input pos \d+ for source L\['b_obs'\]", stopped.stderr), stopped.stderr[-3000:]
    assert re.search(r"stopped by SIGTERM at step ([\d,]+)", stopped.stdout), stopped.stdout[-2000:]
    resumed = run_script("a2c_atari.py", *args, "--resume", run_dir_of(stopped))
    assert "saved" in resumed.stdout, resumed.stdout[-2000:]
    state = torch.load(run_dir_of(resumed) / "model.pt", map_location="cpu", weights_only=True)
    assert state["global_step"] == 4 * 512


# ----------------------------------------------------------------------------- the rest


def test_graphed_update_equals_eager():
    """The update replayed from one CUDA graph per step (the default on CUDA) against the same update
    eagerly, in fp32, in a child process (tests/gpu_updates.py graphed says what is checked); its
    host time per minibatch, eagerly and graphed, printed for gpu_check.sh's report."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu_updates.py"), "graphed"], cwd=ROOT, env=script_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "all graphed update checks passed" in result.stdout


@pytest.mark.parametrize(
    "script, first, then",
    [("ppo_atari_native.py", ["--no-cuda-graphs"], []), ("a2c_atari.py", [], ["--no-cuda-graphs"])],
)
def test_a_run_stopped_eagerly_resumes_graphed_and_the_other_way(script, first, then, runs_dir):
    """A checkpoint of an eager update resumes graphed (PPO) and a graphed one eagerly (A2C, RMSprop
    capturable with a tensor rate, then not): utils.load_optimizer imposes this run's optimizer, its
    step count on the device or not, and the run ends with every loss logged."""
    args = ["--num-envs", "8", "--num-steps", "32", "--total-timesteps", str(3 * 256), "--runs-dir", runs_dir]
    args += ["--num-minibatches", "2"] if script.startswith("ppo") else ["--log-interval", "1"]
    stopped = stop_after_first_progress(script, [*args, *first], signal.SIGTERM)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_script(script, *args, *then, "--resume", run_dir_of(stopped))
    assert "saved" in resumed.stdout and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    scalars = read_scalars(run_dir_of(resumed))
    assert [step for step, _ in scalars["losses/value_loss"]] == [256, 512, 768]
    state = torch.load(run_dir_of(resumed) / "model.pt", map_location="cpu", weights_only=True)
    assert state["global_step"] == 3 * 256


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_headline_command_computes_the_same_run_whoever_drives_it(precision, runs_dir):
    args = [*HEADLINE, *TWO_ITERATIONS, "--precision", precision, "--runs-dir", runs_dir]
    runs = {}
    for name, extra in [
        ("single driver, graphs", ["--driver", "single"]),
        ("threads, graphs", ["--driver", "threads"]),
        ("sequential", ["--driver", "sequential"]),
        ("single driver, no graphs", ["--driver", "single", "--no-cuda-graphs"]),
    ]:
        result = run_script("ppo_atari_native.py", *args, *extra, env=DETERMINISTIC)
        first = result.stdout.splitlines()[0]
        assert first.startswith(torch.cuda.get_device_name()) and f", {precision}, 16 envs x 8 batches" in first, first
        runs[name] = model_of(result)
        scalars = read_scalars(run_dir_of(result))
        assert_all_tags(scalars, ["charts/SPS", "losses/value_loss", "losses/approx_kl"])
        gaps = [gap for _, gap in scalars["losses/rollout_logprob_gap"]]
    print(f"the guard's gap in {precision}, eager, iterations 1-2: {gaps}")  # beside --compile's
    reference = runs["single driver, graphs"]
    for name, model in runs.items():
        different = [k for k in model if not torch.equal(model[k], reference[k])]
        assert not different, f"{name} differs from the single driver with graphs in {different}"


def test_an_edited_network_runs_its_forward_from_cuda_graphs(runs_dir, tmp_path):
    """The general policy step (Agent.forward, under bf16 autocast) captured in CUDA graphs, beside
    the graphed update: the same run as without graphs and with a worker thread per batch, and
    ratio 1 at first."""
    script = tmp_path / "native_layernorm.py"
    text = (ROOT / "ppo_atari_native.py").read_text()
    script.write_text(
        text.replace(
            "            nn.GELU(),\n        )", "            nn.GELU(),\n            nn.LayerNorm(512),\n        )"
        )
    )
    args = [*HEADLINE, *TWO_ITERATIONS, "--num-minibatches", "1", "--update-epochs", "1", "--runs-dir", runs_dir]
    models = []
    for extra in (["--driver", "single"], ["--driver", "threads"], ["--no-cuda-graphs"]):
        result = run_script(script, *args, *extra, env={**DETERMINISTIC, "PYTHONPATH": str(ROOT)})
        assert ", policy module (network[9] is LayerNorm" in result.stdout.splitlines()[0]
        models.append(model_of(result))
        for _, kl in read_scalars(run_dir_of(result))["losses/old_approx_kl"]:
            assert abs(kl) < 1e-3, kl
    for model in models[1:]:
        assert all(torch.equal(model[k], models[0][k]) for k in model)


@pytest.mark.parametrize("stack, size", [(1, 64), (8, 96)])
def test_other_frame_stacks_and_sizes_run_fused_from_cuda_graphs(stack, size, runs_dir):
    """--frame-stack and --screen-size on CUDA: push_frames compiled for them and the fused step
    captured in CUDA graphs compute the same run as without graphs, the guard's gap within its
    bound (tests/test_observation.py shows the frames are the gymnasium pipeline's)."""
    args = [*HEADLINE, *TWO_ITERATIONS, "--num-minibatches", "1", "--update-epochs", "1", "--precision", "fp32"]
    args += ["--frame-stack", str(stack), "--screen-size", str(size), "--runs-dir", runs_dir]
    models = []
    for extra in ([], ["--no-cuda-graphs"]):
        result = run_script("ppo_atari_native.py", *args, *extra, env=DETERMINISTIC)
        first = result.stdout.splitlines()[0]
        assert f"policy fused; Breakout-v5 (4 actions, {stack}x{size}x{size} frames)" in first, first
        gaps = [gap for _, gap in read_scalars(run_dir_of(result))["losses/rollout_logprob_gap"]]
        assert len(gaps) == 2 and max(gaps) <= utils.LOGPROB_GAP_BOUND["fp32"], gaps
        models.append(model_of(result))
    assert all(torch.equal(models[1][k], models[0][k]) for k in models[0])


def test_a_rollout_under_the_cuda_sanitizer_has_no_race(runs_dir):
    """TORCH_CUDA_SANITIZER=1 (CSAN) checks every torch op's stream accesses: the default
    stream's weight refresh, uniforms and storage reads against the batch streams' writes.
    Without graphs, so that it sees every op (Triton launches are invisible to it)."""
    args = ["--num-envs", "8", "--num-steps", "16", "--num-minibatches", "2", "--total-timesteps", "384"]
    result = run_script(
        "ppo_atari_native.py", *args, "--num-gpu-batches", "4", "--no-cuda-graphs", "--runs-dir", runs_dir,
        env={"TORCH_CUDA_SANITIZER": "1"}, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "data race" not in result.stderr.lower() and "CSAN" not in result.stderr, result.stderr[-4000:]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_triton_kernels_compiled_for_this_gpu_equal_their_references(precision):
    if precision == "bf16" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs sm_80")
    env = script_env()
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu_kernels.py"), precision], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "all kernel checks passed" in result.stdout


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 1e-3)])
def test_first_ratio_is_one_on_cuda(precision, tolerance, runs_dir):
    """A single-minibatch, single-epoch update starts at ratio 1: its old_approx_kl (the mean
    log-ratio) is 0 up to rounding, in the first iteration and after updates; the guard's gap
    (the mean |log-ratio|) stays within its bound, as CUDA's rounding must leave it."""
    args = ["--num-envs", "8", "--num-steps", "32", "--num-minibatches", "1", "--update-epochs", "1"]
    result = run_script(
        "ppo_atari_native.py", *args, "--total-timesteps", "768", "--precision", precision, "--runs-dir", runs_dir
    )
    scalars = read_scalars(run_dir_of(result))
    assert len(scalars["losses/old_approx_kl"]) == 3
    for (_, kl), (_, approx_kl) in zip(scalars["losses/old_approx_kl"], scalars["losses/approx_kl"], strict=True):
        assert abs(kl) < tolerance and abs(approx_kl) < tolerance, (kl, approx_kl)
    gaps = [gap for _, gap in scalars["losses/rollout_logprob_gap"]]
    assert len(gaps) == 3 and max(gaps) <= utils.LOGPROB_GAP_BOUND[precision], gaps


def test_profile_on_cuda_times_the_batch_steps_on_their_streams(runs_dir):
    """--profile on the headline command: the torch.profiler trace (started after the CUDA
    graphs are captured), and the table with the batch-steps' GPU time from the timing events
    on their streams beside the host phases, whose shares add up to 100%."""
    args = [*HEADLINE, "--total-timesteps", str(6 * 2048), "--profile", "--runs-dir", runs_dir]
    result = run_script("ppo_atari_native.py", *args)
    assert (run_dir_of(result) / "trace.json").is_file()
    header, progress, rows = profile_table(result.stdout)
    assert progress[3] < header < progress[4]
    assert rows.pop("GPU: batch-steps") is None, rows
    assert {"env wait", "launch", "GPU wait", "training"} <= rows.keys(), rows
    assert abs(sum(rows.values()) - 100) < 0.5


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a2c_and_its_evaluation_on_cuda(precision, runs_dir):
    args = ["--num-envs", "16", "--num-steps", "5", "--total-timesteps", "4000", "--log-interval", "10"]
    result = run_script("a2c_atari.py", *args, "--precision", precision, "--runs-dir", runs_dir)
    run_dir = run_dir_of(result)
    assert_all_tags(read_scalars(run_dir), ["charts/SPS", "losses/value_loss", "losses/entropy"])
    evaluated = run_script("a2c_atari.py", "--eval-checkpoint", run_dir / "model.pt", "--eval-episodes", "2")
    assert re.search(r"evaluation Breakout-v5: 2 games  mean [\d.]+", evaluated.stdout), evaluated.stdout


def test_stop_and_resume_on_cuda(runs_dir):
    """SIGTERM after the first iteration, then the printed resume command, to the end: the
    CUDA RNG state of this device is saved and restored."""
    args = [*HEADLINE, "--total-timesteps", str(6 * 2048), "--runs-dir", str(runs_dir)]
    stopped = stop_after_first_progress("ppo_atari_native.py", args, signal.SIGTERM)
    stdout = stopped.stdout
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    match = re.search(r"resume with: python ppo_atari_native.py (.+)", stdout)
    assert match, stdout[-2000:]
    resumed = run_script("ppo_atari_native.py", *shlex.split(match.group(1)))
    assert "saved" in resumed.stdout
    state = torch.load(run_dir_of(resumed) / "model.pt", map_location="cpu", weights_only=True)
    assert state["global_step"] == 6 * 2048 and state["rng"]["cuda"].dtype == torch.uint8


def test_torchrun_with_nccl_on_one_gpu(runs_dir):
    args = ["--num-envs", "8", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "512"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        str(ROOT / "ppo_atari_native.py"), *args, "--backend", "nccl", "--runs-dir", str(runs_dir),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "weights identical on all 1 ranks: True" in result.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_torchrun_with_nccl_on_two_gpus(runs_dir):
    args = ["--num-envs", "8", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "1024"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "ppo_atari_native.py"), *args, "--runs-dir", str(runs_dir),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "weights identical on all 2 ranks: True" in result.stdout


def test_more_torchrun_processes_than_gpus_is_refused(runs_dir):
    count = torch.cuda.device_count()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(count + 1),
        str(ROOT / "ppo_atari_native.py"), "--runs-dir", str(runs_dir),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"which has {count} GPU(s): use --nproc-per-node {count}" in result.stderr


def test_gpu_sweep_finishes_every_configuration_of_its_quick_grid():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_sweep.py"), "--quick"],
        cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| - |" not in result.stdout and "failed" not in result.stdout, result.stdout


def test_more_ranks_error_is_one_line_per_rank():
    """What each rank prints when refused: one error line, exit code 2 (torchrun reports it)."""
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "99"}
    result = run_script("ppo_atari_native.py", "--total-timesteps", "4096", env=env, check=False)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
