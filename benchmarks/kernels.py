"""Benchmark the fused Triton head path against eager torch (CleanRL's rollout step) and cuBLAS.

The head path is everything after the conv body: Linear(3136, 512) + GELU, actor and critic
heads, sampling with log-prob and entropy.

- With CUDA, for batch sizes 1 to 8,192, in fp32 and bf16, median time per call from CUDA
  events around 50 back-to-back calls (no host sync inside the timed region; every path warmed
  up first):
  - head path: fused (3 Triton kernels, uniforms given) against eager torch (CleanRL's code
    with Categorical(validate_args=False), as the scripts use it: no host sync; bf16 under
    autocast);
  - Linear + GELU alone: kernels.linear_gelu against cuBLAS (torch.addmm, then GELU), and the
    fused kernel's achieved memory bandwidth as a share of the GPU's peak (at small batches it
    streams its weight: 6.4 MB in fp32, 3.2 MB in bf16).
- Without CUDA: timing is skipped; counts kernel launches instead: Triton launches of the
  fused path (run by Triton's CPU interpreter) and aten ops dispatched by the eager path.
- Then (not with --no-aot): compiles every kernel configuration for sm_75/80/89/90 (no GPU
  needed) and prints registers, spills and shared memory per configuration.

Usage: python benchmarks/kernels.py [--no-aot]
"""

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributions import Categorical
from torch.utils._python_dispatch import TorchDispatchMode

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before triton is imported so that the kernels run in the interpreter.
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import aot  # noqa: E402

import kernels  # imports triton: only now that TRITON_INTERPRET is decided

CONV_OUT, HIDDEN = aot.CONV_OUT, aot.HIDDEN
BATCHES = (1, 2, 8, 16, 64, 256, 1024, 4096, 8192)
A = 6
# peak DRAM bandwidth by GPU name, GB/s, where torch does not report the memory clock and bus
PEAK_GBS = {"H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100 NVL": 3900, "H200": 4800, "A100-SXM4-80GB": 2039}


class HeadPath:
    """CleanRL-like head weights plus preallocated outputs for the fused path."""

    def __init__(self, B, A, device, dtype=torch.float32):
        torch.manual_seed(0)
        self.dtype = dtype
        self.fc = torch.nn.Linear(CONV_OUT, HIDDEN).to(device)
        self.gelu = torch.nn.GELU()
        self.actor = torch.nn.Linear(HIDDEN, A).to(device)
        self.critic = torch.nn.Linear(HIDDEN, 1).to(device)
        self.x = torch.randn(B, CONV_OUT, device=device).to(dtype)  # the conv features, in their dtype
        self.fc_weight = self.fc.weight.detach().to(dtype)  # the rollout's copy (kernels.inference_weights)
        self.uniform = torch.rand(B, device=device)
        self.hidden = torch.empty(B, HIDDEN, device=device)
        self.logits = torch.empty(B, A, device=device)
        self.value = torch.empty(B, device=device)
        self.action = torch.empty(B, dtype=torch.int64, device=device)
        self.logprob = torch.empty(B, device=device)
        self.entropy = torch.empty(B, device=device)

    def eager(self, x, validate_args=False):
        # CleanRL's get_action_and_value, with GELU after the hidden layer (bf16: autocast)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
            hidden = self.gelu(self.fc(x))
            logits = self.actor(hidden)
            probs = Categorical(logits=logits.float(), validate_args=validate_args)
            action = probs.sample()
            return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)

    def fused(self, x):
        kernels.linear_gelu(x, self.fc_weight, self.fc.bias, out=self.hidden)
        kernels.policy_value_heads(
            self.hidden,
            self.actor.weight,
            self.actor.bias,
            self.critic.weight,
            self.critic.bias,
            self.logits,
            self.value,
        )
        return kernels.sample_logits(self.logits, self.uniform, self.action, self.logprob, self.entropy)

    def linear_fused(self, x):
        return kernels.linear_gelu(x, self.fc_weight, self.fc.bias, out=self.hidden)

    def linear_cublas(self, x):
        return torch.ops.aten.gelu_(torch.addmm(self.fc.bias.to(self.dtype), x, self.fc_weight.t()))


