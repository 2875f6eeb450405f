"""Tests for kernels.py: Triton kernels run by Triton's CPU interpreter, checked against
float64 torch, plus ahead-of-time compilation for real NVIDIA GPUs (no GPU needed).

Run: pytest -q tests/test_kernels.py (add -s to see the AOT register table).
"""

import os
import sys

# Must be set before triton is imported: @triton.jit (also for Triton's own tl.max, tl.sum,
# ...) decides at decoration time whether it makes an interpreter function or a GPU one.
_USER_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")
# If another test module imported triton without the interpreter, this process cannot run
# the kernels on CPU; then test_in_fresh_process reruns this file in a child process.
TRITON_IMPORTED_WITHOUT_INTERPRETER = "triton" in sys.modules and _USER_TRITON_INTERPRET != "1"
os.environ["TRITON_INTERPRET"] = "1"

import math
import re
import subprocess
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels
from benchmarks import aot

if not TRITON_IMPORTED_WITHOUT_INTERPRETER:
    # Other test modules keep the CPU default they would have without this file (the fast
    # torch reference); the tests below force the Triton path with `triton_on_cpu`.
    kernels.USE_TRITON_ON_CPU = _USER_TRITON_INTERPRET == "1"

NAN = float("nan")
INF = float("inf")


@pytest.fixture(autouse=True)
def triton_on_cpu(request, monkeypatch):
    if TRITON_IMPORTED_WITHOUT_INTERPRETER and request.node.name != "test_in_fresh_process":
        pytest.skip("triton was imported without TRITON_INTERPRET=1; see test_in_fresh_process")
    monkeypatch.setattr(kernels, "USE_TRITON_ON_CPU", True)


