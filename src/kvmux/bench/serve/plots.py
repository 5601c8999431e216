"""PNG plots of a serve benchmark: the ITL CDF per topology, p99 ITL and throughput vs rate.

matplotlib is an optional dependency (``pip install 'kvmux[bench]'``, or
``make bench``); without it the benchmark still writes its JSON and Markdown
and says how to get the plots (:func:`missing_reason`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from kvmux.bench.serve.metrics import RunMetrics

INSTALL_HINT = "pip install 'kvmux[bench]' (or: make bench)"


def missing_reason() -> str | None:
    """Why no plots can be drawn here, with how to fix it; None when they can."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"plots need matplotlib, which is not installed: {INSTALL_HINT}"
    return None


def _topologies(runs: Sequence[RunMetrics]) -> list[str]:
    return list(dict.fromkeys(r.topology for r in runs))


def write_plots(runs: Sequence[RunMetrics], out: Path) -> list[Path]:
    """``itl_cdf.png`` and ``vs_rate.png`` in ``out``; the paths written (none without runs)."""
    if not runs:
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    topologies = _topologies(runs)
    rates = sorted({r.rate for r in runs})
    paths = []

    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        for name in topologies:
            run = next((r for r in runs if r.topology == name and r.rate == rate), None)
            if run is None or not run.itls_ms:
                continue
            gaps = sorted(run.itls_ms)
            fraction = [(i + 1) / len(gaps) for i in range(len(gaps))]
            ax.step(gaps, fraction, where="post", label=name)
        ax.set_xscale("log")
        # Two chunks read in one go are microseconds apart: real, but not worth a
        # decade of empty axis.
        ax.set_xlim(left=1.0)
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_ylabel("fraction of token gaps")
        ax.set_title(f"ITL CDF at {rate:g} req/s")
        ax.axhline(0.99, color="grey", linewidth=0.5, linestyle=":")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out / "itl_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (itl_ax, thr_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name in topologies:
        mine = sorted((r for r in runs if r.topology == name and r.itl is not None), key=_rate)
        xs = [r.rate for r in mine]
        itl_ax.plot(xs, [r.itl.p99_ms for r in mine if r.itl is not None], "o-", label=name)
        thr_ax.plot(xs, [r.output_throughput for r in mine], "o-", label=name)
    itl_ax.set_yscale("log")
    itl_ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    itl_ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    itl_ax.set_xlabel("offered rate (req/s)")
    itl_ax.set_ylabel("p99 inter-token latency (ms)")
    itl_ax.set_title("p99 ITL vs rate")
    thr_ax.set_xlabel("offered rate (req/s)")
    thr_ax.set_ylabel("output throughput (tok/s)")
    thr_ax.set_title("throughput vs rate")
    for ax in (itl_ax, thr_ax):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out / "vs_rate.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _rate(run: RunMetrics) -> float:
    return run.rate
