"""Fused Triton kernels for the rollout of an Atari policy network, and the fused inference
step that ppo_atari_native.py and a2c_atari.py share.

After the conv body, a rollout step of a CleanRL-style agent runs three kernels here:

1. `linear_gelu`: `gelu(x @ weight.T + bias)` with the exact (erf) GELU, the 3136 -> 512 layer
   (at 84x84 frames).
2. `policy_value_heads`: actor logits and critic value from one read of the hidden state.
3. `sample_logits`: inverse-CDF sampling from given uniforms, with log-prob and entropy.

Before the conv body, `push_frames` moves an env batch's frame stacks one step on (the older
frames shift, a game that just ended gets zeros there, the new frame comes in) and writes the
network's float input, scaled by 1/255, in one pass (the stack and the frame size are the
script's). Section 5, `policy_step`, is the whole device side of one env batch's step, as both
native scripts run it (and capture it in a CUDA graph on a GPU); section 6 decides whether the
rollout may take it for a given Agent.

Each kernel is followed by its Python wrapper (argument checks, block sizes, launch grid)
and by a plain torch reference with the same signature. The wrappers launch Triton for CUDA
tensors, and for CPU tensors only when TRITON_INTERPRET=1 was set before this module was
imported (Triton's interpreter: exact but slow, meant for tests); other CPU calls go to the
torch reference.

Precision. Outputs are float32. `linear_gelu` takes float32 or bfloat16 operands (x and weight
alike) and adds up in float32: bfloat16 on tensor cores; float32 as "tf32x3" on sm_80 and newer
(three tensor-core passes, float32 accuracy: products within ~1e-6, the project's policy is no
TF32 rounding for fp32) and as "ieee" FMA loops on sm_75 and in the interpreter. With bfloat16
operands it rounds the bias, the sum and the GELU to bfloat16, as torch.autocast runs Linear and
GELU. The heads and the sampler read float32 or bfloat16 and compute in float32. The training
network computes the same function in the same precision (the Agent's `forward`: under bf16
autocast, heads in float32), so rollout log-probs equal the learner's: to ~1e-6 in fp32, and in
bf16 up to a bf16 rounding step where another order of sums lands on the other side of it.

Sampling rule, shared by kernel and reference (one exact formulation, so both pick the same
action for the same uniform u, up to float rounding at CDF boundaries). Per row, with
z_a = logit_a - max(logits), e_a = exp(z_a), S = sum_a e_a, C_a = e_0 + ... + e_a:
    action = smallest a with e_a > 0 and u * S < C_a,
             or, if rounding leaves none, the last a with e_a > 0.
With exact arithmetic the `e_a > 0` condition never changes the answer (C_a only grows at
actions with e_a > 0); it guarantees that a masked action (-inf logit) is never picked.
logprob = z_action - log S, entropy = log S - sum_a (e_a / S) z_a over actions with e_a > 0
(0 log 0 = 0), so -inf logits are allowed as long as a row has at least one finite logit.

Block sizes, warps and stages come from small deterministic helpers (`_linear_gelu_config`,
`_heads_config`, `_sample_config`, `_push_config`), so `benchmarks/aot.py` can compile for real
GPUs exactly the configurations the wrappers launch, also on a machine without a GPU. They were
chosen by reasoning about tile sizes and shared memory, not tuned on a GPU; benchmarks/kernels.py
times them there.
"""

import ast
import contextlib
import copy
import functools
import inspect
import math
import os
import textwrap
import threading
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

# Triton on CPU tensors only under the interpreter; read once, at import, like Triton does.
USE_TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Number of Triton kernel launches made by the wrappers (for benchmarks and tests); counted
# under a lock, as rollout worker threads launch concurrently.
LAUNCHES = 0
_COUNT_LOCK = threading.Lock()


def triton_launch_count():
    return LAUNCHES


def _counted():
    global LAUNCHES
    with _COUNT_LOCK:
        LAUNCHES += 1


# Triton's interpreter is not thread-safe (launches from the rollout's worker
# threads failed under TRITON_INTERPRET=1), so CPU launches take turns. On a GPU the first
# launch of each specialization compiles, which is not thread-safe either: the scripts warm
# every launch up on the main thread before any worker starts (see `warm_up`).
_INTERPRETER_LOCK = threading.Lock()


def _launch_guard():
    return _INTERPRETER_LOCK if USE_TRITON_ON_CPU else contextlib.nullcontext()


def _use_triton(device):
    return device.type == "cuda" or (device.type == "cpu" and USE_TRITON_ON_CPU)


