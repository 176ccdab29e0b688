"""The reward curve of an RL run as a PNG (matplotlib, from the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def save_reward_plot(steps: Sequence[int], means: Sequence[float], stds: Sequence[float], path: str | Path, *,
                     bounds: tuple[Sequence[float], Sequence[float]] | None = None, title: str = "reward per step",
                     window: int = 10) -> Path:
    """Plot the mean reward of each step (with a +-1 std band over the step's episodes) and its moving average.

    ``bounds``: each step's lowest and highest episode reward; the band is clipped to them (a std band around a
    mean of 0/1 rewards would otherwise reach below 0 and above 1).

    Raises ``ImportError`` with the install command when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a training machine
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("saving the reward plot needs matplotlib: pip install 'lightning-dta[bench]' (or "
                          "pip install matplotlib)") from error
    if not (len(steps) == len(means) == len(stds)):
        raise ValueError(f"steps, means and stds differ in length: {len(steps)}, {len(means)}, {len(stds)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(7, 4))
    low = [m - s for m, s in zip(means, stds)]
    high = [m + s for m, s in zip(means, stds)]
    if bounds is not None:
        low = [max(value, bound) for value, bound in zip(low, bounds[0])]
        high = [min(value, bound) for value, bound in zip(high, bounds[1])]
    axes.fill_between(steps, low, high, alpha=0.15, color="tab:blue", label="±1 std over episodes")
    axes.plot(steps, means, color="tab:blue", alpha=0.5, linewidth=1, label="mean reward")
    if len(means) >= window:
        moving = [sum(means[i - window + 1:i + 1]) / window for i in range(window - 1, len(means))]
        axes.plot(steps[window - 1:], moving, color="tab:red", linewidth=2, label=f"moving average ({window} steps)")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("reward")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
