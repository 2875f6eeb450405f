"""Whether the GPU tier's checks (tests/gpu_updates.py, tests/gpu_kernels.py) fail the slips
GPU_REVIEW.md names and pass rounding-sized differences, on CPU at the tests' shapes, as each
check's largest ratio of error to tolerance (above 1 fails). Run: python benchmarks/check_power.py
[--runs 50] > benchmarks/results/gpu_check_power.md
"""

import argparse
import math
import os
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import gpu_kernels  # noqa: E402
import gpu_updates  # noqa: E402

import a2c_atari as a2c  # noqa: E402
import kernels  # noqa: E402
import ppo_atari_native as native  # noqa: E402
import utils  # noqa: E402

CPU = torch.device("cpu")
STAND_INS = """Each cell is a check's largest ratio of error to tolerance (above 1 fails). Rounding stands in
for a GPU's: for the compiled updates, eager runs from initial weights each moved a float32 step
up or down at random (a ReLU input near 0 flips, and the optimizer carries it on), on one or two
threads, channels_last or contiguous, against one eager run; for the kernel, the float32 sum in
other orders, and a tensor core's 16-product chunks added to a float32 accumulator rounded
toward zero.
"""
OPTIMIZERS = {"native": torch.optim.Adam, "a2c-rmsprop": torch.optim.RMSprop, "a2c-rmsprop-tf": a2c.RMSpropTF}


# ----------------------------------------------------------------------------- the update checks
def update_ratio(run, eager):
    """The weight checks' largest ratio of error to tolerance, that check's name, and the names of
    every check failed."""
    ratio, name = max((error / tolerance, name) for name, error, tolerance in gpu_updates.weight_errors(run, eager))
    checks = [*gpu_updates.loss_checks(run, eager), *gpu_updates.weight_checks(run, eager)]
    return ratio, name, [name for name, ok, _ in checks if not ok]


def nudged(script, seed):
    """The script's Agent with every initial weight moved one float32 step up or down at random."""
    module = native if script == "native" else a2c
    agent_class = module.Agent

    def make(*args):
        agent = agent_class(*args)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in agent.parameters():
                up = torch.rand(p.shape, generator=g) < 0.5
                p.copy_(torch.where(up, torch.nextafter(p, p + 1), torch.nextafter(p, p - 1)))
        return agent

    return mock.patch.object(module, "Agent", make)


def skip_steps(script, which):
    """The optimizer's step skipped where which(call index) says."""
    cls = OPTIMIZERS[script]
    step, calls = cls.step, []

    def maybe_step(self, *args, **kwargs):
        calls.append(None)
        if not which(len(calls) - 1):
            return step(self, *args, **kwargs)

    return mock.patch.object(cls, "step", maybe_step)


def slips(script, steps):
    """name -> a context manager that injects it into gpu_updates.updates."""
    set_lr, first = utils.set_lr, []

    def unannealed(optimizer, lr):
        first.append(lr)
        set_lr(optimizer, first[0])

    return {
        "rate x0.9": mock.patch.object(utils, "set_lr", lambda optimizer, lr: set_lr(optimizer, 0.9 * lr)),
        "rate not annealed": mock.patch.object(utils, "set_lr", unannealed),
        "gradient not clipped": mock.patch.object(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: None),
        "no zero_grad": mock.patch.object(torch.optim.Optimizer, "zero_grad", lambda *a, **k: None),
        "no step": skip_steps(script, lambda i: True),
        "the last step skipped": skip_steps(script, lambda i: i == steps - 1),
    }


def update_power(runs):
    rows, stand_in = {}, {}
    for script in OPTIMIZERS:
        torch.set_num_threads(1)
        eager = gpu_updates.updates(script, False, CPU)
        for name, slip in slips(script, eager.steps).items():
            with slip:
                rows.setdefault(name, {})[script] = update_ratio(gpu_updates.updates(script, False, CPU), eager)
            print(f"{script} {name}: {rows[name][script]}", file=sys.stderr, flush=True)
        worst, failures = (0.0, ""), []
        for seed in range(runs):
            # rounding: weights a float32 step apart; every other run on 2 threads, every 4th
            # pair contiguous (the test's layout is channels_last)
            torch.set_num_threads(1 + seed % 2)
            layout = torch.contiguous_format if seed % 4 >= 2 else torch.channels_last
            with nudged(script, seed):
                run = gpu_updates.updates(script, False, CPU, memory_format=layout)
            ratio, name, failed = update_ratio(run, eager)
            worst = max(worst, (ratio, f"run {seed}, {name}"))
            failures += [f"run {seed}: {', '.join(failed)}"] if failed else []
            print(f"{script} stand-in {seed}: {ratio:.3f} {failed}", file=sys.stderr, flush=True)
        stand_in[script] = (worst, failures)
    return rows, stand_in


