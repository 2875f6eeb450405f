"""Learning curves: return vs agent steps and vs wall time, for each script and seed.

Runs the scripts one after another (never two at once: they would share the cores), keeping
each run under runs/learning/NAME (NAME from --out): the same command resumes a run that a stop
or a lost machine cut short, from its checkpoint, and only reads a finished one. It reads every
full-game return from their TensorBoard files, and writes
  OUT.csv  rows (script, seed, step, wall_time_s, return)
  OUT.png  return vs steps and return vs wall time (mean of the last 20 games, per run)
and prints a summary: the mean return over the last 20 and the last 100 full games of each run,
its wall time, the wall time at which each run's 20-game mean first reached the baseline's
final one, the mean return of the games ended in each fifth of the run (the whole curve, not
its end), and per script the mean over seeds of the last fifth with a 95% confidence interval
(Student's t over seeds), and the paired difference of each script from the baseline (seed by
seed, the seeds both ran) with its interval. An interval that contains 0 does not show a
difference. SLM Lab's published Breakout-v5 points (PUBLISHED: each names its file) are drawn
beside the runs of the same algorithm, where they fall inside the plot's steps.
matplotlib is needed for the plot only: pip install -r benchmarks/requirements.txt
Run: python benchmarks/learning.py --total-timesteps 500000 --seeds 1 2
     python benchmarks/learning.py --total-timesteps 2000000 --variants a2c sb3-a2c --at 1000000 2000000
       (a2c_atari.py beside Stable-Baselines3's A2C with its settings; SB3, a benchmark-only
       requirement, is installed from benchmarks/requirements.txt if it is missing)
     python benchmarks/learning.py --total-timesteps 500000 --schedule-timesteps 10000000
       (the first 500k steps of default 10M-step runs, stopped cleanly there)
     python benchmarks/learning.py --seeds 3 --variants a2c --append  (add runs to OUT.csv)
     python benchmarks/learning.py --plot-only  (redraw from OUT.csv)
     python benchmarks/learning.py --from-run a2c 1 runs/RUN --append  (a run that already ran)
"""

import argparse
import csv
import importlib.util
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

VARIANTS = {
    "baseline": ("ppo_atari_baseline.py", []),
    "native-fp32": ("ppo_atari_native.py", ["--precision", "fp32"]),
    "native-bf16": ("ppo_atari_native.py", ["--precision", "bf16"]),
    "native-fp32-lam0.70": ("ppo_atari_native.py", ["--precision", "fp32", "--gae-lambda", "0.7"]),
    "a2c": ("a2c_atari.py", []),
    "sb3-a2c": ("benchmarks/sb3_a2c.py", []),  # Stable-Baselines3's A2C as a2c_atari.py's defaults
    "a2c-rlzoo": ("a2c_atari.py", "--num-steps 5 --gae-lambda 1 --vf-coef 0.25 --optimizer rmsprop-tf".split()),
}
WINDOW = 20  # games in the running mean, as in the target
LAST_GAMES = 100  # a second, less noisy end-of-run mean
# Student's t, two-sided 95%, by degrees of freedom (seeds - 1); scipy is not a requirement
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
# Published Breakout-v5 points under our protocol (sticky actions, a lost life terminal), each
# with its source: algorithm -> (label, source, [(agent steps, mean return)]). SLM Lab's "frames"
# are its vector env's steps times the envs (slm_lab/env/wrappers.py, tick_timestep): our agent steps.
SLM_PLOT = "kengz/SLM-Lab docs/plots/Breakout-v5_multi_trial_graph_mean_returns_ma_vs_frames.png"
PUBLISHED = {
    "a2c": (
        "SLM Lab A2C (read by eye off its plot; 10M: its table)",
        f"{SLM_PLOT}; kengz/SLM-Lab docs/BENCHMARKS.md (a2c_gae_atari_arc, 273)",
        [(1_000_000, 8.0), (2_000_000, 28.0), (3_000_000, 50.0), (10_000_000, 273.0)],
    ),
    "ppo": (
        "SLM Lab PPO, lambda 0.70 (its table)",
        "kengz/SLM-Lab docs/BENCHMARKS.md (ppo_atari_lam70_arc, 326.47)",
        [(10_000_000, 326.47)],
    ),
}
BENCHMARK_ONLY = {"sb3-a2c": "stable_baselines3"}  # variant -> a package of benchmarks/requirements.txt it needs
ALGORITHM = {"baseline": "ppo", "a2c": "a2c", "sb3-a2c": "a2c"}  # variants not named here are "ppo" or "a2c" by prefix
COLUMNS = ["script", "seed", "step", "wall_time_s", "return"]  # of OUT.csv
PROGRESS = re.compile(r"step ([\d,]+)/")  # the scripts' progress line


