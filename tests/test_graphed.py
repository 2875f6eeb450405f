"""The graphed update (utils.GraphedStep): on CUDA the minibatch step is captured once and replayed;
off CUDA everything but the capture runs (the first call, the warm-up and its undoing, the argument
checks, the copied indices, the step on the graph's own inputs), and here it must give the plain
update to the bit. The data as the main blocks hand it over: the frames, actions, log-probs and
values views of the storage, GAE's advantages and returns written into storage of their own, the
minibatch indices a new slice at each call (copied into the graph's buffer). The GPU tier holds the
replay itself to eager (tests/gpu_updates.py graphed)."""

import inspect
from types import SimpleNamespace

import gpu_updates
import pytest
import torch
from test_algorithm import A2C_ARGS, BEFORE, TERMINAL, T, fixed_batch, make_agent, ppo_args

import a2c_atari as a2c
import ppo_atari_native as native
import utils

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
UPDATES = 2


def recording(step, calls):
    """`step`, keeping a copy of every call's outputs."""

    def record(*args):
        out = step(*args)
        calls.append([o.clone() for o in out])
        return out

    return record


class Storage:
    """The main blocks' storage for the test's fixed batch: `fill(i)` writes update i's values (moved a
    little per update, so each update's advantages differ) and GAE's results into it, in place (graphed)
    or as new tensors (plain), and returns the flat batch either way."""

    def __init__(self, data, module, in_place, gamma=0.99, lam=0.95):
        self.data, self.module, self.in_place, self.gamma, self.lam = data, module, in_place, gamma, lam
        self.values = torch.zeros_like(data.values)
        self.advantages, self.returns = torch.zeros(2, *data.rewards.shape)

    def fill(self, i):
        values = self.data.values + 0.05 * i
        dones = torch.cat([BEFORE, TERMINAL])
        advantages, returns = self.module.gae(self.data.rewards, values, dones, self.gamma, self.lam)
        if self.in_place:
            self.values.copy_(values)
            self.advantages[:], self.returns[:] = advantages, returns
            values, advantages, returns = self.values, self.advantages, self.returns
        obs, actions, logprobs = self.data.obs.flatten(0, 1), self.data.actions.flatten(), self.data.logprobs.flatten()
        return obs, actions, logprobs, advantages.reshape(-1), returns.reshape(-1), values[:T].reshape(-1)


def ppo_updates(graphed, args):
    """UPDATES native PPO updates, the rate annealed in place between them, plainly or through a
    GraphedStep: each step's outputs, each update's stats and flag, the weights and Adam's state after."""
    agent = make_agent(native)
    storage = Storage(fixed_batch(agent, perturb=True), native, in_place=graphed)
    hyper = dict(lr=torch.tensor(args.learning_rate), eps=1e-5) | utils.optimizer_options(CPU, False, graphs=True)
    optimizer = torch.optim.Adam(agent.parameters(), **hyper)
    step = utils.GraphedStep(native.minibatch_step, CPU, copied=["mb_inds"]) if graphed else native.minibatch_step
    calls, results = [], []
    torch.manual_seed(5)
    for i in range(UPDATES):
        utils.set_lr(optimizer, args.learning_rate * (1 - i / UPDATES))
        batch = storage.fill(i)
        results.append(native.update(agent, optimizer, *batch, args, torch.float32, 1, recording(step, calls)))
    weights = [p.detach().clone() for p in agent.parameters()]
    return SimpleNamespace(calls=calls, results=results, weights=weights, state=optimizer.state_dict()["state"],
                           step=step, storage=storage)  # fmt: skip


def assert_same_state(got, want):
    for index, state in want.items():
        for key, value in state.items():
            assert torch.equal(got[index][key], value), (index, key)


@pytest.mark.parametrize("target_kl", [None, 0.15])
def test_the_graphed_ppo_update_is_the_plain_one(target_kl):
    """Two updates of 3 epochs x 2 minibatches (target_kl 0.15 stops some early), new advantages
    each time: every step's outputs, the stats, the weights and Adam's state, to the bit. The graph's
    indices are its own buffer, refilled at each call; the frames are read where they lie."""
    args = ppo_args(update_epochs=3, num_minibatches=2, target_kl=target_kl)
    plain, graphed = ppo_updates(False, args), ppo_updates(True, args)
    assert len(graphed.calls) == len(plain.calls)
    assert (len(plain.calls) == 3 * 2 * UPDATES) == (target_kl is None), "target_kl 0.15 stopped no update early"
    for i, (got, want) in enumerate(zip(graphed.calls, plain.calls, strict=True)):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), f"step {i}"
    for (stats, nonfinite), (want_stats, want_nonfinite) in zip(graphed.results, plain.results, strict=True):
        assert torch.equal(stats, want_stats) and not nonfinite and not want_nonfinite
    assert all(torch.equal(g, w) for g, w in zip(graphed.weights, plain.weights, strict=True))
    assert_same_state(graphed.state, plain.state)
    inputs = dict(zip(inspect.signature(native.minibatch_step).parameters, graphed.step.inputs))
    assert inputs["b_obs"].data_ptr() == graphed.storage.data.obs.data_ptr()  # read in place, not copied
    assert inputs["b_advantages"].data_ptr() == graphed.storage.advantages.data_ptr()
    assert inputs["mb_inds"].shape == (args.minibatch_size,) and inputs["mb_inds"]._base is None  # its own


