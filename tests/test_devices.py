"""Device resolution on a simulated CUDA machine (torch.cuda monkeypatched), so that the CPU
suite checks what every GPU run depends on: a CUDA device always has an index (the scripts'
torch.cuda.set_device raised ValueError for an index-less one: every native and A2C run on a
GPU crashed while CI was green), and torchrun maps processes onto GPUs or refuses."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from conftest import default_game

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


@pytest.fixture
def sixteen_cores(monkeypatch, tmp_path):
    """A 16-core machine that this process owns whole, with no cgroup CPU quota."""
    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(utils.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(utils, "CGROUP_CPU_MAX", tmp_path / "cpu.max")
    monkeypatch.setattr(utils, "CGROUP_V1_QUOTA", tmp_path / "cpu.cfs_quota_us")
    return tmp_path


def test_env_threads_are_a_budget_split_over_the_batches(sixteen_cores, monkeypatch):
    """On CUDA the default is the cores but the driver's, all of them used and pinned when the
    process owns every core; on CPU each batch gets min(cores, its size); an explicit total is
    split with the remainder going to the first batches, at least one thread per batch and at
    most one per env; under torchrun each local rank gets its share of the cores."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert utils.env_threads(None, cuda, 8, 2) == ([2, 2, 2, 2, 2, 2, 2, 1], 0)  # the headline: 15 threads
    assert utils.env_threads(None, cuda, 4, 4) == ([4, 4, 4, 3], 0)
    assert utils.env_threads(None, cuda, 2, 128, local_rank=1, local_world_size=2) == ([4, 3], 8)
    assert utils.env_threads(None, cpu, 2, 8) == ([8, 8], None)
    assert utils.env_threads(64, cuda, 8, 32) == ([8] * 8, None)  # more than the cores: not pinned
    assert utils.env_threads(64, cuda, 8, 1) == ([1] * 8, 0)  # at most one per env
    assert utils.env_threads(3, cuda, 8, 2) == ([1] * 8, 0)  # at least one per batch
    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(8, 16)))  # a cpuset: not pinned
    assert utils.env_threads(None, cuda, 2, 64) == ([4, 3], None)


