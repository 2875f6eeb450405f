"""Compare scripts and your copies of them: learning curves paired by seed, on one game or several.

A variant is a name from VARIANTS, a script (my_ppo.py, labelled my_ppo), or 'LABEL=SCRIPT FLAGS'
('lr2=ppo_atari_native.py --learning-rate 5e-4'; SCRIPT may also be a name from VARIANTS). Every
variant runs on every game (--env-ids) with every seed, one run at a time (two would share the
cores), in RUNS_DIR (default runs/learning/NAME, NAME from --out). The same command resumes a
comparison cut short, run by run from the checkpoints, and only reads the runs already made:
adding a variant or a seed later runs only what is new. Before anything runs, each script is
imported and its flags parsed and checked as the script itself does them; a bad variant, label
or game stops there with one line (exit code 2). A run that fails is named with its log's last
lines and the others go on (exit code 1 at the end). --jobs N runs N at a time (their wall times
then say less), --run-timeout kills a run that takes longer.

Writes OUT.csv (label, game, seed, step, wall_time_s, return: every full game) and OUT.png
(return against agent steps and wall time, mean of the last 20 games, per game), and prints per
game: each run's end-of-run means, the mean return of the games ended in each fifth of the run
(and, for the runs whose directory is at hand, what their logged losses averaged over each fifth:
entropy, approximate KL, clip fraction, value loss, explained variance), and per variant the
last fifth's mean over seeds with its 95% interval (Student's t) and its difference from the
reference (--reference, default the first variant), paired by seed; an interval that contains 0
shows no difference. Across games: human-normalized scores, their interquartile mean (IQM) with a
95% stratified bootstrap interval, and the probability that the variant beats the reference on a
game (Agarwal et al., NeurIPS 2021, computed by rliable).
TensorBoard: RUNS_DIR/tensorboard shows the runs as LABEL/GAME/seedN, with each run's flags in
its HPARAMS tab; the command that opens it is printed. Published points (PUBLISHED: SLM Lab's
and CleanRL's, on Breakout, Pong and Qbert) are drawn beside runs of the same algorithm on the
same game, within the plot's steps; across games, once the runs reach their step (10M), each
publisher's own IQM of its scores on the same games is printed below ours.
Needs benchmarks/requirements.txt (scipy, rliable, matplotlib), installed if missing.
Run: python benchmarks/learning.py --variants a2c my_a2c.py --env-ids Breakout-v5 Pong-v5 --seeds 1 2 3 4
     python benchmarks/learning.py --variants native-fp32 'lr2=ppo_atari_native.py --learning-rate 5e-4'
     python benchmarks/learning.py --total-timesteps 2000000 --variants a2c sb3-a2c --at 1000000 2000000
     python benchmarks/learning.py --total-timesteps 500000 --schedule-timesteps 10000000
       (the first 500k steps of default 10M-step runs, stopped cleanly there)
     python benchmarks/learning.py --seeds 3 --variants a2c --append  (add runs to OUT.csv)
     python benchmarks/learning.py --plot-only  (redraw from OUT.csv)
     python benchmarks/learning.py --from-run a2c 1 runs/RUN --append  (a run that already ran)
"""

import argparse
import contextlib
import csv
import importlib.util
import io
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import utils  # noqa: E402

VARIANTS = {
    "baseline": ("ppo_atari_baseline.py", []),
    "native-fp32": ("ppo_atari_native.py", ["--precision", "fp32"]),
    "native-bf16": ("ppo_atari_native.py", ["--precision", "bf16"]),
    "native-fp32-lam0.70": ("ppo_atari_native.py", ["--precision", "fp32", "--gae-lambda", "0.7"]),
    "a2c": ("a2c_atari.py", []),
    "sb3-a2c": ("benchmarks/sb3_a2c.py", []),  # Stable-Baselines3's A2C as a2c_atari.py's defaults
    "a2c-rlzoo": ("a2c_atari.py", "--num-steps 5 --gae-lambda 1 --vf-coef 0.25 --optimizer rmsprop-tf".split()),
}
SET_HERE = ("--seed", "--total-timesteps", "--env-id", "--runs-dir", "--exp-name", "--resume", "--eval-checkpoint")
WINDOW = 20  # games in the running mean, as in the target
LAST_GAMES = 100  # a second, less noisy end-of-run mean
REACHED = 0.98  # --at: a run reached a step if its last game ended this close to it (games end between steps)
BOOTSTRAP = 2000  # rliable's resamples for the intervals across games


@dataclass
class Published:
    """A published learning curve's points, drawn beside runs of its algorithm on its game."""

    who: str  # the publisher and algorithm, the same name on every game: its IQM across games
    label: str
    source: str  # where each number was read
    points: list  # [(agent steps, mean return)]


