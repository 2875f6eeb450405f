"""tests/gpu_updates.py (the GPU tier's compiled-update test, run in a child process) on CPU: its
eager updates run, and its checks pass a run equal to eager or a rounding apart, and fail a slip
(benchmarks/check_power.py has every slip the GPU review names, for each optimizer)."""

from types import SimpleNamespace
from unittest import mock

import gpu_updates
import pytest
import torch

import utils
from benchmarks.check_power import nudged

CPU = torch.device("cpu")


def run_of(before, after, losses=(), script="a2c-rmsprop-tf", minibatch=512):
    step = SimpleNamespace(eager=False, seconds=1.0)
    return SimpleNamespace(
        script=script, losses=list(losses), before=before, after=after, graphs=[4, 4], step=step, minibatch=minibatch
    )


def weights_ok(run, eager):
    return {name: ok for name, ok, _ in gpu_updates.weight_checks(run, eager)}


@pytest.mark.parametrize("scale", [1e-5, 1e-3])
def test_a_weight_change_is_held_to_the_size_of_eager_change(scale):
    """An update that moves weights by 1e-5 (RMSpropTF) is held as tightly as one moving them
    by 1e-3 (Adam): rounding-sized differences pass, a rate 10% off fails, and so does one
    weight of a small tensor moved as far as the whole tensor's change."""
    g = torch.Generator().manual_seed(0)
    before = [torch.randn(64, 576, generator=g) * 0.05, torch.zeros(64)]
    change = [scale * torch.randn(t.shape, generator=g) for t in before]
    eager = run_of(before, [b + c for b, c in zip(before, change)])
    noise = [c * (1 + 1e-3 * torch.randn(c.shape, generator=g)) for c in change]
    assert all(weights_ok(run_of(before, [b + c for b, c in zip(before, noise)]), eager).values())
    slower = weights_ok(run_of(before, [b + 0.9 * c for b, c in zip(before, change)]), eager)
    assert not slower["weights, whole model"]
    one_off = [c.clone() for c in change]
    one_off[1][0] += change[1].norm()  # one bias of 64: no per-tensor share of outliers lets it pass
    assert not weights_ok(run_of(before, [b + c for b, c in zip(before, one_off)]), eager)["weights 1 (64,)"]


def test_clipfrac_may_differ_by_a_sample_or_two_not_more():
    losses = torch.tensor([1.0, 0.1, 1.3, 0.0, 0.0, 0.25, 0.01])
    eager = run_of([], [], [losses], script="native", minibatch=128)

    def clipfrac_ok(samples):
        moved = losses.clone()
        moved[gpu_updates.CLIPFRAC] += samples / 128
        return dict((n, ok) for n, ok, _ in gpu_updates.loss_checks(run_of([], [], [moved]), eager))["step 0 clipfrac"]

    assert clipfrac_ok(gpu_updates.CLIP_SAMPLES) and not clipfrac_ok(gpu_updates.CLIP_SAMPLES + 1)


@pytest.fixture(scope="module")
def eager():
    return gpu_updates.updates("a2c-rmsprop-tf", False, CPU, count=2)


def checks(eager, run, **changes):
    """Each check's verdict on `run` (an eager one, as if compiled), with `changes` made to it."""
    compiled = SimpleNamespace(**{**vars(run), "step": SimpleNamespace(eager=False, seconds=1.0), **changes})
    return {name: ok for name, ok, _ in gpu_updates.compare(eager, compiled)}


def test_the_update_checks_pass_eager_against_itself_and_fail_a_change(eager):
    assert len(eager.losses) == 2 and all(checks(eager, eager).values()), checks(eager, eager)
    # the first step is held to 1e-4, later ones to 2e-3 relative plus 1e-3
    first, second = eager.losses
    assert not checks(eager, eager, losses=[first + 5e-4, second])["step 0 losses"]
    assert checks(eager, eager, losses=[first, second + 5e-4])["step 1 losses"]
    assert not checks(eager, eager, losses=[first, second + 1e-1])["step 1 losses"]
    assert not checks(eager, eager, after=eager.before)["weights, whole model"]  # no step
    assert not checks(eager, eager, step=SimpleNamespace(eager=True, seconds=None))["compiled, no eager fallback"]
    assert not checks(eager, eager, graphs=[4, 5])["compiled once"]


def test_rmsproptf_passes_weights_a_float32_step_apart_and_fails_a_rate_10_percent_off(eager):
    """RMSpropTF moves weights by ~1e-5: a rate x0.9 passed a tolerance of 1e-4 per weight."""
    with nudged("a2c-rmsprop-tf", seed=0):
        rounding = gpu_updates.updates("a2c-rmsprop-tf", False, CPU, count=2)
    assert all(checks(eager, rounding).values()), checks(eager, rounding)
    set_lr = utils.set_lr
    with mock.patch.object(utils, "set_lr", lambda optimizer, lr: set_lr(optimizer, 0.9 * lr)):
        slower = gpu_updates.updates("a2c-rmsprop-tf", False, CPU, count=2)
    assert not checks(eager, slower)["weights, whole model"]