def returns_of(run_dir):
    """(step, seconds of running since the run's first event, return) for every full game, in
    order. A resumed run (--resume) starts its event file with TensorBoard's purge marker (a
    SessionLog START at the checkpoint's step + 1): games the interrupted run logged from
    there on are dropped, as TensorBoard drops them, and the time the run was down is not
    counted."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog
    from tensorboard.util import tensor_util

    rows, start, offset, last_wall = [], None, 0.0, None
    for path in sorted(Path(run_dir).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            start = event.wall_time if start is None else start
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                rows = [row for row in rows if row[0] < event.step]
                if last_wall is not None:  # continue the clock from the last kept game
                    offset = (rows[-1][1] if rows else 0.0) - (event.wall_time - start)
            last_wall = event.wall_time
            for value in event.summary.value:
                if value.tag == "charts/episodic_return":
                    number = value.simple_value if value.HasField("simple_value") else None
                    if number is None:
                        number = float(tensor_util.make_ndarray(value.tensor))
                    rows.append((event.step, event.wall_time - start + offset, number))
    return rows


def running_mean(values, window=WINDOW):
    values = np.asarray(values, dtype=float)
    return np.array([values[max(0, i + 1 - window) : i + 1].mean() for i in range(len(values))])


def find_run(runs_dir, name, seed):
    """The run directory of `name` and `seed` under runs_dir (the newest, if several), or None."""
    found = sorted(Path(runs_dir).glob(f"*__{name}__{seed}__*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def checkpoint_step(run_dir):
    """The agent steps a run directory's checkpoint holds (0 if none), and whether it ended (model.pt)."""
    import torch

    for name in ("model.pt", "checkpoint.pt"):
        path = Path(run_dir) / name
        if path.is_file():
            return torch.load(path, map_location="cpu", weights_only=True)["global_step"], name == "model.pt"
    return 0, False