# Published points under our protocol (ALE v5: sticky actions; SLM Lab's with a lost life terminal),
# each with its source: game -> algorithm -> [Published]. SLM Lab's "frames" are its vector env's
# steps times the envs (slm_lab/env/wrappers.py, tick_timestep): our agent steps. Its table gives
# the best of its PPO specs per game, which differ in GAE lambda only (ppo_atari_arc 0.95,
# ppo_atari_lam85_arc 0.85, ppo_atari_lam70_arc 0.70, slm_lab/spec/benchmark_arc/ppo/ppo_atari_arc.yaml);
# its Pong and Qbert plots are images not read here, so those games have only the table's 10M figure.
SLM_PLOT = "kengz/SLM-Lab docs/plots/Breakout-v5_multi_trial_graph_mean_returns_ma_vs_frames.png"
SLM_TABLE = "kengz/SLM-Lab docs/BENCHMARKS.md, Phase 4 Atari table (MA, 10M frames)"
MACHADO = "openrlbenchmark/openrlbenchmark static/machado_10M.csv, ppo_atari_envpool_xla_jax_truncation_machado_10M"
CLEANRL = "CleanRL PPO (envpool, JAX), lambda 0.95, Machado's protocol"
TEN_M = 10_000_000
PUBLISHED = {
    "Breakout-v5": {
        "a2c": [
            Published(
                "SLM Lab A2C",
                "SLM Lab A2C (read by eye off its plot; 10M: its table)",
                f"{SLM_PLOT}; kengz/SLM-Lab docs/BENCHMARKS.md (a2c_gae_atari_arc, 273)",
                [
                    (1_000_000, 8.0),
                    (2_000_000, 28.0),
                    (3_000_000, 50.0),
                    (5_000_000, 115.0),
                    (7_000_000, 210.0),
                    (TEN_M, 273.0),
                ],
            )
        ],
        "ppo": [
            Published(
                "SLM Lab PPO",
                "SLM Lab PPO, lambda 0.70 (read by eye off its plot; 10M: its table)",
                f"{SLM_PLOT}; kengz/SLM-Lab docs/BENCHMARKS.md (ppo_atari_lam70_arc, 326.47)",
                [(3_000_000, 70.0), (5_000_000, 160.0), (7_000_000, 237.0), (TEN_M, 326.47)],
            ),
            Published(
                "CleanRL PPO",
                f"{CLEANRL} (+- 59.41 across its seeds)",
                f"{MACHADO}: Breakout-v5 198.37 +- 59.41",
                [(TEN_M, 198.37)],
            ),
        ],
    },
    "Pong-v5": {
        "a2c": [
            Published(
                "SLM Lab A2C",
                "SLM Lab A2C (its table)",
                f"{SLM_TABLE}: ALE/Pong-v5, a2c_gae_atari_arc, 10.17 (run a2c_gae_atari_pong_2026_01_31_213635)",
                [(TEN_M, 10.17)],
            )
        ],
        "ppo": [
            Published(
                "SLM Lab PPO",
                "SLM Lab PPO, lambda 0.85 (its table)",
                f"{SLM_TABLE}: ALE/Pong-v5, ppo_atari_lam85_arc, 16.69 "
                "(run ppo_atari_lam85_arc_pong_2026_02_14_103722)",
                [(TEN_M, 16.69)],
            ),
            Published(
                "CleanRL PPO",
                f"{CLEANRL} (+- 1.62 across its seeds)",
                f"{MACHADO}: Pong-v5 15.23 +- 1.62",
                [(TEN_M, 15.23)],
            ),
        ],
    },
    "Qbert-v5": {
        "a2c": [
            Published(
                "SLM Lab A2C",
                "SLM Lab A2C (its table)",
                f"{SLM_TABLE}: ALE/Qbert-v5, a2c_gae_atari_arc, 12619 (run a2c_gae_atari_qbert_2026_01_31_213720)",
                [(TEN_M, 12619.0)],
            )
        ],
        "ppo": [
            Published(
                "SLM Lab PPO",
                "SLM Lab PPO, lambda 0.95 (its table)",
                f"{SLM_TABLE}: ALE/Qbert-v5, ppo_atari_arc, 15460.48 (run ppo_atari_arc_qbert_2026_02_14_120409)",
                [(TEN_M, 15460.48)],
            ),
            Published(
                "CleanRL PPO",
                f"{CLEANRL} (+- 392.28 across its seeds)",
                f"{MACHADO}: Qbert-v5 15130.00 +- 392.28",
                [(TEN_M, 15130.0)],
            ),
        ],
    },
}
COLUMNS = ["label", "game", "seed", "step", "wall_time_s", "return"]  # of OUT.csv
PROGRESS = re.compile(r"step ([\d,]+)/")  # the scripts' progress line
RUNNING, STOPPING = set(), threading.Event()  # the runs' processes, ended with this tool
RETURN = "charts/episodic_return"
# what a curve's shape is read against (a plateau, a collapse, a step size annealed to nothing):
# each script logs the ones its algorithm has
DIAGNOSTICS = (
    "losses/entropy",
    "losses/approx_kl",
    "losses/clipfrac",
    "losses/value_loss",
    "losses/explained_variance",
)
HPARAMS = ".hparams"  # the suffix of the event file this tool adds to a run (its flags)
REQUIREMENTS = "benchmarks/requirements.txt"


@dataclass
class Variant:
    label: str
    script: Path
    flags: list
    hparams: dict = field(default_factory=dict)  # its parsed Args, for TensorBoard's HPARAMS tab


class RunFailed(Exception):
    pass


