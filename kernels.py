"""Fused Triton kernels for the inference path of an Atari policy network.

After the conv body, a rollout step of a CleanRL-style agent runs three kernels here:

1. `linear_gelu`: `gelu(x @ weight.T + bias)` with the exact (erf) GELU, the 3136 -> 512 layer.
2. `policy_value_heads`: actor logits and critic value from one read of the hidden state.
3. `sample_logits`: inverse-CDF sampling from given uniforms, with log-prob and entropy.

Eager torch dispatches 13 compute ops for the same work, 25 plus 2 host syncs with
Categorical's default argument validation (counted by benchmarks/kernels.py).

Each kernel is followed by its Python wrapper (argument checks, block sizes, launch grid)
and by a plain torch reference with the same signature. The wrappers launch Triton for CUDA
tensors, and for CPU tensors only when TRITON_INTERPRET=1 was set before this module was
imported (Triton's interpreter: exact but slow, meant for tests); other CPU calls go to the
torch reference. float32 is the contract for every input and output. Dot products run in
full float32 precision (no TF32) and accumulate in float32, so rollout log-probs match a
float32 torch network to about 1e-6.

Sampling rule, shared by kernel and reference (one exact formulation, so both pick the same
action for the same uniform u, up to float rounding at CDF boundaries). Per row, with
z_a = logit_a - max(logits), e_a = exp(z_a), S = sum_a e_a, C_a = e_0 + ... + e_a:
    action = smallest a with e_a > 0 and u * S < C_a,
             or, if rounding leaves none, the last a with e_a > 0.
With exact arithmetic the `e_a > 0` condition never changes the answer (C_a only grows at
actions with e_a > 0); it guarantees that a masked action (-inf logit) is never picked.
logprob = z_action - log S, entropy = log S - sum_a (e_a / S) z_a over actions with e_a > 0
(0 log 0 = 0), so -inf logits are allowed as long as a row has at least one finite logit.

Block sizes and warps come from small deterministic helpers (`_linear_gelu_config`,
`_heads_config`, `_sample_config`), so `aot_compile_table` can compile for real GPUs exactly
the configurations the wrappers launch, also on a machine without a GPU.
"""

import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading

import torch
import triton
import triton.language as tl

# Triton on CPU tensors only under the interpreter; read once, at import, like Triton does.
USE_TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Number of Triton kernel launches made by the wrappers (for benchmarks and tests).
LAUNCHES = 0


def triton_launch_count():
    return LAUNCHES


# Triton's interpreter is not thread-safe (seen here: launches from the rollout's worker
# threads failed under TRITON_INTERPRET=1), so CPU launches take turns; GPU launches need no lock.
_INTERPRETER_LOCK = threading.Lock()


def _launch_guard():
    return _INTERPRETER_LOCK if USE_TRITON_ON_CPU else contextlib.nullcontext()


def _use_triton(device):
    return device.type == "cuda" or (device.type == "cpu" and USE_TRITON_ON_CPU)


def _check(name, t, shape, device, dtype=torch.float32):
    """Raise ValueError unless `t` is a contiguous `dtype` tensor of `shape` on `device`
    (TypeError if it is not a tensor at all).

    `None` in `shape` accepts any size for that dimension.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_positive(name, value):
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


# ---------------------------------------------------------------------------------------
# 1. Linear + exact GELU
# ---------------------------------------------------------------------------------------


@triton.jit
def linear_gelu_kernel(
    x_ptr,  # [B, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N]
    out_ptr,  # [B, N]
    B,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Axis 0 walks N fastest, so programs that run together share the same rows of x
    # (read from DRAM once, then from L2); the weight (6.4 MB at 3136x512) stays in L2.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < B
    n_ok = offs_n < N
    # int64 row offsets: B * K can pass 2**31 at large batches.
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    # The weight tile is read as W.T ([BLOCK_K, BLOCK_N]) straight from the [N, K] layout.
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        # "ieee": true float32 products; the GPU default (tf32) is off by ~3e-4.
        acc = tl.dot(a, b, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    # Exact GELU, the same formula as torch.nn.GELU(): x * 0.5 * (1 + erf(x / sqrt(2))).
    y = acc * 0.5 * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, y, mask=m_ok[:, None] & n_ok[None, :])


def _linear_gelu_config(B, N, K):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a [B, K] x [K, N] product.

    Every tl.dot block dim is >= 16 (real GPUs reject smaller ones). Float32 "ieee" dots run
    on FMA units with operands in registers, so BLOCK_K stays small: these tiles compile to
    72-128 registers per thread without spills on sm_75..sm_90 (see aot_compile_table).
    Small batches get narrow N tiles so that more programs stream the weight in parallel.
    """
    if B <= 16:
        return 16, 32, 32, 4
    if B <= 128:
        return 32, 64, 16, 4
    return 64, 64, 16, 8