@functools.cache
def _cuda_capability(index):
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def capability(device):
    """The compute capability (75, 80, 90, ...) of a CUDA device; None for the CPU interpreter."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


FLOAT = (torch.float32,)
FLOAT_OR_BF16 = (torch.float32, torch.bfloat16)


def _check(name, t, shape, device, dtypes=FLOAT):
    """Raise ValueError unless `t` is a contiguous tensor of one of `dtypes`, of `shape`, on
    `device` (TypeError if it is not a tensor at all). `None` in `shape` accepts any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
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
def _round_to_bf16(x):
    """float32 rounded to the nearest bfloat16 (ties to even), kept in float32; in integer
    ops, since Triton's interpreter truncates in .to(tl.bfloat16)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def linear_gelu_kernel(
    x_ptr,  # [B, K], float32 or bfloat16
    w_ptr,  # [N, K], the same dtype
    b_ptr,  # [N], float32
    out_ptr,  # [B, N], float32
    B,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    # Axis 0 walks N fastest, so programs that run together share the same rows of x
    # (read from DRAM once, then from L2); the weight (3.2 MB in bf16) stays in L2.
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
        if WIDEN:  # Triton's interpreter gets bf16 dots wrong: widen first (exact, same sums)
            a, b = a.to(tl.float32), b.to(tl.float32)
        # bf16: exact products on tensor cores; fp32: "tf32x3" (tensor cores, fp32 accuracy)
        # or "ieee" (FMA units); both add up in float32.
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0)
    ROUND: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16  # as bf16 autocast: bias, sum, GELU rounded
    if ROUND:
        bias = _round_to_bf16(bias)
    acc += bias[None, :]
    if ROUND:
        acc = _round_to_bf16(acc)
    # Exact GELU, the same formula as torch.nn.GELU(): x * 0.5 * (1 + erf(x / sqrt(2))).
    y = acc * 0.5 * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    if ROUND:
        y = _round_to_bf16(y)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, y, mask=m_ok[:, None] & n_ok[None, :])


def _linear_gelu_config(B, dtype, cc):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, dot precision) for x [B, K] @ W.T on
    compute capability `cc` (None: the CPU interpreter).

    Every tl.dot block dim is >= 16 (real GPUs reject smaller ones). Without tensor cores
    (float32 on sm_75 and in the interpreter) the dots are FMA loops with operands in
    registers, so K tiles stay small. With them, K tiles are as deep as shared memory allows
    (sm_89 has 99 KB per block: fp32 tiles are half as deep as bf16 ones) and a small batch
    gets narrow N tiles, so that more programs stream the weight at once.
    """
    if cc is None or cc < 80:
        if B <= 16:
            return 16, 32, 32, 4, 2, "ieee"
        if B <= 128:
            return 32, 64, 16, 4, 2, "ieee"
        return 64, 64, 16, 8, 2, "ieee"
    if dtype == torch.float32:  # tf32x3: three tensor-core passes, float32 accuracy
        tiles = {16: (16, 32, 64, 4, 4), 64: (32, 32, 64, 4, 4), 256: (64, 64, 32, 4, 4)}
        large, precision = (128, 128, 32, 8, 3), "tf32x3"
    else:  # bfloat16: products exact, sums float32
        tiles = {16: (16, 32, 128, 4, 4), 64: (32, 32, 128, 4, 4), 256: (64, 64, 64, 4, 4)}
        large, precision = (128, 128, 64, 8, 3), "ieee"
    tile = next((tile for limit, tile in tiles.items() if B <= limit), large)
    return (*tile, precision)


def linear_gelu(x, weight, bias, out=None):
    """gelu(x @ weight.T + bias), exact erf GELU. x [B, K] and weight [N, K] in float32 or
    bfloat16 (the same), bias [N] float32 -> float32 [B, N]."""
    _check("x", x, (None, None), None, FLOAT_OR_BF16)
    B, K = x.shape
    device = x.device
    _check("weight", weight, (None, K), device, (x.dtype,))
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
    BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, precision = _linear_gelu_config(B, x.dtype, capability(device))
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(B, BLOCK_M))
    with _launch_guard():
        linear_gelu_kernel[grid](
            x, weight, bias, out, B, N, K, BLOCK_M, BLOCK_N, BLOCK_K, precision, device.type == "cpu",
            num_warps=num_warps, num_stages=num_stages,
            # Fused multiply-add contraction, as nvcc does for torch's own kernels (and set
            # explicitly: Triton warns when it is left to the default).
            enable_fp_fusion=True,
        )  # fmt: skip
    _counted()
    return out