@pytest.mark.skipif(not TRITON_IMPORTED_WITHOUT_INTERPRETER, reason="runs in this process")
def test_in_fresh_process(tmp_path):
    """This file in a child process, where every test but this one must run and pass (a child
    that skipped them all would also exit 0)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", __file__],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("skipped", "failure", "error")), "passed")
        outcomes.setdefault(outcome, []).append(case.get("name"))
    skipped = outcomes.pop("skipped", [])
    assert skipped == ["test_in_fresh_process"] and set(outcomes) == {"passed"}, (skipped, outcomes)
    assert len(outcomes["passed"]) >= 100, proc.stdout[-2000:]


def randn(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def poisoned(*shape, dtype=torch.float32):
    if dtype == torch.int64:
        return torch.full(shape, -12345, dtype=dtype)
    return torch.full(shape, NAN, dtype=dtype)


def launches(fn):
    """Run fn() and return (its result, Triton launches it made)."""
    before = kernels.triton_launch_count()
    result = fn()
    return result, kernels.triton_launch_count() - before


# ---------------------------------------------------------------------------------------
# linear_gelu
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "B,K,N",
    [(1, 3136, 512), (3, 100, 40), (20, 75, 70), (200, 48, 130), (257, 3136, 512)],
)
def test_linear_gelu_matches_float64(B, K, N):
    x = randn(B, K, seed=B * 7 + K)
    weight = randn(N, K, seed=N + 1, scale=1 / math.sqrt(K))
    bias = randn(N, seed=N + 2, scale=0.5)
    out = poisoned(B, N)
    result, n = launches(lambda: kernels.linear_gelu(x, weight, bias, out=out))
    assert result is out and n == 1
    expected = torch.nn.functional.gelu(x.double() @ weight.double().T + bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5)
    reference = kernels.linear_gelu_reference(x, weight, bias, out=poisoned(B, N))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=2e-5)
    # The reference is the training network's nn.Linear + nn.GELU() op for op.
    layer = torch.nn.Linear(K, N)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
        assert torch.equal(reference, torch.nn.GELU()(layer(x)))


@pytest.mark.parametrize("B", [1, 20, 257])
def test_linear_gelu_bf16_is_what_bf16_autocast_computes(B):
    """bf16 x and weight: exact products added up in float32, and the bias, the sum and the
    GELU rounded to bfloat16, as torch.autocast runs Linear + GELU (the training network in
    bf16). Against float64 on the same operands, rounded the same way: equal but where float32
    summation lands a sum on the other side of a bf16 rounding boundary (one bf16 step)."""
    K, N = 3136, 512
    x = randn(B, K, seed=B).bfloat16()
    weight = randn(N, K, seed=B + 1, scale=1 / math.sqrt(K)).bfloat16()
    bias = randn(N, seed=B + 2, scale=0.5)
    out = poisoned(B, N)
    result, n = launches(lambda: kernels.linear_gelu(x, weight, bias, out=out))
    assert result is out and n == 1 and out.dtype == torch.float32
    bf16 = lambda t: t.bfloat16().double()  # noqa: E731
    expected = bf16(torch.nn.functional.gelu(bf16(x.double() @ weight.double().T + bf16(bias))))
    assert torch.equal(bf16(out), out.double()), "not rounded to bfloat16"
    assert (out.double() != expected).float().mean() < 0.01
    torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias))
    assert (autocast.float() != out).float().mean() < 0.01
    torch.testing.assert_close(autocast.float(), out, rtol=2**-7, atol=1e-3)
    reference = kernels.linear_gelu_reference(x, weight, bias)
    assert (reference != out).float().mean() < 0.01
    torch.testing.assert_close(reference, out, rtol=2**-7, atol=1e-3)


def test_linear_gelu_allocates_output():
    x, weight, bias = randn(5, 40, seed=1), randn(24, 40, seed=2), randn(24, seed=3)
    out, n = launches(lambda: kernels.linear_gelu(x, weight, bias))
    assert n == 1 and out.shape == (5, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out, kernels.linear_gelu_reference(x, weight, bias))


# ---------------------------------------------------------------------------------------
# policy_value_heads
# ---------------------------------------------------------------------------------------


def heads_inputs(B, H, A, seed):
    return (
        randn(B, H, seed=seed),
        randn(A, H, seed=seed + 1, scale=0.1),
        randn(A, seed=seed + 2),
        randn(1, H, seed=seed + 3, scale=0.1),
        randn(1, seed=seed + 4),
    )


HEAD_SHAPES = [(B, 512, A) for B in (1, 3) for A in (1, 4, 6, 9, 18)]
HEAD_SHAPES += [(257, 100, A) for A in (1, 4, 6, 9, 18)] + [(257, 512, 6)]


@pytest.mark.parametrize("B,H,A", HEAD_SHAPES)
def test_policy_value_heads_match_float64(B, H, A):
    h, wa, ba, wc, bc = heads_inputs(B, H, A, seed=B + H + A)
    logits_out, value_out = poisoned(B, A), poisoned(B)
    (logits, value), n = launches(lambda: kernels.policy_value_heads(h, wa, ba, wc, bc, logits_out, value_out))
    assert logits is logits_out and value is value_out and n == 1
    h64 = h.double()
    torch.testing.assert_close(logits.double(), h64 @ wa.double().T + ba.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(value.double(), (h64 @ wc.double().T + bc.double())[:, 0], rtol=1e-5, atol=1e-5)
    ref_logits, ref_value = kernels.policy_value_heads_reference(h, wa, ba, wc, bc)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-5)


def test_policy_value_heads_read_bf16_hidden_in_float32():
    h, wa, ba, wc, bc = heads_inputs(20, 512, 6, seed=3)
    h = h.bfloat16()
    logits, value = kernels.policy_value_heads(h, wa, ba, wc, bc)
    assert logits.dtype == value.dtype == torch.float32
    h64 = h.double()
    torch.testing.assert_close(logits.double(), h64 @ wa.double().T + ba.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(value.double(), (h64 @ wc.double().T + bc.double())[:, 0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# sample_logits
# ---------------------------------------------------------------------------------------


def sampling_inputs(B, A, scale, seed):
    """Logits with large magnitudes and offsets, some actions masked with -inf (never a
    whole row), and one uniform per row."""
    logits = randn(B, A, seed=seed, scale=scale)
    logits += randn(B, 1, seed=seed + 1, scale=1000.0)  # large per-row offsets
    if A > 1:
        g = torch.Generator().manual_seed(seed + 2)
        masked = torch.rand(B, A, generator=g) < 0.3
        masked[torch.arange(B), torch.randint(0, A, (B,), generator=g)] = False
        logits[masked] = -INF
    g = torch.Generator().manual_seed(seed + 3)
    return logits, torch.rand(B, generator=g)


def near_boundary(logits, uniform, tol=1e-6):
    """Rows whose uniform lies within tol of a CDF boundary (float64 truth)."""
    cdf = torch.softmax(logits.double(), dim=1).cumsum(dim=1)
    return ((cdf - uniform.double()[:, None]).abs() < tol).any(dim=1)


@pytest.mark.parametrize("scale", [1.0, 50.0])
@pytest.mark.parametrize("A", [1, 4, 6, 9, 18])
@pytest.mark.parametrize("B", [1, 3, 257])
def test_sample_logits_matches_reference_and_float64(B, A, scale):
    logits, uniform = sampling_inputs(B, A, scale, seed=B * 31 + A)
    outs = poisoned(B, dtype=torch.int64), poisoned(B), poisoned(B)
    result, n = launches(lambda: kernels.sample_logits(logits, uniform, *outs))
    assert all(r is o for r, o in zip(result, outs)) and n == 1
    action, logprob, entropy = result
    ref_action, ref_logprob, ref_entropy = kernels.sample_logits_reference(logits, uniform)
    ok = ~near_boundary(logits, uniform)
    assert ok.float().mean() > 0.9
    assert torch.equal(action[ok], ref_action[ok])
    # Never a masked action, always in range.
    assert ((action >= 0) & (action < A)).all()
    assert torch.isfinite(logits[torch.arange(B), action]).all()
    # float64 truth for the chosen actions.
    logp64 = torch.log_softmax(logits.double(), dim=1)
    p64 = logp64.exp()
    entropy64 = -torch.where(p64 > 0, p64 * logp64, 0.0).sum(dim=1)
    torch.testing.assert_close(logprob.double(), logp64[torch.arange(B), action], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), entropy64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprob[ok], ref_logprob[ok], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)


def test_sample_logits_reads_bf16_logits():
    logits, uniform = sampling_inputs(33, 6, 1.0, seed=5)
    logits = logits.bfloat16()
    action, logprob, entropy = kernels.sample_logits(logits, uniform)
    ref_action, ref_logprob, ref_entropy = kernels.sample_logits_reference(logits.float(), uniform)
    ok = ~near_boundary(logits.float(), uniform)
    assert torch.equal(action[ok], ref_action[ok])
    torch.testing.assert_close(logprob[ok], ref_logprob[ok], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampler", ["triton", "reference"])
def test_sample_logits_edge_uniforms(sampler):
    fn = kernels.sample_logits if sampler == "triton" else kernels.sample_logits_reference
    logits = torch.tensor(
        [
            [0.0, 0.0, -INF, -INF],  # u = 1: nothing left, fall back to last p > 0
            [1.0, -INF, 2.0, -INF],  # same, with a masked action in between
            [-INF, 0.0, 0.0, 5.0],  # u = 0: first action with p > 0, not the masked 0
            [-INF, -INF, 3.0, -INF],  # one possible action
        ]
    )
    uniform = torch.tensor([1.0, 1.0, 0.0, 0.7])
    action, logprob, entropy = fn(logits, uniform)
    assert action.tolist() == [1, 2, 1, 2]
    torch.testing.assert_close(logprob[3], torch.tensor(0.0))
    torch.testing.assert_close(entropy[[0, 3]], torch.tensor([math.log(2), 0.0]))


# Chi-square critical values at p = 0.001 (scipy.stats.chi2.ppf(0.999, dof)), by dof.
CHI2_CRITICAL_P001 = {5: 20.515}


@pytest.mark.parametrize("sampler", ["triton", "reference"])
def test_sample_logits_chi_square(sampler):
    fn = kernels.sample_logits if sampler == "triton" else kernels.sample_logits_reference
    draws = 20000
    row = torch.tensor([0.5, -0.3, 1.2, 0.0, -1.0, 0.7]) + 300.0
    logits = row.repeat(draws, 1).contiguous()
    uniform = torch.rand(draws, generator=torch.Generator().manual_seed(1234))
    action, _, _ = fn(logits, uniform)
    observed = torch.bincount(action, minlength=6).double()
    expected = torch.softmax(row.double(), dim=0) * draws
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    assert statistic < CHI2_CRITICAL_P001[5], (statistic, observed, expected)


# ---------------------------------------------------------------------------------------
# push_frames
# ---------------------------------------------------------------------------------------


def frames_inputs(B, seed, stack=4, size=84):
    g = torch.Generator().manual_seed(seed)
    prev = torch.randint(0, 256, (B, stack, size, size), generator=g, dtype=torch.uint8)
    frames = torch.randint(0, 256, (B, size, size), generator=g, dtype=torch.uint8)
    staged = torch.full((B, kernels.staged_row(size * size)), 77, dtype=torch.uint8)  # padding poisoned
    ended = torch.randperm(B, generator=g)[: B // 3].numpy()
    kernels.stage_frames(staged.numpy(), frames.numpy(), ended)
    return prev, frames, staged, ended


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("B, stack, size", [(1, 4, 84), (5, 4, 84), *((3, *obs) for obs in aot.OBSERVATIONS[1:])])
def test_push_frames_shifts_masks_and_scales(B, stack, size, shift, dtype):
    """The stacks move one frame on (zeros where a game ended), or are copied; x = stacks / 255
    in channels_last, as the learner's x * (1 / 255) rounds it (the interpreter rounds bf16 by
    truncation: there the kernel may be 1 bf16 ulp below the reference). At the default stack of
    4 84x84 frames and at the others the scripts are tested with (one frame: nothing to shift)."""
    prev, frames, staged, ended = frames_inputs(B, seed=B + 10 * shift + stack, stack=stack, size=size)
    obs = torch.full((B, stack, size, size), 7, dtype=torch.uint8)
    x = torch.full((B, stack, size, size), NAN, dtype=dtype).contiguous(memory_format=torch.channels_last)
    _, n = launches(lambda: kernels.push_frames(prev, staged, obs, x, shift))
    assert n == 1
    if shift:
        keep = torch.ones(B, dtype=torch.uint8)
        keep[ended] = 0
        expected = torch.cat([prev[:, 1:] * keep.view(-1, 1, 1, 1), frames[:, None]], dim=1)
    else:
        expected = prev
    assert torch.equal(obs, expected)
    learner = (expected * (1.0 / 255.0)).to(dtype)
    if dtype == torch.float32:
        assert torch.equal(x, learner)
    else:
        ulp = (learner.float() - x.float()).abs().max()
        assert ulp <= 2.0**-8, ulp
    obs_ref, x_ref = torch.empty_like(obs), torch.empty_like(x)
    kernels.push_frames_reference(prev, staged, obs_ref, x_ref, shift)
    assert torch.equal(obs_ref, expected) and torch.equal(x_ref, learner)


def test_push_frames_refuses_an_nchw_input_buffer():
    prev, _, staged, _ = frames_inputs(2, seed=1)
    with pytest.raises(ValueError, match="x_out must be channels_last"):
        kernels.push_frames(prev, staged, torch.empty_like(prev), torch.empty(2, 4, 84, 84))


# ---------------------------------------------------------------------------------------
# Dispatch, out= buffers, input checks
# ---------------------------------------------------------------------------------------


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    """Without the interpreter CPU calls launch nothing and still fill their out= buffers with
    the right values (float64 truth, as for the kernels above)."""
    monkeypatch.setattr(kernels, "USE_TRITON_ON_CPU", False)
    x, weight, bias = randn(4, 30, seed=1), randn(8, 30, seed=2), randn(8, seed=3)
    out = poisoned(4, 8)
    result, n = launches(lambda: kernels.linear_gelu(x, weight, bias, out=out))
    assert result is out and n == 0
    expected = torch.nn.functional.gelu(x.double() @ weight.double().T + bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5)
    h, wa, ba, wc, bc = heads_inputs(4, 16, 5, seed=9)
    outs = poisoned(4, 5), poisoned(4)
    result, n = launches(lambda: kernels.policy_value_heads(h, wa, ba, wc, bc, *outs))
    assert n == 0 and all(r is o for r, o in zip(result, outs))
    h64 = h.double()
    torch.testing.assert_close(outs[0].double(), h64 @ wa.double().T + ba.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1].double(), (h64 @ wc.double().T + bc.double())[:, 0], rtol=1e-5, atol=1e-5)
    logits, uniform = sampling_inputs(4, 5, 1.0, seed=4)
    outs = poisoned(4, dtype=torch.int64), poisoned(4), poisoned(4)
    result, n = launches(lambda: kernels.sample_logits(logits, uniform, *outs))
    assert n == 0 and all(r is o for r, o in zip(result, outs))
    assert not near_boundary(logits, uniform).any()
    cdf = torch.softmax(logits.double(), dim=1).cumsum(dim=1)
    assert outs[0].tolist() == (cdf <= uniform.double()[:, None]).sum(dim=1).tolist()  # the inverse CDF
    logp64 = torch.log_softmax(logits.double(), dim=1)
    entropy64 = -torch.where(logp64 > -INF, logp64.exp() * logp64, 0.0).sum(dim=1)
    torch.testing.assert_close(outs[1].double(), logp64[torch.arange(4), outs[0]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[2].double(), entropy64, rtol=1e-5, atol=1e-5)


def test_full_head_path_is_three_launches():
    x, weight, bias = randn(2, 64, seed=1), randn(32, 64, seed=2), randn(32, seed=3)
    _, wa, ba, wc, bc = heads_inputs(2, 32, 6, seed=4)

    def head_path():
        hidden = kernels.linear_gelu(x, weight, bias)
        logits, _ = kernels.policy_value_heads(hidden, wa, ba, wc, bc)
        return kernels.sample_logits(logits, torch.rand(2))

    _, n = launches(head_path)
    assert n == 3


def _bad_calls():
    """(argument named in the message, what is wrong, call) triples."""
    x, w, b = randn(3, 8, seed=1), randn(5, 8, seed=2), randn(5, seed=3)
    h, wa, ba, wc, bc = heads_inputs(3, 8, 4, seed=4)
    logits, u = randn(3, 4, seed=5), torch.rand(3)
    lg, pvh, sl = kernels.linear_gelu, kernels.policy_value_heads, kernels.sample_logits
    meta = {"device": "meta"}
    return [
        ("x", "1-D", lambda: lg(x[0], w, b)),
        ("weight", "K mismatch", lambda: lg(x, randn(5, 9, seed=6), b)),
        ("bias", "shape", lambda: lg(x, w, randn(6, seed=7))),
        ("out", "shape", lambda: lg(x, w, b, out=torch.empty(3, 6))),
        ("x", "float64", lambda: lg(x.double(), w, b)),
        ("bias", "float16", lambda: lg(x, w, b.half())),
        ("out", "float64", lambda: lg(x, w, b, out=torch.empty(3, 5).double())),
        ("x", "transposed", lambda: lg(randn(8, 3, seed=8).t(), w, b)),
        ("out", "transposed", lambda: lg(x, w, b, out=torch.empty(5, 3).t())),
        ("weight", "meta device", lambda: lg(x, torch.empty(5, 8, **meta), b)),
        ("h", "transposed", lambda: pvh(h.t(), wa, ba, wc, bc)),
        ("actor_weight", "H mismatch", lambda: pvh(h, randn(4, 9, seed=9), ba, wc, bc)),
        ("actor_bias", "float64", lambda: pvh(h, wa, ba.double(), wc, bc)),
        ("critic_weight", "2 rows", lambda: pvh(h, wa, ba, randn(2, 8, seed=10), bc)),
        (
            "critic_bias",
            "meta device",
            lambda: pvh(h, wa, ba, wc, torch.empty(1, **meta)),
        ),
        ("logits_out", "shape", lambda: pvh(h, wa, ba, wc, bc, torch.empty(3, 5))),
        (
            "value_out",
            "2-D",
            lambda: pvh(h, wa, ba, wc, bc, value_out=torch.empty(3, 1)),
        ),
        ("logits", "column slice", lambda: sl(logits[:, :2], u)),
        ("uniform", "length", lambda: sl(logits, torch.rand(4))),
        ("uniform", "float64", lambda: sl(logits, u.double())),
        ("action_out", "float32", lambda: sl(logits, u, torch.empty(3))),
        (
            "logprob_out",
            "meta",
            lambda: sl(logits, u, logprob_out=torch.empty(3, **meta)),
        ),
        ("entropy_out", "shape", lambda: sl(logits, u, entropy_out=torch.empty(2))),
        ("A (logits.shape[1])", "no actions", lambda: sl(torch.empty(3, 0), u)),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("index", range(len(BAD_CALLS)), ids=[f"{a}-{why}" for a, why, _ in BAD_CALLS])
def test_bad_inputs_raise_value_error(index):
    name, _, call = BAD_CALLS[index]
    with pytest.raises(ValueError, match="^" + re.escape(name) + " "):
        call()


def test_non_tensor_raises_type_error():
    with pytest.raises(TypeError, match="^x must be a torch.Tensor"):
        kernels.linear_gelu([[1.0]], randn(1, 1, seed=1), randn(1, seed=2))


# ---------------------------------------------------------------------------------------
# Ahead-of-time compilation for real GPUs
# ---------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for a kernel: records the constexprs, warps and stages of each launch (WIDEN,
    a workaround for the CPU interpreter only, is left out: GPUs launch WIDEN=False)."""

    def __init__(self, name, const_names, launched):
        self.name, self.const_names, self.launched = name, const_names, launched

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages=3, **_):
            consts = tuple((k, v) for k, v in zip(self.const_names, args[-len(self.const_names) :]) if k != "WIDEN")
            self.launched.add((self.name, consts, num_warps, num_stages))

        return launch


