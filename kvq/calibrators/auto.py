"""`kvq calibrate auto --bits B`: the method kvq's measurements favour at that width.

The choice is `AutoOptions.chosen` (`kvq.calibrators.options.AUTO_CHOICES`), per width:
scalar KVQuant NUQ (`kvq calibrate kvquant`), vector codebooks over channel groups
(`kvq calibrate vq`) or bit-shift trellis codes (`kvq calibrate trellis`), as `--prefer
speed|balanced|quality` asks (measured trade-offs in `kvq.calibrators.options`), the latter two
with KVQuant's normalisers, exact outliers and sink, and optionally per-layer, per-side
bits from the Fisher sensitivity (within each side) or from the model's measured KL with
each layer-side quantized alone (across sides, `--mixed loss`, vq only). The streamed bits
per element are KVQuant's at the same width (same code bits, same row overheads); the
static tables and codebooks differ, and the cache's ledger counts them. The pass names
its choice in a progress stage, in the policy name and in the manifest (the pass's
recorded options carry `method`).

Where `AUTO_ROTATE` says so, auto runs as the chain rotate -> auto (`AutoOptions.chain`):
the values are rotated by a folded randomized Hadamard before anything is calibrated.
"""

from __future__ import annotations

from dataclasses import replace

from kvq.calibrators import kvquant
from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.options import KVQuantOptions, TrellisOptions
from kvq.calibrators.trellis import calibrate_trellis
from kvq.calibrators.vq import calibrate_vq, fisher_sums


def fit(ctx: FitContext) -> PassResult:
    opts = ctx.options
    chosen = opts.chosen()
    with ctx.progress.stage(f"auto {opts.bits} bits ({opts.why()}): {opts.method()}"):
        pass  # the stage is the announcement: it shows in the output and the stage timings
    if isinstance(chosen, KVQuantOptions):
        result = kvquant.fit(replace(ctx, options=chosen))
        policy = replace(result.policy, name=f"auto{opts.bits}: {result.policy.name}")
        return PassResult(policy, result.tensors)
    info = fisher_sums(ctx, chosen.sink)
    calibrate = calibrate_trellis if isinstance(chosen, TrellisOptions) else calibrate_vq
    policy, tensors = calibrate(
        ctx.loaded.model, ctx.loaded.adapter, ctx.windows.ids, chosen, ctx.progress,
        (info.key, info.value), name=f"auto{opts.bits}: {policy_name(chosen)}",
    )  # fmt: skip
    return PassResult(policy, tensors | info.to_tensors())


def policy_name(v) -> str:
    mixed = {"none": "", "fisher": "-mixed", "loss": "-mixed-loss"}[v.mixed]
    if isinstance(v, TrellisOptions):
        return f"trellis{v.bits}-w{v.window}{mixed}"
    dims = str(v.dim) if v.dim else ("4" if v.bits <= 2 else "2+4")
    return f"vq{v.bits}-d{dims}{mixed}"