@pytest.mark.parametrize("optimizer", ["rmsprop", "rmsprop-tf"])
def test_the_graphed_a2c_update_is_the_plain_one(optimizer):
    """Two A2C updates with either optimizer as the main block makes it graphed (a tensor rate,
    annealed in place), new advantages each time, normalized: the losses, weights and state, to the bit."""
    args = SimpleNamespace(**{**A2C_ARGS, "optimizer": optimizer, "norm_adv": True})
    runs = []
    for graphed in (False, True):
        agent = make_agent(a2c)
        storage = Storage(fixed_batch(agent, perturb=True), a2c, in_place=graphed, gamma=args.gamma)
        hyper = dict(lr=torch.tensor(args.learning_rate), alpha=args.rms_alpha, eps=args.rms_eps)
        if optimizer == "rmsprop":
            opt = torch.optim.RMSprop(agent.parameters(), **hyper, **utils.optimizer_options(CPU, False, False, True))
        else:
            opt = a2c.RMSpropTF(agent.parameters(), **hyper)
        step = utils.GraphedStep(a2c.update, CPU) if graphed else a2c.update
        outputs = []
        for i in range(UPDATES):
            utils.set_lr(opt, args.learning_rate * (1 - i / UPDATES))
            losses, nonfinite = step(agent, opt, *storage.fill(i)[:5], args, torch.float32)
            outputs.append((losses.clone(), nonfinite.clone()))
        runs.append((outputs, [p.detach().clone() for p in agent.parameters()], opt.state_dict()["state"]))
    (plain, plain_weights, plain_state), (graphed, graphed_weights, graphed_state) = runs
    for i, ((got, got_flag), (want, want_flag)) in enumerate(zip(graphed, plain, strict=True)):
        assert torch.equal(got, want) and not got_flag and not want_flag, f"update {i}"
    assert all(torch.equal(g, w) for g, w in zip(graphed_weights, plain_weights, strict=True))
    assert_same_state(graphed_state, plain_state)


def tiny_step(layer, optimizer, x, indices, scale):
    optimizer.zero_grad()
    loss = (layer(x[indices]) * scale).square().mean()
    loss.backward()
    optimizer.step()
    return (loss.detach(),)


def test_the_warm_up_is_undone_and_the_first_call_is_eager():
    """Five warm-up steps, then the weights and Adam's state are the first call's: one plain step's."""
    runs = []
    for warmup in (None, 5):
        torch.manual_seed(0)
        layer, x = torch.nn.Linear(3, 2), torch.randn(6, 3)
        optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
        step = tiny_step if warmup is None else utils.GraphedStep(tiny_step, CPU, copied=["indices"], warmup=warmup)
        loss = step(layer, optimizer, x, torch.tensor([0, 2]), 2.0)[0].clone()
        runs.append((loss, [p.detach().clone() for p in layer.parameters()], optimizer.state_dict()["state"]))
    assert torch.equal(runs[1][0], runs[0][0])
    assert all(torch.equal(g, w) for g, w in zip(runs[1][1], runs[0][1], strict=True))
    assert_same_state(runs[1][2], runs[0][2])
    assert runs[1][2][0]["step"] == 1


def test_a_graphed_step_refuses_an_argument_its_graph_does_not_read():
    """A graph reads its inputs where they lay at the capture: a tensor elsewhere, another value of
    an argument frozen into it, or copied indices of another shape are refused, naming the argument."""
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(3, 2), torch.randn(6, 3)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    step = utils.GraphedStep(tiny_step, CPU, copied=["indices"])
    step(layer, optimizer, x, torch.tensor([0, 2]), 2.0)
    step(layer, optimizer, x, torch.tensor([1, 5]), 2.0)  # new indices: copied in
    step(layer, optimizer, x.view(6, 3), torch.tensor([1, 5]), 2.0)  # another view of the same memory
    with pytest.raises(ValueError, match="argument x is not the one its CUDA graph reads"):
        step(layer, optimizer, x.clone(), torch.tensor([1, 5]), 2.0)
    with pytest.raises(ValueError, match="argument scale"):
        step(layer, optimizer, x, torch.tensor([1, 5]), 3.0)
    with pytest.raises(ValueError, match="argument indices"):
        step(layer, optimizer, x, torch.tensor([1, 5, 3]), 2.0)


