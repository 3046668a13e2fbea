"""References the sampling tests share: Pearson's chi-square goodness of fit, and the top_p / min_p
that keep exactly the m most likely tokens."""

from __future__ import annotations

import torch


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's goodness-of-fit p-value of `counts` against `probs`; tokens expected fewer than
    `min_expected` times are pooled into one bin. A count where probs is 0 gives 0."""
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2))


def top_p_keeping(probs: torch.Tensor, m: int) -> float:
    """A top_p that keeps exactly the m most likely tokens, halfway between the two edges."""
    cum = probs.sort(descending=True).values.cumsum(-1)
    return float(cum[m - 2] + cum[m - 1]) / 2


def min_p_keeping(probs: torch.Tensor, m: int) -> float:
    """A min_p that keeps exactly the m most likely tokens, halfway (in log) between the two edges."""
    ratio = probs.sort(descending=True).values / probs.max()
    return float((ratio[m - 1] * ratio[m]).sqrt())