def linear_gelu_reference(x, weight, bias, out=None):
    """Torch reference for `linear_gelu` (no argument checks): addmm in float32, then GELU in
    place. bfloat16 operands are widened first (exactly), so the sums are float32's; and with
    them the bias, the sum and the GELU are rounded to bfloat16, as under bf16 autocast.

    The same ops as the training network's float32 Linear + GELU, so CPU results equal it bit
    for bit. (aten._addmm_activation(use_gelu=True) fuses both but differed by ~2e-6 at B=1.)
    """
    if x.dtype == torch.bfloat16:
        bias = bias.bfloat16().float()
    out = torch.addmm(bias, x.float(), weight.float().t(), out=out)
    if x.dtype == torch.bfloat16:
        out.copy_(out.bfloat16())
    torch.ops.aten.gelu_(out)
    if x.dtype == torch.bfloat16:
        out.copy_(out.bfloat16())
    return out


# ---------------------------------------------------------------------------------------
# 2. Actor and critic heads
# ---------------------------------------------------------------------------------------


@triton.jit
def policy_value_heads_kernel(
    h_ptr,  # [B, H], float32 or bfloat16
    wa_ptr,  # [A, H] actor weight, float32
    ba_ptr,  # [A]
    wc_ptr,  # [1, H] critic weight
    bc_ptr,  # [1]
    logits_ptr,  # [B, A], float32
    value_ptr,  # [B], float32
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
        # Each tile of h is read once and feeds both heads, in float32.
        h = tl.load(
            h_ptr + rows[:, None].to(tl.int64) * H + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
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
    """Actor logits [B, A] and critic value [B] (float32) from hidden state h [B, H] (float32
    or bfloat16); the heads' weights are float32."""
    _check("h", h, (None, None), None, FLOAT_OR_BF16)
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
            h, actor_weight, actor_bias, critic_weight, critic_bias, logits_out, value_out
        )
    if B == 0:
        return logits_out, value_out
    BLOCK_B, BLOCK_A, BLOCK_H, num_warps = _heads_config(B, A, H)
    grid = (triton.cdiv(B, BLOCK_B),)
    with _launch_guard():
        policy_value_heads_kernel[grid](
            h, actor_weight, actor_bias, critic_weight, critic_bias, logits_out, value_out, B, H, A,
            BLOCK_B, BLOCK_A, BLOCK_H, num_warps=num_warps, enable_fp_fusion=True,
        )  # fmt: skip
    _counted()
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
    """Torch reference for `policy_value_heads` (no argument checks), in float32."""
    h = h.float()
    logits = torch.addmm(actor_bias, h, actor_weight.t(), out=logits_out)
    value = torch.addmv(critic_bias, h, critic_weight[0], out=value_out)
    return logits, value


# ---------------------------------------------------------------------------------------
# 3. Sampling, log-prob and entropy
# ---------------------------------------------------------------------------------------


@triton.jit
def sample_logits_kernel(
    logits_ptr,  # [B, A], float32 or bfloat16
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
    ).to(tl.float32)
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
    """Sample one action per row of logits [B, A] (float32 or bfloat16) from uniform [B] in [0, 1).

    Returns action int64 [B], logprob float32 [B], entropy float32 [B]; see the module
    docstring for the exact rule. Each row needs at least one finite logit.
    """
    _check("logits", logits, (None, None), None, FLOAT_OR_BF16)
    B, A = logits.shape
    device = logits.device
    _check_positive("A (logits.shape[1])", A)
    _check("uniform", uniform, (B,), device)
    if action_out is None:
        action_out = torch.empty((B,), dtype=torch.int64, device=device)
    else:
        _check("action_out", action_out, (B,), device, (torch.int64,))
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
            logits, uniform, action_out, logprob_out, entropy_out, B, A, BLOCK_B, BLOCK_A,
            num_warps=num_warps, enable_fp_fusion=True,
        )  # fmt: skip
    _counted()
    return action_out, logprob_out, entropy_out


def sample_logits_reference(logits, uniform, action_out=None, logprob_out=None, entropy_out=None):
    """Torch reference for `sample_logits` (no argument checks), the same rule step by step."""
    logits = logits.float()
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
# 4. The frame stack: one step on, and the network's input
# ---------------------------------------------------------------------------------------


def staged_row(frame):
    """Bytes of one env's row of a staging buffer: its new frame (`frame` pixels), then one byte
    that is 1 where the env's game goes on and 0 where it just ended (its older frames become
    zeros, as ale-py's own stack does), padded to a multiple of 16 so that every row starts aligned."""
    return (frame + 1 + 15) // 16 * 16


