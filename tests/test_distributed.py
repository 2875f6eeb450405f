"""ppo_atari_native.py under torchrun: 2 CPU processes with gloo train in lockstep, and the
gradient each rank applies is the mean of the ranks' own."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ROOT, assert_all_tags, read_scalars, run_dir_of, script_env

import ppo_atari_native as native
import utils


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
    assert "weights identical on all 2 ranks: True" in result.stdout.splitlines(), result.stdout[-2000:]
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


def agent_shapes():
    with torch.device("meta"):  # shapes only: no orthogonal init, which takes a second
        return [p.shape for p in native.Agent(4).parameters()]


def own_gradients(rank):
    """The gradients rank `rank` computed itself, one per parameter of the agent: distinct per rank."""
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(shape, generator=generator) for shape in agent_shapes()]


def all_reduce_on_rank(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    parameters = [torch.nn.Parameter(torch.zeros(shape)) for shape in agent_shapes()]
    for p, grad in zip(parameters, own_gradients(rank), strict=True):
        p.grad = grad
    utils.all_reduce_gradients(parameters, world_size)
    torch.save([p.grad for p in parameters], out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_all_reduce_leaves_every_rank_the_mean_of_the_ranks_gradients(tmp_path):
    """Two gloo processes, each with its own gradients for every parameter (of every shape the
    flat buffer packs): after all_reduce_gradients, each rank's p.grad is the mean of the two."""
    world_size = 2
    mp.spawn(all_reduce_on_rank, args=(world_size, tmp_path / "init", tmp_path), nprocs=world_size)
    expected = [sum(grads) / world_size for grads in zip(*(own_gradients(r) for r in range(world_size)))]
    for rank in range(world_size):
        applied = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert len(applied) == len(expected)
        for grad, mean in zip(applied, expected, strict=True):
            torch.testing.assert_close(grad, mean, rtol=1e-6, atol=1e-7)


def agree_on_rank(rank, world_size, init_file, out_dir, stopped_rank, diverged_rank):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    stop = utils.StopSignal(out_dir / "checkpoint.pt")
    stop.received = "SIGINT" if rank == stopped_rank else None
    nonfinite = torch.tensor(rank == diverged_rank)
    nonfinite, gap = utils.agree(stop, nonfinite, torch.tensor(0.5 * rank))
    torch.save({"received": stop.received, "nonfinite": bool(nonfinite), "gap": float(gap)}, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("stopped_rank, diverged_rank", [(1, None), (None, 0), (None, None)])
def test_every_rank_stops_or_diverges_when_one_does(stopped_rank, diverged_rank, tmp_path):
    """utils.agree, each iteration under torchrun: a signal on one rank stops them all (after
    the update, in lockstep), a non-finite loss on one rank stops them all, and every rank sees the
    largest log-prob gap, so that the guard stops them all."""
    world_size = 2
    mp.spawn(
        agree_on_rank, args=(world_size, tmp_path / "init", tmp_path, stopped_rank, diverged_rank), nprocs=world_size
    )
    for rank in range(world_size):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        expected = None if stopped_rank is None else "SIGINT" if rank == stopped_rank else "a signal on another rank"
        assert seen == {"received": expected, "nonfinite": diverged_rank is not None, "gap": 0.5 * (world_size - 1)}
