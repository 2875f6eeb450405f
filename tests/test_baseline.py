"""ppo_atari_baseline.py: runs end to end, writes every tag, and counts episodes right."""

import gymnasium as gym
import numpy as np
import pytest
from conftest import TINY, assert_all_tags, default_game, read_scalars, run_dir_of, run_script


@pytest.mark.parametrize("vector_mode", ["async", "sync"])
def test_baseline_runs_and_writes_every_tag(vector_mode, runs_dir):
    result = run_script("ppo_atari_baseline.py", *TINY, "--vector-mode", vector_mode, "--runs-dir", runs_dir)
    run_dir = run_dir_of(result)
    assert run_dir.name.startswith("Breakout-v5__ppo_atari_baseline__1__")
    assert_all_tags(read_scalars(run_dir))
    assert (run_dir / "model.pt").is_file()
    assert "SPS: " in result.stdout
    steps = [step for step, _ in read_scalars(run_dir)["charts/SPS"]]
    assert steps == [256, 512, 768, 1024]  # global_step counts agent steps


def test_baseline_episode_accounting():
    """Full-game returns over all lives from unclipped rewards; the learner's rewards clipped
    and every lost life terminal. SpaceInvaders gives rewards above 1 and has 3 lives."""
    from utils import make_env

    env = make_env("SpaceInvaders-v5", 3, default_game())()
    # spy on the rewards that come out of the preprocessing, before any clipping
    inner = env
    while not isinstance(inner, gym.wrappers.AtariPreprocessing):
        inner = inner.env
    raw_rewards = []
    step = inner.step

    def spy(action):
        result = step(action)
        raw_rewards.append(result[1])
        return result

    inner.step = spy
    env.reset(seed=3)
    rng = np.random.default_rng(0)
    clipped, terminals, episode = [], 0, None
    for _ in range(20_000):
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(env.action_space.n)))
        clipped.append(reward)
        if terminated or truncated:
            terminals += 1
            if "episode" in info:
                episode = info["episode"]
                break
            env.reset()  # as the vector env would: a lost life does not restart the game
    assert episode is not None, "no full game ended"
    assert terminals == 3  # one per life: the learner sees each lost life as terminal
    assert set(clipped) <= {0.0, 1.0} and sum(clipped) > 0
    assert max(raw_rewards) > 1  # so clipping really changed something
    assert float(episode["r"]) == pytest.approx(sum(raw_rewards))
    assert int(episode["l"]) == len(raw_rewards)  # agent steps: no extra step after a lost life
