"""tests/gpu_kernels.py's checks (the GPU tier's Triton test) run on CPU against kernels.py's
torch references, which compute what the kernels are specified to: every check must pass on
them, and must fail an output that breaks the specification."""

import math

import gpu_kernels
import pytest
import torch

import kernels

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def references(monkeypatch):
    """The wrappers call the torch references on CPU (test_kernels may have turned Triton on)."""
    monkeypatch.setattr(kernels, "USE_TRITON_ON_CPU", False)


def test_every_check_passes_on_the_references():
    results = list(gpu_kernels.run(CPU, (torch.float32, torch.bfloat16), (1, 2, 17, 100), (4, 18), (1, 7)))
    assert len(results) == 2 * (4 * (1 + 2 * 2) + 2 * len(gpu_kernels.aot.OBSERVATIONS) * 2)
    failed = [(name, detail) for name, ok, detail in results if not ok]
    assert not failed, failed


def bf16_operands(B, seed):
    g = torch.Generator().manual_seed(seed)
    K, N = 3136, 512
    x = torch.randn(B, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / math.sqrt(K)).bfloat16()
    return x, w, torch.randn(N, generator=g) * 0.5


@pytest.mark.parametrize("B", [1, 2, 17])
def test_bf16_linear_gelu_is_held_to_its_rounding_not_to_float32(B):
    """bf16 output is rounded by specification (about 1e-2 off float64 at |y| of 2 to 4), so the
    float32 rule (5e-5 against unrounded float64) fails even the reference; the bf16 rule
    passes it and fails an output left unrounded, or one a bf16 step off."""
    x, w, b = bf16_operands(B, seed=B)
    out = kernels.linear_gelu(x, w, b)
    unrounded = torch.nn.functional.gelu(x.double() @ w.double().T + b.double())
    assert (out.double() - unrounded).abs().max() > gpu_kernels.FP32_TOLERANCE
    assert gpu_kernels.check_linear_gelu(out, x, w, b)[0]
    float32 = kernels.linear_gelu_reference(x.float(), w.float(), b)
    assert not gpu_kernels.check_linear_gelu(float32, x, w, b)[0]
    step_up = (out * (1 + 2**-7)).bfloat16().float()
    assert not gpu_kernels.check_linear_gelu(step_up, x, w, b)[0]
    far = out.clone()
    far[0, out[0].abs().argmax()] *= 1 + 5 * 2**-7  # one output 5 steps off
    assert not gpu_kernels.check_linear_gelu(far.bfloat16().float(), x, w, b)[0]


def test_fp32_linear_gelu_keeps_float32_accuracy():
    x, w, b = (t.float() for t in bf16_operands(3, seed=5))
    out = kernels.linear_gelu(x, w, b)
    assert gpu_kernels.check_linear_gelu(out, x, w, b)[0]
    assert not gpu_kernels.check_linear_gelu(out + 1e-4, x, w, b)[0]


def test_float32_sum_error_bounds_a_float32_sum():
    """SUM_SAFETY sqrt(K) 2**-24 sum |x w|: sqrt(4) 2**-24 4 for ones, above float32's real error
    in other orders too, and far below the worst case K 2**-23 sum |x w|."""
    ones = torch.ones(1, 4)
    expected = gpu_kernels.SUM_SAFETY * 2 * 2**-24 * 4
    assert gpu_kernels.float32_sum_error(ones, torch.ones(2, 4)).tolist() == [[expected] * 2]
    x, w, _ = (t.float() for t in bf16_operands(17, seed=3))
    bound = gpu_kernels.float32_sum_error(x, w)
    for chunk in (64, 3136):  # K in blocks, as a kernel sums; in one addmm
        total = sum(x[:, k : k + chunk] @ w[:, k : k + chunk].T for k in range(0, 3136, chunk))
        assert ((total - x.double() @ w.double().T).abs() <= 0.25 * bound).all()
    assert (bound < 0.05 * 3136 * 2**-23 * (x.abs().double() @ w.abs().double().T)).all()


def test_bf16_linear_gelu_fails_one_column_off_and_a_transposed_block():
    """Slips that touch few outputs, which the 1% rule cannot see: one column's bias off by
    0.01 (benchmarks/check_power.py: from B = 17), a 64x64 weight block transposed."""
    x, w, b = bf16_operands(64, seed=4)
    assert gpu_kernels.check_linear_gelu(kernels.linear_gelu(x, w, b), x, w, b)[0]
    off = b.clone()
    off[0] += 0.01
    assert not gpu_kernels.check_linear_gelu(kernels.linear_gelu(x, w, off), x, w, b)[0]
    swapped = w.clone()
    swapped[:64, :64] = w[:64, :64].T
    assert not gpu_kernels.check_linear_gelu(kernels.linear_gelu(x, swapped, b), x, w, b)[0]


def test_bf16_linear_gelu_allows_float32s_summation_error_where_a_sum_cancels():
    """Where x @ w.T + b nearly cancels, a float32 sum a few float32 steps of sum |x w| off is
    many bf16 steps of the sum off: the check allows it there, as the kernel sums in float32."""
    x, w, b = bf16_operands(2, seed=2)
    total = x.double() @ w.double().T + b.double()
    i, j = divmod(total.abs().argmin().item(), total.shape[1])
    b[j] -= total[i, j]  # output [i, j] now sums to (nearly) 0
    out = kernels.linear_gelu(x, w, b)
    off = out.clone()
    shift = 0.5 * gpu_kernels.float32_sum_error(x, w)[i, j]
    off[i, j] = torch.nn.functional.gelu(shift).bfloat16().float()  # the sum off by `shift`
    assert gpu_kernels.check_linear_gelu(out, x, w, b)[0]
    assert gpu_kernels.check_linear_gelu(off, x, w, b)[0], gpu_kernels.check_linear_gelu(off, x, w, b)
    off[i, j] = torch.nn.functional.gelu(8 * shift).bfloat16().float()  # beyond the bound (GELU' is 0.5 at 0)
    assert not gpu_kernels.check_linear_gelu(off, x, w, b)[0]
