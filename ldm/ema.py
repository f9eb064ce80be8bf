"""`python -m ldm.ema`: post-hoc EMA (EDM2) after training, from the snapshots a run with --ema_sigma_rels and
--ema_snapshot_steps wrote (docs/training.md#post-hoc-ema).

    python -m ldm.ema reconstruct RUN --sigma_rel 0.08 [--step N] --output DIR [--json]
    python -m ldm.ema sweep RUN --sigma_rel 0.03,0.05,0.08,0.12,0.2 --metric heldout_loss --output DIR \\
        -- --file_list held_out.list --validation_samples 256
    python -m ldm.ema sweep RUN --sigma_rel 0.05,0.1,0.2 --metric fid --output DIR \\
        -- --prompts coco.txt --num_samples 5000 --inception inception.safetensors --reference coco256.npz

`reconstruct` writes the pipeline folder of the EMA of relative width --sigma_rel (below sqrt(1/12) = 0.2887) at
update --step (default: the newest snapshot's), a weighted sum of the snapshots taken at or before it; --json prints
the snapshots used, their coefficients, the step and the width. `sweep` reconstructs each width, scores it with
`python -m ldm.evaluate loss` (heldout_loss) or `run` (fid; its first --guidance_scale), given the flags after `--`,
and writes sweep.json, sweep.md (the table) and sweep.png (the metric against sigma_rel, the run's standard EMA at
that update as a line when a checkpoint there has one), and names the best.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys

from ldm.runtime.cli import ToolParser
from ldm.runtime.errors import UserError
from ldm.runtime.files import atomic_write, save_figure

METRICS = {"heldout_loss": "loss", "fid": "run"}  # --metric: the `ldm.evaluate` command that scores it


class SweepError(UserError):
    """A sweep whose evaluation cannot run: one line, exit 2."""


def cmd_reconstruct(args) -> int:
    from ldm.inference.posthoc import reconstruct

    rebuilt, source = reconstruct(args.run, args.sigma_rel, args.output, args.step)
    if args.json:
        print(json.dumps({**rebuilt.as_dict(), "output": args.output, "model": source}))
    else:
        print(f"sigma_rel {rebuilt.sigma_rel:g} at update {rebuilt.step}: {len(rebuilt.snapshots)} snapshot profiles "
              f"(the model's other parts from {source}), written to {args.output}")
    return 0


def evaluate(metric: str, model: str, extra: list[str], folder: str) -> float:
    """`python -m ldm.evaluate loss|run --model MODEL EXTRA --json`, in this process; its metric."""
    from ldm import evaluate as evaluation

    command = METRICS[metric]
    argv = [command, "--model", model, *extra, "--json"]
    if command == "run":
        argv += ["--output_dir", folder]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = evaluation.main(argv)
    if code:
        raise SweepError(f"python -m ldm.evaluate {' '.join(argv)} failed (exit {code}; its error is above)")
    report = json.loads(printed.getvalue().strip().splitlines()[-1])
    return float(report["loss"] if command == "loss" else report["results"][0]["fid"])


def standard_ema(run: str, step: int) -> str | None:
    """The run's checkpoint at update `step` when it holds the standard EMA (--use_ema), else None."""
    from ldm.checkpoint.format import EMA
    from ldm.checkpoint.run_folder import checkpoint_problem
    from ldm.checkpoint.serialization import has_state

    folder = os.path.join(run, f"checkpoint-{step}")
    if os.path.isdir(folder) and checkpoint_problem(folder, checksums=False) is None and has_state(folder, EMA):
        return folder
    return None