# ----------------------------------------------------------------------------- the bf16 linear_gelu check
def operands(B, seed=0):
    """As gpu_kernels.run makes them: x, w bfloat16, b float32."""
    g = torch.Generator().manual_seed(seed)
    K, N = 3136, 512
    x = torch.randn(B, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / math.sqrt(K)).bfloat16()
    return x, w, torch.randn(N, generator=g) * 0.5


def rounded_gelu(total, tanh=False):
    """The specification after the sum: round, GELU, round (float32 in, float32 out)."""
    gelu = torch.nn.functional.gelu(total.bfloat16().float(), approximate="tanh" if tanh else "none")
    return gelu.bfloat16().float()


def chunked_sum(x, w, chunk):
    """x @ w.T in float32, K in chunks of `chunk`, each chunk's float32 sum added in order."""
    total = torch.zeros(x.shape[0], w.shape[0])
    for k in range(0, x.shape[1], chunk):
        total += x[:, k : k + chunk].float() @ w[:, k : k + chunk].float().T
    return total


def truncated_sum(x, w, chunk=16):
    """A tensor core's way: each chunk of 16 products summed exactly, added to a float32
    accumulator that is rounded toward zero (the worst rounding, biased)."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for k in range(0, x.shape[1], chunk):
        exact = acc + x[:, k : k + chunk].double() @ w[:, k : k + chunk].double().T
        nearest = exact.float()
        acc = torch.where(nearest.double().abs() > exact.abs(), torch.nextafter(nearest, torch.zeros(())), nearest)
        acc = acc.double()
    return acc.float()


def kernel_slips():
    """name -> out(x, w, b): the reference with one slip."""
    reference = kernels.linear_gelu_reference

    def bias_column(delta):
        return lambda x, w, b: reference(x, w, b + delta * (torch.arange(b.numel()) == 0))

    def transposed_block(x, w, b):
        w = w.clone()
        w[:64, :64] = w[:64, :64].T.clone()  # a weight tile read with its strides swapped
        return reference(x, w, b)

    def dropped_tail(x, w, b):
        x = x.clone()
        x[:, -(x.shape[1] % 128) :] = 0  # K = 3136 = 24 * 128 + 64: the last 64 left out
        return reference(x, w, b)

    def double_rounding(x, w, b):  # the sum rounded to bfloat16 before the bias is added, and after
        return rounded_gelu(chunked_sum(x, w, x.shape[1]).bfloat16().float() + b.bfloat16().float())

    rows = {f"column 0's bias off by {d:g}": bias_column(d) for d in (0.005, 0.01, 0.02)}
    rows |= {
        "a 64x64 weight block transposed": transposed_block,
        "no bias": lambda x, w, b: reference(x, w, torch.zeros_like(b)),
        "the bias doubled": lambda x, w, b: reference(x, w, 2 * b),
        "the K tail (last 64) dropped": dropped_tail,
        "tanh GELU": lambda x, w, b: rounded_gelu(chunked_sum(x, w, x.shape[1]) + b.bfloat16().float(), tanh=True),
        "double rounding (the sum rounded, then the sum + bias)": double_rounding,
    }
    return rows


def rounding_orders():
    """name -> x @ w.T in float32 in another order than linear_gelu_reference's addmm."""
    orders = {f"K in chunks of {c}": lambda x, w, c=c: chunked_sum(x, w, c) for c in (16, 64, 128, 1024)}
    orders["K reversed, in chunks of 64"] = lambda x, w: chunked_sum(x.flip(1), w.flip(1), 64)
    orders["chunks of 16, accumulator truncated toward zero"] = truncated_sum
    return orders