def train(name, seed, total_timesteps, runs_dir, schedule_timesteps=None):
    """Run one script to `total_timesteps`; with `schedule_timesteps`, run it as a run of that
    length (its learning rate anneals over it, as in a default 10M-step run) and stop it with
    SIGTERM (a clean stop) at the first iteration that reaches `total_timesteps`. A run of this
    variant and seed already in runs_dir is resumed from its checkpoint (or read, if it got there)."""
    script, extra = VARIANTS[name]
    command = [sys.executable, str(ROOT / script), *extra, "--seed", str(seed)]
    command += ["--total-timesteps", str(schedule_timesteps or total_timesteps)]
    run_dir = find_run(runs_dir, name, seed)
    done, ended = checkpoint_step(run_dir) if run_dir is not None else (0, False)
    if ended or done >= total_timesteps:
        print(f"{name} seed {seed}: read from {run_dir} ({done:,} steps)", file=sys.stderr, flush=True)
        return [row for row in returns_of(run_dir) if row[0] <= done]
    if done > 0:
        command += ["--resume", str(run_dir)]
    else:
        command += ["--runs-dir", str(runs_dir), "--exp-name", name]
    print(" ".join(command[1:]), file=sys.stderr, flush=True)
    stop_step = None
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
        for line in process.stdout:
            if line.startswith("run directory: "):
                run_dir = line.removeprefix("run directory: ").strip()
            progress = PROGRESS.search(line)
            step = int(progress.group(1).replace(",", "")) if progress else 0
            if stop_step is None and step >= total_timesteps:
                stop_step = step
                process.send_signal(signal.SIGTERM)
        if process.wait() != 0 or run_dir is None:
            stderr.seek(0)
            raise RuntimeError(f"{name} seed {seed} failed:\n{stderr.read()[-2000:]}")
    # a stop abandons the next rollout, whose games the baseline may already have logged
    return [row for row in returns_of(run_dir) if stop_step is None or row[0] <= stop_step]


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {}
    for (name, seed), run in sorted(group(rows).items()):
        color = colors.setdefault(name, f"C{len(colors)}")
        steps, times, returns = np.array(run).T
        mean = running_mean(returns)
        label = name if seed == min(s for n, s in group(rows) if n == name) else None
        by_step.plot(steps, mean, color=color, label=label, alpha=0.9)
        by_time.plot(times / 60, mean, color=color, label=label, alpha=0.9)
    last_step = max(float(step) for _, _, step, _, _ in rows)
    for marker, algorithm in zip("^v", sorted({algorithm_of(name) for name, _ in group(rows)})):
        label, _, points = PUBLISHED[algorithm]
        shown = [(step, value) for step, value in points if step <= last_step * 1.05]
        if shown:
            by_step.plot(*zip(*shown), "k" + marker, label=label)
    by_step.set_xlabel("agent steps")
    by_time.set_xlabel("wall time (minutes)")
    for ax in (by_step, by_time):
        ax.set_ylabel(f"return (mean of last {WINDOW} games)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Breakout-v5, one line per seed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def algorithm_of(name):
    return ALGORITHM.get(name, "a2c" if name.startswith("a2c") else "ppo")


def group(rows):
    runs = {}
    for name, seed, step, wall, ret in rows:
        runs.setdefault((name, int(seed)), []).append((float(step), float(wall), float(ret)))
    return runs


def interval(values):
    """(mean, half-width of the 95% t interval) over seeds; no interval from one seed."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float(values.mean()), float("nan")
    return float(values.mean()), T95[len(values) - 1] * float(values.std(ddof=1)) / np.sqrt(len(values))


def bounds(mean, half, sign=""):
    """'[low, high]' of a 95% interval; a difference is written with its sign (sign="+")."""
    return "[no interval from 1 seed]" if np.isnan(half) else f"[{mean - half:{sign}.2f}, {mean + half:{sign}.2f}]"


def summary(rows, marks=()):
    runs = group(rows)
    finals = {key: float(np.mean([r for _, _, r in run[-WINDOW:]])) for key, run in runs.items()}
    base = [v for (name, _), v in finals.items() if name == "baseline"]
    target = float(np.mean(base)) if base else None
    lines = [
        f"| script | seed | games | return, last {WINDOW} games | last {LAST_GAMES} games | wall time "
        "| time to baseline's final return |"
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for (name, seed), run in sorted(runs.items()):
        steps, times, returns = np.array(run).T
        mean = running_mean(returns)
        reached = "-"
        if target is not None:
            hits = np.flatnonzero(mean[WINDOW - 1 :] >= target)
            reached = f"{times[hits[0] + WINDOW - 1] / 60:.1f} min" if len(hits) else "not reached"
        last = returns[-LAST_GAMES:].mean()
        lines.append(
            f"| {name} | {seed} | {len(run)} | {finals[(name, seed)]:.2f} | {last:.2f} | {times[-1] / 60:.1f} min "
            f"| {reached} |"
        )
    if target is not None:
        lines.append(f"\nbaseline's final return (mean over its seeds of the last {WINDOW} games): {target:.2f}")
    # the whole curve, not only its end: mean return of the games ended in each fifth of the run
    last_step = max(max(step for step, _, _ in run) for run in runs.values())
    edges = np.linspace(0, last_step, 6).round(-3).astype(int)
    spans = [f"{lo // 1000}k-{hi // 1000}k" for lo, hi in zip(edges[:-1], edges[1:])]
    lines += ["", "| script | seed | " + " | ".join(spans) + " |", "|---|---|" + "---|" * len(spans)]
    last_fifth = {}
    for (name, seed), run in sorted(runs.items()):
        steps, _, returns = np.array(run).T
        means = [returns[(steps > lo) & (steps <= hi)].mean() for lo, hi in zip(edges[:-1], edges[1:])]
        lines.append(f"| {name} | {seed} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
        last_fifth.setdefault(name, {})[seed] = means[-1]
    # per script, over its seeds: what the targets are about. The last fifth averages a few
    # hundred games per run, so it is far less noisy than the last 20 games
    lines += ["", f"| script | seeds | return, last {WINDOW} games: mean (range) | last fifth: mean (range) |"]
    lines.append("|---|---|---|---|")
    for name in sorted(last_fifth):
        final = np.array([v for (n, _), v in sorted(finals.items()) if n == name])
        fifth = np.array(list(last_fifth[name].values()))
        lines.append(
            f"| {name} | {len(final)} | {final.mean():.2f} ({final.min():.2f}-{final.max():.2f}) "
            f"| {fifth.mean():.2f} ({fifth.min():.2f}-{fifth.max():.2f}) |"
        )
    # what the seeds support: the last fifth's mean with its 95% interval, and each script's
    # paired difference from the baseline over the seeds both ran
    lines += ["", "| script | seeds | last fifth: mean [95% CI] | minus baseline, paired by seed: mean [95% CI] |"]
    lines.append("|---|---|---|---|")
    base = last_fifth.get("baseline", {})
    for name in sorted(last_fifth):
        mean, half = interval(list(last_fifth[name].values()))
        paired = "-"
        shared = sorted(set(last_fifth[name]) & set(base))
        if name != "baseline" and shared:
            diff, diff_half = interval([last_fifth[name][s] - base[s] for s in shared])
            paired = f"{diff:+.2f} {bounds(diff, diff_half, '+')} ({len(shared)} seeds)"
        lines.append(f"| {name} | {len(last_fifth[name])} | {mean:.2f} {bounds(mean, half)} | {paired} |")
    # where the targets are set: the mean of the last LAST_GAMES games ended by each mark, per run
    if marks:
        head = " | ".join(f"at {mark / 1e6:g}M" for mark in marks)
        lines += ["", f"| script | seed | {head} (last {LAST_GAMES} games by then) |"]
        lines.append("|---|---|" + "---|" * len(marks))
        at = {}
        for (name, seed), run in sorted(runs.items()):
            steps, _, returns = np.array(run).T
            means = [returns[steps <= mark][-LAST_GAMES:].mean() if (steps <= mark).any() else np.nan for mark in marks]
            at.setdefault(name, []).append(means)
            lines.append(f"| {name} | {seed} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
        for name, values in sorted(at.items()):
            values = np.array(values)
            cells = [f"{v.mean():.2f} ({v.min():.2f}-{v.max():.2f})" for v in values.T]
            lines.append(f"| {name} | mean (range) of {len(values)} | " + " | ".join(cells) + " |")
    lines += ["", "| published | points (agent steps: mean return) | source |", "|---|---|---|"]
    for algorithm in sorted({algorithm_of(name) for name in last_fifth}):
        label, source, points = PUBLISHED[algorithm]
        text = ", ".join(f"{step / 1e6:g}M: {value:g}" for step, value in points)
        lines.append(f"| {label} | {text} | {source} |")
    return "\n".join(lines)


def read_rows(path):
    with open(path) as f:
        return [tuple(r[column] for column in COLUMNS) for r in csv.DictReader(f)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-timesteps", type=int, default=500_000)
    parser.add_argument(
        "--schedule-timesteps",
        type=int,
        default=None,
        help="run each script as a run of this many steps (e.g. 10000000, the default run, whose learning rate "
        "anneals over 10M steps) and stop it at --total-timesteps; default: a run of --total-timesteps",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--at", type=int, nargs="*", default=[], metavar="STEP",
        help=f"also give each run's mean return over its last {LAST_GAMES} games by these agent steps",
    )  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "learning"))
    parser.add_argument(
        "--runs-dir",
        default=None,
        help="where the runs are kept (default runs/learning/NAME, NAME from --out): a run cut short, by a stop or "
        "a lost machine, is resumed from its checkpoint by the same command, and a finished one is only read",
    )
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot and summary from OUT.csv")
    parser.add_argument("--append", action="store_true", help="keep OUT.csv's other runs; replace only the ones rerun")
    parser.add_argument(
        "--from-run", nargs=3, metavar=("VARIANT", "SEED", "RUN_DIR"),
        help="read one run that already ran (e.g. one resumed by hand after an interruption) into OUT.csv "
        "instead of running it; with --append, OUT.csv's other runs are kept",
    )  # fmt: skip
    args = parser.parse_args()
    out_csv, out_png = Path(args.out + ".csv"), Path(args.out + ".png")
    requirements = "benchmarks/requirements.txt"
    missing = [n for n in args.variants if n in BENCHMARK_ONLY and importlib.util.find_spec(BENCHMARK_ONLY[n]) is None]
    if missing and not (args.plot_only or args.from_run):  # before the first run, not after hours of them
        print(f"{' '.join(missing)} needs {requirements}: installing it", file=sys.stderr, flush=True)
        if subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", str(ROOT / requirements)]).returncode:
            sys.exit(f"error: pip install -r {requirements} failed; install it, then rerun")

    if args.from_run:
        name, seed, run_dir = args.from_run[0], int(args.from_run[1]), args.from_run[2]
        rows = [row for row in read_rows(out_csv) if (row[0], int(row[1])) != (name, seed)] if args.append else []
        rows += [(name, seed, int(step), round(wall, 2), ret) for step, wall, ret in returns_of(run_dir)]
        with open(out_csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            writer.writerows(rows)
    elif not args.plot_only:
        rows = []
        if args.append and out_csv.exists():  # runs take an hour each: add to a results file, run by run
            rerun = {(name, seed) for name in args.variants for seed in args.seeds}
            rows = [row for row in read_rows(out_csv) if (row[0], int(row[1])) not in rerun]
        runs_dir = Path(args.runs_dir or ROOT / "runs" / "learning" / Path(args.out).name)
        for seed in args.seeds:  # seed-major, so a cut-short benchmark still compares scripts
            for name in args.variants:
                for step, wall, ret in train(name, seed, args.total_timesteps, runs_dir, args.schedule_timesteps):
                    rows.append((name, seed, int(step), round(wall, 2), ret))
                with open(out_csv, "w", newline="") as f:  # after every run: nothing is lost
                    writer = csv.writer(f)
                    writer.writerow(COLUMNS)
                    writer.writerows(rows)
    rows = read_rows(out_csv)
    print(
        f"Breakout-v5, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), no GPU, "
        f"{time.strftime('%Y-%m-%d')}{' (drawn from OUT.csv; the runs may be older)' if args.plot_only else ''}\n"
    )
    print(summary(rows, args.at))
    try:
        plot(rows, out_png)
        print(f"\nplot: {out_png}")
    except ImportError:
        print("\nno plot: matplotlib is not installed (pip install -r benchmarks/requirements.txt)")


if __name__ == "__main__":
    main()
