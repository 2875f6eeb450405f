"""The game. By default every script plays one, the ALE v5 protocol (the game block of its Args):
with sticky actions, FIRE and noops on, the native envs (ale-py's vector env) and the baseline's
gymnasium pipeline start games and go on after a lost life alike. Their random draws differ, so
what is compared is the distributions over a few hundred game starts, within sampling error.

Under a fixed action sequence (NOOP throughout), per game start:
- the frames that pass before the first observation (FIRE and noops);
- whether Breakout's ball was served (a life is lost only if it was: nobody presses FIRE);
- the agent step at which the first life is lost.

A copy, or a run's flags, changes the game for everything that plays it: the envs, the network's
action set, the learner's rewards and terminals, the first line, the checkpoint.
"""

import inspect
import math
import runpy
import signal
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, default_game

import a2c_atari
import ppo_atari_baseline
import ppo_atari_native
import utils
from utils import make_env

STARTS = 576  # game starts per pipeline: enough to see the ball served 10 points less often (see below)
STEPS = 40  # agent steps watched after each start (a served ball is lost by step ~24)


def native_starts(game, steps=STEPS, starts=STARTS, num_envs=32):
    """(frames before the first observation, agent step of the first lost life or 0) per game
    start, from utils.ThreadedAtariEnvs as the native scripts make it: seeded once (the first
    num_envs rows), then new games without reseeding (a seeded start loads the ROM: slow)."""
    envs = utils.ThreadedAtariEnvs(f"{game}-v5", num_envs, 1, 2, 0, default_game())
    rewards, dones = np.zeros(num_envs, np.float32), np.zeros(num_envs, np.float32)
    noop = np.zeros(num_envs, dtype=np.int64)
    rows = []
    for start in range(starts // num_envs):
        if start == 0:
            envs.reset()
            frames = envs.frame_number.copy()
        else:
            frames = envs.envs[0].reset()[1]["episode_frame_number"].copy()
        first_loss = np.zeros(num_envs, dtype=np.int64)
        for step in range(1, steps + 1):
            envs.send(0, noop)
            envs.recv(0, rewards, dones)  # dones: a lost life (life_loss_terminal) or a game over
            first_loss[(dones > 0) & (first_loss == 0)] = step
        rows += zip(frames.tolist(), first_loss.tolist())
    envs.close()
    return np.array(rows)


def baseline_starts(game, steps=STEPS, starts=STARTS):
    """The same from utils.make_env's gymnasium pipeline (lives read from ALE)."""
    env = make_env(f"{game}-v5", 0, default_game(life_loss_terminal=False))()
    ale = env.unwrapped.ale
    rows = []
    for start in range(starts):
        env.reset(seed=0 if start == 0 else None)
        frames, lives, first_loss = ale.getEpisodeFrameNumber(), ale.lives(), 0
        for step in range(1, steps + 1):
            env.step(0)
            if ale.lives() < lives:
                first_loss = step
                break
        rows.append((frames, first_loss))
    env.close()
    return np.array(rows)


def ks_statistic(a, b):
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    values = np.union1d(a, b)
    cdf_a = np.searchsorted(np.sort(a), values, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), values, side="right") / len(b)
    return np.abs(cdf_a - cdf_b).max()


def ks_critical(n, m, c=1.95):
    """The KS statistic's critical value at p = 0.001 (c(alpha) = sqrt(-ln(alpha / 2) / 2));
    conservative for discrete values like these."""
    return c * np.sqrt((n + m) / (n * m))


def assert_same_distribution(name, a, b):
    statistic, critical = ks_statistic(a, b), ks_critical(len(a), len(b))
    assert statistic < critical, (
        f"{name}: KS {statistic:.3f} >= {critical:.3f}; native mean {a.mean():.2f}, baseline {b.mean():.2f}"
    )


@pytest.fixture(scope="module")
def breakout():
    return native_starts("Breakout"), baseline_starts("Breakout")


