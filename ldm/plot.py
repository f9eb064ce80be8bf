"""Curves of one run or several, drawn from their `metrics.jsonl` (no tracker needed).

    python -m ldm.plot OUT [OUT2 ...] --output curves.png
    python -m ldm.plot OUT --panel train/loss,eval/loss,eval/ema_loss --panel "eval/loss_t*" --output p.svg

Each `--panel` is one plot of the metrics it names (comma-separated `fnmatch` patterns on the names
`metrics.jsonl` holds); by default the training loss beside the held-out loss (and the EMA's), then the
held-out loss at each fixed timestep, then the training loss by quarter of the noise schedule. A run is
its output folder or its `metrics.jsonl`; a metric has its colour, and with several runs each run has
its line style and its folder's name in the legend.
"""

from __future__ import annotations

import fnmatch
import math
import os
import sys

from ldm.runtime.errors import UserError
from ldm.runtime.files import save_figure
from ldm.runtime.tracking import METRICS_FILE, metrics_records

DEFAULT_PANELS = (
    ("train/loss", "eval/loss", "eval/ema_loss"),
    ("eval/loss_t*",),
    ("train/loss_q*",),
)


class PlotError(UserError, ValueError):
    """A run or a metric the user named cannot be drawn: one line, exit 2."""


def read_metrics(run: str) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (steps, values)} of a run folder or a metrics file; non-finite values are left out (a skipped
    window's NaN would break the line)."""
    path = os.path.join(run, METRICS_FILE) if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise PlotError(f"{run}: no {METRICS_FILE} (give a run's --output_dir or the file itself)")
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in metrics_records(path):
        for name, value in record.items():
            if name in ("step", "time") or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            steps, values = series.setdefault(name, ([], []))
            steps.append(int(record["step"]))
            values.append(float(value))
    if not series:
        raise PlotError(f"{path}: no metric in it yet")
    return series


def matching(names, patterns) -> list[str]:
    """The metric names that match any pattern, in the patterns' order (then by name, timesteps numerically)."""
    def key(name):
        digits = "".join(c for c in name.rsplit("_", 1)[-1] if c.isdigit())
        return (name.rstrip("0123456789"), int(digits) if digits else -1)

    chosen = []
    for pattern in patterns:
        chosen += sorted((n for n in names if fnmatch.fnmatchcase(n, pattern) and n not in chosen), key=key)
    return chosen


def plot(runs: dict[str, dict], panels, output: str) -> list[tuple[str, list[str]]]:
    """Draw `panels` of every run into `output`; returns [(panel title, metrics drawn)] (empty panels dropped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {name for series in runs.values() for name in series}
    drawn = [(", ".join(patterns), matching(names, patterns)) for patterns in panels]
    drawn = [(title, metrics) for title, metrics in drawn if metrics]
    if not drawn:
        raise PlotError(f"none of {', '.join(p for panel in panels for p in panel)} is in the runs' metrics "
                        f"(they hold {', '.join(sorted(names))})")
    fig, axes = plt.subplots(1, len(drawn), figsize=(5.5 * len(drawn), 4), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]
    for ax, (title, metrics) in zip(axes[0], drawn, strict=True):
        for r, (run, series) in enumerate(runs.items()):
            for m, metric in enumerate(metrics):
                if metric not in series:
                    continue
                steps, values = series[metric]
                label = metric if len(runs) == 1 else f"{run}: {metric}"
                ax.plot(steps, values, linestyle=styles[r % len(styles)], color=colours[m % len(colours)],
                        label=label, marker="." if len(steps) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("optimizer update")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        save_figure(fig, output, dpi=100)
    finally:
        plt.close(fig)
    return drawn


def check_output(output: str) -> None:
    """Refuse an image name matplotlib cannot write, before anything is read or drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    kinds = FigureCanvasAgg.get_supported_filetypes()
    kind = os.path.splitext(output)[1][1:].lower()
    if kind not in kinds:
        raise PlotError(f"--output {output}: name the image with one of the extensions {', '.join(sorted(kinds))}")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise PlotError(f"--output {output}: the folder {folder} does not exist")


def main(argv: list[str] | None = None) -> int:
    from ldm.runtime.cli import ToolParser

    parser = ToolParser(prog="python -m ldm.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run output folders (or metrics.jsonl files)")
    parser.add_argument("--panel", action="append", metavar="METRIC[,METRIC...]",
                        help="metrics of one plot (comma-separated fnmatch patterns); repeat for more plots")
    parser.add_argument("--output", default="curves.png", help="the image written (.png, .svg, .pdf, ...)")
    args = parser.parse_args(argv)
    panels = [tuple(p.strip() for p in panel.split(",") if p.strip()) for panel in args.panel] if args.panel \
        else DEFAULT_PANELS
    try:
        check_output(args.output)
        labels = [os.path.basename(os.path.normpath(r if os.path.isdir(r) else os.path.dirname(r) or "."))
                  for r in args.runs]
        if len(set(labels)) < len(labels):
            labels = args.runs  # folders of the same name: show the paths given
        runs = {label: read_metrics(run) for label, run in zip(labels, args.runs, strict=True)}
        names = {name for series in runs.values() for name in series}
        for pattern in (p for panel in panels for p in panel) if args.panel else ():  # the user's only
            if not matching(names, [pattern]):
                print(f"warning: no metric matches {pattern!r}", file=sys.stderr)
        drawn = plot(runs, panels, args.output)
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for title, metrics in drawn:
        print(f"{title}: {', '.join(metrics)}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
