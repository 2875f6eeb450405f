"""Hand-made mutants of the algorithm: does the suite catch a plausible slip?

Each mutant changes one line of the update, advantage, sampling, checkpoint or resume code
(matched with its indentation stripped, so a mutant survives code being moved) in a copy of
the repository, and runs the tests that cover that code; a mutant is killed when they fail.
Not collected by pytest (no test_ prefix): it runs the suite many times.

Run: python tests/mutants.py [--rev REV] [--only NAME ...] [--out FILE.md]
(--rev: mutate and test that commit instead of the working tree, e.g. the one before a change
to the tests, for a before/after score; a mutant whose line is not there is reported n/a.)
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# test selections: what covers each part of the code (the native tests of env frames, game
# accounting and allocations never run the mutated lines, and take minutes: left out)
FRAMES_ONLY = "not frame_stack_matches and not env_pipelines_give and not episode_accounting and not allocates_nothing"
NATIVE = [
    "tests/test_algorithm.py",
    "tests/test_rollout.py",
    "tests/test_network.py",
    "tests/test_native.py",
    "-k",
    FRAMES_ONLY,
]
BASELINE = ["tests/test_algorithm.py", "tests/test_baseline.py"]
A2C = ["tests/test_algorithm.py", "tests/test_a2c.py"]
RESUME = ["tests/test_reliability.py", "tests/test_a2c.py", "-k", "resume or sigint or rng or checkpoint or stop"]
DISTRIBUTED = ["tests/test_distributed.py"]
NETWORK = ["tests/test_network.py"]

# (name, file, line as it is, line as the mutant has it, tests)
MUTANTS = [
    # PPO's loss, native and baseline
    ("native clip bound 1 + 2c", "ppo_atari_native.py",
     "pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)",
     "pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + 2 * args.clip_coef)", NATIVE),
    ("native min of the surrogates", "ppo_atari_native.py",
     "pg_loss = torch.max(pg_loss1, pg_loss2).mean()", "pg_loss = torch.min(pg_loss1, pg_loss2).mean()", NATIVE),
    ("native entropy sign", "ppo_atari_native.py",
     "loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef",
     "loss = pg_loss + args.ent_coef * entropy_loss + v_loss * args.vf_coef", NATIVE),
    ("native value loss without 0.5", "ppo_atari_native.py",
     "v_loss = 0.5 * v_loss_max.mean()", "v_loss = v_loss_max.mean()", NATIVE),
    ("native value clip: min", "ppo_atari_native.py",
     "v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)",
     "v_loss_max = torch.min(v_loss_unclipped, v_loss_clipped)", NATIVE),
    ("native advantages not normalized", "ppo_atari_native.py",
     "mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)",
     "mb_advantages = mb_advantages - mb_advantages.mean()", NATIVE),
    ("native upper clip bound with ent_coef", "ppo_atari_native.py",
     "pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)",
     "pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.ent_coef)", NATIVE),
    ("native grad clip at vf_coef", "ppo_atari_native.py",
     "nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)",
     "nn.utils.clip_grad_norm_(agent.parameters(), args.vf_coef)", NATIVE),
    ("native grad clip doubled", "ppo_atari_native.py",
     "nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)",
     "nn.utils.clip_grad_norm_(agent.parameters(), 2 * args.max_grad_norm)", NATIVE),
    ("baseline clip bound 1 + 2c", "ppo_atari_baseline.py",
     "pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)",
     "pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + 2 * args.clip_coef)", BASELINE),
    ("baseline value loss without 0.5", "ppo_atari_baseline.py",
     "v_loss = 0.5 * v_loss_max.mean()", "v_loss = v_loss_max.mean()", BASELINE),
    ("baseline entropy sign", "ppo_atari_baseline.py",
     "loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef",
     "loss = pg_loss + args.ent_coef * entropy_loss + v_loss * args.vf_coef", BASELINE),
    # advantages
    ("native GAE bootstraps from the wrong step", "ppo_atari_native.py",
     "deltas = rewards + gamma * values[1:] * next_nonterminal - values[:-1]",
     "deltas = rewards + gamma * values[:-1] * next_nonterminal - values[:-1]", NATIVE),
    ("native GAE terminal one step early", "ppo_atari_native.py",
     "next_nonterminal = 1.0 - dones[1:]", "next_nonterminal = 1.0 - dones[:-1]", NATIVE),
    ("native GAE without lambda", "ppo_atari_native.py",
     "decay = torch.where(lag >= 0, (gamma * gae_lambda) ** lag.clamp(min=0), 0.0).to(rewards.dtype)",
     "decay = torch.where(lag >= 0, gamma ** lag.clamp(min=0), 0.0).to(rewards.dtype)", NATIVE),
    ("baseline GAE bootstraps from the wrong step", "ppo_atari_baseline.py",
     "nextvalues = values[t + 1]", "nextvalues = values[t]", BASELINE),
    ("a2c returns bootstrap from the wrong step", "a2c_atari.py",
     "deltas = rewards + gamma * values[1:] * next_nonterminal - values[:-1]",
     "deltas = rewards + gamma * values[:-1] * next_nonterminal - values[:-1]", A2C),
    # A2C's loss and optimizer
    ("a2c entropy sign", "a2c_atari.py",
     "loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef",
     "loss = pg_loss + args.ent_coef * entropy_loss + v_loss * args.vf_coef", A2C),
    ("a2c value coefficient dropped", "a2c_atari.py",
     "loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef",
     "loss = pg_loss - args.ent_coef * entropy_loss + v_loss", A2C),
    ("a2c value loss halved", "a2c_atari.py",
     "v_loss = ((newvalue - b_returns) ** 2).mean()", "v_loss = 0.5 * ((newvalue - b_returns) ** 2).mean()", A2C),
    ("a2c grad clip at vf_coef", "a2c_atari.py",
     "nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)",
     "nn.utils.clip_grad_norm_(agent.parameters(), args.vf_coef)", A2C),
    ("a2c RMSprop eps outside the sqrt", "a2c_atari.py",
     "denominators = torch._foreach_add(square_avgs, eps)", "denominators = torch._foreach_add(square_avgs, 0.0)", A2C),
    # sampling and the rollout's storage
    ("every step samples with step 0's uniforms", "utils.py",
     "[(obs[t - 1 if t > 0 else T, sl], obs[t, sl], self.uniforms[t, sl], actions[t, sl], logprobs[t, sl],",
     "[(obs[t - 1 if t > 0 else T, sl], obs[t, sl], self.uniforms[0, sl], actions[t, sl], logprobs[t, sl],", NATIVE),
    ("every step samples with step 0's uniforms (before BatchedRollout drew them)", "utils.py",
     "[(obs[t - 1 if t > 0 else T, sl], obs[t, sl], uniforms[t, sl], actions[t, sl], logprobs[t, sl],",
     "[(obs[t - 1 if t > 0 else T, sl], obs[t, sl], uniforms[0, sl], actions[t, sl], logprobs[t, sl],", NATIVE),
    ("terminals stored one step early", "utils.py",
     "frames, ended = self.envs.recv(b, self.rewards_np[step - 1, sl], self.dones_np[step, sl])",
     "frames, ended = self.envs.recv(b, self.rewards_np[step - 1, sl], self.dones_np[step - 1, sl])", NATIVE),
    ("terminals stored one step early (before BatchedRollout held the host buffers)", "utils.py",
     "frames, ended = self.envs.recv(b, self.rewards_host[step - 1, sl], self.dones_host[step, sl])",
     "frames, ended = self.envs.recv(b, self.rewards_host[step - 1, sl], self.dones_host[step - 1, sl])", NATIVE),
    ("sampler's log-prob not normalized", "kernels.py",
     "logprob = torch.sub(zs.gather(1, action[:, None])[:, 0], log_total, out=logprob_out)",
     "logprob = torch.sub(zs.gather(1, action[:, None])[:, 0], 0.0, out=logprob_out)", NATIVE),
    ("sampler reads a skewed CDF", "kernels.py",
     "hit = pos & (cdf > (uniform * total)[:, None])", "hit = pos & (cdf > (uniform * total * 0.5)[:, None])", NATIVE),
    # resume and checkpoints
    ("native LR annealing restarts on resume", "ppo_atari_native.py",
     "frac = 1.0 - (iteration - 1.0) / args.num_iterations",
     "frac = 1.0 - (iteration - 1.0 - start_iteration) / args.num_iterations", RESUME),
    ("a2c LR annealing restarts on resume", "a2c_atari.py",
     "frac = 1.0 - (iteration - 1.0) / args.num_iterations",
     "frac = 1.0 - (iteration - 1.0 - start_iteration) / args.num_iterations", RESUME),
    ("native optimizer state not restored", "ppo_atari_native.py",
     'utils.load_optimizer(optimizer, checkpoint["optimizer"], hyper)', "pass", RESUME),
    ("native RNG states not restored", "ppo_atari_native.py",
     'utils.set_rng_states(checkpoint["rng"], device)', "pass", RESUME),
    ("checkpoint written in place, not atomically", "utils.py",
     'tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")', "tmp = path", RESUME),
    # torchrun
    ("all-reduced gradients never written back", "utils.py",
     "g.copy_(flat[offset : offset + g.numel()].view_as(g))", "pass", DISTRIBUTED),
    ("all-reduced gradients summed, not averaged", "utils.py",
     "flat /= world_size", "pass", DISTRIBUTED),
    ("a signal on one rank does not stop the others", "utils.py",
     'stop.received = "a signal on another rank"', "pass", DISTRIBUTED),
    ("a non-finite loss on one rank does not stop the others", "utils.py",
     "return flags[1] > 0, flags[2]", "return nonfinite, flags[2]", DISTRIBUTED),
    ("guard: each rank keeps its own gap", "utils.py",
     "return flags[1] > 0, flags[2]", "return flags[1] > 0, logprob_gap", DISTRIBUTED),
    # the rollout's policy: the fused check, the refusals, the run-long guard
    ("policy: the fused check does not read forward", "kernels.py",
     "if not _is_fused_forward(type(agent)):", "if False:", NETWORK + ["-k", "every_edit"]),
    ("policy: the fused check reads no parameter", "kernels.py",
     "extra = [name for name, _ in agent.named_parameters() if name not in expected]", "extra = []",
     NETWORK + ["-k", "fused_check"]),
    ("policy: the probe runs on the untrained agent", "kernels.py",
     "probe = spread_copy(agent, frames)", "probe = agent", NETWORK + ["-k", "probe_compares"]),
    ("policy: a random forward is not refused", "kernels.py",
     'return "Agent.forward gives different outputs for the same frames (a random layer, such as dropout?)"',
     "pass", NETWORK + ["-k", "every_edit and dropout"]),
    ("policy: the learner is checked at an untrained policy's logits", "kernels.py",
     "logits = (3 * torch.randn(n, num_actions, generator=generator)).to(device)",
     "logits = (0.01 * torch.randn(n, num_actions, generator=generator)).to(device)",
     NETWORK + ["-k", "(every_edit and clamps) or other_logits"]),
    ("guard: the other precision's bound", "utils.py",
     "bound = LOGPROB_GAP_BOUND[precision]", 'bound = LOGPROB_GAP_BOUND["bf16"]', NETWORK + ["-k", "guard_stops"]),
    ("guard: PPO keeps the last minibatch's gap", "ppo_atari_native.py",
     "if epoch == 0 and start == 0:", "if True:", ["tests/test_algorithm.py", "-k", "gap"]),
    ("guard: A2C's gap signed", "a2c_atari.py",
     "logprob_gap = (newlogprob - b_logprobs).abs().mean()  # the learner's log-probs against the rollout's",
     "logprob_gap = (newlogprob - b_logprobs).mean()", ["tests/test_algorithm.py", "-k", "gap"]),
]  # fmt: skip


def copy_tree(rev, where):
    """The repository's tracked files at `rev` (None: the working tree) in `where`."""
    if rev is None:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        for name in filter(None, files.decode().split("\0")):
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / name).is_file():
                (where / name).write_bytes((ROOT / name).read_bytes())
    else:
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)