class CountOps(TorchDispatchMode):
    """Counts aten ops as they are dispatched; views (t, expand, ...) launch no kernel."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__), func.is_view] += 1
        return func(*args, **(kwargs or {}))

    def summary(self):
        total = sum(self.ops.values())
        compute = sum(n for (_, view), n in self.ops.items() if not view)
        names = ", ".join(f"{name}x{n}" if n > 1 else name for (name, _), n in self.ops.items())
        return total, compute, names


def count_launches(B=8, A=6):
    path = HeadPath(B, A, "cpu")
    with torch.no_grad():
        start = time.perf_counter()
        before = kernels.triton_launch_count()
        path.fused(path.x)
        fused = kernels.triton_launch_count() - before
        seconds = time.perf_counter() - start
        # Same uniforms through the torch reference: the interpreter run must agree.
        ref = kernels.sample_logits_reference(
            kernels.policy_value_heads_reference(
                kernels.linear_gelu_reference(path.x, path.fc_weight, path.fc.bias),
                path.actor.weight,
                path.actor.bias,
                path.critic.weight,
                path.critic.bias,
            )[0],
            path.uniform,
        )
        agree = torch.equal(ref[0], path.action)
        rows = []
        for label, validate in (
            ("CleanRL default (validate_args: 2 host syncs)", None),
            ("validate_args=False (as the scripts)", False),
        ):
            with CountOps() as counter:
                path.eager(path.x, validate_args=validate)
            rows.append((label, *counter.summary()))
    print(f"Kernel launches per rollout step of the head path (B={B}, A={A}):")
    print(
        f"  fused Triton: {fused} launches (+1 torch.rand for the uniforms); "
        f"interpreter run {seconds:.1f} s, actions equal to reference: {agree}"
    )
    for label, total, compute, names in rows:
        print(f"  eager torch, {label}: {total} aten ops, {compute} non-view")
        print(f"    {names}")


def cuda_ms(fn, reps=50):
    """Median ms per call over 5 windows of `reps` back-to-back calls, timed by CUDA events (one
    host sync per window, after it); warmed up first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[2]


def peak_bandwidth_gbs():
    props = torch.cuda.get_device_properties(0)
    clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8 / 1e9  # double data rate, kHz, bits
    return next((gbs for name, gbs in PEAK_GBS.items() if name in props.name), None)


def time_cuda():
    peak = peak_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: peak memory bandwidth {f'{peak:,.0f} GB/s' if peak else 'unknown'}")
    print("median ms per call (CUDA events, 50 calls back to back); A = 6 actions")
    print(
        f"{'dtype':>5} {'B':>5} | {'eager head':>10} {'fused head':>10} {'speedup':>7} | "
        f"{'cuBLAS+GELU':>11} {'linear_gelu':>11} {'speedup':>7} {'GB/s':>7} {'of peak':>7}"
    )
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for B in BATCHES:
                path = HeadPath(B, A, "cuda", dtype)
                eager = cuda_ms(lambda p=path: p.eager(p.x))
                fused = cuda_ms(lambda p=path: p.fused(p.x))
                cublas = cuda_ms(lambda p=path: p.linear_cublas(p.x))
                linear = cuda_ms(lambda p=path: p.linear_fused(p.x))
                moved = path.fc_weight.numel() * path.fc_weight.element_size() + path.x.numel() * path.x.element_size()
                moved += path.hidden.numel() * 4
                gbs = moved / (linear * 1e-3) / 1e9
                share = f"{gbs / peak:7.0%}" if peak else f"{'-':>7}"
                name = "fp32" if dtype == torch.float32 else "bf16"
                print(
                    f"{name:>5} {B:5} | {eager:10.4f} {fused:10.4f} {eager / fused:6.2f}x | "
                    f"{cublas:11.4f} {linear:11.4f} {cublas / linear:6.2f}x {gbs:7.0f} {share}",
                    flush=True,
                )
    print(
        "fp32 dots: "
        + ("tf32x3 (tensor cores, float32 accuracy)" if kernels.capability(torch.device("cuda")) >= 80 else "ieee")
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-aot", action="store_true", help="skip the ahead-of-time compile table")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, CUDA available: {HAS_CUDA}")
    if HAS_CUDA:
        time_cuda()
    else:
        print("No CUDA device: CUDA timing was not run.")
        count_launches()
    if args.no_aot:
        return 0
    print()
    start = time.perf_counter()
    rows = aot.compile_table()
    print(f"AOT compilation for real GPUs (cubin via Triton's ptxas, {time.perf_counter() - start:.0f} s):")
    print(aot.format_table(rows))
    failed = sum(bool(r["error"]) for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} configurations compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
