"""Benchmark the fused Triton head path against eager torch (CleanRL's rollout step).

The head path is everything after the conv body: Linear(3136, 512) + GELU, actor and
critic heads, sampling with log-prob and entropy.

- With CUDA: times fused (3 Triton kernels + 1 torch.rand), eager torch and torch.compile
  with triton.testing.do_bench at rollout shapes, printed as a table.
- Without CUDA: timing is skipped; counts kernel launches instead: Triton launches of the
  fused path (run by Triton's CPU interpreter) and aten ops dispatched by the eager path.
- Always: compiles every kernel configuration for sm_75/80/89/90 (no GPU needed) and prints
  registers, spills and shared memory per configuration.

Usage: python benchmarks/kernels.py
"""

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
import kernels  # imports triton: only now that TRITON_INTERPRET is decided

CONV_OUT, HIDDEN = kernels.CONV_OUT, kernels.HIDDEN
BATCHES = (2, 8, 16, 64, 256, 1024, 4096)
ACTIONS = (4, 6, 9, 18)


class HeadPath:
    """CleanRL-like head weights plus preallocated outputs for the fused path."""

    def __init__(self, B, A, device):
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(CONV_OUT, HIDDEN).to(device)
        self.gelu = torch.nn.GELU()
        self.actor = torch.nn.Linear(HIDDEN, A).to(device)
        self.critic = torch.nn.Linear(HIDDEN, 1).to(device)
        self.x = torch.randn(B, CONV_OUT, device=device)
        self.uniform = torch.empty(B, device=device)
        self.hidden = torch.empty(B, HIDDEN, device=device)
        self.logits = torch.empty(B, A, device=device)
        self.value = torch.empty(B, device=device)
        self.action = torch.empty(B, dtype=torch.int64, device=device)
        self.logprob = torch.empty(B, device=device)
        self.entropy = torch.empty(B, device=device)

    def eager(self, x, validate_args=None):
        # CleanRL's get_action_and_value, with GELU after the hidden layer.
        hidden = self.gelu(self.fc(x))
        logits = self.actor(hidden)
        probs = Categorical(logits=logits, validate_args=validate_args)
        action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)

    def fused(self, x):
        torch.rand(self.uniform.shape, out=self.uniform, device=self.uniform.device)
        kernels.linear_gelu(x, self.fc.weight, self.fc.bias, out=self.hidden)
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
                kernels.linear_gelu_reference(path.x, path.fc.weight, path.fc.bias),
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
            ("CleanRL default", None),
            ("validate_args=False", False),
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


def time_cuda():
    from triton.testing import do_bench

    print("CUDA timings, median ms per head path (fused includes torch.rand):")
    print(f"{'B':>5} {'A':>3} {'eager':>8} {'compile':>8} {'fused':>8} {'speedup':>8}")
    with torch.no_grad():
        for B in BATCHES:
            for A in ACTIONS:
                path = HeadPath(B, A, "cuda")
                eager = do_bench(lambda p=path: p.eager(p.x), return_mode="median")
                torch._dynamo.reset()  # one fresh compile per shape, no recompile limit
                compiled_fn = torch.compile(path.eager)
                try:
                    compiled_fn(path.x)
                    compiled = do_bench(lambda f=compiled_fn, p=path: f(p.x), return_mode="median")
                    compiled_text = f"{compiled:8.4f}"
                except Exception as exc:  # noqa: BLE001  (report and keep benchmarking)
                    compiled_text = f"{'n/a':>8}"
                    print(f"  torch.compile failed at B={B} A={A}: {type(exc).__name__}")
                fused = do_bench(lambda p=path: p.fused(p.x), return_mode="median")
                print(f"{B:5} {A:3} {eager:8.4f} {compiled_text} {fused:8.4f} {eager / fused:7.2f}x")


def main():
    print(f"torch {torch.__version__}, CUDA available: {HAS_CUDA}")
    if HAS_CUDA:
        time_cuda()
    else:
        print("No CUDA device: CUDA timing was not run.")
        count_launches()
    print()
    start = time.perf_counter()
    rows = kernels.aot_compile_table()
    print(f"AOT compilation for real GPUs (cubin via Triton's ptxas, {time.perf_counter() - start:.0f} s):")
    print(kernels.format_aot_table(rows))
    failed = sum(bool(r["error"]) for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} configurations compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
