"""`run-eval --budget ppl=1.02,kld=0.02,passkey=-1`: each task's headline figure against
the user's limit, PASS or FAIL, with its noise floor where the task has one.

A limit is an upper bound for error figures (ppl ratio, KLD, attention error, latency
slowdown) and a lower bound for the others (retrieval: trials lost in the worst cell as a
negative number, so passkey=-1 allows one lost trial per cell; decode agreement;
speculative acceptance). Defaults depend on the cache's mean code bits (`DEFAULTS`).
No torch here: the command line checks a budget before loading anything.
"""

from __future__ import annotations

from kvq.errors import KvqError

# key -> (task section, how to read its figure, "max" or "min" bound, what it means)
FIGURES = {
    "ppl": ("ppl", lambda s: s["ratio"], "max", "perplexity ratio"),
    "kld": ("kld", lambda s: s["mean"], "max", "mean KL divergence"),
    "passkey": ("passkey", lambda s: -s["max_cell_gap"], "min", "-trials lost, worst cell"),
    "needle": ("needle", lambda s: -s["max_cell_gap"], "min", "-trials lost, worst cell"),
    "decode": ("decode", lambda s: s["mean_agreement"], "min", "token agreement"),
    "speculative": (
        "speculative",
        lambda s: s["quantized_draft"]["quantized_acceptance"],
        "min",
        "quantized draft acceptance",
    ),  # fmt: skip
    "attention": (
        "attention",
        lambda s: s["mean_output_rel_error"],
        "max",
        "attention output rel. error",
    ),  # fmt: skip
    "latency": ("latency", lambda s: max(s["slowdown"].values()), "max", "decode slowdown"),
}
# defaults by the cache's mean code bits (nearest key): what a user of that width expects
DEFAULTS = {
    8: {"ppl": 1.005, "kld": 0.005, "passkey": 0, "needle": 0, "decode": 0.9},
    4: {"ppl": 1.02, "kld": 0.02, "passkey": -1, "needle": -1, "decode": 0.5},
    3: {"ppl": 1.05, "kld": 0.05, "passkey": -2, "needle": -2, "decode": 0.3},
    2: {"ppl": 1.15, "kld": 0.15, "passkey": -3, "needle": -3, "decode": 0.1},
}


def parse_budget(text: str) -> dict[str, float]:
    """ "ppl=1.02,kld=0.02,passkey=-1" -> {"ppl": 1.02, ...}; a one-line error otherwise."""
    out = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in FIGURES:
            raise KvqError(
                f"--budget: {item!r} is not KEY=LIMIT with KEY one of {', '.join(FIGURES)}"
            )
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise KvqError(f"--budget: {key.strip()}={value!r} needs a number") from None
    if not out:
        raise KvqError("--budget needs at least one KEY=LIMIT")
    return out


def default_budget(mean_bits: float) -> dict[str, float]:
    return dict(DEFAULTS[min(DEFAULTS, key=lambda b: abs(b - mean_bits))])


def verdict(sections: dict, budget: dict[str, float]) -> list[dict]:
    """One row per budget key whose task ran: figure, limit, interval, PASS/FAIL."""
    rows = []
    for key, limit in budget.items():
        task, read, bound, meaning = FIGURES[key]
        if task not in sections:
            continue
        value = float(read(sections[task]))
        ok = value <= limit if bound == "max" else value >= limit
        interval = sections[task].get("interval95") or {}
        if isinstance(interval, dict):  # ppl's holds both figures; kld's is the pair itself
            interval = interval.get("ppl_ratio")
        within_noise = bool(interval) and interval[0] <= limit <= interval[1]
        rows.append({"key": key, "figure": meaning, "value": value, "limit": limit,
                     "bound": bound, "interval95": interval, "within_noise": within_noise,
                     "verdict": "PASS" if ok else "FAIL"})  # fmt: skip
    return rows