def cmd_sweep(args) -> int:
    from ldm.inference.posthoc import plan, reconstruct
    from ldm.models.posthoc_ema import parse_sigma_rels

    widths = parse_sigma_rels(args.sigma_rel, "--sigma_rel")
    if not args.evaluate:
        raise SweepError(f"sweep: give the flags of `python -m ldm.evaluate {METRICS[args.metric]}` after `--` "
                         "(e.g. -- --file_list held_out.list)")
    step = plan(args.run, widths[0], args.step).step  # every input checked before the first evaluation
    os.makedirs(args.output, exist_ok=True)
    rows = []
    for width in widths:
        folder = os.path.join(args.output, f"sigma_rel-{width:g}")
        rebuilt, _ = reconstruct(args.run, width, os.path.join(folder, "pipeline"), step)
        value = evaluate(args.metric, os.path.join(folder, "pipeline"), args.evaluate, os.path.join(folder, "eval"))
        rows.append({"sigma_rel": width, args.metric: value, "snapshots": len(rebuilt.snapshots)})
        print(f"sigma_rel {width:g}: {args.metric} {value:.6f}", file=sys.stderr)
        if not args.keep_pipelines:
            shutil.rmtree(os.path.join(folder, "pipeline"))
            if not os.listdir(folder):
                os.rmdir(folder)
    reference = standard_ema(args.run, step)
    standard = None
    if reference is not None:
        standard = evaluate(args.metric, reference, args.evaluate, os.path.join(args.output, "standard_ema", "eval"))
    best = min(rows, key=lambda row: row[args.metric])
    report = {"run": args.run, "step": step, "metric": args.metric, "evaluate": args.evaluate, "results": rows,
              "best": best, "standard_ema": None if standard is None else {"checkpoint": reference,
                                                                          args.metric: standard}}
    with atomic_write(os.path.join(args.output, "sweep.json"), "w") as f:
        json.dump(report, f, indent=1)
    table = "\n".join([f"| sigma_rel | {args.metric} |", "|---|---|",
                       *(f"| {row['sigma_rel']:g}{' (best)' if row is best else ''} | {row[args.metric]:.6f} |"
                         for row in rows),
                       *([f"| standard EMA (--use_ema) | {standard:.6f} |"] if standard is not None else [])])
    with atomic_write(os.path.join(args.output, "sweep.md"), "w") as f:
        f.write(f"{args.metric} of the post-hoc EMA of {args.run} at update {step}\n\n{table}\n")
    plot(rows, args.metric, standard, step, os.path.join(args.output, "sweep.png"))
    print(table)
    print(f"best: sigma_rel {best['sigma_rel']:g} ({args.metric} {best[args.metric]:.6f}); wrote sweep.json, sweep.md "
          f"and sweep.png to {args.output}")
    return 0


def plot(rows: list[dict], metric: str, standard: float | None, step: int, path: str) -> None:
    """The metric against sigma_rel, the standard EMA's value as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 3.5))
    axes.plot([row["sigma_rel"] for row in rows], [row[metric] for row in rows], marker="o", label="post-hoc EMA")
    if standard is not None:
        axes.axhline(standard, color="grey", linestyle="--", label="standard EMA (--use_ema)")
    axes.set_xlabel("sigma_rel")
    axes.set_ylabel(metric)
    axes.set_title(f"{metric} at update {step}")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    save_figure(figure, path, dpi=120)
    plt.close(figure)


def sigma_rel(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number, not {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(prog="python -m ldm.ema", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("reconstruct", help="the EMA of one width at one update, as a pipeline folder")
    p.add_argument("run", help="the run's --output_dir (its ema_snapshots/)")
    p.add_argument("--sigma_rel", type=sigma_rel, required=True, help="the EMA's relative width, below 0.2887")
    p.add_argument("--step", type=int, default=None, help="the update (default: the newest snapshot's)")
    p.add_argument("--output", required=True, help="the pipeline folder to write")
    p.add_argument("--json", action="store_true", help="one JSON object: snapshots, step, sigma_rel, coefficients")
    p.set_defaults(run_command=cmd_reconstruct)
    p = sub.add_parser("sweep", help="reconstruct and evaluate several widths; a table, a plot, the best")
    p.add_argument("run", help="the run's --output_dir (its ema_snapshots/)")
    p.add_argument("--sigma_rel", required=True, help="widths separated by commas: 0.03,0.05,0.08,0.12,0.2")
    p.add_argument("--metric", choices=tuple(METRICS), required=True,
                   help="heldout_loss (python -m ldm.evaluate loss) or fid (python -m ldm.evaluate run)")
    p.add_argument("--step", type=int, default=None, help="the update (default: the newest snapshot's)")
    p.add_argument("--output", required=True, help="the folder of sweep.json, sweep.md and sweep.png")
    p.add_argument("--keep_pipelines", action="store_true", help="keep each width's pipeline folder")
    p.set_defaults(run_command=cmd_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    evaluate_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.evaluate = evaluate_flags
    from ldm.runtime.device import use_fast_cpu_kernels
    from ldm.runtime.tracking import quiet_libraries

    use_fast_cpu_kernels()
    quiet_libraries()
    try:
        return args.run_command(args)
    except (UserError, OSError, ValueError) as e:
        message = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror or e}"
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
