"""How often LOOP-26's "worse than its best to the end" fires on simulated evaluation series, by number of
evaluations: never-worse shapes (pure noise, an improving curve that plateaus) give its false-alarm rate, a jump
that stays and a rise after the minimum its detection rate. The rule and its noise band are the product's own
(`sftaudit.checks.selection_metric`); the noise is Gaussian with unit sigma, the effects are in units of it.

    python benchmarks/eval_band.py [--trials 2000] [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np

from sftaudit.checks.selection_metric import MIN_BAND_EVALS, noise_band, worse_to_the_end

SIZES = (6, 8, 12, 20, 40, 80)


def shapes(n: int) -> dict[str, np.ndarray]:
    """Each shape's noiseless curve over `n` evaluations (lower is better), in units of the noise sigma."""
    t = np.arange(n)
    turn = n // 2
    return {
        "flat noise (false alarm)": np.zeros(n),
        "improve, then plateau (false alarm)": 30 * np.exp(-t / (n / 8)),
        "jump of 8 sigma at the middle, stays (detection)": np.where(t >= turn, 8.0, 0.0),
        "rise of 8 sigma after the middle (detection)": np.where(t >= turn, 8.0 * (t - turn + 1) / (n - turn), 0.0),
    }


def fires(values: np.ndarray) -> bool:
    band = noise_band(values)
    return band is not None and worse_to_the_end(values, "lower", band) is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"share of {args.trials} series on which the rule fires (fewer than {MIN_BAND_EVALS} evaluations: never)")
    print(f"{'shape':<50}" + "".join(f"{f'n={n}':>8}" for n in SIZES))
    for name in shapes(SIZES[0]):
        rates = []
        for n in SIZES:
            curve = shapes(n)[name]
            hits = sum(fires(curve + rng.standard_normal(n)) for _ in range(args.trials))
            rates.append(hits / args.trials)
        print(f"{name:<50}" + "".join(f"{r:>8.3f}" for r in rates))


if __name__ == "__main__":
    main()
