"""ppo_atari_native.py under torchrun: 2 CPU processes with gloo train in lockstep."""

import subprocess
import sys

from conftest import ROOT, assert_all_tags, read_scalars, run_dir_of, script_env


def test_torchrun_two_ranks_gloo(runs_dir):
    args = ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "768"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "ppo_atari_native.py"), *args, "--runs-dir", str(runs_dir), "--num-env-threads", "1",
        "--device", "cpu", "--backend", "gloo",  # CPU ranks even where a GPU is present
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the script compares every rank's final weights with rank 0's and says so
    assert "weights identical on all 2 ranks" in result.stdout, result.stdout[-2000:]
    run_dir = run_dir_of(result)
    assert sorted(p.name for p in runs_dir.iterdir()) == [run_dir.name]  # only rank 0 writes
    scalars = read_scalars(run_dir)
    assert_all_tags(scalars, ["charts/SPS", "losses/value_loss", "losses/policy_loss"])
    # global_step counts both ranks' steps: 2 ranks x 4 envs x 32 steps per iteration
    assert [step for step, _ in scalars["charts/SPS"]] == [256, 512, 768]
    assert (run_dir / "model.pt").is_file()


def test_a_lone_torchrun_process_joins_a_process_group(runs_dir):
    """torchrun with one process runs the distributed path (on one GPU: NCCL at world size 1)."""
    args = ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "256"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        str(ROOT / "ppo_atari_native.py"), *args, "--runs-dir", str(runs_dir), "--num-env-threads", "1",
        "--device", "cpu", "--backend", "gloo",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "weights identical on all 1 ranks: True" in result.stdout, result.stdout[-2000:]
