"""`run-eval --plot DIR`: each task's PNGs, and error against position for the window tasks.

matplotlib is imported only here and only when plots are asked for (Agg: no display).
"""

from __future__ import annotations

from pathlib import Path

from kvq.errors import KvqError
from kvq.eval.tasks import WINDOW_TASKS, get_task


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(sections: dict, folder: Path, chosen: tuple[str, ...]) -> list[Path]:
    """Every plot of the tasks run, written into `folder` (made if missing)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvqError(f"--plot {folder}: cannot make the folder ({e.strerror})") from None
    written: list[Path] = []
    if "ppl" in sections and sections["ppl"].get("by_position"):
        written.append(_by_position(sections["ppl"]["by_position"], folder / "ppl_by_position.png"))
    for name in chosen:
        if name in WINDOW_TASKS or name not in sections:
            continue
        task = get_task(name)
        if task.plot is not None:
            written += task.plot(sections[name], folder)
    return written


def _by_position(rows: list[dict], path: Path) -> Path:
    """KL divergence and NLL delta by span of the window: does error grow with position?"""
    plt = pyplot()
    mid = [(r["start"] + r["end"]) / 2 for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(mid, [r["kld"] for r in rows], marker="o", label="KL divergence")
    ax.plot(mid, [r["nll_delta"] for r in rows], marker="s", label="NLL delta (nats)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("position in the window (tokens)")
    ax.set_ylabel("per token")
    ax.set_title("quantized cache vs unquantized, by position")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
