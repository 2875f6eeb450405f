"""Ahead-of-time compilation of kernels.py's Triton kernels for real NVIDIA GPUs, on a machine
without one: every configuration the wrappers launch, compiled to cubin with Triton's own
ptxas, with its registers, spills and shared memory (tests/test_kernels.py asserts none spill
and all fit; benchmarks/kernels.py prints the table).
"""

import concurrent.futures
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import kernels  # noqa: E402

CAPABILITIES = (75, 80, 89, 90)
# largest dynamic shared memory per block, KB (sm_75: 64, sm_80: 163, sm_86/89: 99, sm_90: 227)
SHARED_LIMIT_KB = {75: 64, 80: 163, 89: 99, 90: 227}
BATCHES = (1, 2, 8, 16, 64, 256, 1024, 4096)
ACTIONS = (1, 4, 6, 9, 18)
OBSERVATIONS = ((4, 84), (1, 64), (2, 96), (8, 64))  # (frame stack, screen size): the default, and others tested
HIDDEN, CONV_OUT = 512, 3136
TRITON_TYPE = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def dtypes(cc):
    """The dtypes the rollout uses on a GPU of capability cc: bf16 needs sm_80 (on sm_75 the
    scripts refuse --precision bf16, and auto picks fp32)."""
    return (torch.float32,) if cc < 80 else (torch.float32, torch.bfloat16)


def configs(cc, batches=BATCHES, actions=ACTIONS, K=CONV_OUT, H=HIDDEN, observations=OBSERVATIONS):
    """Every distinct (kernel name, kernel, signature, constexprs, num_warps, num_stages) the
    wrappers launch at these shapes on a GPU of capability cc, in a fixed order."""
    found = {}
    for dtype in dtypes(cc):
        p = "*" + TRITON_TYPE[dtype]
        for B in batches:
            bm, bn, bk, w, stages, precision = kernels._linear_gelu_config(B, dtype, cc)
            sig = {"x_ptr": p, "w_ptr": p, "b_ptr": "*fp32", "out_ptr": "*fp32", "B": "i32", "N": "i32", "K": "i32"}
            consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "DOT_PRECISION": precision, "WIDEN": False}
            key = ("linear_gelu_kernel", p, bm, bn, bk, w, stages, precision)
            found[key] = (kernels.linear_gelu_kernel, sig, consts, w, stages)
            for A in actions:
                bb, ba, bh, w = kernels._heads_config(B, A, H)
                names = ["wa_ptr", "ba_ptr", "wc_ptr", "bc_ptr", "logits_ptr", "value_ptr"]
                sig = {"h_ptr": p} | {name: "*fp32" for name in names} | {"B": "i32", "H": "i32", "A": "i32"}
                consts = {"BLOCK_B": bb, "BLOCK_A": ba, "BLOCK_H": bh}
                found[("policy_value_heads_kernel", p, bb, ba, bh, w)] = (
                    kernels.policy_value_heads_kernel,
                    sig,
                    consts,
                    w,
                    3,
                )
            # the heads write float32 logits: the sampler reads float32 in the rollout
            for A in actions:
                bb, ba, w = kernels._sample_config(B, A)
                sig = {"logits_ptr": "*fp32", "uniform_ptr": "*fp32", "action_ptr": "*i64"}
                sig |= {"logprob_ptr": "*fp32", "entropy_ptr": "*fp32", "B": "i32", "A": "i32"}
                consts = {"BLOCK_B": bb, "BLOCK_A": ba}
                found[("sample_logits_kernel", bb, ba, w)] = (kernels.sample_logits_kernel, sig, consts, w, 3)
        block, w = kernels._push_config()
        for (stack, size), shift in itertools.product(observations, (True, False)):
            sig = {"prev_ptr": "*u8", "staged_ptr": "*u8", "obs_ptr": "*u8", "x_ptr": p}
            frame = size * size
            consts = {"STACK": stack, "FRAME": frame, "STAGED_ROW": kernels.staged_row(frame), "SHIFT": shift}
            consts["BLOCK"] = block
            found[("push_frames_kernel", p, stack, size, shift)] = (kernels.push_frames_kernel, sig, consts, w, 3)
    out = []
    for (name, *_), (kernel, sig, consts, w, stages) in found.items():
        out.append((name, kernel, sig | {k: "constexpr" for k in consts}, consts, w, stages))
    return out