@triton.jit
def push_frames_kernel(
    prev_ptr,  # [B, STACK, H, W] uint8: the stacks before this step
    staged_ptr,  # [B, STAGED_ROW] uint8: new frames, then the keep flag
    obs_ptr,  # [B, STACK, H, W] uint8: the stacks after it (rollout storage)
    x_ptr,  # [B, STACK, H, W] float32 or bfloat16, channels_last: obs / 255, the network's input
    STACK: tl.constexpr,  # frames per stack
    FRAME: tl.constexpr,  # pixels per frame, H * W
    STAGED_ROW: tl.constexpr,
    SHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    env = tl.program_id(1).to(tl.int64)
    pixel = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = pixel < FRAME
    prev = prev_ptr + env * STACK * FRAME
    obs = obs_ptr + env * STACK * FRAME
    x = x_ptr + env * STACK * FRAME + pixel * STACK  # channels_last: the frames of a pixel side by side
    keep = tl.load(staged_ptr + env * STAGED_ROW + FRAME)
    for c in tl.static_range(STACK):
        if not SHIFT:  # a plain copy: the stacks carried over from the last horizon
            v = tl.load(prev + c * FRAME + pixel, mask=ok)
        elif c < STACK - 1:  # the older frames move down; zeros where a game just ended
            v = tl.load(prev + (c + 1) * FRAME + pixel, mask=ok) * keep
        else:  # the new frame
            v = tl.load(staged_ptr + env * STAGED_ROW + pixel, mask=ok)
        tl.store(obs + c * FRAME + pixel, v, mask=ok)
        # float32 multiply, then one rounding (to nearest even) to x's dtype: what the learner's
        # x * (1 / 255) does. (Triton's interpreter truncates instead: 1 bf16 ulp apart.)
        tl.store(x + c, (v.to(tl.float32) * (1.0 / 255.0)).to(x_ptr.dtype.element_ty), mask=ok)


def _push_config():
    """(BLOCK, num_warps): 1024 pixels per program, 8 per thread."""
    return 1024, 4


def stage_frames(staging, frames, ended=()):
    """Write an env batch's new frames [B, H, W] and keep flags into a host staging buffer
    [B, staged_row(H * W)] (a numpy view of pinned memory on a GPU), from which one copy moves both."""
    frame = frames.shape[1] * frames.shape[2]
    staging[:, :frame] = frames.reshape(len(frames), frame)
    staging[:, frame] = 1
    staging[ended, frame] = 0


def push_frames(prev, staged, obs_out, x_out, shift=True):
    """The stacks one step on: obs_out[:, :-1] = prev[:, 1:] (zeros where a game ended),
    obs_out[:, -1] = the staged frame; with shift=False a plain copy of prev. Also writes
    x_out = obs_out / 255 (float32 or bfloat16, channels_last), the network's input.

    prev, obs_out uint8 [B, STACK, H, W] (contiguous: env batches are slices of the storage);
    staged uint8 [B, staged_row(H * W)] on the device (see `stage_frames`).
    """
    _check("prev", prev, (None, None, None, None), None, (torch.uint8,))
    (B, stack, height, width), device = prev.shape, prev.device
    frame = height * width
    _check("staged", staged, (B, staged_row(frame)), device, (torch.uint8,))
    _check("obs_out", obs_out, prev.shape, device, (torch.uint8,))
    if not isinstance(x_out, torch.Tensor) or x_out.dtype not in FLOAT_OR_BF16 or x_out.shape != prev.shape:
        raise ValueError(f"x_out must be a float32 or bfloat16 tensor of shape {tuple(prev.shape)}")
    if x_out.device != device or not x_out.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"x_out must be channels_last on {device}")
    if not _use_triton(device):
        return push_frames_reference(prev, staged, obs_out, x_out, shift)
    if B == 0:
        return obs_out, x_out
    BLOCK, num_warps = _push_config()
    grid = (triton.cdiv(frame, BLOCK), B)
    with _launch_guard():
        push_frames_kernel[grid](
            prev, staged, obs_out, x_out, stack, frame, staged_row(frame), shift, BLOCK, num_warps=num_warps
        )
    _counted()
    return obs_out, x_out


def push_frames_reference(prev, staged, obs_out, x_out, shift=True):
    """Torch reference for `push_frames` (no argument checks); allocates nothing."""
    if shift:
        frame = prev.shape[2] * prev.shape[3]
        keep = staged[:, frame].view(-1, 1, 1, 1)
        torch.mul(prev[:, 1:], keep, out=obs_out[:, :-1])
        obs_out[:, -1].copy_(staged[:, :frame].view(obs_out[:, -1].shape))
    else:
        obs_out.copy_(prev)
    # uint8 -> float and NCHW -> channels_last in one copy (exact), then the scale in place:
    # the same float32 product, rounded once more in bf16, as the learner's x * (1 / 255)
    x_out.copy_(obs_out)
    x_out.mul_(1.0 / 255.0)
    return obs_out, x_out


