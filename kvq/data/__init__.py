"""kvq.data: text sources and reproducible token windows for calibration and evaluation."""

from kvq.data.text import TextSource, load_text
from kvq.data.windows import TokenWindows, sample_windows

__all__ = ["TextSource", "TokenWindows", "load_text", "sample_windows"]
