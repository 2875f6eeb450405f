"""Every Triton kernel compiled for this GPU (not interpreted) against its torch reference and
float64, at batch sizes 1 to 8,192, in fp32 and bf16, at storage offsets that change the
pointers' 16-byte alignment (Triton specializes on it), the frame stacks at every shape of
aot.OBSERVATIONS. Run by tests/test_gpu.py in a fresh process, because a test module that sets
TRITON_INTERPRET=1 makes every kernel of its process an interpreted one. Also runnable alone:
python tests/gpu_kernels.py [fp32] [bf16] (both by default; bf16 only from sm_80). Prints one
line per check and exits 1 if any failed.

Each check holds a kernel to what it is specified to compute (kernels.py's docstrings), so the
same checks run on CPU against the torch references (tests/test_gpu_kernel_checks.py). Each
tolerance follows from the rounding the specification leaves free. fp32: float32's accuracy
against float64. bf16 linear_gelu: equal to the rounded float64 reference but for at most 1% of
outputs (a float32 sum on the other side of a bf16 rounding boundary), those within 3 bf16 steps
plus GELU's carry of float32's summation error, bounded as rounding errors add up in practice
(float32_sum_error: about sqrt(K) u sum |x w|, not the worst case K u sum |x w|, which would
let a column's bias 0.01 off pass). benchmarks/check_power.py shows the slips that fail it and
the summation orders that pass (benchmarks/results/gpu_check_power.md).
"""

import itertools
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kernels  # noqa: E402
from benchmarks import aot  # noqa: E402

BATCHES = (1, 2, 3, 8, 16, 17, 64, 100, 256, 1024, 4096, 8192)
ACTIONS = (4, 6, 18)
FRAME_BATCHES = (1, 2, 7, 64, 512)
FP32_TOLERANCE = 5e-5  # tf32x3 and ieee add exact-enough products in float32: float32 accuracy
BF16_STEP = 2.0**-7  # one bfloat16 step (ulp) is at most this fraction of the value
GELU_SLOPE = 1.13  # the largest |GELU'|: how far GELU carries an error of its input
SUM_SAFETY = 4  # float32_sum_error's margin over a random walk's typical size


def offset_view(t, offset):
    """t's values in a fresh buffer, starting `offset` elements in (so its address moves)."""
    flat = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = flat[offset:].view(t.shape)
    view.copy_(t)
    return view


def bf16(t):
    """t rounded to the nearest bfloat16 (ties to even), as float64."""
    return t.to(torch.bfloat16).double()


def float32_sum_error(x, w):
    """A bound on float32's rounding error in each sum of x @ w.T, [B, N] in float64: each of the
    K additions rounds its partial sum (at most sum |x w|) by at most u = 2**-24, with signs
    that do not conspire, so the errors add up like a random walk's steps: sqrt(K) u sum |x w|,
    times SUM_SAFETY for the tail of millions of sums and for a biased rounding (toward zero)."""
    return SUM_SAFETY * math.sqrt(x.shape[1]) * 2.0**-24 * (x.double().abs() @ w.double().abs().T)


def linear_gelu_bound(x, w, total):
    """How far a bf16 output may be from the rounded reference where a float32 sum rounds to the
    other side (see check_linear_gelu): `total` is the reference's rounded sum, in float64."""
    return 3 * BF16_STEP * total.abs() + GELU_SLOPE * float32_sum_error(x, w) + 1e-6


def check_linear_gelu(out, x, w, b):
    """(ok, detail): out = linear_gelu(x, w, b) against float64 on the same operands.

    float32: within FP32_TOLERANCE of gelu(x @ w.T + b). bfloat16: the kernel rounds the bias,
    the sum and the GELU to bfloat16 (as bf16 autocast does), so the float64 reference is
    rounded the same way; out must be bfloat16 values, equal to it but for at most 1% of them,
    where a float32 sum lands on the other side of a bf16 rounding boundary. There the sum is
    one bf16 step (<= 2**-7 |sum|) off, GELU (slope <= 1.13) carries it over, and both GELUs are
    rounded (half a step each): within 3 steps of the rounded sum, by construction, plus what
    float32's own summation error (float32_sum_error) moves it, carried over by GELU: where the
    sum nearly cancels, that error is larger than a step of the sum."""
    if x.dtype == torch.float32:
        expected = torch.nn.functional.gelu(x.double() @ w.double().T + b.double())
        error = (out.double() - expected).abs().max().item()
        return error < FP32_TOLERANCE, f"max error {error:.2e}"
    total = bf16(x.double() @ w.double().T + bf16(b))
    expected = bf16(torch.nn.functional.gelu(total))
    out64 = out.double()
    representable = torch.equal(bf16(out64), out64)
    error = (out64 - expected).abs()
    bound = linear_gelu_bound(x, w, total)
    apart = (error > 0).double().mean().item()
    ok = representable and apart <= 0.01 and bool((error <= bound).all())
    return ok, f"max error {error.max().item():.2e}, {apart:.2%} one rounding apart" + (
        "" if representable else ", not rounded to bfloat16"
    )