def test_frames_before_the_first_observation(breakout):
    """FIRE for one frame, then max(0, U{0..29} - 1) noop frames: 1 to 29 frames in both."""
    native, baseline = breakout
    for rows in (native, baseline):
        assert rows[:, 0].min() >= 1 and rows[:, 0].max() <= 29
        assert len(np.unique(rows[:, 0])) >= 25  # the noops really are drawn
    assert_same_distribution("frames before the first observation", native[:, 0], baseline[:, 0])


def binomial_pmf(n, k, p):
    return math.exp(
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    )


def acceptance_region(n, p, alpha=0.001):
    """The counts (lo, hi) of n Bernoulli(p) draws that an exact two-sided binomial test at
    level alpha accepts: each tail left out holds at most alpha / 2."""
    lo, below = 0, 0.0
    while below + binomial_pmf(n, lo, p) <= alpha / 2:
        below, lo = below + binomial_pmf(n, lo, p), lo + 1
    hi, above = n, 0.0
    while above + binomial_pmf(n, hi, p) <= alpha / 2:
        above, hi = above + binomial_pmf(n, hi, p), hi - 1
    return lo, hi


def refused(n, p, region):
    """The probability that n Bernoulli(p) draws fall outside the region."""
    lo, hi = region
    return 1.0 - sum(binomial_pmf(n, k, p) for k in range(lo, hi + 1))


def test_the_served_test_sees_a_10_point_difference():
    """The power of test_ball_served_as_often, exact from the binomial: at STARTS starts per
    pipeline a pipeline serving in 65% (or 85%) of games instead of 75% falls outside the
    acceptance region at least 95% of the time (576 starts: 97.4% and 99.7%; 512 would give
    95.0%, 320 74%), and one serving in 75% at most 0.1% of the time. Simulated with the z test
    too (benchmarks/protocol_power.py, 200,000 trials): 65% is caught 97.5% of the time, 85%
    99.7%, and a false alarm at 75% is 0.2%; the test as it was at 320 starts (rates in
    (0.6, 0.9), z below 3.3) caught 65% 29.8% of the time."""
    region = acceptance_region(STARTS, 0.75)
    assert refused(STARTS, 0.75, region) <= 0.001
    assert refused(STARTS, 0.65, region) >= 0.95 and refused(STARTS, 0.85, region) >= 0.95


def test_ball_served_as_often(breakout):
    """The FIRE frame is dropped by sticky actions (p = 0.25) in both, so 3 games in 4 start
    with the ball in play: each pipeline's count of served games is one an exact binomial test
    of p = 0.75 accepts (two-sided, p = 0.001), and the two pipelines' rates agree."""
    native, baseline = breakout
    lo, hi = acceptance_region(STARTS, 0.75)
    for name, rows in (("native", native), ("baseline", baseline)):
        served = int((rows[:, 1] > 0).sum())
        assert lo <= served <= hi, f"{name}: ball served in {served} of {STARTS} games, expected {lo} to {hi}"
    served_native, served_baseline = (native[:, 1] > 0).mean(), (baseline[:, 1] > 0).mean()
    pooled = (served_native + served_baseline) / 2
    z = abs(served_native - served_baseline) / np.sqrt(pooled * (1 - pooled) * 2 / STARTS)
    assert z < 3.3, (served_native, served_baseline)


def test_steps_to_the_first_lost_life(breakout):
    native, baseline = (rows[rows[:, 1] > 0, 1] for rows in breakout)  # served games
    assert_same_distribution("steps to the first lost life", native, baseline)


def test_after_a_lost_life_the_game_goes_on_without_a_step():
    """A lost life is terminal for the learner and nothing else: the baseline's reset after it
    returns the last observation and takes no step, as ale-py's vector env does not."""
    env = make_env("Breakout-v5", 0, default_game())()
    env.reset(seed=3)
    env.step(1)  # serve, so that the ball is lost under NOOP
    for _ in range(200):
        obs, _, terminated, _, _ = env.step(0)
        if terminated:
            break
    else:
        pytest.fail("no life lost")
    frame = env.unwrapped.ale.getEpisodeFrameNumber()
    again, _ = env.reset()
    assert env.unwrapped.ale.getEpisodeFrameNumber() == frame
    np.testing.assert_array_equal(np.asarray(again), np.asarray(obs))
    env.close()