def kernel_ratio(out, x, w, b):
    """The bf16 check's two ratios to tolerance: the largest error against its bound, the share
    of elements a rounding apart against 1%; and whether the check passes."""
    ok, _ = gpu_kernels.check_linear_gelu(out, x, w, b)
    total = gpu_kernels.bf16(x.double() @ w.double().T + gpu_kernels.bf16(b))
    expected = gpu_kernels.bf16(torch.nn.functional.gelu(total))
    error = (out.double() - expected).abs()
    bound = gpu_kernels.linear_gelu_bound(x, w, total)
    return (error / bound).max().item(), (error > 0).double().mean().item() / 0.01, ok


def kernel_power(batches):
    """(kind, name) -> {B: ratios}: the check's for each slip and each summation order, and for
    each order its float32 sum's largest error against float32_sum_error."""
    rows = {}
    for B in batches:
        x, w, b = operands(B, seed=B)
        for name, out in kernel_slips().items():
            rows.setdefault(("slip", name), {})[B] = kernel_ratio(out(x, w, b), x, w, b)
        exact, sum_error = x.double() @ w.double().T, gpu_kernels.float32_sum_error(x, w)
        for name, order in rounding_orders().items():
            total = order(x, w)
            out = rounded_gelu(total + b.bfloat16().float())
            rows.setdefault(("rounding", name), {})[B] = kernel_ratio(out, x, w, b)
            rows.setdefault(("sum", name), {})[B] = ((total.double() - exact).abs() / sum_error).max().item()
        print(f"linear_gelu B={B} done", file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------- the report
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50, help="stand-in runs per optimizer")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 17, 256, 1024, 8192])
    parser.add_argument("--skip-updates", action="store_true")
    args = parser.parse_args()
    kernel_rows = kernel_power(args.batches)
    command = " ".join(["python", "benchmarks/check_power.py", *sys.argv[1:]])
    print("# The GPU tier's checks against slips and rounding, on CPU\n")
    print(f"`{command}`, on a {os.cpu_count()}-core CPU with no GPU, torch {torch.__version__}.\n")
    print(STAND_INS)
    if not args.skip_updates:
        update_rows, stand_in = update_power(args.runs)
        print("## Compiled updates (tests/gpu_updates.py): the weight checks' largest ratio to tolerance\n")
        print(
            f"Each tensor's change within {gpu_updates.TENSOR_CHANGE:g} of eager's (in norm), the whole model's within"
        )
        print(f"{gpu_updates.MODEL_CHANGE:g}, each plus a float32 step of every weight in norm; the number of checks")
        print("failed (the losses' and clipfrac's too) in brackets.\n")
        print("| slip | " + " | ".join(OPTIMIZERS) + " |")
        print("|---|" + "---|" * len(OPTIMIZERS))
        for name, cells in update_rows.items():
            text = [f"{r:.2f} ({len(f)} fail)" if f else f"{r:.2f} (passes)" for r, _, f in cells.values()]
            print(f"| {name} | " + " | ".join(text) + " |")
        worst = [f"{r:.3f} ({where}), {len(f)} failing" for (r, where), f in stand_in.values()]
        print(f"| {args.runs} stand-in runs: the worst | " + " | ".join(worst) + " |\n")
        for script, (_, failures) in stand_in.items():
            for failure in failures:
                print(f"- {script} {failure}")
    print("## bf16 linear_gelu (tests/gpu_kernels.py): the largest error / its bound, the share apart / 1%\n")
    print("| | " + " | ".join(f"B={B}" for B in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for (kind, name), cells in kernel_rows.items():
        if kind != "sum":
            text = [f"{r:.3g} / {a:.3g}" + ("" if ok else " fails") for r, a, ok in cells.values()]
            print(f"| {kind}: {name} | " + " | ".join(text) + " |")
    print("\nThe float32 sum's largest error against float32_sum_error (the bound's summation part,")
    print(f"{gpu_kernels.SUM_SAFETY} sqrt(K) 2^-24 sum |x w|):\n")
    print("| | " + " | ".join(f"B={B}" for B in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for (kind, name), cells in kernel_rows.items():
        if kind == "sum":
            print(f"| {name} | " + " | ".join(f"{r:.3g}" for r in cells.values()) + " |")


if __name__ == "__main__":
    main()