@pytest.mark.parametrize(
    "files, cores",
    [
        ({"cpu.max": "400000 100000\n"}, 4),  # cgroup v2: 4 CPUs of time
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ({"cpu.max": "max 100000\n"}, 16),  # no quota
        ({"cpu.cfs_quota_us": "800000\n", "cpu.cfs_period_us": "100000\n"}, 8),  # cgroup v1
        ({"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}, 16),
    ],
)
def test_a_cgroup_cpu_quota_caps_the_cores_and_stops_pinning(sixteen_cores, files, cores):
    """A container limited by CPU time sees every host core in its affinity mask: the quota
    is the real budget, and pinning to cores other containers also run on would be wrong."""
    for name, text in files.items():
        (sixteen_cores / name).write_text(text)
    assert utils.usable_cores() == (cores, cores == 16)
    per_batch, first_core = utils.env_threads(None, torch.device("cuda", 0), 2, 64)
    assert sum(per_batch) == max(2, cores - 1) and (first_core is None) == (cores < 16)


def test_threaded_envs_pin_each_batch_after_the_previous_ones(monkeypatch):
    """Batch b's C++ threads start at first_core plus the earlier batches' threads."""
    import ale_py.vector_env

    made = []

    class FakeVectorEnv:
        single_action_space = SimpleNamespace(n=4)

        def __init__(self, game, num_envs, num_threads, thread_affinity_offset, **kwargs):
            made.append((num_envs, num_threads, thread_affinity_offset))

    monkeypatch.setattr(ale_py.vector_env, "AtariVectorEnv", FakeVectorEnv)
    envs = utils.ThreadedAtariEnvs("Breakout-v5", 16, 8, 15, 0, default_game(), first_core=1)
    assert envs.threads_per_batch == [2, 2, 2, 2, 2, 2, 2, 1]
    assert made == [(2, 2, 1), (2, 2, 3), (2, 2, 5), (2, 2, 7), (2, 2, 9), (2, 2, 11), (2, 2, 13), (2, 1, 15)]
    made.clear()
    utils.ThreadedAtariEnvs("Breakout-v5", 16, 8, 15, 0, default_game())
    assert [offset for *_, offset in made] == [-1] * 8  # unpinned


def test_the_first_line_names_each_batchs_threads():
    args, policy = SimpleNamespace(num_envs=5, num_gpu_batches=3), SimpleNamespace(name="fused", reason=None)
    text = utils.rollout_text(args, [2, 2, 1], None, "threads", False, policy)
    assert text == "5 envs x 3 batches, 5 env threads (2,2,1 per batch), driver threads, CUDA graphs off, policy fused"


def test_warm_up_orders_every_batch_stream_after_the_default_stream(monkeypatch):
    """The buffers, storage and weights were written on the default stream: each batch stream
    must wait for it before its first step (CUDA simulated: streams that log what happens)."""
    log = []

    class FakeStream:
        def __init__(self, name):
            self.name, self.device = name, torch.device("cuda", 0)

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    default = FakeStream("default")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext(log.append(("on", stream.name))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    streams = [FakeStream(0), FakeStream(1)]
    utils.warm_up(lambda t, b: log.append(("step", t, b)), 2, 2, streams)
    for b in (0, 1):
        first_step = log.index(("step", 0, b))
        assert ("wait", b, "default") in log[:first_step], log


@pytest.fixture
def captured(monkeypatch):
    """utils.capture_graphs for 2 steps of 3 batches, CUDA simulated: streams, pools and graphs
    that log, in order, each clear of cuBLAS's workspaces and each capture's stream, pool and
    step, pools numbered as they come; returns (the log, the batches' streams)."""
    log, current, pools = [], [None], []

    class FakeStream:
        def __init__(self, device=None):
            self.device = torch.device("cuda", 0)

    class FakeGraph:
        def capture_begin(self, pool=None):
            pools.extend([pool] if pool not in pools else [])
            log.append(("begin", current[0], pools.index(pool)))

        def capture_end(self):
            log.append(("end", current[0]))

    @contextlib.contextmanager
    def on(stream):
        before, current[0] = current[0], stream
        yield
        current[0] = before

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: log.append(("clear",)), raising=False)
    streams = [FakeStream() for _ in range(3)]
    utils.capture_graphs(lambda t, b: log.append(("step", t, b, current[0])), 2, 3, streams)
    return log, streams


def test_each_batch_captures_its_graphs_on_its_own_stream(captured):
    """cuBLAS keys its workspace by (handle, stream) and a graph bakes in its capture stream's
    workspace: batches replay concurrently, so no two batches may capture on the same stream."""
    log, streams = captured
    steps = {(t, b): stream for _, t, b, stream in (entry for entry in log if entry[0] == "step")}
    assert steps == {(t, b): streams[b] for t in range(2) for b in range(3)}


def test_each_batch_makes_its_cublas_workspace_inside_its_own_pool(captured):
    """Inductor's CUDA graph trees (--compile) clear cuBLAS's workspaces and empty the cache: one
    made outside the rollout's graph pools would be freed under the graphs that write to it. So
    the workspaces are cleared right before each batch's first capture, after the last batch's."""
    log, streams = captured
    expected = []
    for b in range(3):
        expected.append(("clear",))
        for t in range(2):
            expected += [("begin", streams[b], b), ("step", t, b, streams[b]), ("end", streams[b])]
    assert log == expected


@pytest.mark.parametrize(
    "driver, device, batches, resolved",
    [
        ("auto", "cuda:0", 8, "single"),  # on CUDA one thread serves every batch
        ("auto", "cpu", 8, "threads"),  # on CPU a worker thread per batch
        ("threads", "cuda:0", 8, "threads"),
        ("single", "cpu", 2, "single"),
        ("auto", "cuda:0", 1, "sequential"),
        ("sequential", "cpu", 4, "sequential"),
    ],
)
def test_driver_resolves_by_device_and_batches(driver, device, batches, resolved):
    assert utils.resolve_driver(driver, torch.device(device), batches) == resolved
