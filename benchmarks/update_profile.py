"""Per PPO minibatch, the update's launches: eagerly, and graphed (what its CUDA graph holds, and what
the host still launches around the one replay).

Counted as benchmarks/rollout_profile.py counts the rollout's: the aten ops dispatched (its
CountOps, a TorchDispatchMode; views count too, since each is a dispatch), here on the CPU, where
utils.GraphedStep runs everything but the capture, so the step's ops are the ones a capture records
on CUDA. The optimizer is the CUDA one where the CPU has it: fused Adam reading a tensor rate
(`_foreach_add_` of the step counts, `_fused_adam_`), the clip's foreach norms. On a GPU an op may
launch more kernels than one (a convolution's backward, a foreach op over many tensors) or none (a
view): the H200's profile counted 227 kernels a minibatch eagerly.
Run: python benchmarks/update_profile.py [--minibatch-size 256] [--num-minibatches 8]
"""

import argparse
import functools
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ppo_atari_native as native  # noqa: E402
import utils  # noqa: E402
from benchmarks.rollout_profile import CountOps  # noqa: E402

# ops that launch no kernel on a GPU: views, and the labels torch.optim's step sets for the profiler
NO_KERNEL = {"detach", "t", "view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "slice", "select", "permute",
             "_record_function_enter_new", "_record_function_exit"}  # fmt: skip


def counted(step):
    """`step`, and the list its calls' ops go to while `count.outer` (the update's CountOps) is set,
    counted apart from the outer's: the step itself, not GraphedStep's copy of the indices around it."""

    @functools.wraps(step)  # GraphedStep reads the step's parameters' names
    def count(*args):
        if count.outer is None:
            return step(*args)
        count.outer.paused = True
        try:
            with CountOps() as mode:
                out = step(*args)
        finally:
            count.outer.paused = False
        calls.append(mode.ops)
        return out

    calls, count.outer = [], None
    return count, calls


def update_ops(graphed, minibatch_size, num_minibatches):
    """(ops of each minibatch step, ops of the update around them) for one epoch of the native update,
    after one uncounted update (Adam's state made, GraphedStep's first call and warm-up done)."""
    torch.manual_seed(0)
    agent = native.Agent(4).to(memory_format=torch.channels_last)
    batch = minibatch_size * num_minibatches
    obs = torch.randint(0, 256, (batch, 4, 84, 84), dtype=torch.uint8)
    actions = torch.randint(0, 4, (batch,))
    with torch.no_grad():
        _, logprobs, _, values = agent.get_action_and_value(obs, actions)
    values = values.view(-1)
    advantages = torch.randn(batch)
    data = (obs, actions, logprobs, advantages, values + advantages, values)
    args = SimpleNamespace(
        update_epochs=1, batch_size=batch, minibatch_size=minibatch_size, clip_coef=0.1, norm_adv=True,
        clip_vloss=True, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, target_kl=None,
    )  # fmt: skip
    optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(2.5e-4), eps=1e-5, fused=True)
    step, calls = counted(native.minibatch_step)
    if graphed:
        step = utils.GraphedStep(step, torch.device("cpu"), ["mb_inds"])
    native.update(agent, optimizer, *data, args, torch.float32, 1, step)
    with CountOps() as outer:
        calls.clear()
        (step.step if graphed else step).outer = outer
        native.update(agent, optimizer, *data, args, torch.float32, 1, step)
    return calls, outer.ops


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minibatch-size", type=int, default=256, help="the headline's: 2,048 samples / 8")
    parser.add_argument("--num-minibatches", type=int, default=8)
    args = parser.parse_args()
    n = args.num_minibatches
    eager_steps, eager_around = update_ops(False, args.minibatch_size, n)
    graphed_steps, graphed_around = update_ops(True, args.minibatch_size, n)
    step_ops = len(eager_steps[-1])
    assert all(len(ops) == step_ops for ops in eager_steps + graphed_steps), "the step's ops differ by minibatch"
    print(
        f"The native PPO update's launches per minibatch, minibatch {args.minibatch_size}, "
        f"torch {torch.__version__}, device cpu (aten ops dispatched)\n"
    )
    print("| update | host launches per minibatch | of them no kernel | the step's ops | ops around the step |")
    print("|---|---|---|---|---|")
    step_free = sum(op in NO_KERNEL for op in eager_steps[-1])
    for name, around in (("eager", eager_around), ("graphed", graphed_around)):
        free = sum(op in NO_KERNEL for op in around) / n
        if name == "eager":
            host, free, step = f"{step_ops + len(around) / n:.1f}", f"{step_free + free:.1f}", f"{step_ops}"
        else:
            host, free, step = f"{1 + len(around) / n:.1f} (1 replay)", f"{free:.1f}", f"{step_ops}, in the graph"
        print(f"| {name} | {host} | {free} | {step} | {len(around) / n:.1f} |")
    print(
        "\nNo kernel: views and the optimizer's profiler labels (" + ", ".join(sorted(NO_KERNEL)) + ")."
        " Around the step, per epoch: the stats' zeros and the shuffle; per minibatch: the stats' copies out of"
        " the step's outputs, and graphed, the copy of the minibatch's indices into the graph's buffer."
    )
    syncs = sum(op == "_local_scalar_dense" for ops in eager_steps for op in ops)
    print(
        f"\nOps of the step that read a value back to the host (_local_scalar_dense: what .item() and a Python"
        f" `if` on a tensor dispatch; none may run in a capture): {syncs}."
    )
    print(f"\nthe step ({step_ops} ops): {', '.join(eager_steps[-1])}")
    print(f"\nits ops by name: {dict(Counter(eager_steps[-1]).most_common())}")
    print(f"\naround the steps, eager, one epoch of {n}: {', '.join(eager_around)}")
    print(f"\naround the steps, graphed, one epoch of {n}: {', '.join(graphed_around)}")


if __name__ == "__main__":
    main()