# ---------------------------------------------------------------------------------------
# 5. The rollout's policy step: fused for the native scripts' network, or the Agent's forward
# ---------------------------------------------------------------------------------------


def inference_weights(agent, dtype):
    """The rollout's own copy of the policy, refreshed in place before every rollout (on the
    default stream, which the env batches' streams then wait for), so that no rollout reads a
    parameter while the optimizer writes it.

    Convolutions in `dtype`, channels_last. Linear(64 * side**2, 512) in `dtype` with its columns
    permuted to the (h, w, c) order in which channels_last features flatten, so the last
    conv's output feeds it without a copy. Biases and heads in float32.
    """
    network = agent.network
    convs, fc = (network[0], network[2], network[4]), network[7]
    cl = torch.channels_last
    w = SimpleNamespace(
        conv_weight=[torch.empty_like(c.weight, dtype=dtype, memory_format=cl) for c in convs],
        conv_bias=[torch.empty_like(c.bias, dtype=dtype) for c in convs],
        fc_weight=torch.empty_like(fc.weight, dtype=dtype, memory_format=torch.contiguous_format),
        fc_bias=torch.empty_like(fc.bias),
        actor_weight=torch.empty_like(agent.actor.weight),
        actor_bias=torch.empty_like(agent.actor.bias),
        critic_weight=torch.empty_like(agent.critic.weight),
        critic_bias=torch.empty_like(agent.critic.bias),
        agent=agent,
    )
    refresh_inference_weights(w)
    return w


@torch.no_grad()
def refresh_inference_weights(w):
    """Copy the agent's current parameters into the rollout's copy (on the current stream)."""
    network = w.agent.network
    for i, conv in enumerate((network[0], network[2], network[4])):
        w.conv_weight[i].copy_(conv.weight)
        w.conv_bias[i].copy_(conv.bias)
    fc = network[7]
    side = math.isqrt(fc.in_features // 64)  # the last conv's output is 64 x side x side
    w.fc_weight.copy_(fc.weight.view(512, 64, side, side).permute(0, 2, 3, 1).reshape(512, fc.in_features))
    w.fc_bias.copy_(fc.bias)
    for name in ("actor_weight", "actor_bias", "critic_weight", "critic_bias"):
        head, field = name.split("_")
        getattr(w, name).copy_(getattr(getattr(w.agent, head), field))


def inference_buffers(shape, num_actions, dtype, device):
    """Everything one env batch's step writes apart from the rollout storage, allocated once;
    `shape` is the batch's stacks' [B, STACK, H, W]."""
    batch, _, height, width = shape
    return SimpleNamespace(
        staged=torch.empty((batch, staged_row(height * width)), dtype=torch.uint8, device=device),
        x=torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last),
        hidden=torch.empty((batch, 512), device=device),
        logits=torch.empty((batch, num_actions), device=device),
        entropy=torch.empty(batch, device=device),
    )


def conv_relu(x, weight, bias, stride):
    """Convolution (no padding) + bias + ReLU. cuDNN runs conv and bias as two kernels, then the
    ReLU is one more; under a CUDA graph the host pays one launch for the graph whatever its
    node count, so torch.cudnn_convolution_relu's single node is left for a measured change
    (its speed with channels_last varies: pytorch issue 68506)."""
    return F.conv2d(x, weight, bias, stride).relu_()


@torch.no_grad()
def policy_step(w, buf, prev_obs, obs_out, uniform, action_out, logprob_out, value_out, shift=True):
    """One env batch's step on the device, straight into views of the rollout storage:

    the frames staged in buf.staged pushed onto the stacks (obs_out, from prev_obs; with
    shift=False obs_out is a copy of prev_obs), then the network (three convolutions,
    Linear + GELU, both heads) and sampling with the given uniforms. Ten kernels in fp32 or
    bf16; nothing allocated but the convolutions' outputs (from the CUDA graph's own pool
    when captured). Every address it touches is fixed per (step, batch), which is what lets
    the scripts capture it in a CUDA graph.
    """
    push_frames(prev_obs, buf.staged, obs_out, buf.x, shift)
    c1 = conv_relu(buf.x, w.conv_weight[0], w.conv_bias[0], 4)
    c2 = conv_relu(c1, w.conv_weight[1], w.conv_bias[1], 2)
    c3 = conv_relu(c2, w.conv_weight[2], w.conv_bias[2], 1)
    features = c3.permute(0, 2, 3, 1).reshape(c3.shape[0], -1)  # channels_last: (h, w, c), a view
    linear_gelu(features.contiguous(), w.fc_weight, w.fc_bias, out=buf.hidden)
    policy_value_heads(
        buf.hidden, w.actor_weight, w.actor_bias, w.critic_weight, w.critic_bias,
        logits_out=buf.logits, value_out=value_out,
    )  # fmt: skip
    sample_logits(buf.logits, uniform, action_out, logprob_out, buf.entropy)