def test_games_without_fire_start_after_0_to_29_noop_frames():
    native, baseline = native_starts("MsPacman", steps=0, starts=320), baseline_starts("MsPacman", steps=0, starts=320)
    for rows in (native, baseline):
        assert rows[:, 0].min() >= 0 and rows[:, 0].max() <= 29
    assert_same_distribution("frames before the first observation", native[:, 0], baseline[:, 0])


def test_the_seeded_start_does_not_tie_fire_to_the_noop_count(breakout):
    """ale-py seeds an env's noop draw and its sticky actions with the same seed: started once,
    the ball went unserved exactly in the games with at most 7 frames before the first
    observation. utils.seeded_reset starts the games a second time, unseeded."""
    seeded = breakout[0][:32]
    served = seeded[:, 1] > 0
    assert (served & (seeded[:, 0] <= 7)).any() and (~served & (seeded[:, 0] > 7)).any(), seeded.tolist()


# ----------------------------------------------------------------------------- the game's settings
def game_block(module) -> str:
    """The lines of a script's Args from its "# the game" comment to the next blank line."""
    source = inspect.getsource(module.Args)
    start = source.index("    # the game")
    return source[start : source.index("\n\n", start)]


def test_every_script_plays_one_game_by_default():
    """The three scripts' game blocks are the same lines (names, defaults, help), hold every setting
    utils plays, and default to ale-py's v5 game: its registered env's sticky actions, frame skip,
    action set and frame cut, its vector env's noops and FIRE; SLM Lab's clipped rewards and
    lost-life terminals."""
    import gymnasium as gym
    from ale_py.vector_env import AtariVectorEnv

    scripts = (ppo_atari_native, ppo_atari_baseline, a2c_atari)
    assert game_block(scripts[1]) == game_block(scripts[0]) == game_block(scripts[2])
    games = [utils.game_settings(script.Args()) for script in scripts]
    assert games[0] == games[1] == games[2] == default_game()
    v5 = gym.spec("ALE/Breakout-v5").kwargs
    vector = inspect.signature(AtariVectorEnv).parameters
    assert games[0] == dict(
        repeat_action_probability=v5["repeat_action_probability"], frame_skip=v5["frameskip"],
        frame_stack=vector["stack_num"].default, screen_size=vector["img_height"].default,
        noop_max=vector["noop_max"].default, fire_reset=vector["use_fire_reset"].default,
        max_episode_frames=v5["max_num_frames_per_episode"], full_action_space=v5["full_action_space"],
        clip_rewards=True, life_loss_terminal=True,
    )  # fmt: skip


@pytest.mark.parametrize("pipeline", ["native", "baseline"])
def test_without_sticky_actions_and_noops_the_same_actions_give_the_same_game(pipeline):
    """DQN's protocol, --repeat-action-probability 0 --noop-max 0: two envs seeded differently and
    given the same actions play the same game, frame for frame; with the default sticky actions
    they part within a few steps."""

    def play(settings, steps=120):
        """Newest frames [steps, 2, 84, 84] and rewards [steps, 2] of two envs (seeds 0 and 1) under
        one action sequence, in utils.ThreadedAtariEnvs or in utils.make_env's gymnasium pipeline."""
        actions = np.random.default_rng(0).integers(9, size=steps)
        if pipeline == "native":
            envs = utils.ThreadedAtariEnvs("Asterix-v5", 2, 1, 1, 0, settings)
            envs.reset()
            rewards, dones, frames, returned = np.zeros(2, np.float32), np.zeros(2, np.float32), [], []
            for action in actions:
                envs.send(0, np.array([action, action]))
                frames.append(envs.recv(0, rewards, dones)[0].copy())
                returned.append(rewards.copy())
            envs.close()
            return np.stack(frames), np.stack(returned)
        envs = [make_env("Asterix-v5", seed, settings)() for seed in (0, 1)]
        for seed, env in enumerate(envs):
            env.reset(seed=seed)
        steps = [[env.step(int(action))[:2] for env in envs] for action in actions]
        frames = np.array([[np.asarray(obs)[-1] for obs, _ in step] for step in steps])
        return frames, np.array([[reward for _, reward in step] for step in steps])

    frames, rewards = play(default_game(repeat_action_probability=0.0, noop_max=0, clip_rewards=False))
    np.testing.assert_array_equal(frames[:, 0], frames[:, 1])
    np.testing.assert_array_equal(rewards[:, 0], rewards[:, 1])
    assert rewards.max() == 50  # the game went on: Asterix scored
    sticky, _ = play(default_game(noop_max=0))
    assert (sticky[:, 0] != sticky[:, 1]).any(axis=(1, 2)).mean() > 0.5