def parse_variant(spec: str) -> Variant:
    """A name from VARIANTS, SCRIPT [FLAGS] (labelled by the script's name), or LABEL=SCRIPT [FLAGS]."""
    labelled = re.fullmatch(r"([^\s/=]+)=(.*)", spec, re.S)
    label, rest = labelled.groups() if labelled else (None, spec)
    try:
        tokens = shlex.split(rest)
    except ValueError as e:
        raise utils.UsageError(f"variant {spec!r}: {e}")
    if not tokens:
        raise utils.UsageError(f"variant {spec!r}: no script")
    first, flags = tokens[0], tokens[1:]
    if first in VARIANTS:
        script, table_flags = VARIANTS[first]
        return Variant(label or first, ROOT / script, [*table_flags, *flags])
    path = Path(first).expanduser()
    if not path.is_file() and not path.is_absolute():
        path = ROOT / path  # a script of this repository, from any directory
    if path.suffix != ".py" or not path.is_file():
        raise utils.UsageError(
            f"variant {spec!r}: {first!r} is no script and no variant of the table ({', '.join(VARIANTS)})"
        )
    return Variant(label or path.stem, path.resolve(), flags)


def check_variant(variant: Variant, index: int, env_id: str, total_timesteps: int):
    """Import the variant's script and parse its flags as the script does, before any run: a
    script that fails at import, an unknown flag or a value out of range stops here."""
    label = variant.label
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*", label) or ".." in label:
        raise utils.UsageError(f"label {label!r}: a name (letters, digits, _ . + = -), as it names the runs")
    for flag in variant.flags:
        if flag.split("=")[0] in SET_HERE:
            raise utils.UsageError(
                f"variant {label}: {flag.split('=')[0]} is set by learning.py (--seeds, --env-ids, "
                "--total-timesteps, --runs-dir; the label names the runs)"
            )
    name = f"_variant_{index}_{variant.script.stem}"  # a copy and its original may share a name
    spec = importlib.util.spec_from_file_location(name, variant.script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it is made
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise utils.UsageError(f"variant {label}: {variant.script} fails at import ({type(e).__name__}: {why})")
    if not hasattr(module, "parse_args"):  # benchmarks/sb3_a2c.py: a2c_atari.py's settings, no flags of its own
        if variant.flags:
            raise utils.UsageError(f"variant {label}: {variant.script.name} takes no flags here")
        return
    argv = [str(variant.script), *variant.flags, "--env-id", env_id, "--total-timesteps", str(total_timesteps)]
    captured = io.StringIO()
    try:
        with mock.patch.object(sys, "argv", argv), contextlib.redirect_stderr(captured):
            with contextlib.redirect_stdout(captured):
                parsed = module.parse_args()
    except SystemExit:  # utils.cli's one line
        raise utils.UsageError(f"variant {label}: {captured.getvalue().strip().removeprefix('error: ')}")
    except utils.UsageError as e:
        raise utils.UsageError(f"variant {label}: {e}")
    skip = {"exp_name", "seed", "env_id", "runs_dir", "resume", "eval_checkpoint", "total_timesteps"}
    variant.hparams = {
        key: value if isinstance(value, (bool, int, float, str)) else str(value)
        for key, value in vars(parsed).items()
        if key not in skip
    }


def scalars_of(run_dir, tags):
    """tag -> [(step, seconds of running since the run's first event, value)] for each of `tags`
    the run logged, in order. A resumed run (--resume) starts its event file with TensorBoard's
    purge marker (a SessionLog START at the checkpoint's step + 1): points the interrupted run
    logged from there on are dropped, as TensorBoard drops them, and the time the run was down
    is not counted."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog
    from tensorboard.util import tensor_util

    series, start, offset, last_wall = {tag: [] for tag in tags}, None, 0.0, None
    for path in sorted(Path(run_dir).glob("events.out.tfevents.*")):
        if path.name.endswith(HPARAMS):
            continue
        for event in EventFileLoader(str(path)).Load():
            start = event.wall_time if start is None else start
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                series = {tag: [row for row in rows if row[0] < event.step] for tag, rows in series.items()}
                if last_wall is not None:  # continue the clock from the last kept point
                    kept = max((rows[-1][1] for rows in series.values() if rows), default=0.0)
                    offset = kept - (event.wall_time - start)
            last_wall = event.wall_time
            for value in event.summary.value:
                if value.tag in series:
                    number = value.simple_value if value.HasField("simple_value") else None
                    if number is None:
                        number = float(tensor_util.make_ndarray(value.tensor))
                    series[value.tag].append((event.step, event.wall_time - start + offset, number))
    return {tag: rows for tag, rows in series.items() if rows}


def returns_of(run_dir):
    """(step, seconds of running, return) for every full game, in order (scalars_of)."""
    return scalars_of(run_dir, [RETURN]).get(RETURN, [])


def running_mean(values, window=WINDOW):
    values = np.asarray(values, dtype=float)
    return np.array([values[max(0, i + 1 - window) : i + 1].mean() for i in range(len(values))])


def find_run(runs_dir, game, label, seed):
    """The run directory of `label` on `game` with `seed` under runs_dir (the newest, if several), or None."""
    found = sorted(Path(runs_dir).glob(f"{game}__{label}__{seed}__*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def checkpoint_step(run_dir):
    """The agent steps a run directory's checkpoint holds (0 if none), and whether it ended (model.pt)."""
    import torch

    for name in ("model.pt", "checkpoint.pt"):
        path = Path(run_dir) / name
        if path.is_file():
            return torch.load(path, map_location="cpu", weights_only=True)["global_step"], name == "model.pt"
    return 0, False


def end_group(process, grace=60):
    """Stop a run and everything it started (its own process group): SIGTERM, its clean stop with
    a checkpoint, then SIGKILL if it has not ended within `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
            return


def train(variant, game, seed, total_timesteps, runs_dir, schedule_timesteps=None, timeout=None, jobs=1):
    """Run one variant to `total_timesteps`; returns (its run directory, its games). With
    `schedule_timesteps`, run it as a run of that length (its learning rate anneals over it, as in
    a default 10M-step run) and stop it with SIGTERM (a clean stop) at the first iteration that
    reaches `total_timesteps`. A run of this variant, game and seed already in runs_dir is
    resumed from its checkpoint (or read, if it got there). A run past `timeout` seconds is killed;
    with `jobs` runs at a time, each gets its share of the cores for torch's threads."""
    name = f"{variant.label} {game} seed {seed}"
    command = [sys.executable, str(variant.script), *variant.flags, "--seed", str(seed), "--env-id", game]
    command += ["--total-timesteps", str(schedule_timesteps or total_timesteps)]
    run_dir = find_run(runs_dir, game, variant.label, seed)
    done, ended = checkpoint_step(run_dir) if run_dir is not None else (0, False)
    if ended or done >= total_timesteps:
        print(f"{name}: read from {run_dir} ({done:,} steps)", file=sys.stderr, flush=True)
        return run_dir, [row for row in returns_of(run_dir) if row[0] <= done]
    command += ["--resume", str(run_dir)] if done > 0 else ["--runs-dir", str(runs_dir), "--exp-name", variant.label]
    print(f"{name}: {shlex.join(command[1:])}", file=sys.stderr, flush=True)
    # a copy outside the repository imports utils and kernels from it
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if jobs > 1:  # OpenMP threads spin while they wait for each other: more than the cores wastes most of them
        env.setdefault("OMP_NUM_THREADS", str(max(1, utils.usable_cores()[0] // jobs)))
    stop_step, tail, timed_out = None, deque(maxlen=12), threading.Event()
    with tempfile.TemporaryFile("w+") as stderr:
        # its own process group: a timeout, or a stop of this tool, ends it and anything it started
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, process_group=0
        )
        RUNNING.add(process)
        if STOPPING.is_set():  # stopped while this run started
            end_group(process)
        timer = threading.Timer(timeout or 0, lambda: (timed_out.set(), end_group(process, grace=10)))
        try:
            if timeout:
                timer.start()
            for line in process.stdout:
                tail.append(line.rstrip())
                if line.startswith("run directory: "):
                    run_dir = line.removeprefix("run directory: ").strip()
                progress = PROGRESS.search(line)
                step = int(progress.group(1).replace(",", "")) if progress else 0
                if stop_step is None and step >= total_timesteps:
                    stop_step = step
                    process.send_signal(signal.SIGTERM)
            code = process.wait()
        finally:
            timer.cancel()
            if process.poll() is None:  # this tool was stopped: so is the run, with a checkpoint
                end_group(process)
            RUNNING.discard(process)
        if code != 0 or run_dir is None:
            stderr.seek(0)
            lines = [*tail, *stderr.read().splitlines()][-12:]
            why = f"killed after --run-timeout {timeout} s" if timed_out.is_set() else f"exit code {code}"
            raise RunFailed(f"{name} failed ({why}); its log ends:\n" + "\n".join(f"    {x}" for x in lines))
    # a stop abandons the next rollout, whose games the baseline may already have logged
    return run_dir, [row for row in returns_of(run_dir) if stop_step is None or row[0] <= stop_step]


def link_run(view, variant, game, seed, run_dir):
    """The run as LABEL/GAME/seedN under `view` (a link), and its flags for TensorBoard's HPARAMS tab
    (an event file of its own in the run, so that the tab lists the run with its scalars)."""
    link = Path(view) / variant.label / game / f"seed{seed}"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(run_dir).resolve(), target_is_directory=True)
    if any(Path(run_dir).glob(f"events.out.tfevents.*{HPARAMS}")):
        return
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    flags = {"label": variant.label, "script": str(variant.script), "flags": shlex.join(variant.flags)}
    flags |= variant.hparams | {"env_id": game, "seed": seed}
    writer = SummaryWriter(str(run_dir), filename_suffix=HPARAMS)
    for summary in hparams(flags, {RETURN: 0.0}):
        writer.file_writer.add_summary(summary)
    writer.close()


def tensorboard_command(view):
    tensorboard = Path(sys.executable).with_name("tensorboard")
    return f"{tensorboard if tensorboard.exists() else 'tensorboard'} --logdir {view}"


def algorithm_of(label):
    return "a2c" if "a2c" in label else "ppo"


def published(runs, game):
    """The Published sources on `game` of the algorithms the runs of that game train (by label:
    a2c_atari, ppo_atari_native, ppo_atari_slm, my_ppo...)."""
    algorithms = sorted({algorithm_of(label) for label, g, _ in runs if g == game})
    return [source for algorithm in algorithms for source in PUBLISHED.get(game, {}).get(algorithm, [])]


def published_iqm(runs, games):
    """Each publisher's own IQM of human-normalized scores across `games`, from its last point on each
    (one score per game: no interval), where it published every game and the runs reached that step."""
    from rliable import metrics

    last_step = max(run[-1][0] for run in runs.values())
    sources = {}  # who -> {game: Published}
    for game in games:
        for source in published(runs, game):
            sources.setdefault(source.who, {})[game] = source
    lines = []
    for who, by_game in sources.items():
        steps = {source.points[-1][0] for source in by_game.values()}
        if len(by_game) < len(games) or len(steps) > 1 or last_step < REACHED * min(steps):
            continue
        scores = [utils.human_normalized(utils.game_name(game), by_game[game].points[-1][1]) for game in games]
        if None in scores:
            continue
        each = ", ".join(f"{game} {score:.3f}" for game, score in zip(games, scores))
        iqm = metrics.aggregate_iqm(np.array([scores]))
        lines.append(f"| {who} | {steps.pop() / 1e6:g}M | {iqm:.3f} | {each} |")
    if not lines:
        return []
    head = "| published | at | IQM (one score per game; under 4 games, their mean) | human-normalized, per game |"
    return ["", "The publishers' own IQM across the same games (their final figures, not a last fifth):", "",
            head, "|---|---|---|---|", *lines]  # fmt: skip


def group(rows):
    """(label, game, seed) -> [(step, wall time, return)], in the rows' order."""
    runs = {}
    for label, game, seed, step, wall, ret in rows:
        runs.setdefault((label, game, seed), []).append((step, wall, ret))
    return runs


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = group(rows)
    games = sorted({game for _, game, _ in runs})
    fig, axes = plt.subplots(len(games), 2, figsize=(12, 4.5 * len(games)), squeeze=False)
    colors = {}
    for (label, game, seed), run in sorted(runs.items()):
        by_step, by_time = axes[games.index(game)]
        color = colors.setdefault(label, f"C{len(colors)}")
        steps, times, returns = np.array(run).T
        mean = running_mean(returns)
        first = seed == min(s for n, g, s in runs if (n, g) == (label, game))
        by_step.plot(steps, mean, color=color, label=label if first else None, alpha=0.9)
        by_time.plot(times / 60, mean, color=color, label=label if first else None, alpha=0.9)
    for (by_step, by_time), game in zip(axes, games):
        last_step = max(run[-1][0] for (_, g, _), run in runs.items() if g == game)
        for marker, source in zip("^vsD", published(runs, game)):
            shown = [(step, value) for step, value in source.points if step <= last_step * 1.05]
            if shown:
                by_step.plot(*zip(*shown), "k" + marker, label=source.label)
        by_step.set_xlabel("agent steps")
        by_time.set_xlabel("wall time (minutes)")
        for ax in (by_step, by_time):
            ax.set_title(f"{game}, one line per seed")
            ax.set_ylabel(f"return (mean of last {WINDOW} games)")
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", bbox_to_anchor=(0, -0.15), fontsize="small")  # below: hides no point
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")


def interval(values):
    """(mean, half-width of the 95% Student's t interval) over seeds; no interval from one seed."""
    from scipy import stats

    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float(values.mean()), float("nan")
    t95 = stats.t.ppf(0.975, len(values) - 1)
    return float(values.mean()), float(t95 * values.std(ddof=1) / np.sqrt(len(values)))


def bounds(mean, half, sign=""):
    """'[low, high]' of a 95% interval; a difference is written with its sign (sign="+")."""
    return "[no interval from 1 seed]" if np.isnan(half) else f"[{mean - half:{sign}.2f}, {mean + half:{sign}.2f}]"


def mean_of(values):
    return float(np.mean(values)) if len(values) else float("nan")


def at_cell(values, seeds=1):
    """--at's cell: one run's figure, or the mean (range) of the seeds that reached the step."""
    values = [v for v in values if not np.isnan(v)]
    if not values:
        return "not reached"
    if seeds == 1:
        return f"{values[0]:.2f}"
    short = f", {len(values)} of {seeds} seeds" if len(values) < seeds else ""
    return f"{np.mean(values):.2f} ({min(values):.2f}-{max(values):.2f}{short})"


def game_summary(runs, reference, marks, logs):
    """One game's tables from its runs, (label, seed) -> games, and from the logged losses of
    those whose directory is at hand, (label, seed) -> scalars_of; and (label -> seed -> the
    mean return of the games ended in the last fifth of the run)."""
    finals = {key: mean_of([r for _, _, r in run[-WINDOW:]]) for key, run in runs.items()}
    ref = [v for (label, _), v in finals.items() if label == reference]
    target = mean_of(ref) if ref else None
    lines = [
        f"| variant | seed | games | return, last {WINDOW} games | last {LAST_GAMES} games | wall time "
        "| time to the reference's final return |",
        "|---|---|---|---|---|---|---|",
    ]
    for (label, seed), run in sorted(runs.items()):
        steps, times, returns = np.array(run).T
        mean = running_mean(returns)
        reached = "-"
        if target is not None:
            hits = np.flatnonzero(mean[WINDOW - 1 :] >= target)
            reached = f"{times[hits[0] + WINDOW - 1] / 60:.1f} min" if len(hits) else "not reached"
        lines.append(
            f"| {label} | {seed} | {len(run)} | {finals[(label, seed)]:.2f} | {returns[-LAST_GAMES:].mean():.2f} "
            f"| {times[-1] / 60:.1f} min | {reached} |"
        )
    if target is not None:
        lines.append(f"\n{reference}'s final return (the reference: mean over its seeds of the last {WINDOW} games): "
                     f"{target:.2f}")  # fmt: skip
    # the whole curve, not only its end: mean return of the games ended in each fifth of the run
    last_step = max(run[-1][0] for run in runs.values())
    big = last_step >= 5000
    edges = np.linspace(0, last_step, 6).round(-3 if big else 0).astype(int)
    spans = [f"{lo // 1000}k-{hi // 1000}k" if big else f"{lo}-{hi}" for lo, hi in zip(edges[:-1], edges[1:])]
    lines += ["", "| variant | seed | " + " | ".join(spans) + " |", "|---|---|" + "---|" * len(spans)]
    last_fifth = {}
    for (label, seed), run in sorted(runs.items()):
        steps, _, returns = np.array(run).T
        means = [mean_of(returns[(steps > lo) & (steps <= hi)]) for lo, hi in zip(edges[:-1], edges[1:])]
        lines.append(f"| {label} | {seed} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
        if not np.isnan(means[-1]):
            last_fifth.setdefault(label, {})[seed] = means[-1]
    # what the losses did meanwhile, fifth by fifth: a policy that sharpens, a step size that
    # anneals to nothing, a value function that stops improving
    logged = {key: logs[key] for key in sorted(runs) if logs.get(key)}
    if logged:
        lines += ["", "| variant | seed | logged: mean over the fifth | " + " | ".join(spans) + " |"]
        lines.append("|---|---|---|" + "---|" * len(spans))
        for (label, seed), series in logged.items():
            for tag, points in series.items():
                steps, _, values = np.array(points).T
                finite = np.isfinite(values)  # explained variance is NaN where the returns did not vary
                means = [
                    mean_of(values[finite & (steps > lo) & (steps <= hi)]) for lo, hi in zip(edges[:-1], edges[1:])
                ]
                lines.append(f"| {label} | {seed} | {tag} | " + " | ".join(f"{m:.4g}" for m in means) + " |")
    # per variant, over its seeds; the last fifth averages a few hundred games per run, so it is
    # far less noisy than the last 20 games
    lines += ["", f"| variant | seeds | return, last {WINDOW} games: mean (range) | last fifth: mean (range) |"]
    lines.append("|---|---|---|---|")
    for label in sorted(last_fifth):
        final = np.array([v for (n, _), v in sorted(finals.items()) if n == label])
        fifth = np.array(list(last_fifth[label].values()))
        lines.append(
            f"| {label} | {len(final)} | {final.mean():.2f} ({final.min():.2f}-{final.max():.2f}) "
            f"| {fifth.mean():.2f} ({fifth.min():.2f}-{fifth.max():.2f}) |"
        )
    # what the seeds support: the last fifth's mean with its 95% interval, and each variant's
    # difference from the reference over the seeds both ran, seed by seed
    lines += ["", f"| variant | seeds | last fifth: mean [95% CI] | minus {reference}, paired by seed: mean [95% CI] |"]
    lines.append("|---|---|---|---|")
    base = last_fifth.get(reference, {})
    for label in sorted(last_fifth):
        mean, half = interval(list(last_fifth[label].values()))
        paired = "-"
        shared = sorted(set(last_fifth[label]) & set(base))
        if label != reference and shared:
            diffs = [last_fifth[label][s] - base[s] for s in shared]
            diff, diff_half = interval(diffs)
            each = ", ".join(f"{s}: {d:+.2f}" for s, d in zip(shared, diffs))
            paired = f"{diff:+.2f} {bounds(diff, diff_half, '+')} (seed {each})"
        lines.append(f"| {label} | {len(last_fifth[label])} | {mean:.2f} {bounds(mean, half)} | {paired} |")
    # where the targets are set: the mean of the last LAST_GAMES games ended by each mark, per run
    if marks:
        head = " | ".join(f"at {mark / 1e6:g}M" for mark in marks)
        lines += ["", f"| variant | seed | {head} (last {LAST_GAMES} games by then) |"]
        lines.append("|---|---|" + "---|" * len(marks))
        at = {}
        for (label, seed), run in sorted(runs.items()):
            steps, _, returns = np.array(run).T
            means = [
                mean_of(returns[steps <= mark][-LAST_GAMES:]) if steps[-1] >= REACHED * mark else np.nan
                for mark in marks
            ]  # a run cut short, or still going, has no figure at a step it has not reached
            at.setdefault(label, []).append(means)
            lines.append(f"| {label} | {seed} | " + " | ".join(at_cell([m]) for m in means) + " |")
        for label, values in sorted(at.items()):
            if len(values) == 1:
                continue  # one seed: its run's row says it all
            cells = [at_cell(v, len(values)) for v in np.array(values).T]
            lines.append(f"| {label} | mean (range) of {len(values)} | " + " | ".join(cells) + " |")
    return lines, last_fifth


def across_games(last_fifth, games, reference):
    """Human-normalized last fifths, per variant a matrix of its seeds that ran every game by the
    games: the IQM with its stratified bootstrap interval and the probability of improvement over
    the reference (rliable)."""
    from rliable import library as rly
    from rliable import metrics

    scores = {}
    for label in sorted({label for by_label in last_fifth.values() for label in by_label}):
        seeds = set.intersection(*(set(last_fifth[game].get(label, {})) for game in games))
        normalized = [
            [utils.human_normalized(utils.game_name(game), last_fifth[game][label][seed]) for game in games]
            for seed in sorted(seeds)
        ]
        if seeds and all(score is not None for row in normalized for score in row):
            scores[label] = np.array(normalized)
    lines = ["", f"Across {', '.join(games)}: human-normalized last fifths (atari_scores.csv), the seeds that ran "
             f"every game; IQM with its 95% stratified bootstrap interval ({BOOTSTRAP:,} resamples)", "",
             f"| variant | runs per game | IQM [95% CI] | P({reference} is beaten on a game) [95% CI] |",
             "|---|---|---|---|"]  # fmt: skip
    if not scores:
        return [*lines, "| (no variant ran every game to the last fifth) | | | |"]
    iqm = lambda x: np.array([metrics.aggregate_iqm(x)])
    point, ci = rly.get_interval_estimates(scores, iqm, reps=BOOTSTRAP, random_state=np.random.RandomState(0))
    pairs = {label: (s, scores[reference]) for label, s in scores.items() if label != reference and reference in scores}
    improve, improve_ci = {}, {}
    if pairs:
        improve, improve_ci = rly.get_interval_estimates(
            pairs, metrics.probability_of_improvement, reps=BOOTSTRAP, random_state=np.random.RandomState(0)
        )
    for label, s in scores.items():
        beats = "-"
        if label in improve:
            low, high = np.ravel(improve_ci[label])
            beats = f"{float(improve[label]):.2f} [{low:.2f}, {high:.2f}]"
        low, high = np.ravel(ci[label])
        lines.append(f"| {label} | {len(s)} | {float(point[label][0]):.3f} [{low:.3f}, {high:.3f}] | {beats} |")
    return lines


def summary(rows, reference, marks=(), logs=None):
    """The printed tables, from OUT.csv's rows and the runs' logged losses, (label, game, seed) -> scalars_of."""
    runs, logs = group(rows), logs or {}
    games = sorted({game for _, game, _ in runs})
    lines, last_fifth = [], {}
    for game in games:
        tables, last_fifth[game] = game_summary(
            {(label, seed): run for (label, g, seed), run in runs.items() if g == game},
            reference,
            marks,
            {(label, seed): series for (label, g, seed), series in logs.items() if g == game},
        )
        lines += [f"## {game}", "", *tables, ""]
    if len(games) > 1:
        lines += across_games(last_fifth, games, reference)
        lines += published_iqm(runs, games)
    for game in games:
        sources = published(runs, game)
        if sources:
            lines += ["", f"| published, {game} | points (agent steps: mean return) | source |", "|---|---|---|"]
        for source in sources:
            text = ", ".join(f"{step / 1e6:g}M: {value:g}" for step, value in source.points)
            lines.append(f"| {source.label} | {text} | {source.source} |")
    return "\n".join(lines)


def read_rows(path):
    """OUT.csv's rows, typed; a CSV from before --env-ids (a 'script' column, Breakout-v5 only) reads too."""
    with open(path) as f:
        reader = csv.DictReader(f)
        old = "script" in reader.fieldnames
        return [
            (r["script"] if old else r["label"], utils.DEFAULT_ENV_ID if old else r["game"], int(r["seed"]),
             float(r["step"]), float(r["wall_time_s"]), float(r["return"]))
            for r in reader
        ]  # fmt: skip


def write_rows(path, rows):
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # a new --out folder, as --runs-dir is made
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(
            (label, game, seed, int(step), round(wall, 2), ret) for label, game, seed, step, wall, ret in rows
        )


def install_missing(modules):
    """Install benchmarks/requirements.txt if one of `modules` is missing, before the first run."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"{' '.join(missing)} missing: installing {REQUIREMENTS}", file=sys.stderr, flush=True)
        if subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", str(ROOT / REQUIREMENTS)]).returncode:
            utils.fail(f"pip install -r {REQUIREMENTS} failed; install it, then rerun", code=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", nargs="+", default=None, metavar="VARIANT",
        help=f"names from the table ({', '.join(VARIANTS)}; default: all), scripts (my_ppo.py), or "
        "'LABEL=SCRIPT FLAGS' (quoted, e.g. 'lr2=ppo_atari_native.py --learning-rate 5e-4')",
    )  # fmt: skip
    parser.add_argument("--reference", default=None, help="the label every paired difference is taken from "
                        "(default: the first variant)")  # fmt: skip
    parser.add_argument("--env-ids", nargs="+", default=[utils.DEFAULT_ENV_ID], help="the games (default Breakout-v5)")
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
        help=f"also give each run's mean return over its last {LAST_GAMES} games by these agent steps "
        "('not reached' where a run stopped before one)",
    )  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "learning"))
    parser.add_argument(
        "--runs-dir",
        default=None,
        help="where the runs are kept (default runs/learning/NAME, NAME from --out): a run cut short, by a stop or "
        "a lost machine, is resumed from its checkpoint by the same command, and a finished one is only read",
    )
    parser.add_argument("--run-timeout", type=float, default=None, help="kill a run that takes longer (seconds)")
    parser.add_argument(
        "--jobs", type=int, default=1,
        help="runs at a time (default 1: runs side by side share the cores, and their wall times say less)",
    )  # fmt: skip
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot and summary from OUT.csv")
    parser.add_argument("--append", action="store_true", help="keep OUT.csv's other runs; replace only the ones rerun")
    parser.add_argument(
        "--from-run", nargs=3, metavar=("LABEL", "SEED", "RUN_DIR"),
        help="read one run that already ran (e.g. one resumed by hand after an interruption) into OUT.csv "
        "instead of running it, as a run of the first of --env-ids; with --append, OUT.csv's other runs are kept",
    )  # fmt: skip
    args = parser.parse_args(argv)
    out_csv, out_png = Path(args.out + ".csv"), Path(args.out + ".png")
    runs_dir = Path(args.runs_dir or ROOT / "runs" / "learning" / Path(args.out).name).absolute()
    view = runs_dir / "tensorboard"
    specs = args.variants or list(VARIANTS)
    running = not (args.plot_only or args.from_run)
    try:
        if args.jobs < 1:
            raise utils.UsageError(f"--jobs must be at least 1, got {args.jobs}")
        env_ids = list(dict.fromkeys(utils.canonical_env_id(env_id) for env_id in args.env_ids))
        if running:
            variants = [parse_variant(spec) for spec in specs]
            labels = [variant.label for variant in variants]
            twice = next((label for label in labels if labels.count(label) > 1), None)
            if twice is not None:
                raise utils.UsageError(f"label {twice!r} names two variants: give one another, as LABEL=SCRIPT")
            if args.reference is not None and args.reference not in labels:
                raise utils.UsageError(f"--reference {args.reference!r} is none of the variants ({', '.join(labels)})")
            sb3 = ["stable_baselines3"] if any(v.script.name == "sb3_a2c.py" for v in variants) else []
            install_missing(["scipy", "rliable", "matplotlib", *sb3])
            for index, variant in enumerate(variants):
                check_variant(variant, index, env_ids[0], args.schedule_timesteps or args.total_timesteps)
    except utils.UsageError as e:
        utils.fail(str(e))
    install_missing(["scipy", "rliable", "matplotlib"])

    failed = []
    if args.from_run:
        label, seed, run_dir = args.from_run[0], int(args.from_run[1]), args.from_run[2]
        key = (label, env_ids[0], seed)
        rows = [row for row in read_rows(out_csv) if row[:3] != key] if args.append else []
        rows += [(*key, step, wall, ret) for step, wall, ret in returns_of(run_dir)]
        write_rows(out_csv, rows)
    elif running:
        rows = []
        if args.append and out_csv.exists():  # runs take an hour each: add to a results file, run by run
            rerun = {(v.label, game, seed) for v in variants for game in env_ids for seed in args.seeds}
            rows = [row for row in read_rows(out_csv) if row[:3] not in rerun]
        # seed-major, so that a cut-short comparison still pairs the variants
        STOPPING.clear()
        todo = [(variant, game, seed) for seed in args.seeds for game in env_ids for variant in variants]
        run = lambda task: train(
            *task, args.total_timesteps, runs_dir, args.schedule_timesteps, args.run_timeout, args.jobs
        )
        with ThreadPoolExecutor(args.jobs) as pool:
            try:
                for (variant, game, seed), result in zip(todo, [pool.submit(run, task) for task in todo]):
                    try:
                        run_dir, games = result.result()
                    except RunFailed as e:
                        print(f"FAILED: {e}", file=sys.stderr, flush=True)
                        failed.append(f"{variant.label} {game} seed {seed}")
                        continue
                    link_run(view, variant, game, seed, run_dir)
                    rows += [(variant.label, game, seed, step, wall, ret) for step, wall, ret in games]
                    write_rows(out_csv, rows)  # after every run: nothing is lost
            finally:  # stopped: the runs in progress stop too, with a checkpoint
                STOPPING.set()
                pool.shutdown(wait=False, cancel_futures=True)
                for process in list(RUNNING):
                    end_group(process)
    rows = read_rows(out_csv) if out_csv.exists() else []
    if not rows:
        utils.fail(f"no games to summarize in {out_csv}", code=1)
    labels = list(dict.fromkeys(row[0] for row in rows))
    reference = args.reference or next((label for label in (*specs, *labels) if label in labels), labels[0])
    if running:
        reference = args.reference or variants[0].label
    import torch

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), {where}, "
        f"{time.strftime('%Y-%m-%d')}{' (drawn from OUT.csv; the runs may be older)' if args.plot_only else ''}; "
        f"the reference: {reference}\n"
    )
    # the losses of the runs at hand: those in RUNS_DIR, and --from-run's
    keys = {row[:3] for row in rows} if runs_dir.is_dir() else set()
    at_hand = {(label, game, seed): find_run(runs_dir, game, label, seed) for label, game, seed in keys}
    if args.from_run:
        at_hand[(args.from_run[0], env_ids[0], int(args.from_run[1]))] = Path(args.from_run[2])
    logs = {key: scalars_of(run_dir, DIAGNOSTICS) for key, run_dir in at_hand.items() if run_dir is not None}
    print(summary(rows, reference, args.at, logs))
    try:
        plot(rows, out_png)
        print(f"\nplot: {out_png}")
    except ImportError:
        print(f"\nno plot: matplotlib is not installed (pip install -r {REQUIREMENTS})")
    if view.is_dir():
        print(f"\nthese runs side by side in TensorBoard: {tensorboard_command(view)}")
    if failed:
        print(f"\nfailed: {', '.join(failed)} (their logs: above)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the runs in progress stop cleanly
    main()