def linear_gelu(x, weight, bias, out=None):
    """gelu(x @ weight.T + bias), exact erf GELU. x [B, K], weight [N, K], bias [N] -> [B, N]."""
    global LAUNCHES
    _check("x", x, (None, None), None)
    B, K = x.shape
    device = x.device
    _check("weight", weight, (None, K), device)
    N = weight.shape[0]
    _check_positive("K (x.shape[1])", K)
    _check_positive("N (weight.shape[0])", N)
    _check("bias", bias, (N,), device)
    if out is None:
        out = torch.empty((B, N), dtype=torch.float32, device=device)
    else:
        _check("out", out, (B, N), device)
    if not _use_triton(device):
        return linear_gelu_reference(x, weight, bias, out=out)
    if B == 0:
        return out
    BLOCK_M, BLOCK_N, BLOCK_K, num_warps = _linear_gelu_config(B, N, K)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(B, BLOCK_M))
    with _launch_guard():
        linear_gelu_kernel[grid](
            x,
            weight,
            bias,
            out,
            B,
            N,
            K,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            num_warps=num_warps,
            # Fused multiply-add contraction, as nvcc does for torch's own kernels (and set
            # explicitly: Triton 3.9 warns when it is left to the default).
            enable_fp_fusion=True,
        )
    LAUNCHES += 1
    return out


def linear_gelu_reference(x, weight, bias, out=None):
    """Torch reference for `linear_gelu` (no argument checks): addmm, then GELU in place.

    The same ops as nn.Linear + nn.GELU(), so CPU results equal the training network's bit for
    bit. (aten._addmm_activation(use_gelu=True) fuses both but differed by ~2e-6 at B=1.)
    """
    out = torch.addmm(bias, x, weight.t(), out=out)
    torch.ops.aten.gelu_(out)
    return out


# ---------------------------------------------------------------------------------------
# 2. Actor and critic heads
# ---------------------------------------------------------------------------------------


