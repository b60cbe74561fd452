"""Chi-square goodness of fit of sampled sequences against exact probabilities (speculative tests).

Cells expecting fewer than 20 samples are pooled into one, so chi-square's approximation holds (left
out when the pool itself expects fewer than 20). The threshold is the 1 - 1e-4 quantile of
chi-square with (cells - 1) degrees of freedom (Wilson-Hilferty).
"""

import math

Z = 3.719  # the standard normal's 1 - 1e-4 quantile


def chi_square_counts(counts: dict, exact: dict, total: int) -> tuple[float, float]:
    """(statistic, threshold) of observed `counts` {cell: n} against `exact` {cell: probability}."""
    big, pooled_obs, pooled_exp = [], 0.0, 0.0
    for cell, p in exact.items():
        expected = p * total
        if expected >= 20:
            big.append((counts.get(cell, 0), expected))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(cell, 0), pooled_exp + expected
    if pooled_exp >= 20:
        big.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in big)
    df = len(big) - 1
    threshold = df * (1 - 2 / (9 * df) + Z * math.sqrt(2 / (9 * df))) ** 3
    return stat, threshold
