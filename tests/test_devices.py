"""Device resolution on a simulated CUDA machine (torch.cuda monkeypatched), so that the CPU
suite checks what every GPU run depends on: a CUDA device always has an index (the scripts'
torch.cuda.set_device raised ValueError for an index-less one: every native and A2C run on a
GPU crashed while CI was green), and torchrun maps processes onto GPUs or refuses."""

import pytest
import torch

import utils


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with 2 GPUs whose current device is cuda:1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.mark.parametrize("spec, index", [("auto", 1), ("cuda", 1), ("cuda:0", 0), ("cuda:1", 1)])
def test_cuda_devices_always_have_an_index(two_gpus, spec, index):
    device = utils.resolve_device(spec)
    assert device == torch.device("cuda", index)
    # what torch.cuda.set_device does with it first (it raised for an index-less device)
    assert torch.cuda._get_device_index(device, optional=False) == index


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cuda:2", r"only 2 CUDA device\(s\)"),
        ("gpu", "expected auto, cpu, cuda or cuda:N"),
        ("cuda:x", "expected auto"),
    ],
)
def test_bad_devices_are_refused(two_gpus, spec, message):
    with pytest.raises(utils.UsageError, match=message):
        utils.resolve_device(spec)


def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert utils.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(utils.UsageError, match="CUDA is not available"):
        utils.resolve_device("cuda")


@pytest.mark.parametrize("local_rank", [0, 1])
def test_torchrun_puts_each_local_rank_on_its_gpu(two_gpus, monkeypatch, local_rank):
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert utils.torchrun_device(utils.resolve_device("auto")) == torch.device("cuda", local_rank)
    assert utils.torchrun_device(torch.device("cpu")) == torch.device("cpu")


def test_torchrun_with_more_processes_than_gpus_is_refused(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(utils.UsageError, match="3 processes on this machine, which has 2 GPU"):
        utils.torchrun_device(torch.device("cuda", 1))


def test_env_threads_are_a_budget_split_over_the_batches(monkeypatch):
    """On CUDA the default is the cores but the driver's, pinned when the process owns every
    core; on CPU each batch gets min(cores, its size); an explicit total is split, at least one
    thread per batch; under torchrun each local rank gets its share of the cores."""
    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(utils.os, "cpu_count", lambda: 16)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert utils.env_threads(None, cuda, 8, 2) == (15, 0)
    assert utils.env_threads(None, cuda, 2, 128, local_rank=1, local_world_size=2) == (7, 8)
    assert utils.env_threads(None, cpu, 2, 8) == (16, None)
    assert utils.env_threads(64, cuda, 8, 32) == (64, None)  # more than the cores: not pinned
    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(8, 16)))  # a cpuset: not pinned
    assert utils.env_threads(None, cuda, 2, 64) == (7, None)


@pytest.mark.parametrize(
    "driver, device, batches, single_threaded, resolved",
    [
        ("auto", "cuda:0", 8, False, "single"),  # on CUDA one thread serves every batch
        ("auto", "cpu", 8, False, "threads"),  # on CPU a worker thread per batch
        ("threads", "cuda:0", 8, False, "threads"),
        ("single", "cpu", 2, False, "single"),
        ("auto", "cuda:0", 1, False, "sequential"),
        ("threads", "cpu", 4, True, "sequential"),
    ],
)
def test_driver_resolves_by_device_and_batches(driver, device, batches, single_threaded, resolved):
    assert utils.resolve_driver(driver, torch.device(device), batches, single_threaded) == resolved


def test_an_unknown_driver_is_refused():
    with pytest.raises(utils.UsageError, match="--driver 'fibers': expected auto, single or threads"):
        utils.resolve_driver("fibers", torch.device("cpu"), 2, False)
