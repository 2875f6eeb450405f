"""Each network edit of tests/test_network.py, run as a user would on a copy of each native
script, in fp32 and bf16: the reason on its first line (or the line it was refused with) and
its first iteration's losses/rollout_logprob_gap, as a markdown table.
Run: python benchmarks/edits.py [--out benchmarks/results/edits.md]
"""

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import read_scalars, run_dir_of, run_script  # noqa: E402
from test_network import ALL_EDITS, edited_copy  # noqa: E402

ARGS = {
    "ppo_atari_native.py": ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "1"]
    + ["--total-timesteps", "128"],
    "a2c_atari.py": ["--num-envs", "4", "--num-steps", "5", "--total-timesteps", "20"],
}


def outcome(script, edit, precision, where):
    path = edited_copy(script, edit, where)
    args = [*ARGS[script], "--precision", precision, "--runs-dir", where / "runs"]
    result = run_script(path, *args, env={"PYTHONPATH": str(ROOT)}, check=False)
    if result.returncode != 0:
        return f"exit {result.returncode}: `{result.stderr.strip().splitlines()[-1]}`", "-"
    policy = re.search(r", (policy \w+(?: \(.*\))?); ", result.stdout.splitlines()[0])[1]
    gap = read_scalars(run_dir_of(result))["losses/rollout_logprob_gap"][0][1]
    return f"`{policy}`", f"{gap:.1e}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "edits.md"))
    out = parser.parse_args().out
    lines = [
        "# Network edits: what the rollout runs, and the guard's first gap",
        "",
        "`python benchmarks/edits.py` on CPU (first iteration of a tiny run; bounds: fp32 1e-3, bf16 2e-2).",
        "",
        "| script | edit | fp32: first line / refusal | fp32 gap | bf16: first line / refusal | bf16 gap |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for script in ARGS:
            for edit in ALL_EDITS:
                cells = []
                for precision in ("fp32", "bf16"):
                    where = Path(tmp) / f"{script}-{edit}-{precision}"
                    where.mkdir()
                    cells += outcome(script, edit, precision, where)
                lines.append(f"| {script} | {edit} | {' | '.join(cells)} |")
                print(lines[-1], flush=True)
    Path(out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