@triton.jit
def policy_value_heads_kernel(
    h_ptr,  # [B, H]
    wa_ptr,  # [A, H] actor weight
    ba_ptr,  # [A]
    wc_ptr,  # [1, H] critic weight
    bc_ptr,  # [1]
    logits_ptr,  # [B, A]
    value_ptr,  # [B]
    B,
    H,
    A,
    BLOCK_B: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    acts = tl.arange(0, BLOCK_A)
    row_ok = rows < B
    act_ok = acts < A
    logits = tl.zeros((BLOCK_B, BLOCK_A), dtype=tl.float32)
    value = tl.zeros((BLOCK_B,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        # Each tile of h is read once and feeds both heads.
        h = tl.load(
            h_ptr + rows[:, None].to(tl.int64) * H + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        wa = tl.load(
            wa_ptr + acts[:, None] * H + ks[None, :],
            mask=act_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        wc = tl.load(wc_ptr + ks, mask=k_ok, other=0.0)
        # A <= 18 is too narrow for tl.dot (GPUs need block dims >= 16 and would waste most
        # of the tile), so: broadcast multiply and reduce over H, in float32.
        logits += tl.sum(h[:, None, :] * wa[None, :, :], axis=2)
        value += tl.sum(h * wc[None, :], axis=1)
    logits += tl.load(ba_ptr + acts, mask=act_ok, other=0.0)[None, :]
    value += tl.load(bc_ptr)
    tl.store(
        logits_ptr + rows[:, None].to(tl.int64) * A + acts[None, :],
        logits,
        mask=row_ok[:, None] & act_ok[None, :],
    )
    tl.store(value_ptr + rows, value, mask=row_ok)


def _heads_config(B, A, H):
    """(BLOCK_B, BLOCK_A, BLOCK_H, num_warps) for the heads kernel.

    Depends on A only: the [BLOCK_B, BLOCK_A, BLOCK_H] product tile is kept at 4096 floats
    (32 per thread with 4 warps); twice that needed up to 166 registers on sm_80.
    """
    BLOCK_B = 16
    BLOCK_A = max(2, triton.next_power_of_2(A))
    BLOCK_H = max(2, min(128, 4096 // (BLOCK_B * BLOCK_A)))
    return BLOCK_B, BLOCK_A, BLOCK_H, 4


def policy_value_heads(
    h,
    actor_weight,
    actor_bias,
    critic_weight,
    critic_bias,
    logits_out=None,
    value_out=None,
):
    """Actor logits [B, A] and critic value [B] from hidden state h [B, H]."""
    global LAUNCHES
    _check("h", h, (None, None), None)
    B, H = h.shape
    device = h.device
    _check_positive("H (h.shape[1])", H)
    _check("actor_weight", actor_weight, (None, H), device)
    A = actor_weight.shape[0]
    _check_positive("A (actor_weight.shape[0])", A)
    _check("actor_bias", actor_bias, (A,), device)
    _check("critic_weight", critic_weight, (1, H), device)
    _check("critic_bias", critic_bias, (1,), device)
    if logits_out is None:
        logits_out = torch.empty((B, A), dtype=torch.float32, device=device)
    else:
        _check("logits_out", logits_out, (B, A), device)
    if value_out is None:
        value_out = torch.empty((B,), dtype=torch.float32, device=device)
    else:
        _check("value_out", value_out, (B,), device)
    if not _use_triton(device):
        return policy_value_heads_reference(
            h,
            actor_weight,
            actor_bias,
            critic_weight,
            critic_bias,
            logits_out,
            value_out,
        )
    if B == 0:
        return logits_out, value_out
    BLOCK_B, BLOCK_A, BLOCK_H, num_warps = _heads_config(B, A, H)
    grid = (triton.cdiv(B, BLOCK_B),)
    with _launch_guard():
        policy_value_heads_kernel[grid](
            h,
            actor_weight,
            actor_bias,
            critic_weight,
            critic_bias,
            logits_out,
            value_out,
            B,
            H,
            A,
            BLOCK_B,
            BLOCK_A,
            BLOCK_H,
            num_warps=num_warps,
            enable_fp_fusion=True,
        )
    LAUNCHES += 1
    return logits_out, value_out


def policy_value_heads_reference(
    h,
    actor_weight,
    actor_bias,
    critic_weight,
    critic_bias,
    logits_out=None,
    value_out=None,
):
    """Torch reference for `policy_value_heads` (no argument checks)."""
    logits = torch.addmm(actor_bias, h, actor_weight.t(), out=logits_out)
    value = torch.addmv(critic_bias, h, critic_weight[0], out=value_out)
    return logits, value


# ---------------------------------------------------------------------------------------
# 3. Sampling, log-prob and entropy
# ---------------------------------------------------------------------------------------


@triton.jit
def sample_logits_kernel(
    logits_ptr,  # [B, A]
    uniform_ptr,  # [B]
    action_ptr,  # [B] int64
    logprob_ptr,  # [B]
    entropy_ptr,  # [B]
    B,
    A,
    BLOCK_B: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    acts = tl.arange(0, BLOCK_A)
    row_ok = rows < B
    act_ok = acts < A
    x = tl.load(
        logits_ptr + rows[:, None].to(tl.int64) * A + acts[None, :],
        mask=row_ok[:, None] & act_ok[None, :],
        other=float("-inf"),
    )
    # Padding columns stay -inf (probability 0); padding rows become all zeros, so they
    # compute harmless numbers instead of NaNs (they are never stored).
    x = tl.where(row_ok[:, None], x, 0.0)
    z = x - tl.max(x, axis=1)[:, None]
    e = tl.exp(z)
    pos = e > 0.0
    total = tl.sum(e, axis=1)
    cdf = tl.cumsum(e, axis=1)
    u = tl.load(uniform_ptr + rows, mask=row_ok, other=0.0)
    last = tl.max(tl.where(pos, acts[None, :], 0), axis=1)
    hit = pos & (cdf > (u * total)[:, None])
    action = tl.min(tl.where(hit, acts[None, :], last[:, None]), axis=1)
    log_total = tl.log(total)
    # z is -inf where e == 0; zero it first so that p * z is 0 there, not NaN.
    zs = tl.where(pos, z, 0.0)
    logprob = tl.sum(tl.where(acts[None, :] == action[:, None], zs, 0.0), axis=1) - log_total
    entropy = log_total - tl.sum((e / total[:, None]) * zs, axis=1)
    tl.store(action_ptr + rows, action.to(tl.int64), mask=row_ok)
    tl.store(logprob_ptr + rows, logprob, mask=row_ok)
    tl.store(entropy_ptr + rows, entropy, mask=row_ok)


def _sample_config(B, A):
    """(BLOCK_B, BLOCK_A, num_warps): 1024-element tiles (8 per thread), rows per program
    from A only."""
    BLOCK_A = max(2, triton.next_power_of_2(A))
    return max(1, 1024 // BLOCK_A), BLOCK_A, 4


def sample_logits(logits, uniform, action_out=None, logprob_out=None, entropy_out=None):
    """Sample one action per row of logits [B, A] from uniform [B] in [0, 1).

    Returns action int64 [B], logprob float32 [B], entropy float32 [B]; see the module
    docstring for the exact rule. Each row needs at least one finite logit.
    """
    global LAUNCHES
    _check("logits", logits, (None, None), None)
    B, A = logits.shape
    device = logits.device
    _check_positive("A (logits.shape[1])", A)
    _check("uniform", uniform, (B,), device)
    if action_out is None:
        action_out = torch.empty((B,), dtype=torch.int64, device=device)
    else:
        _check("action_out", action_out, (B,), device, dtype=torch.int64)
    if logprob_out is None:
        logprob_out = torch.empty((B,), dtype=torch.float32, device=device)
    else:
        _check("logprob_out", logprob_out, (B,), device)
    if entropy_out is None:
        entropy_out = torch.empty((B,), dtype=torch.float32, device=device)
    else:
        _check("entropy_out", entropy_out, (B,), device)
    if not _use_triton(device):
        return sample_logits_reference(logits, uniform, action_out, logprob_out, entropy_out)
    if B == 0:
        return action_out, logprob_out, entropy_out
    BLOCK_B, BLOCK_A, num_warps = _sample_config(B, A)
    grid = (triton.cdiv(B, BLOCK_B),)
    with _launch_guard():
        sample_logits_kernel[grid](
            logits,
            uniform,
            action_out,
            logprob_out,
            entropy_out,
            B,
            A,
            BLOCK_B,
            BLOCK_A,
            num_warps=num_warps,
            enable_fp_fusion=True,
        )
    LAUNCHES += 1
    return action_out, logprob_out, entropy_out


def sample_logits_reference(logits, uniform, action_out=None, logprob_out=None, entropy_out=None):
    """Torch reference for `sample_logits` (no argument checks), the same rule step by step."""
    z = logits - logits.amax(dim=1, keepdim=True)
    e = z.exp()
    pos = e > 0
    total = e.sum(dim=1)
    cdf = e.cumsum(dim=1)
    acts = torch.arange(logits.shape[1], device=logits.device)
    last = torch.where(pos, acts, 0).amax(dim=1, keepdim=True)
    hit = pos & (cdf > (uniform * total)[:, None])
    action = torch.amin(torch.where(hit, acts, last), dim=1, out=action_out)
    log_total = total.log()
    zs = torch.where(pos, z, 0.0)
    logprob = torch.sub(zs.gather(1, action[:, None])[:, 0], log_total, out=logprob_out)
    entropy = torch.sub(log_total, (e / total[:, None] * zs).sum(dim=1), out=entropy_out)
    return action, logprob, entropy


# ---------------------------------------------------------------------------------------
# Ahead-of-time compilation for real GPUs (no GPU needed)
# ---------------------------------------------------------------------------------------

AOT_CAPABILITIES = (75, 80, 89, 90)
AOT_BATCHES = (1, 2, 8, 16, 64, 256, 1024, 4096)
AOT_ACTIONS = (1, 4, 6, 9, 18)
HIDDEN, CONV_OUT = 512, 3136


def aot_configs(batches=AOT_BATCHES, actions=AOT_ACTIONS, K=CONV_OUT, H=HIDDEN):
    """Every distinct (kernel name, kernel, signature, constexprs, num_warps) the wrappers
    launch at these shapes, in a fixed order."""
    p = "*fp32"
    configs = {}
    for B in batches:
        bm, bn, bk, w = _linear_gelu_config(B, H, K)
        sig = {"x_ptr": p, "w_ptr": p, "b_ptr": p, "out_ptr": p, "B": "i32", "N": "i32"}
        sig["K"] = "i32"
        consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
        configs[("linear_gelu_kernel", bm, bn, bk, w)] = (
            linear_gelu_kernel,
            sig,
            consts,
            w,
        )
        for A in actions:
            bb, ba, bh, w = _heads_config(B, A, H)
            names = [
                "h_ptr",
                "wa_ptr",
                "ba_ptr",
                "wc_ptr",
                "bc_ptr",
                "logits_ptr",
                "value_ptr",
            ]
            sig = {name: p for name in names} | {"B": "i32", "H": "i32", "A": "i32"}
            consts = {"BLOCK_B": bb, "BLOCK_A": ba, "BLOCK_H": bh}
            key = ("policy_value_heads_kernel", bb, ba, bh, w)
            configs[key] = (policy_value_heads_kernel, sig, consts, w)
            bb, ba, w = _sample_config(B, A)
            sig = {"logits_ptr": p, "uniform_ptr": p, "action_ptr": "*i64"}
            sig |= {"logprob_ptr": p, "entropy_ptr": p, "B": "i32", "A": "i32"}
            consts = {"BLOCK_B": bb, "BLOCK_A": ba}
            configs[("sample_logits_kernel", bb, ba, w)] = (
                sample_logits_kernel,
                sig,
                consts,
                w,
            )
    out = []
    for (name, *_), (kernel, sig, consts, w) in configs.items():
        out.append((name, kernel, sig | {k: "constexpr" for k in consts}, consts, w))
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


def _aot_compile_target(cc):
    """Compile every `aot_configs()` entry for GPUTarget("cuda", cc, 32) down to cubin.

    Must run in a process without TRITON_INTERPRET (see `aot_compile_table`).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", cc, 32)
    rows = []
    for name, kernel, sig, consts, num_warps in aot_configs():
        # Torch allocations are 16-byte aligned; tell the compiler, as a launch would.
        attrs = {(kernel.arg_names.index(k),): [["tt.divisibility", 16]] for k, t in sig.items() if t.startswith("*")}
        row = {
            "target": f"sm_{cc}",
            "kernel": name,
            "config": " ".join(f"{k}={v}" for k, v in consts.items()),
            "num_warps": num_warps,
            "regs": None,
            "spill_bytes": None,
            "shared_bytes": None,
            "error": None,
        }
        try:
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
            options = {"num_warps": num_warps, "enable_fp_fusion": True}
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


def aot_compile_table(capabilities=AOT_CAPABILITIES, jobs=2):
    """Compile every configuration the wrappers launch for real NVIDIA GPUs; no GPU needed.

    Returns one dict per (target, config) with keys target, kernel, config, num_warps,
    regs, spill_bytes, shared_bytes and error (None when it compiled to cubin).

    Each target compiles in a child process, `jobs` at a time: under TRITON_INTERPRET=1
    the tl library functions (tl.max, tl.sum, ...) are interpreter objects that the GPU
    compiler cannot use, so the child runs without it. Compiled kernels land in Triton's
    cache, so repeated calls take about a second per target.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    code = "import json, sys, kernels; print(json.dumps(kernels._aot_compile_target(int(sys.argv[1]))))"

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


def format_aot_table(rows):
    lines = [f"{'target':7} {'kernel':26} {'config':38} warps regs spill shared"]
    for r in rows:
        if r["error"]:
            lines.append(f"{r['target']:7} {r['kernel']:26} {r['config']:38} FAILED {r['error']}")
        else:
            lines.append(
                f"{r['target']:7} {r['kernel']:26} {r['config']:38} {r['num_warps']:5} "
                f"{r['regs']:4} {r['spill_bytes']:5} {r['shared_bytes']:6}"
            )
    return "\n".join(lines)