@pytest.mark.parametrize("cc", aot.CAPABILITIES)
def test_aot_configs_cover_every_launch(monkeypatch, cc):
    """The configurations compiled below are exactly those the wrappers launch at rollout
    shapes on a GPU of capability cc, in each dtype it runs (the kernels are replaced by
    recorders and the device's capability is simulated, so large batches cost nothing)."""
    launched, compiled = set(), set()
    monkeypatch.setattr(kernels, "capability", lambda device: cc)
    for name, kernel, _, consts, warps, stages in aot.configs(cc):
        compiled.add((name, tuple((k, v) for k, v in consts.items() if k != "WIDEN"), warps, stages))
        monkeypatch.setattr(kernels, name, _Recorder(name, list(kernel.arg_names[-len(consts) :]), launched))
    H, K = aot.HIDDEN, aot.CONV_OUT
    for dtype in aot.dtypes(cc):
        for B in aot.BATCHES:
            kernels.linear_gelu(torch.empty(B, K, dtype=dtype), torch.empty(H, K, dtype=dtype), torch.empty(H))
            h = torch.empty(B, H, dtype=dtype)
            for A in aot.ACTIONS:
                wa, ba, wc, bc = torch.empty(A, H), torch.empty(A), torch.empty(1, H), torch.empty(1)
                kernels.policy_value_heads(h, wa, ba, wc, bc)
                kernels.sample_logits(torch.empty(B, A), torch.empty(B))
        for stack, size in aot.OBSERVATIONS:
            prev = torch.empty(2, stack, size, size, dtype=torch.uint8)
            staged = torch.empty(2, kernels.staged_row(size * size), dtype=torch.uint8)
            x = torch.empty(2, stack, size, size, dtype=dtype).contiguous(memory_format=torch.channels_last)
            for shift in (True, False):
                kernels.push_frames(prev, staged, torch.empty_like(prev), x, shift)
    assert launched == compiled
    assert len(compiled) <= 44  # keep the number of distinct configurations small


def test_aot_compile_all_targets():
    """Every configuration compiles to cubin for sm_75, 80, 89 and 90, without register spills
    and within each target's shared memory per block."""
    rows = aot.compile_table()
    print("\n" + aot.format_table(rows))
    n_configs = sum(len(aot.configs(cc)) for cc in aot.CAPABILITIES)
    assert len(rows) == n_configs
    assert {r["target"] for r in rows} == {"sm_75", "sm_80", "sm_89", "sm_90"}
    failed = [r for r in rows if r["error"]]
    assert not failed, aot.format_table(failed)
    assert all(r["regs"] > 0 for r in rows)
    too_big = [r for r in rows if r["shared_bytes"] > r["shared_limit"] or r["spill_bytes"] > 0]
    assert not too_big, aot.format_table(too_big)
    # bf16 only where the GPU has it (sm_80 and newer): sm_75 gets fp32 ("ieee" dots)
    assert {r["dtype"] for r in rows if r["target"] == "sm_75" and r["kernel"] == "linear_gelu_kernel"} == {"fp32"}