def _resource_usage(cubin):
    """(registers, spill bytes) of a cubin, read with the cuobjdump that ships with Triton.

    cuobjdump reports LOCAL (per-thread local memory); these kernels use no local arrays,
    so any local memory is register spills.
    """
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    local = int(re.search(r"LOCAL:(\d+)", text).group(1))
    return regs, local


def compile_target(cc):
    """Compile every `configs()` entry for GPUTarget("cuda", cc, 32) down to cubin.

    Must run in a process without TRITON_INTERPRET (see `compile_table`).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", cc, 32)
    rows = []
    for name, kernel, sig, consts, num_warps, num_stages in configs(cc):
        # Torch allocations are 16-byte aligned; tell the compiler, as a launch would.
        attrs = {(kernel.arg_names.index(k),): [["tt.divisibility", 16]] for k, t in sig.items() if t.startswith("*")}
        row = {
            "target": f"sm_{cc}",
            "kernel": name,
            "dtype": next(t for t in sig.values() if t.startswith("*"))[1:],
            "config": " ".join(f"{k}={v}" for k, v in consts.items()),
            "num_warps": num_warps,
            "num_stages": num_stages,
            "shared_limit": SHARED_LIMIT_KB[cc] * 1024,
            "regs": None,
            "spill_bytes": None,
            "shared_bytes": None,
            "error": None,
        }
        try:
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
            options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
            compiled = triton.compile(src, target=target, options=options)
            row["regs"], row["spill_bytes"] = _resource_usage(compiled.asm["cubin"])
            row["shared_bytes"] = compiled.metadata.shared
        # Record every failure (MLIR passes raise RuntimeError, ptxas PTXASError).
        except (
            triton.TritonError,
            RuntimeError,
            ValueError,
            subprocess.SubprocessError,
        ) as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()] or [""]
            row["error"] = f"{type(exc).__name__}: {lines[0]} ... {lines[-1]}"[:300]
        rows.append(row)
    return rows


def compile_table(capabilities=CAPABILITIES, jobs=2):
    """Compile every configuration the wrappers launch for real NVIDIA GPUs; no GPU needed.

    Returns one dict per (target, config) with keys target, kernel, config, num_warps,
    regs, spill_bytes, shared_bytes and error (None when it compiled to cubin).

    Each target compiles in a child process, `jobs` at a time: under TRITON_INTERPRET=1
    the tl library functions (tl.max, tl.sum, ...) are interpreter objects that the GPU
    compiler cannot use, so the child runs without it. Compiled kernels land in Triton's
    cache, so repeated calls take about a second per target.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), str(ROOT), env.get("PYTHONPATH")]))
    code = "import json, sys, aot; print(json.dumps(aot.compile_target(int(sys.argv[1]))))"

    def run(cc):
        proc = subprocess.run(
            [sys.executable, "-c", code, str(cc)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"AOT compile for sm_{cc} crashed: {tail[0]}")
        # Triton may print diagnostics first; the table is the last line.
        return json.loads(proc.stdout.strip().splitlines()[-1])

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(run, capabilities))
    return [row for rows in results for row in rows]


def format_table(rows):
    lines = [f"{'target':7} {'kernel':26} {'dtype':5} {'config':62} warps stages regs spill shared"]
    for r in rows:
        head = f"{r['target']:7} {r['kernel']:26} {r['dtype']:5} {r['config']:62}"
        if r["error"]:
            lines.append(f"{head} FAILED {r['error']}")
        else:
            numbers = f"{r['num_warps']:5} {r['num_stages']:6} {r['regs']:4} {r['spill_bytes']:5} {r['shared_bytes']:6}"
            lines.append(f"{head} {numbers}")
    return "\n".join(lines)
