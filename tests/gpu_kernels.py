"""Every Triton kernel compiled for this GPU (not interpreted) against its torch reference and
float64, at batch sizes 1 to 8,192, in fp32 and bf16, at storage offsets that change the
pointers' 16-byte alignment (Triton specializes on it). Run by tests/test_gpu.py in a fresh
process, because a test module that sets TRITON_INTERPRET=1 makes every kernel of its
process an interpreted one. Also runnable alone: python tests/gpu_kernels.py
Prints one line per check and exits 1 if any failed.
"""

import math
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kernels  # noqa: E402
from benchmarks import aot  # noqa: E402

BATCHES = (1, 2, 3, 8, 16, 17, 64, 100, 256, 1024, 4096, 8192)
ACTIONS = (4, 6, 18)
FAILURES = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def offset_view(t, offset):
    """t's values in a fresh buffer, starting `offset` elements in (so its address moves)."""
    flat = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = flat[offset:].view(t.shape)
    view.copy_(t)
    return view


def main():
    device = torch.device("cuda")
    cc = kernels.capability(device)
    print(f"{torch.cuda.get_device_name()} (sm_{cc}), torch {torch.__version__}, triton {kernels.triton.__version__}")
    g = torch.Generator(device=device).manual_seed(0)
    dtypes = aot.dtypes(cc)
    for dtype in dtypes:
        for B in BATCHES:
            K, N = aot.CONV_OUT, aot.HIDDEN
            x = torch.randn(B, K, generator=g, device=device).to(dtype)
            w = (torch.randn(N, K, generator=g, device=device) / math.sqrt(K)).to(dtype)
            b = torch.randn(N, generator=g, device=device) * 0.5
            out = torch.full((B, N), float("nan"), device=device)
            kernels.linear_gelu(offset_view(x, B % 4), w, b, out=out)
            expected = torch.nn.functional.gelu(x.double() @ w.double().T + b.double())
            error = (out.double() - expected).abs().max().item()
            # tf32x3 and bf16 (exact products) add up in float32: float32 accuracy
            check(f"linear_gelu {dtype} B={B}", error < 5e-5, f"max error {error:.2e}")
            h = torch.randn(B, N, generator=g, device=device).to(dtype)
            for A in ACTIONS:
                wa, ba = torch.randn(A, N, generator=g, device=device) * 0.1, torch.randn(A, generator=g, device=device)
                wc, bc = torch.randn(1, N, generator=g, device=device) * 0.1, torch.randn(1, generator=g, device=device)
                logits, value = kernels.policy_value_heads(offset_view(h, A), wa, ba, wc, bc)
                h64 = h.double()
                ref_logits, ref_value = h64 @ wa.double().T + ba.double(), (h64 @ wc.double().T + bc.double())[:, 0]
                error = max((logits - ref_logits).abs().max().item(), (value - ref_value).abs().max().item())
                check(f"policy_value_heads {dtype} B={B} A={A}", error < 1e-4, f"max error {error:.2e}")
                uniform = torch.rand(B, generator=g, device=device)
                action, logprob, entropy = kernels.sample_logits(offset_view(logits, 1), offset_view(uniform, 3))
                ref_action, ref_logprob, ref_entropy = kernels.sample_logits_reference(logits, uniform)
                cdf = torch.softmax(logits.double(), 1).cumsum(1)
                clear = ~((cdf - uniform.double()[:, None]).abs() < 1e-5).any(1)  # not at a CDF boundary
                same = torch.equal(action[clear], ref_action[clear])
                error = (entropy - ref_entropy).abs().max().item()
                if clear.any():
                    error = max(error, (logprob - ref_logprob)[clear].abs().max().item())
                check(f"sample_logits B={B} A={A}", same and error < 1e-4, f"max error {error:.2e}")
        for B in (1, 2, 7, 64, 512):
            prev = torch.randint(0, 256, (B, 4, 84, 84), generator=g, device=device, dtype=torch.uint8)
            frames = torch.randint(0, 256, (B, 84, 84), dtype=torch.uint8)
            staged_host = torch.empty(B, kernels.STAGED_ROW, dtype=torch.uint8)
            ended = list(range(0, B, 3))
            kernels.stage_frames(staged_host.numpy(), frames.numpy(), ended)
            staged = staged_host.to(device)
            for shift in (True, False):
                obs = torch.empty_like(prev)
                x = torch.empty(B, 4, 84, 84, dtype=dtype, device=device).contiguous(memory_format=torch.channels_last)
                kernels.push_frames(prev, staged, obs, x, shift)
                obs_ref, x_ref = torch.empty_like(obs), torch.empty_like(x)
                kernels.push_frames_reference(prev, staged, obs_ref, x_ref, shift)
                learner = (obs_ref * (1.0 / 255.0)).to(dtype)
                exact = torch.equal(obs, obs_ref) and torch.equal(x, x_ref) and torch.equal(x, learner)
                check(f"push_frames {dtype} B={B} shift={shift}", exact)
    if FAILURES:
        print(f"{len(FAILURES)} failed: {', '.join(FAILURES[:10])}")
        sys.exit(1)
    print("all kernel checks passed")


if __name__ == "__main__":
    main()