def test_the_graphed_optimizers_are_capturable_with_adam_fused_as_eagerly():
    """On CUDA the graphed optimizers are capturable (Adam's step count then lives on the device, where
    the graph reads it), Adam fused as in an eager run; on the CPU, where nothing is captured, eager's."""
    assert utils.optimizer_options(CUDA, False, graphs=True) == dict(foreach=None, capturable=True, fused=True)
    assert utils.optimizer_options(CUDA, False, has_fused=False, graphs=True) == dict(foreach=True, capturable=True)
    assert utils.optimizer_options(CUDA, False) == dict(foreach=None, capturable=False, fused=True)
    assert utils.optimizer_options(CPU, False, graphs=True) == utils.optimizer_options(CPU, False)
    assert utils.optimizer_options(CUDA, True, graphs=True) == utils.optimizer_options(CUDA, True)


def saved_after_one_update(graphed, args):
    """A PPO run's weights and optimizer after its first update, written and read back as a checkpoint
    is; graphed: as a CUDA run writes them (a tensor rate, capturable fused Adam's flags)."""
    agent = make_agent(native)
    storage = Storage(fixed_batch(agent, perturb=True), native, in_place=True)
    lr = torch.tensor(args.learning_rate) if graphed else args.learning_rate
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5, **utils.optimizer_options(CPU, False))
    torch.manual_seed(5)
    native.update(agent, optimizer, *storage.fill(0), args, torch.float32, 1)
    saved = optimizer.state_dict()
    if graphed:
        flags = utils.optimizer_options(CUDA, False, graphs=True)
        saved["param_groups"] = [group | flags for group in saved["param_groups"]]
    return {"model": agent.state_dict(), "optimizer": saved, "rng": torch.get_rng_state()}, storage


@pytest.mark.parametrize("written_by, resumed_by", [("eager", "graphed"), ("graphed", "eager")])
def test_a_resume_between_eager_and_graphed_runs_the_next_update_as_the_writer_would(written_by, resumed_by, tmp_path):
    """A checkpoint written after one update, eagerly or graphed, resumed the other way (utils.load_optimizer
    imposes this run's flags and rate tensor): its next update is the one the writer runs, within the
    rounding of the rate (a float32 tensor graphed, a Python float eagerly); Adam's count goes on."""
    args = ppo_args(update_epochs=2, num_minibatches=2)
    state, storage = saved_after_one_update(written_by == "graphed", args)
    torch.save(state, tmp_path / "checkpoint.pt")
    checkpoint = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    ends = []
    for mode, source in ((written_by, state), (resumed_by, checkpoint)):
        graphed = mode == "graphed"
        agent = make_agent(native)
        agent.load_state_dict(source["model"])
        lr = torch.tensor(args.learning_rate) if graphed else args.learning_rate
        hyper = dict(lr=lr, eps=1e-5) | utils.optimizer_options(CPU, False, graphs=graphed)
        optimizer = torch.optim.Adam(agent.parameters(), **hyper)
        utils.load_optimizer(optimizer, source["optimizer"], hyper)
        group = optimizer.param_groups[0]
        assert group["lr"] is lr and {k: group[k] for k in hyper if k != "lr"} == {
            k: v for k, v in hyper.items() if k != "lr"
        }
        step = utils.GraphedStep(native.minibatch_step, CPU, copied=["mb_inds"]) if graphed else native.minibatch_step
        utils.set_lr(optimizer, args.learning_rate / 2)
        torch.set_rng_state(source["rng"])
        stats, nonfinite = native.update(agent, optimizer, *storage.fill(1), args, torch.float32, 1, step)
        assert not nonfinite
        assert {float(s["step"]) for s in optimizer.state.values()} == {8.0}
        ends.append((stats, [p.detach().clone() for p in agent.parameters()]))
    (want_stats, want), (got_stats, got) = ends
    torch.testing.assert_close(got_stats, want_stats, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)


@pytest.fixture
def lone_gloo_rank():
    """A one-rank process group, for the update at world size 2 (its all-reduce then averages one rank's gradient
    with nothing: halves it, eagerly and graphed alike)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_gpu_tiers_graphed_update_check_runs_and_tells_a_change(lone_gloo_rank):
    """tests/gpu_updates.py graphed on the CPU, small (PPO at world size 2, A2C): its updates run eagerly
    and through GraphedStep, and its checks pass them (equal to the bit here) and fail a weight moved by
    more than rounding."""
    for script, count in (("native-torchrun", 1), ("a2c-rmsprop-tf", 2)):
        eager = gpu_updates.graphed_updates(script, False, CPU, count=count, batch=32, timed=0)
        graphed = gpu_updates.graphed_updates(script, True, CPU, count=count, batch=32, timed=0)
        checks = list(gpu_updates.compare_graphed(script, eager, graphed))
        assert len(eager.losses) == (2 * 4 if script.startswith("native") else 2), script
        assert all(ok for _, ok, _ in checks) and checks[0][0] == "as many steps", (script, checks)  # no capture
        assert all(detail == "equal to the bit" for _, _, detail in checks[1:]), (script, checks)
    moved = SimpleNamespace(**{**vars(graphed), "weights": [w + 1e-4 for w in graphed.weights]})
    assert not any(ok for name, ok, _ in gpu_updates.compare_graphed(script, eager, moved) if name.startswith("w"))
