"""tests/gpu_updates.py (the GPU tier's compiled-update test, run in a child process) on CPU: its
eager updates run, and its checks pass a run equal to eager, allow rounding, and fail a change."""

from types import SimpleNamespace

import gpu_updates
import pytest
import torch

CPU = torch.device("cpu")


def test_close_but_a_few_allows_rounding_on_a_few_weights_only():
    want = torch.linspace(-1, 1, 10_000)
    assert gpu_updates.close_but_a_few(want + 5e-5, want)[0]  # rounding everywhere
    few = want.clone()
    few[:5] += 1e-3  # 0.05% a GPU rounding apart
    assert gpu_updates.close_but_a_few(few, want)[0]
    many = want.clone()
    many[:20] += 1e-3  # 0.2%
    assert not gpu_updates.close_but_a_few(many, want)[0]
    far = want.clone()
    far[0] += 0.1  # one weight moved for real
    assert not gpu_updates.close_but_a_few(far, want)[0]


@pytest.fixture(scope="module")
def eager():
    return gpu_updates.updates("a2c-rmsprop-tf", False, CPU, count=2)


def checks(eager, losses=None, weights=None):
    compiled = (losses or eager[0], weights or eager[1], [4, 4], SimpleNamespace(eager=False, seconds=1.0))
    return {name: ok for name, ok, _ in gpu_updates.compare(eager, compiled)}


def test_the_update_checks_pass_eager_against_itself_and_fail_a_change(eager):
    assert len(eager[0]) == 2 and all(checks(eager).values()), checks(eager)
    # the first step is held to 1e-4, later ones to 2e-3 relative plus 1e-3
    assert not checks(eager, losses=[eager[0][0] + 5e-4, eager[0][1]])["step 0 losses"]
    assert checks(eager, losses=[eager[0][0], eager[0][1] + 5e-4])["step 1 losses"]
    assert not checks(eager, losses=[eager[0][0], eager[0][1] + 1e-1])["step 1 losses"]
    moved = [w + 1e-3 for w in eager[1]]
    assert not any(ok for name, ok in checks(eager, weights=moved).items() if name.startswith("weights"))
    fallback = (*eager[:3], SimpleNamespace(eager=True, seconds=None))
    assert not dict((n, ok) for n, ok, _ in gpu_updates.compare(eager, fallback))["compiled, no eager fallback"]