@torch.no_grad()
def module_policy_step(agent, buf, prev_obs, obs_out, uniform, action_out, logprob_out, value_out, shift=True):
    """The general path, with `policy_step`'s contract: the frames pushed as there, then the
    agent's own forward (any network) for logits and value, under bf16 autocast where the
    rollout runs bf16, as the learner runs it; sampling as there, from the same uniforms."""
    push_frames(prev_obs, buf.staged, obs_out, buf.x, shift)
    bf16 = buf.x.dtype == torch.bfloat16  # (a CUDA graph needs autocast's cast cache off)
    with torch.autocast(obs_out.device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
        logits, value = agent(obs_out)
    sample_logits(logits.float().contiguous(), uniform, action_out, logprob_out, buf.entropy)
    value_out.copy_(value.view(-1))


# ---------------------------------------------------------------------------------------
# 6. Which step the rollout takes: the fused one only where it computes Agent.forward
# ---------------------------------------------------------------------------------------


# The one network `policy_step` computes: the native scripts' Agent.network layer by layer
# (class and repr), its heads, and its forward (compared as syntax: comments, layout and the
# docstring aside).
def fused_network(stack, size):
    """The Nature CNN's layers, as reprs, for stacks of `stack` frames of size x size pixels."""
    side = size
    for kernel, stride in ((8, 4), (4, 2), (3, 1)):
        side = (side - kernel) // stride + 1
    return [
        f"Conv2d({stack}, 32, kernel_size=(8, 8), stride=(4, 4))", "ReLU",
        "Conv2d(32, 64, kernel_size=(4, 4), stride=(2, 2))", "ReLU",
        "Conv2d(64, 64, kernel_size=(3, 3), stride=(1, 1))", "ReLU", "Flatten(start_dim=1, end_dim=-1)",
        f"Linear(in_features={64 * side * side}, out_features=512, bias=True)", "GELU(approximate='none')",
    ]  # fmt: skip


FUSED_FORWARD = """
def forward(self, x):
    hidden = self.network(x.contiguous(memory_format=torch.channels_last) * (1.0 / 255.0))
    with torch.autocast(x.device.type, enabled=False):
        hidden = hidden.float()
        return self.actor(hidden), self.critic(hidden)
"""
# the layers' own forward, read at import: a script that patches a class afterwards is seen
_LAYER_FORWARD = {cls: cls.forward for cls in (nn.Sequential, nn.Conv2d, nn.ReLU, nn.Flatten, nn.Linear, nn.GELU)}


def _layer(module):
    """A layer as fused_network names it: its repr, and a bare ReLU (in place or not) as ReLU."""
    return "ReLU" if type(module) is nn.ReLU else repr(module)


def _syntax(source):
    """A function's syntax tree as text, without its docstring; None if unreadable."""
    function = ast.parse(textwrap.dedent(source)).body[0]
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        function.body = function.body[1:]
    function.decorator_list = []
    return ast.dump(function)


def _is_fused_forward(cls):
    try:
        return _syntax(inspect.getsource(cls.forward)) == _syntax(FUSED_FORWARD)
    except (OSError, TypeError, SyntaxError, IndexError):  # no source to read: not the fused forward
        return False


def fused_mismatch(agent, num_actions, shape=(4, 84, 84)):
    """None if `agent` computes exactly what `policy_step` does on stacks of `shape` [STACK, H, H],
    else its first difference in a few words. Read are its forward (and __call__), its modules
    (class, the class's forward, hyperparameters, nothing extra), every parameter and buffer, and
    forward hooks."""
    fused = fused_network(shape[0], shape[-1])  # square frames
    network = getattr(agent, "network", None)
    if network is None:
        return "the agent has no .network"
    if type(network) is not nn.Sequential:
        return f"agent.network is a {type(network).__name__}, not an nn.Sequential"
    for i, want in enumerate(fused):
        if i == len(network):
            return f"network ends at [{i}], the fused step computes {want} there"
        got = _layer(network[i])
        if got != want:
            name = lambda layer: layer.split("(")[0]  # noqa: E731
            got, want = (got, want) if name(got) == name(want) else (name(got), name(want))
            return f"network[{i}] is {got}, the fused step computes {want}"
    if len(network) > len(fused):
        extra = type(network[len(fused)]).__name__
        return f"network[{len(fused)}] is {extra}, after the layers the fused step computes"
    extra = [name for name, _ in agent.named_children() if name not in ("network", "actor", "critic")]
    if extra:
        return f"agent.{extra[0]} is not part of the fused step"
    for name, outputs in (("actor", num_actions), ("critic", 1)):
        want = f"Linear(in_features=512, out_features={outputs}, bias=True)"
        head = getattr(agent, name, None)
        if type(head) is not nn.Linear or repr(head) != want:
            got = repr(head) if type(head) is nn.Linear else type(head).__name__
            return f"agent.{name} is {got}, the fused step computes {want}"
    if type(agent).__call__ is not nn.Module.__call__:
        return "Agent.__call__ is overridden"
    if not _is_fused_forward(type(agent)):
        return "Agent.forward differs from kernels.FUSED_FORWARD"
    for name, module in agent.named_modules():
        where = f"agent.{name}" if name else "the agent"
        if "forward" in vars(module):
            return f"{where} has a forward of its own"
        if name and type(module) not in _LAYER_FORWARD:
            return f"{where} is a {type(module).__qualname__} from {type(module).__module__}, not torch's layer"
        if name and _LAYER_FORWARD[type(module)] is not type(module).forward:
            return f"{where}'s class {type(module).__name__} has an edited forward"
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{where} has a forward hook, which the fused step does not run"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "a global forward hook is registered, which the fused step does not run"
    expected = {f"{m}.{p}" for m in ("network.0", "network.2", "network.4", "network.7", "actor", "critic")
                for p in ("weight", "bias")}  # fmt: skip
    extra = [name for name, _ in agent.named_parameters() if name not in expected]
    if extra:
        return f"agent.{extra[0]} is a parameter the fused step does not read"
    buffers = [name for name, _ in agent.named_buffers()]
    if buffers:
        return f"agent.{buffers[0]} is a buffer the fused step does not read"
    return None


class PolicyMismatch(ValueError):
    """The rollout's step would not sample from the policy the learner trains."""


def _close(a, b, tolerance):
    """Every element within tolerance * (1 + |b|) (NaN is never close)."""
    return bool(((a.float() - b.float()).abs() <= tolerance * (1 + b.float().abs())).all())


@torch.no_grad()
def forward_problem(agent, frames, num_actions):
    """Why the rollout could not sample from agent.forward at all, or None: its outputs break
    the contract (logits [B, A], value [B] or [B, 1]), differ between two calls on the same
    frames (a random layer), or depend on the other frames of the batch (BatchNorm in train
    mode). Checked in float32; the run's random streams are left as they were."""
    n, device = len(frames), frames.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        first = agent(frames)
        shape = lambda out: "x".join(map(str, out.shape)) if isinstance(out, torch.Tensor) else type(out).__name__  # noqa: E731
        if not isinstance(first, (tuple, list)) or len(first) != 2:
            return f"Agent.forward must return (logits, value), it returned {shape(first)}"
        logits, value = first
        if shape(logits) != f"{n}x{num_actions}" or shape(value) not in (f"{n}", f"{n}x1"):
            want = f"logits {n}x{num_actions} and a value {n} or {n}x1"
            return f"Agent.forward must return {want} for {n} frames, it returned {shape(logits)} and {shape(value)}"
        again = agent(frames)
        mixed = agent(torch.cat([frames, 255 - frames]))  # the same frames in a batch with others
    outputs = torch.cat([logits, value.view(n, 1)], 1)
    if not _close(torch.cat([again[0], again[1].view(n, 1)], 1), outputs, 1e-6):
        return "Agent.forward gives different outputs for the same frames (a random layer, such as dropout?)"
    if not _close(torch.cat([mixed[0][:n], mixed[1].view(-1, 1)[:n]], 1), outputs, 1e-4):
        return "Agent.forward's output for a frame depends on the other frames in its batch (BatchNorm?)"
    return None


@torch.no_grad()
def learner_mismatch(agent, frames, num_actions):
    """None if agent.get_action_and_value scores actions by forward()'s logits and returns its
    value, else how far off it is: tried with forward's outputs replaced by logits that span
    several units (at an untrained policy's almost equal logits, a temperature would not show)."""
    n, device = len(frames), frames.device
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(n, num_actions, generator=generator)).to(device)
    value = torch.randn(n, 1, generator=generator).to(device)
    action = torch.arange(n, device=device) % num_actions
    agent.forward = lambda x: (logits, value)  # an instance attribute: __call__ runs it
    try:
        _, logprob, _, newvalue = agent.get_action_and_value(frames, action)
    finally:
        del agent.forward
    expected = torch.log_softmax(logits, 1).gather(1, action[:, None])[:, 0]
    gap = (logprob.float() - expected).abs().max().item()
    if not gap <= 1e-4 or not _close(newvalue.view(-1), value.view(-1), 1e-6):
        return f"its log-probs are {gap:.2g} from those of forward()'s logits, or its value is not forward()'s"
    return None


