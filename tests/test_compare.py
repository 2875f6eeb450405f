"""benchmarks/learning.py compares a researcher's copies with the originals: paired by seed on
each game, aggregated across games, laid out for TensorBoard; bad input stops before any run.
benchmarks/sps.py, which compares their speed, has a span to time in each variant's run."""

import csv
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, script_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import learning  # noqa: E402
import sps  # noqa: E402

GAMES = ["Breakout-v5", "Pong-v5"]
# the smallest runs that still end games in every fifth of the run: 2 envs of 160 steps, games cut at 200 frames
A2C = "--num-envs 2 --num-steps 16 --num-gpu-batches 1 --max-episode-frames 200"
PPO = f"{A2C} --num-minibatches 2 --update-epochs 1"
TOTAL = "320"


def run_tool(*args, timeout=480):
    """learning.py as a user runs it; on a timeout its whole process group (the runs too) is ended."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "learning.py"), *args], cwd=ROOT, env=script_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # learning.py stops its runs, each in its own group
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"learning.py took over {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def copy_with(tmp_path, script, name, old, new):
    """A copy of `script` with one line changed, as a researcher makes one."""
    text = (ROOT / script).read_text()
    assert text.count(old) == 1
    (tmp_path / name).write_text(text.replace(old, new))
    return tmp_path / name


def last_fifths(rows, game):
    """(label, seed) -> mean return of the games ended in the last fifth of the run, from the CSV."""
    runs = {}
    for row in rows:
        if row["game"] == game:
            runs.setdefault((row["label"], int(row["seed"])), []).append((int(row["step"]), float(row["return"])))
    last_step = max(step for run in runs.values() for step, _ in run)
    edge = round(last_step * 4 / 5)
    return {key: np.mean([r for step, r in run if step > edge]) for key, run in runs.items()}


def test_copies_against_originals_on_two_games(tmp_path):
    copy_with(tmp_path, "a2c_atari.py", "my_a2c.py", "ent_coef: float = 0.01", "ent_coef: float = 0.02")
    # a copy and another script, each against the reference: 12 runs
    variants = [f"a2c=a2c_atari.py {A2C}", f"my_a2c={tmp_path}/my_a2c.py {A2C}", f"ppo=ppo_atari_native.py {PPO}"]
    command = ["--variants", *variants, "--env-ids", *GAMES, "--seeds", "1", "2", "--total-timesteps", TOTAL,
               "--out", str(tmp_path / "cmp"), "--runs-dir", str(tmp_path / "runs"), "--jobs", "2",
               "--run-timeout", "240"]  # fmt: skip
    code, out, err = run_tool(*command)
    assert code == 0, f"{out[-3000:]}\n{err[-3000:]}"

    with open(tmp_path / "cmp.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["label", "game", "seed", "step", "wall_time_s", "return"]
        rows = list(reader)
    labels = ["a2c", "my_a2c", "ppo"]
    assert {(r["label"], r["game"], r["seed"]) for r in rows} == {
        (label, game, seed) for label in labels for game in GAMES for seed in "12"
    }
    # each game's paired differences from the reference (a2c, the first), seed by seed, as the CSV gives them
    sections = re.split(r"^## ", out, flags=re.M)
    for game in GAMES:
        section = next(s for s in sections if s.startswith(game))
        fifths = last_fifths(rows, game)
        for label in labels[1:]:
            line = next(x for x in section.splitlines() if x.startswith(f"| {label} |") and "(seed 1:" in x)
            found = re.search(
                r"\| ([-+.\d]+) \[([-+.\d]+), ([-+.\d]+)\] \(seed 1: ([-+.\d]+), 2: ([-+.\d]+)\) \|$", line
            )
            mean, low, high, d1, d2 = map(float, found.groups())
            e1, e2 = (fifths[(label, seed)] - fifths[("a2c", seed)] for seed in (1, 2))
            assert (d1, d2, mean) == pytest.approx((e1, e2, (e1 + e2) / 2), abs=0.006)
            half = 12.7062 * abs(e1 - e2) / 2  # Student's t, 1 degree of freedom: t * sd / sqrt(2)
            assert (low, high) == pytest.approx(((e1 + e2) / 2 - half, (e1 + e2) / 2 + half), abs=0.006)
        # each run's logged losses, fifth by fifth: the ones its algorithm has
        for label, seed in [(label, seed) for label in labels for seed in (1, 2)]:
            for tag in ["losses/entropy", "losses/value_loss", "losses/clipfrac", "losses/approx_kl"]:
                expected = label == "ppo" or tag not in ("losses/clipfrac", "losses/approx_kl")
                assert (f"| {label} | {seed} | {tag} | " in section) == expected, (label, tag, section)
    # across games: the IQM of human-normalized scores inside its interval, and P(improvement) for the others
    across = out[out.index("Across Breakout-v5, Pong-v5") :]
    for label in labels:
        cells = re.search(rf"^\| {label} \| 2 \| ([-.\d]+) \[([-.\d]+), ([-.\d]+)\] \| (.*) \|$", across, re.M)
        assert cells, across
        iqm, low, high = map(float, cells.groups()[:3])
        assert low <= iqm <= high
        if label == "a2c":
            assert cells.group(4) == "-"
        else:
            p, p_low, p_high = map(float, re.fullmatch(r"([.\d]+) \[([.\d]+), ([.\d]+)\]", cells.group(4)).groups())
            assert 0 <= p_low <= p <= p_high <= 1

    # TensorBoard: the printed log directory shows every run as label/game/seed, with its flags
    from tensorboard.backend.event_processing import plugin_event_multiplexer
    from tensorboard.plugins.hparams import metadata

    logdir = re.search(r"tensorboard --logdir (\S+)$", out, re.M).group(1)
    board = plugin_event_multiplexer.EventMultiplexer()
    board.AddRunsFromDirectory(logdir)
    board.Reload()
    names = {f"{label}/{game}/seed{seed}" for label in labels for game in GAMES for seed in (1, 2)}
    assert set(board.Runs()) == names
    hparams = board.PluginRunToTagToContent(metadata.PLUGIN_NAME)
    for name in names:
        assert board.GetAccumulator(name).Tensors("charts/episodic_return")
        info = metadata.parse_session_start_info_plugin_data(hparams[name][metadata.SESSION_START_INFO_TAG])
        label, game, seed = name.split("/")
        assert info.hparams["label"].string_value == label and info.hparams["env_id"].string_value == game
        copied = label.startswith("my_")
        assert info.hparams["ent_coef"].number_value == (0.02 if copied else 0.01)
        # the run itself trained the copy
        model = torch.load(os.path.join(logdir, name, "model.pt"), map_location="cpu", weights_only=True)
        assert model["args"]["ent_coef"] == (0.02 if copied else 0.01) and model["args"]["seed"] == int(seed[-1])

    # the same command again reads every run: nothing reruns
    code, again, err = run_tool(*command)
    assert code == 0 and err.count(": read from ") == len(names), err[-3000:]
    with open(tmp_path / "cmp.csv") as f:
        assert list(csv.DictReader(f)) == rows


def test_a_failing_run_is_named_and_the_others_go_on(tmp_path):
    broken = copy_with(
        tmp_path, "a2c_atari.py", "broken.py", "    rollout.start()\n", "    raise RuntimeError('midway')\n"
    )
    code, out, err = run_tool(
        "--variants", f"broken={broken} {A2C}", f"a2c=a2c_atari.py {A2C}", "--seeds", "1", "--jobs", "2",
        "--total-timesteps", TOTAL, "--out", str(tmp_path / "cmp"), "--runs-dir", str(tmp_path / "runs"),
        "--run-timeout", "240",
    )  # fmt: skip
    assert code == 1, f"{out[-2000:]}\n{err[-2000:]}"
    assert re.search(r"FAILED: broken Breakout-v5 seed 1 failed \(exit code 1\); its log ends:\n(.*\n)*.*midway", err)
    with open(tmp_path / "cmp.csv") as f:
        assert {row["label"] for row in csv.DictReader(f)} == {"a2c"}
    assert "| a2c | 1 |" in out


@pytest.mark.parametrize(
    "variants, extra, message",
    [
        (["nothere.py"], [], "'nothere.py' is no script"),
        (["BROKEN"], [], "fails at import (RuntimeError: at import)"),
        ([f"x=a2c_atari.py {A2C} --no-such-flag 1"], [], "variant x: Unrecognized"),
        (["x=a2c_atari.py --seed 3"], [], "--seed is set by learning.py"),
        (["x=a2c_atari.py --ent-coef -1"], [], "variant x: --ent-coef must be"),
        (["a2c_atari.py", "a2c_atari.py"], [], "label 'a2c_atari' names two variants"),
        (["a2c"], ["--env-ids", "Breakout-v5", "NoSuchGame-v5"], "unknown Atari game 'NoSuchGame'"),
        (["a2c"], ["--reference", "ppo"], "--reference 'ppo' is none of the variants"),
    ],
)
def test_bad_input_stops_before_any_run(tmp_path, monkeypatch, capsys, variants, extra, message):
    (tmp_path / "broken.py").write_text("raise RuntimeError('at import')\n")
    variants = [str(tmp_path / "broken.py") if v == "BROKEN" else v for v in variants]
    monkeypatch.setattr(learning, "train", lambda *args: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as stop:
        learning.main(["--variants", *variants, *extra, "--out", str(tmp_path / "cmp"), "--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_old_results_still_read(tmp_path, capsys):
    """A CSV from before labels and games (benchmarks/results/) redraws with the figures the README
    quotes for seeds 1-4 (the file gains seeds as issue 46's runs land)."""
    with open(ROOT / "benchmarks/results/learning_500k_protocol.csv") as f, open(tmp_path / "old.csv", "w") as old:
        rows = list(csv.reader(f))
        assert rows[0] == ["script", "seed", "step", "wall_time_s", "return"]  # the format before --env-ids
        csv.writer(old).writerows([rows[0], *(row for row in rows[1:] if int(row[1]) <= 4)])
    learning.main(["--plot-only", "--out", str(tmp_path / "old"), "--runs-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| native-fp32 | 4 | 8.80 [6.93, 10.66] | -1.20 [-4.88, +2.47]" in out
    assert (tmp_path / "old.png").stat().st_size > 0


def test_a_step_a_run_has_not_reached_has_no_figure():
    """--at on a run cut short (or still going): 'not reached', and the seeds' mean leaves it out."""
    game = "Breakout-v5"
    rows = [("x", game, 1, step, step / 100, float(step // 100)) for step in range(100, 2001, 100)]
    rows += [("x", game, 2, step, step / 100, 1.0) for step in range(100, 1001, 100)]
    rows += [("y", game, 1, step, step / 100, 2.0) for step in range(100, 2001, 100)]
    out = learning.summary(rows, "x", marks=(1000, 2000))
    assert "| y | 1 | 2.00 | 2.00 |" in out and "| y | mean" not in out  # one seed: no mean row
    assert "| x | 1 | 5.50 | 10.50 |" in out  # the last 100 games by then: here every game so far
    assert "| x | 2 | 1.00 | not reached |" in out
    assert "| x | mean (range) of 2 | 3.25 (1.00-5.50) | 10.50 (10.50-10.50, 1 of 2 seeds) |" in out


def test_logged_losses_per_fifth_as_tensorboard_keeps_them(tmp_path):
    """A run's losses averaged over each fifth, beside its returns; a resumed run's points after
    its checkpoint dropped, as TensorBoard drops them (the writer's purge_step); a tag the run did
    not log (A2C has no clip fraction) gets no row."""
    from torch.utils.tensorboard import SummaryWriter

    crashed = SummaryWriter(str(tmp_path))
    for step in range(100, 1001, 100):
        crashed.add_scalar("losses/entropy", 1.0, step)
        crashed.add_scalar(learning.RETURN, 5.0, step)
    crashed.close()
    resumed = SummaryWriter(str(tmp_path), purge_step=601)  # the checkpoint held step 600
    for step in range(700, 1001, 100):
        resumed.add_scalar("losses/entropy", 2.0, step)
        resumed.add_scalar(learning.RETURN, float(step), step)
    resumed.close()
    series = learning.scalars_of(tmp_path, learning.DIAGNOSTICS)
    assert list(series) == ["losses/entropy"]
    kept = [(step, 1.0) for step in range(100, 601, 100)] + [(step, 2.0) for step in range(700, 1001, 100)]
    assert [(step, value) for step, _, value in series["losses/entropy"]] == kept
    assert [r for _, _, r in learning.returns_of(tmp_path)] == [5.0] * 6 + [700.0, 800.0, 900.0, 1000.0]
    rows = [("a2c", "Pong-v5", 1, step, wall, ret) for step, wall, ret in learning.returns_of(tmp_path)]
    out = learning.summary(rows, "a2c", logs={("a2c", "Pong-v5", 1): series})
    # fifths of 1000 steps: (0, 200], (200, 400], (400, 600], (600, 800], (800, 1000]
    assert "| a2c | 1 | losses/entropy | 1 | 1 | 1 | 2 | 2 |" in out
    assert "| a2c | 1 | 5.00 | 5.00 | 5.00 | 750.00 | 950.00 |" in out
    assert "losses/clipfrac" not in out
    assert "logged:" not in learning.summary(rows, "a2c")  # no run directory at hand: no table


def test_a_run_read_with_from_run_into_a_new_folder(tmp_path, capsys):
    """--from-run reads a run cut short (a partial curve) into OUT.csv, its folder made if missing,
    with the steps it reached and its logged losses."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "Qbert-v5__ppo_atari_native__2__1"
    writer = SummaryWriter(str(run_dir))
    for step in range(100, 1501, 100):
        writer.add_scalar(learning.RETURN, float(step), step)
        writer.add_scalar("losses/entropy", 1.5, step)
    writer.close()
    out = tmp_path / "new" / "partial"
    learning.main(["--from-run", "ppo_atari_native", "2", str(run_dir), "--env-ids", "Qbert-v5",
                   "--out", str(out), "--at", "1000", "2000"])  # fmt: skip
    with open(f"{out}.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["game"], r["seed"]) for r in rows] == [("ppo_atari_native", "Qbert-v5", "2")] * 15
    printed = capsys.readouterr().out
    assert "| ppo_atari_native | 2 | 550.00 | not reached |" in printed
    assert "| ppo_atari_native | 2 | losses/entropy |" in printed
    assert (tmp_path / "new" / "partial.png").stat().st_size > 0


def test_published_points_follow_the_algorithm_and_the_game(monkeypatch):
    """Runs are drawn and summarized beside their algorithm's published figures on their own game (by
    label: A2C's beside SLM Lab's A2C, PPO's, the SLM-settings copy's too, beside SLM Lab's PPO and
    CleanRL's); across Breakout, Pong and Qbert each publisher's own IQM is printed below ours once
    the runs reach 10M, from atari_scores.csv's random and human scores."""
    monkeypatch.setattr(learning, "BOOTSTRAP", 50)  # the intervals are not what is tested here
    games, labels, ten_m = (
        ["Breakout-v5", "Pong-v5", "Qbert-v5"],
        ["a2c_atari", "ppo_atari_native", "ppo_atari_slm"],
        10**7,
    )
    steps = range(200_000, ten_m + 1, 200_000)
    rows = [(label, game, seed, step, step / 1e4, float(seed + labels.index(label)))
            for label in labels for game in games for seed in (1, 2) for step in steps]  # fmt: skip
    runs = learning.group(rows)

    def finals(label, game):
        mine = {key: run for key, run in runs.items() if key[0] == label}
        return {(source.who, source.points[-1]) for source in learning.published(mine, game)}

    assert finals("a2c_atari", "Pong-v5") == {("SLM Lab A2C", (ten_m, 10.17))}
    assert finals("a2c_atari", "Qbert-v5") == {("SLM Lab A2C", (ten_m, 12619.0))}
    assert finals("ppo_atari_native", "Pong-v5") == {("SLM Lab PPO", (ten_m, 16.69)), ("CleanRL PPO", (ten_m, 15.23))}
    assert finals("ppo_atari_native", "Qbert-v5") == {
        ("SLM Lab PPO", (ten_m, 15460.48)),
        ("CleanRL PPO", (ten_m, 15130.0)),
    }
    assert finals("ppo_atari_slm", "Breakout-v5") == {
        ("SLM Lab PPO", (ten_m, 326.47)),
        ("CleanRL PPO", (ten_m, 198.37)),
    }
    assert finals("ppo_atari_slm", "Asterix-v5") == set()  # no published figure: nothing drawn

    out = learning.summary(rows, "ppo_atari_native")
    across = out[out.index("Across Breakout-v5, Pong-v5, Qbert-v5") :]
    for label in labels:
        assert re.search(rf"^\| {label} \| 2 \| [-.\d]+ \[", across, re.M), across
    # human-normalized (random, human): Breakout (1.7, 30.5), Pong (-20.7, 14.6), Qbert (163.9, 13455.0);
    # the IQM of three scores trims none: their mean
    hns = lambda b, p, q: [(b - 1.7) / 28.8, (p + 20.7) / 35.3, (q - 163.9) / (13455.0 - 163.9)]  # noqa: E731
    for who, scores in [("SLM Lab PPO", hns(326.47, 16.69, 15460.48)), ("SLM Lab A2C", hns(273, 10.17, 12619)),
                        ("CleanRL PPO", hns(198.37, 15.23, 15130.0))]:  # fmt: skip
        line = next(x for x in across.splitlines() if x.startswith(f"| {who} | 10M | "))
        assert float(line.split("|")[3]) == pytest.approx(np.mean(scores), abs=6e-4), line
    for game in games:
        assert f"| published, {game} |" in out
    # runs short of the publishers' step: their IQM would compare another point of the curve
    short = [row for row in rows if row[3] <= 2_000_000]
    assert "| SLM Lab PPO | 10M |" not in learning.summary(short, "ppo_atari_native")


@pytest.mark.parametrize("name, small", [("native-fp32", PPO), ("a2c", f"{A2C} --precision fp32")])
def test_sps_variants_print_two_progress_lines_to_time_between(tmp_path, monkeypatch, name, small):
    """sps.py times a run from its first progress line to its last: a variant's budget, counted in
    its script's iterations at the default batch, must give two. Run with as many small iterations."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the scripts run as users run them
    script, extra, budget = sps.VARIANTS[name]
    text = (ROOT / script).read_text()  # its Args' defaults: an import here would find benchmarks/kernels.py
    defaults = {field: int(value) for field, value in re.findall(r"\n    (num_envs|num_steps): int = (\d+)", text)}
    iterations = budget // (defaults["num_envs"] * defaults["num_steps"])
    steps = iterations * int(re.search(r"--num-envs (\d+)", small)[1]) * int(re.search(r"--num-steps (\d+)", small)[1])
    rate, from_launch, _ = sps.run(script, [*extra, *small.split()], steps, str(tmp_path))
    assert rate > 0 and from_launch > 0
