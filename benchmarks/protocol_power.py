"""How often tests/test_protocol.py's served-ball test sees a pipeline serving the ball in a
different share of games than the protocol's 75%, simulated: each trial draws the served counts
of the two pipelines (one at 75%, the other at the rate shown) and applies the test as it
was at 320 starts per pipeline (each rate in (0.6, 0.9), the two rates' z below 3.3) and as it is
(each count inside the exact binomial acceptance region of p = 0.75 at p = 0.001, and the z).
Printed as a markdown table; the 75% row is the false-alarm rate.
Run: python benchmarks/protocol_power.py [--trials 200000]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from test_protocol import STARTS, acceptance_region  # noqa: E402


def z_fails(a, b, n):
    pooled = (a + b) / (2 * n)
    spread = np.sqrt(np.maximum(pooled * (1 - pooled) * 2 / n, 1e-12))
    return np.abs(a - b) / n / spread >= 3.3


def fails_before(a, b, n=320):
    """The test at 320 starts: both rates in (0.6, 0.9) and their z below 3.3."""
    rates_off = ~((0.6 < a / n) & (a / n < 0.9) & (0.6 < b / n) & (b / n < 0.9))
    return rates_off | z_fails(a, b, n)


def fails_now(a, b, n=STARTS):
    lo, hi = acceptance_region(n, 0.75)
    return (a < lo) | (a > hi) | (b < lo) | (b > hi) | z_fails(a, b, n)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=200_000)
    trials = parser.parse_args().trials
    rng = np.random.default_rng(0)
    print(f"| served rate of one pipeline | test at 320 starts | test at {STARTS} starts |")
    print("|---|---|---|")
    for rate in (0.65, 0.70, 0.75, 0.80, 0.85):
        before = fails_before(rng.binomial(320, rate, trials), rng.binomial(320, 0.75, trials)).mean()
        now = fails_now(rng.binomial(STARTS, rate, trials), rng.binomial(STARTS, 0.75, trials)).mean()
        print(f"| {rate:.0%} | {before:.1%} | {now:.1%} |")


if __name__ == "__main__":
    main()
