"""Polar Express: a Newton–Schulz polynomial for each step, each the best one for where the singular values
can be by then (Amsel, Persson, Musco and Gower, "The Polar Express", arXiv:2505.16932).

Muon's quintic iteration applies one odd polynomial p(x) = a x + b x³ + c x⁵ to the singular values five
times. Its fixed coefficients (3.4445, −4.7750, 2.0315) pull small singular values up fast but leave them
anywhere in about [0.47, 1.2] (from [1e-3, 1], five steps). Polar Express instead tracks the interval
[lo, hi] the singular values lie in after each step and takes, for the next step, the odd quintic closest
to 1 over that interval in the max norm (Chebyshev's equioscillation: 1 − p(x) reaches ±E alternately at lo, at the two
inner extrema of p, and at hi; the Remez exchange below finds them). The next interval is then
[p(lo), p(hi)] = [1 − E, 1 + E]. After five steps, every singular value in [1e-3, 1] ends within 0.134 of 1
(`composed_error`, exact arithmetic), where the quintic leaves it within 0.53.

This module derives the coefficients itself (numpy, float64, once a step count; they are cached) rather
than carrying a table. Three settings of the derivation, near the paper's and for its reasons:

- LOWER: the smallest singular value designed for, relative to the largest (the input is divided by its
  Frobenius norm, so the largest is at most 1). Smaller ones are still pulled up, just not optimally.
- CUSHION: a step is never designed for an interval narrower at the bottom than CUSHION·hi. Below it the
  best polynomial's slope at zero grows without bound and bf16's rounding of tiny values is amplified.
- SAFETY: each polynomial but the last is applied as p(x / SAFETY), so that a singular value bf16 rounding
  has pushed a little above the interval still maps below the next interval's top.

The paper's own five-step table differs from this one in the second or third digit (its composition ends
within 0.141 of 1). Which of the two trains better was not measured."""

from __future__ import annotations

from functools import cache

import numpy as np

LOWER = 1e-3
CUSHION = 0.025
SAFETY = 1.01
Coefficients = tuple[float, float, float]


def _quintic(coefficients: Coefficients, x: float) -> float:
    a, b, c = coefficients
    return a * x + b * x**3 + c * x**5


def closest_quintic(lo: float, hi: float, rounds: int = 100) -> Coefficients:
    """The odd quintic a x + b x³ + c x⁵ closest to 1 over [lo, hi] (0 < lo < hi) in the max norm, by Remez's
    exchange: solve for the polynomial whose error alternates ±E at four points, then move the two inner
    points to that polynomial's extrema (where p' = a + 3b x² + 5c x⁴ = 0), until they stay put."""
    if not 0 < lo < hi:
        raise ValueError(f"closest_quintic needs 0 < lo < hi, not [{lo}, {hi}]")
    inner = np.array([lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3])
    signs = np.array([1.0, -1.0, 1.0, -1.0])
    solution = np.zeros(3)
    for _ in range(rounds):
        points = np.array([lo, inner[0], inner[1], hi])
        system = np.stack([points, points**3, points**5, signs], axis=1)
        a, b, c, _ = np.linalg.solve(system, np.ones(4))  # p(x_i) + E s_i = 1
        solution = np.array([a, b, c])
        squares = np.roots([5 * c, 3 * b, a])
        real = squares[(np.abs(squares.imag) < 1e-12) & (squares.real > 0)].real
        extrema = np.sort(np.sqrt(real))
        extrema = extrema[(extrema > lo) & (extrema < hi)]
        if len(extrema) != 2:  # the interval is so narrow that p has no inner extrema: the last solve stands
            break
        moved = float(np.abs(extrema - inner).max())
        inner = extrema
        if moved < 1e-15 * hi:
            break
    a, b, c = (float(v) for v in solution)
    return a, b, c


@cache
def polar_express(steps: int, lower: float = LOWER, cushion: float = CUSHION,
                  safety: float = SAFETY) -> tuple[Coefficients, ...]:
    """Each of `steps` Newton–Schulz steps' (a, b, c), for singular values in [lower, 1] at the start."""
    if steps < 1:
        raise ValueError(f"polar_express needs at least one step, not {steps}")
    lo, hi = lower, 1.0
    table = []
    for step in range(steps):
        a, b, c = closest_quintic(max(lo, cushion * hi), hi)
        # Centred on 1 over the whole [lo, hi]: with the cushion, p(lo) is not yet 1 - E.
        centre = 2.0 / (_quintic((a, b, c), lo) + _quintic((a, b, c), hi))
        a, b, c = a * centre, b * centre, c * centre
        if step < steps - 1:
            a, b, c = a / safety, b / safety**3, c / safety**5
        table.append((a, b, c))
        lo = _quintic((a, b, c), lo)
        hi = 2.0 - lo
    return tuple(table)


def composed_error(table: tuple[Coefficients, ...], lower: float = LOWER, points: int = 20001) -> float:
    """The largest |1 − P(x)| over x in [lower, 1] (geometrically spaced points), P the composition of the
    table's polynomials: how far from orthogonal the iteration leaves a matrix whose singular values start
    there, in exact arithmetic."""
    x: np.ndarray = np.geomspace(lower, 1.0, points)
    for a, b, c in table:
        x = a * x + b * x**3 + c * x**5
    return float(np.abs(1.0 - x).max())