def mutate(path, old, new):
    """Replace the one line whose stripped text is `old` by `new`, keeping its indentation;
    False if no line or several lines match."""
    lines = path.read_text().split("\n")
    found = [i for i, line in enumerate(lines) if line.strip() == old]
    if len(found) != 1:
        return False
    line = lines[found[0]]
    lines[found[0]] = line[: len(line) - len(line.lstrip())] + new
    path.write_text("\n".join(lines))
    return True


def run(name, file, old, new, tests, rev):
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        copy_tree(rev, where)
        if not mutate(where / file, old, new):
            return "n/a", 0.0
        selection = [t for t in tests if not t.startswith("tests/") or (where / t).exists()]
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *selection],
            cwd=where, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        if result.returncode == 0:
            return "survived", seconds
        return ("killed" if result.returncode == 1 else f"error {result.returncode}"), seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default=None, help="mutate this commit instead of the working tree")
    parser.add_argument("--only", nargs="+", default=None, help="mutant names (substrings) to run")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.only is None or any(o in m[0] for o in args.only)]
    lines = [
        f"Mutants of {args.rev or 'the working tree'}, {time.strftime('%Y-%m-%d')}: `python tests/mutants.py"
        f"{' --rev ' + args.rev if args.rev else ''}`\n",
        "| mutant | file | tests | result | seconds |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    results = []
    for name, file, old, new, tests in chosen:
        result, seconds = run(name, file, old, new, tests, args.rev)
        results.append(result)
        group = " ".join(t.removeprefix("tests/") for t in tests if t.startswith("tests/"))
        lines.append(f"| {name} | {file} | {group} | {result} | {seconds:.0f} |")
        print(lines[-1], flush=True)
    applicable = [r for r in results if r != "n/a"]
    killed = sum(r == "killed" for r in applicable)
    lines.append(f"\nkilled {killed} of {len(applicable)} applicable mutants ({len(results) - len(applicable)} n/a)")
    print(lines[-1])
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