def probe_mismatch(step, agent, frames, dtype, tolerance, num_actions):
    """None if `step` (with policy_step's contract) gives, on these frames (uint8 stacks), the
    log-probs and values of agent.get_action_and_value for the actions it sampled, else how far
    apart they are. The learner's side runs as the update runs it (bf16 autocast in bf16)."""
    n, device = len(frames), frames.device
    buf = inference_buffers(frames.shape, num_actions, dtype, device)
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(0)).to(device)
    action, logprob, value = (torch.empty(n, dtype=torch.long, device=device), torch.empty(n, device=device),
                              torch.empty(n, device=device))  # fmt: skip
    step(buf, frames, torch.empty_like(frames), uniform, action, logprob, value, shift=False)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        _, expected_logprob, _, expected_value = agent.get_action_and_value(frames, action)
    logprob_gap = (logprob - expected_logprob).abs().max().item()
    value_gap = ((value - expected_value.view(-1)).abs() / (1 + expected_value.view(-1).abs())).max().item()
    if not logprob_gap <= tolerance or not value_gap <= tolerance:  # (NaN is a mismatch)
        return f"log-probs {logprob_gap:.2g} and values {value_gap:.2g} (relative) apart"
    return None


@torch.no_grad()
def spread_copy(agent, frames):
    """A float32 copy of a fused-layout agent with fresh random weights whose logits on `frames`
    span several units, where two policies that differ show it."""
    probe = copy.deepcopy(agent).float()
    generator = torch.Generator().manual_seed(0)
    for p in probe.parameters():
        std = (2 / p[0].numel()) ** 0.5 if p.dim() > 1 else 0.1  # He for weights (fan-in)
        p.copy_(std * torch.randn(p.shape, generator=generator))
    logits, _ = probe(frames)
    probe.actor.weight.mul_(3 / logits.std(1).mean().clamp(min=1e-6))  # about 3 units per row
    return probe