# a copy's game (set here by flags): no sticky actions or noops, all 18 actions, unclipped rewards,
# a lost life not terminal; Asterix scores 50 within its first few dozen steps
CHANGED = ["--env-id", "Asterix-v5", "--repeat-action-probability", "0", "--noop-max", "0", "--full-action-space",
           "--no-clip-rewards", "--no-life-loss-terminal"]  # fmt: skip
TINY_RUNS = {
    "ppo_atari_native.py": ["--num-gpu-batches", "1", "--num-minibatches", "1", "--update-epochs", "1"],
    "a2c_atari.py": ["--num-gpu-batches", "1"],
    "ppo_atari_baseline.py": ["--num-minibatches", "1", "--update-epochs", "1", "--vector-mode", "sync"],
}


@pytest.mark.parametrize("script", TINY_RUNS)
def test_a_copy_changes_the_game_with_its_flags(script, tmp_path, monkeypatch, capsys):
    """One iteration of 2 envs x 64 steps, run in this process so that its storage can be read: the
    first line names the full action set (and, in the native scripts, the fused step serving it), the
    network has 18 actions and the rollout took some beyond the minimal set's 9, the learner's
    rewards hold Asterix's 50, unclipped, and the checkpoint keeps the game's settings."""
    tiny = ["--num-envs", "2", "--num-steps", "64", "--total-timesteps", "128", "--runs-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [script, *tiny, *TINY_RUNS[script], *CHANGED])
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # no stop handlers in pytest's process
    run = runpy.run_path(str(ROOT / script), run_name="__main__")
    first = capsys.readouterr().out.splitlines()[0]
    assert "; Asterix-v5 (18 actions, full set), 1 iteration of 128 steps" in first, first
    assert script == "ppo_atari_baseline.py" or ", policy fused; " in first, first
    changed = dict(repeat_action_probability=0.0, noop_max=0, full_action_space=True, clip_rewards=False,
                   life_loss_terminal=False)  # fmt: skip
    assert run["game"] == default_game(**changed)
    assert run["agent"].actor.out_features == 18 and run["actions"].max() >= 9
    assert run["rewards"].max() == 50
    saved = torch.load(run["run_dir"] / "model.pt", weights_only=True)
    assert saved["num_actions"] == 18 and {name: saved["args"][name] for name in utils.GAME} == run["game"]


# ----------------------------------------------------------------------------- SLM Lab's settings
# benchmarks/ppo_atari_slm.py is ppo_atari_native.py with these edits and no other (after the
# docstring): the settings of docs/protocol.md's table where SLM Lab's spec differs, and the
# import path a script under benchmarks/ needs. (ppo_atari_native.py's lines, the copy's)
SLM_COPY = "benchmarks/ppo_atari_slm.py"
SLM_EDITS = [
    ("import random\n", "import random\nimport sys\n"),
    (
        "import kernels\nimport utils\n",
        "sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's kernels and utils\n"
        "import kernels  # noqa: E402\nimport utils  # noqa: E402\n",
    ),
    (
        '    gae_lambda: float = 0.95\n    """the lambda for the general advantage estimation, in [0, 1]"""',
        '    gae_lambda: float = 0.70\n    """the lambda for the general advantage estimation, in [0, 1] (SLM Lab\'s '
        'ppo_atari_lam70_arc)"""',
    ),
    (
        "GELU -> actor and critic heads. The rollout's fused step\n    (kernels.policy_step) computes exactly this "
        "network; edit it, and the rollout runs forward().",
        "ReLU (SLM Lab's) -> actor and critic heads. The fused step\n    (kernels.policy_step) computes the GELU "
        "network, so the rollout runs forward().",
    ),
    ("            nn.GELU(),\n", "            nn.ReLU(),  # SLM Lab's hidden activation (ppo_atari_native.py: GELU)\n"),
    (
        "    hyper = dict(lr=lr, eps=1e-5) | utils.optimizer_options(device, args.compile, graphs=graphs)\n"
        "    optimizer = optim.Adam(agent.parameters(), **hyper)\n",
        "    # SLM Lab's AdamW, whose spec leaves PyTorch's weight decay (0.01)\n"
        "    hyper = dict(lr=lr, eps=1e-5, weight_decay=0.01) | "
        "utils.optimizer_options(device, args.compile, graphs=graphs)\n"
        "    optimizer = optim.AdamW(agent.parameters(), **hyper)\n",
    ),
]


def test_the_slm_copy_is_ppo_atari_native_at_slm_labs_settings_only():
    """benchmarks/ppo_atari_slm.py cannot drift from ppo_atari_native.py unseen: its text is the
    original's with SLM_EDITS (a change to either that is not carried over fails here); its Args
    differ in the run name and GAE lambda 0.70 only; its Agent in the hidden activation only (ReLU:
    the fused step refuses it, so the rollout runs the module); its docstring names each setting."""
    import difflib
    import importlib.util
    from dataclasses import MISSING, fields

    import kernels

    native_text, copy_text = (ROOT / "ppo_atari_native.py").read_text(), (ROOT / SLM_COPY).read_text()
    body = lambda text: text[text.index('"""\n', 3) + 4 :]  # noqa: E731  (after the module docstring)
    expected = body(native_text)
    for old, new in SLM_EDITS:
        assert expected.count(old) == 1, f"ppo_atari_native.py no longer has, once: {old!r}"
        expected = expected.replace(old, new)
    diff = "".join(
        difflib.unified_diff(expected.splitlines(True), body(copy_text).splitlines(True), "expected", SLM_COPY)
    )
    assert not diff, f"{SLM_COPY} is not ppo_atari_native.py with SLM_EDITS: carry the change over\n{diff}"

    spec = importlib.util.spec_from_file_location("ppo_atari_slm", ROOT / SLM_COPY)
    slm = importlib.util.module_from_spec(spec)
    sys.modules["ppo_atari_slm"] = slm  # dataclasses look their module up while it is made
    try:
        spec.loader.exec_module(slm)
    finally:
        del sys.modules["ppo_atari_slm"]
    defaults = lambda module: {f.name: f.default for f in fields(module.Args) if f.default is not MISSING}  # noqa: E731
    native_args, slm_args = defaults(ppo_atari_native), defaults(slm)
    assert native_args.keys() == slm_args.keys()
    assert {k: (v, slm_args[k]) for k, v in native_args.items() if slm_args[k] != v} == {
        "exp_name": ("ppo_atari_native", "ppo_atari_slm"),
        "gae_lambda": (0.95, 0.70),
    }
    torch.manual_seed(0)
    native_agent = ppo_atari_native.Agent(4)
    torch.manual_seed(0)
    slm_agent = slm.Agent(4)
    kinds = lambda agent: [type(module).__name__ for module in agent.modules()]  # noqa: E731
    assert [(a, b) for a, b in zip(kinds(native_agent), kinds(slm_agent)) if a != b] == [("GELU", "ReLU")]
    native_weights, slm_weights = native_agent.state_dict(), slm_agent.state_dict()
    assert native_weights.keys() == slm_weights.keys()
    assert all(torch.equal(native_weights[k], slm_weights[k]) for k in native_weights)  # same init
    assert kernels.fused_mismatch(slm_agent, 4) == "network[8] is ReLU, the fused step computes GELU"
    assert kernels.fused_mismatch(native_agent, 4) is None
    for setting in ("lam: 0.70", "AdamW", "weight decay 0.01", "ReLU", "val_loss_coef: 0.5", "ppo_atari_lam70_arc"):
        assert setting in slm.__doc__, setting