def check_heads(logits, value, h, wa, ba, wc, bc):
    """(ok, detail): the heads read h in float32 and add up in float32, against float64."""
    h64 = h.double()
    ref_logits, ref_value = h64 @ wa.double().T + ba.double(), (h64 @ wc.double().T + bc.double())[:, 0]
    error = max((logits - ref_logits).abs().max().item(), (value - ref_value).abs().max().item())
    return error < 1e-4, f"max error {error:.2e}"


def check_sample(action, logprob, entropy, logits, uniform):
    """(ok, detail): the same action as the reference's rule wherever the uniform is not at a
    CDF boundary (float rounding may put it on either side there), log-prob and entropy close."""
    ref_action, ref_logprob, ref_entropy = kernels.sample_logits_reference(logits, uniform)
    cdf = torch.softmax(logits.double(), 1).cumsum(1)
    clear = ~((cdf - uniform.double()[:, None]).abs() < 1e-5).any(1)
    same = torch.equal(action[clear], ref_action[clear])
    error = (entropy - ref_entropy).abs().max().item()
    if clear.any():
        error = max(error, (logprob - ref_logprob)[clear].abs().max().item())
    return same and error < 1e-4, f"max error {error:.2e}" + ("" if same else ", another action")


def check_push(obs, x, prev, staged, shift, dtype):
    """(ok, detail): the stacks and the network's input equal the reference's to the bit, and
    the input is what the learner computes, uint8 * (1 / 255) in float32 rounded once to dtype."""
    obs_ref, x_ref = torch.empty_like(obs), torch.empty_like(x)
    kernels.push_frames_reference(prev, staged, obs_ref, x_ref, shift)
    learner = (obs_ref * (1.0 / 255.0)).to(dtype)
    exact = torch.equal(obs, obs_ref) and torch.equal(x, x_ref) and torch.equal(x, learner)
    return exact, ""


def run(device, dtypes, batches=BATCHES, actions=ACTIONS, frame_batches=FRAME_BATCHES, observations=aot.OBSERVATIONS):
    """Every check on `device`, yielded as (name, ok, detail) in order: the kernels on a GPU,
    the torch references on a CPU (where the wrappers call them)."""
    g = torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes:
        for B in batches:
            K, N = aot.CONV_OUT, aot.HIDDEN
            x = torch.randn(B, K, generator=g, device=device).to(dtype)
            w = (torch.randn(N, K, generator=g, device=device) / math.sqrt(K)).to(dtype)
            b = torch.randn(N, generator=g, device=device) * 0.5
            out = torch.full((B, N), float("nan"), device=device)
            kernels.linear_gelu(offset_view(x, B % 4), w, b, out=out)
            yield f"linear_gelu {dtype} B={B}", *check_linear_gelu(out, x, w, b)
            h = torch.randn(B, N, generator=g, device=device).to(dtype)
            for A in actions:
                wa, ba = torch.randn(A, N, generator=g, device=device) * 0.1, torch.randn(A, generator=g, device=device)
                wc, bc = torch.randn(1, N, generator=g, device=device) * 0.1, torch.randn(1, generator=g, device=device)
                logits, value = kernels.policy_value_heads(offset_view(h, A), wa, ba, wc, bc)
                checked = check_heads(logits, value, h, wa, ba, wc, bc)
                yield f"policy_value_heads {dtype} B={B} A={A}", *checked
                uniform = torch.rand(B, generator=g, device=device)
                sampled = kernels.sample_logits(offset_view(logits, 1), offset_view(uniform, 3))
                yield f"sample_logits {dtype} B={B} A={A}", *check_sample(*sampled, logits, uniform)
        for B, (stack, size) in itertools.product(frame_batches, observations):
            prev = torch.randint(0, 256, (B, stack, size, size), generator=g, device=device, dtype=torch.uint8)
            frames = torch.randint(0, 256, (B, size, size), dtype=torch.uint8)
            staged_host = torch.empty(B, kernels.staged_row(size * size), dtype=torch.uint8)
            kernels.stage_frames(staged_host.numpy(), frames.numpy(), list(range(0, B, 3)))
            staged = staged_host.to(device)
            for shift in (True, False):
                obs = torch.empty_like(prev)
                x = torch.empty_like(prev, dtype=dtype, memory_format=torch.channels_last)
                kernels.push_frames(prev, staged, obs, x, shift)
                name = f"push_frames {dtype} B={B} {stack}x{size}x{size} shift={shift}"
                yield name, *check_push(obs, x, prev, staged, shift, dtype)


def main():
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    device = torch.device("cuda")
    cc = kernels.capability(device)
    print(f"{torch.cuda.get_device_name()} (sm_{cc}), torch {torch.__version__}, triton {kernels.triton.__version__}")
    # one dtype per process (fp32 or bf16) lets the GPU tier run both at once
    names = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if any(arg not in names for arg in sys.argv[1:]):
        print(f"usage: python tests/gpu_kernels.py [{' | '.join(names)}]...", file=sys.stderr)
        sys.exit(2)
    dtypes = [dtype for dtype in aot.dtypes(cc) if not sys.argv[1:] or dtype in {names[a] for a in sys.argv[1:]}]
    failures = []
    for name, ok, detail in run(device, dtypes):
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            failures.append(name)
    if failures:
        print(f"{len(failures)} failed: {', '.join(failures[:10])}")
        sys.exit(1)
    print("all kernel checks passed")


if __name__ == "__main__":
    main()