def rollout_policy(choice, agent, dtype, frames, num_actions):
    """The rollout's policy step for `agent`: the fused `policy_step` (choice "fused", or "auto"
    when `fused_mismatch` finds the agent to be the network it computes and the two agree on
    `frames`: in float32 on a copy whose logits span several units, and in `dtype` on the agent
    itself), else `module_policy_step`, which runs the agent's own forward ("module"). Either
    way a step that would sample from another policy than the learner's raises PolicyMismatch.

    Returns .name ("fused" or "module"), .reason (why not fused, or None), .dtype, .step(buf,
    prev_obs, obs_out, uniform, action_out, logprob_out, value_out, shift) and .refresh(),
    which the script calls before each rollout (the fused step reads its own weight copy).
    """
    problem = forward_problem(agent, frames, num_actions)
    if problem is None and (mismatch := learner_mismatch(agent, frames, num_actions)):
        problem = f"Agent.get_action_and_value: {mismatch}; get_action_and_value must sample from forward()'s logits"
    if problem is not None:
        raise PolicyMismatch(f"policy: {problem}")
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: cuDNN's order of sums at other batch sizes
    reason = None if choice == "module" else fused_mismatch(agent, num_actions, frames.shape[1:])
    if reason is None and choice != "module":
        probe = spread_copy(agent, frames)
        gap = probe_mismatch(functools.partial(policy_step, inference_weights(probe, torch.float32)), probe, frames,
                             torch.float32, 1e-4, num_actions)  # fmt: skip
        weights = inference_weights(agent, dtype)
        step = functools.partial(policy_step, weights)
        gap = gap or probe_mismatch(step, agent, frames, dtype, tolerance, num_actions)
        reason = gap and f"the fused step and Agent.forward give {gap}"
        if reason is None:
            refresh = functools.partial(refresh_inference_weights, weights)
            return SimpleNamespace(name="fused", reason=None, dtype=dtype, step=step, refresh=refresh)
    if choice == "fused":
        raise PolicyMismatch(f"--policy fused: {reason}; use --policy auto or module")
    step = functools.partial(module_policy_step, agent)
    gap = probe_mismatch(step, agent, frames, dtype, tolerance, num_actions)
    if gap is not None:
        raise PolicyMismatch(
            f"policy: the rollout's step (Agent.forward) and Agent.get_action_and_value (what the learner "
            f"trains) give {gap}: get_action_and_value must sample from forward()'s logits"
        )
    return SimpleNamespace(name="module", reason=reason, dtype=dtype, step=step, refresh=lambda: None)
