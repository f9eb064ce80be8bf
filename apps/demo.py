"""The end-to-end demo on CPU: corpus -> autoencoder -> latents -> LDM -> export -> samples -> evaluation.

    bash scripts/demo.sh [--quick] [--output_dir outputs/demo] [--processes N] [--seed S]

Every stage runs the project's own command line, exactly as a user would (the commands are
printed); this module only chains them, times them and writes the report. Outputs, all under
`--output_dir`: corpus/, autoencoder/ (its run), latents/ (the corpus encoded once), ldm/ (its run),
pipeline/ (the exported LDMTextToImagePipeline), samples.png (rows = prompts, columns = seeds, guidance on),
reconstructions.png (autoencoder inputs above, outputs below), loss.png, report.json.
`--quick` runs the same stages on a few steps (for the tests; its numbers mean nothing).
`--posthoc_ema` also tracks post-hoc EMA profiles in the LDM stage (the trained weights are the same) and adds a
stage that sweeps their width: posthoc_ema/ (`python -m ldm.ema sweep`'s output), posthoc_ema.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

from ldm.prepare.synth import caption
from ldm.runtime.cli import ToolParser
from ldm.runtime.tracking import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "ldm-demo"  # 32 px images, x4 autoencoder (8x8x4 latents), small UNet and LDMBert
# the same autoencoder and LDMBert with a small PixArt-style diffusion transformer (a token per latent pixel),
# trained by flow matching (its scheduler folder says so)
OBJECTIVES = {PRESET: "epsilon", "dit-demo": "flow_matching"}  # each preset's own (its scheduler folder's)
# the full demo's LDM updates where a preset needs other than Settings.ldm_steps (--quick keeps its own): the
# transformer draws shapes with twice the UNet's updates (shape 84-91% over three seeds, 66-69% at 2400), at about
# 1.7-1.9x the demo's time (docs/demo.md, "Issue 67: what limits the transformer demo")
LDM_STEPS = {"dit-demo": 4800}
HELDOUT_SEED = 12345  # apps.eval's held-out corpus images: records the corpus (seed 0) never holds


@dataclass(frozen=True)
class Settings:
    records: int = 20000
    resolution: int = 32
    # 2400, not 1200: reconstructions keep small triangles' points, and the LDM on them draws shapes better;
    # fewer updates at a lower rate, or fewer LDM updates, drew shapes worse (docs/demo.md, "Experiments").
    autoencoder_steps: int = 2400
    autoencoder_batch: int = 8  # global, like the LDM's: split across the training processes
    autoencoder_lr: float = 2e-3
    ldm_steps: int = 2400  # no EMA: with the learning rate decayed to 0, the last weights did as well or better
    ldm_batch: int = 32  # global: split across the LDM's training processes
    ldm_lr: float = 2e-3
    processes: int = 0  # training processes (paddle.distributed.launch); 0: default_processes()
    seed: int = 0  # of both training stages (the corpus is the same for every seed)
    model: str = PRESET  # the preset of both training stages (its autoencoder's configuration, its backbone)
    prediction_type: str = ""  # the LDM's objective; "": the preset's (epsilon for ldm-demo, flow for dit-demo)
    num_workers: int = 0  # 32 px PNGs decode faster in the training process than through a worker
    caption_dropout_prob: float = 0.1
    # 3, not 7.5: squares are what the LDM draws last; at 7.5 they come out rounded and read as circles (seed 0:
    # shape 81% at 7.5, 95% at 3, colour and background 100% at both; docs/demo.md, "Guidance")
    guidance_scale: float = 3.0
    num_inference_steps: int = 25
    eval_images_per_prompt: int = 4
    reference_images: int = 300
    sample_seeds: int = 6
    # --posthoc_ema: the profiles the LDM stage tracks, its snapshots' interval, the widths swept, and the
    # held-out records (python -m ldm.prepare synth with apps.eval's held-out seed) of their loss
    posthoc_ema: bool = False
    ema_sigma_rels: str = "0.05,0.10"  # EDM2's pair
    ema_snapshot_steps: int = 100
    sweep_sigma_rels: str = "0.03,0.05,0.07,0.10,0.13,0.16,0.20"
    heldout_records: int = 1000


FULL = Settings()
QUICK = Settings(records=256, autoencoder_steps=4, autoencoder_batch=8, ldm_steps=4, ldm_batch=8,
                 num_inference_steps=3, eval_images_per_prompt=1, reference_images=50, sample_seeds=2,
                 ema_snapshot_steps=2, sweep_sigma_rels="0.05,0.15", heldout_records=16)

# samples.png: one row per prompt, every colour once as object and once as background, in the
# corpus's own caption template (a word it never uses is out of its vocabulary)
SAMPLE_PROMPTS = tuple(caption(*words) for words in (
    ("red", "circle", "blue"), ("green", "square", "yellow"), ("blue", "triangle", "white"),
    ("yellow", "circle", "purple"), ("purple", "square", "orange"), ("orange", "triangle", "black"),
    ("white", "circle", "green"), ("black", "square", "red"),
))


class StageFailed(RuntimeError):
    pass


class Demo:
    def __init__(self, output_dir: str, settings: Settings):
        if not settings.processes:
            settings = replace(settings, processes=default_processes())
        self.out, self.settings = os.path.abspath(output_dir), settings
        self.times: dict[str, float] = {}
        self.stage_index, self.stage_count = 0, 8 if settings.posthoc_ema else 7
        self.sampled = self.path("pipeline")  # what the samples and the evaluation read

    def path(self, *parts: str) -> str:
        return os.path.join(self.out, *parts)

    def run(self, name: str, description: str, command: list[str], capture: bool = False) -> str:
        """Run one stage's command; its progress bars go to the terminal. Returns stdout if captured."""
        self.stage_index += 1
        print(f"\n==> [{self.stage_index}/{self.stage_count}] {name}: {description}", flush=True)
        return self.command(name, command, capture)

    def command(self, name: str, command: list[str], capture: bool = False) -> str:
        """Run one of stage `name`'s commands, its time added to the stage's. Returns stdout if captured."""
        print("    $ " + " ".join(shown(c) for c in ["python", *command[1:]]), flush=True)
        start = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, text=True, stdout=subprocess.PIPE if capture else None)
        self.times[name] = round(self.times.get(name, 0.0) + time.perf_counter() - start, 1)
        if result.returncode != 0:
            raise StageFailed(f"stage {name!r} failed (exit {result.returncode}); its messages are above")
        return result.stdout or ""

    def summary(self, name: str, text: str) -> None:
        """The stage's one-line summary."""
        print(f"    {name} done in {self.times[name]:.1f} s: {text}", flush=True)

    def corpus(self) -> None:
        s = self.settings
        self.run("corpus", f"{s.records} captioned shapes at {s.resolution} px in the production shard format",
                 [sys.executable, "-m", "ldm.data", "synth", "--output_dir", self.path("corpus"), "--num_records",
                  str(s.records), "--resolution", str(s.resolution), "--records_per_shard", "2000", "--seed", "0"])
        shards = sum(1 for name in os.listdir(self.path("corpus")) if name.endswith(".gz"))
        self.summary("corpus", f"{s.records} records in {shards} shards, vocab in corpus/tokenizer")

    def trainer(self, script: str, name: str, n: int) -> list[str]:
        """`python SCRIPT`, under paddle.distributed.launch with `n` > 1 processes."""
        if n == 1:
            return [sys.executable, script]
        return [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(n),
                "--log_dir", self.path("launch_logs", name), script]

    @staticmethod
    def batches(steps: int, batch: int, n: int = 1) -> str:
        return f"{steps} updates of {batch}" + (f" ({batch // n} in each of {n} processes)" if n > 1 else "")

    def data_flags(self, batch: int, steps: int, lr: float, output: str, file_list: str) -> list[str]:
        """The flags both training stages share; `batch` is per process."""
        s = self.settings
        return ["--file_list", file_list, "--resolution", str(s.resolution),
                "--center_crop", "True", "--train_batch_size", str(batch), "--max_train_steps", str(steps),
                "--learning_rate", str(lr), "--lr_scheduler", "cosine", "--lr_warmup_steps", str(min(100, steps // 10)),
                "--logging_steps", str(max(1, min(50, steps // 4))), "--save_steps", str(steps),
                "--num_workers", str(s.num_workers), "--seed", str(s.seed), "--output_dir", output,
                "--overwrite_output_dir", "True"]

    def autoencoder(self) -> None:
        s = self.settings
        self.run("autoencoder", f"AutoencoderKL (x4, from the {s.model} preset) on the corpus, "
                 f"{self.batches(s.autoencoder_steps, s.autoencoder_batch, s.processes)}",
                 [*self.trainer("train_autoencoder.py", "autoencoder", s.processes), "--model_name_or_path", s.model,
                  "--adam_weight_decay", "0", "--scale_batches", "8",  # 64 images on 2 processes, as on 1
                  *self.data_flags(s.autoencoder_batch // s.processes, s.autoencoder_steps, s.autoencoder_lr,
                                   self.path("autoencoder"), self.path("corpus", "shapes.filelist.list"))])
        with open(self.path("autoencoder", "vqvae", "config.json")) as f:
            factor = json.load(f)["scaling_factor"]
        loss = last_scalar(self.path("autoencoder", "visualdl"), "train/reconstruction_l1")
        self.summary("autoencoder", f"reconstruction L1 {loss:.4f}, scaling_factor {factor:.4f}")

    def latents(self) -> None:
        """The corpus encoded once by the trained autoencoder: the LDM stage then never runs its encoder."""
        s = self.settings
        shutil.rmtree(self.path("latents"), ignore_errors=True)  # made by the previous run's autoencoder
        self.run("latents", f"the corpus encoded once by the trained autoencoder, in {s.processes} process(es)",
                 [*self.trainer("encode_latents.py", "latents", s.processes), "--file_list",
                  self.path("corpus", "shapes.filelist.list"), "--vae_name_or_path", self.path("autoencoder", "vqvae"),
                  "--output_dir", self.path("latents"), "--resolution", str(s.resolution), "--center_crop",
                  "--num_workers", "0", "--batch_size", "256"], capture=True)
        self.summary("latents", "latent shards in latents/ (python -m ldm.prepare encode)")

    def ldm(self) -> None:
        s = self.settings
        objective = s.prediction_type or OBJECTIVES[s.model]
        # min-SNR weighting (gamma 5) for epsilon and v; flow matching keeps its plain (unweighted) loss
        weighting = ["--snr_gamma", "5"] if objective != "flow_matching" else []
        # the profiles are averages beside the training: the trained weights are those of the run without them
        profiles = ["--ema_sigma_rels", s.ema_sigma_rels, "--ema_snapshot_steps",
                    str(s.ema_snapshot_steps)] if s.posthoc_ema else []
        self.run("ldm", f"the {s.model} LDM through train_txt2img_laion400m_no_trainer.py, "
                 f"{self.batches(s.ldm_steps, s.ldm_batch, s.processes)}, caption dropout {s.caption_dropout_prob}",
                 [*self.trainer("train_txt2img_laion400m_no_trainer.py", "ldm", s.processes),
                  "--model_name_or_path", s.model, "--prediction_type", objective,
                  "--vae_name_or_path", self.path("autoencoder", "vqvae"),
                  "--tokenizer_name", self.path("corpus", "tokenizer"), "--model_max_length", "16",
                  "--caption_dropout_prob", str(s.caption_dropout_prob), "--adam_weight_decay", "0.01",
                  *weighting, *profiles,
                  *self.data_flags(s.ldm_batch // s.processes, s.ldm_steps, s.ldm_lr, self.path("ldm"),
                                   self.path("latents", "latents.filelist.list"))])
        loss = last_scalar(self.path("ldm", "visualdl"), "train/loss")
        self.summary("ldm", f"final loss {loss:.4f}; checkpoints and pipeline in ldm/")

    def export(self) -> None:
        from ldm.checkpoint.run_folder import latest_checkpoint

        checkpoint = latest_checkpoint(self.path("ldm"))
        if self.settings.model != PRESET:
            # a diffusion transformer with LDMBert has no pipeline class in ppdiffusers or diffusers: the samples
            # and the evaluation read the checkpoint, as python -m ldm.generate does
            self.sampled = checkpoint
            self.stage_index += 1
            self.times["export"] = 0.0
            self.summary("export", f"none: {self.settings.model} (a transformer with LDMBert) has no pipeline class; "
                         f"sampling from {shown(checkpoint)}")
            return
        self.run("export", "the last checkpoint as an LDMTextToImagePipeline",
                 [sys.executable, "-m", "ldm.export", "--checkpoint", checkpoint, "--output", self.path("pipeline")])
        self.sampled = self.path("pipeline")
        self.summary("export", f"{shown(self.path('pipeline'))} (loads with LDMTextToImagePipeline.from_pretrained)")

    def samples(self) -> None:
        s = self.settings
        prompts = self.path("sample_prompts.txt")
        with open(prompts, "w") as f:
            f.write("\n".join(SAMPLE_PROMPTS) + "\n")
        folder = self.path("samples")
        shutil.rmtree(folder, ignore_errors=True)
        self.run("samples", f"{len(SAMPLE_PROMPTS)} prompts x {s.sample_seeds} seeds, guidance {s.guidance_scale}",
                 [sys.executable, "-m", "ldm.generate", "--model", self.sampled, "--prompts_file", prompts,
                  "--num_images_per_prompt", str(s.sample_seeds), "--guidance_scale", str(s.guidance_scale),
                  "--num_inference_steps", str(s.num_inference_steps), "--output_dir", folder])
        shutil.copyfile(os.path.join(folder, "grid.png"), self.path("samples.png"))
        self.summary("samples", "samples.png (a row per prompt, written at its left; a column per seed; 4x enlarged)")

    def evaluate(self) -> dict:
        from apps.eval import eval_prompts, misread_text

        s = self.settings
        result = json.loads(self.run(
            "evaluate", f"the shapes classifier on {s.eval_images_per_prompt} images for each of "
            f"{len(eval_prompts())} prompts "
            "(every colour, background and shape), on autoencoder reconstructions and on corpus images",
            [*self.shapes_command(self.sampled), "--reconstructions", self.path("reconstructions.png")],
            capture=True))
        g = result["generated"]
        misread = misread_text(g)
        self.summary("evaluate", f"object colour {g['object_colour']:.1%}, background {g['background']:.1%}, "
                     f"shape {g['shape']:.1%}" + (f" (misread: {misread})" if misread else ""))
        return result

    def shapes_command(self, model: str) -> list[str]:
        """The evaluate stage's `python -m apps.eval shapes` of `model`, printing JSON."""
        s = self.settings
        return [sys.executable, "-m", "apps.eval", "shapes", "--model", model, "--num_images_per_prompt",
                str(s.eval_images_per_prompt), "--guidance_scale", str(s.guidance_scale), "--num_inference_steps",
                str(s.num_inference_steps), "--reference_images", str(s.reference_images), "--json"]

    def posthoc_ema(self, evaluation: dict) -> dict:
        """Each swept width reconstructed from the LDM's snapshots (`python -m ldm.ema sweep`), scored by its
        held-out loss and by the evaluate stage's shapes classifier, beside the demo's own weights."""
        s = self.settings
        heldout, folder = self.path("heldout"), self.path("posthoc_ema")
        shutil.rmtree(folder, ignore_errors=True)  # a previous run's widths
        self.run("posthoc_ema", f"sigma_rel {s.sweep_sigma_rels} reconstructed from the snapshots of the "
                 f"{s.ema_sigma_rels} profiles; held-out loss on {s.heldout_records} records, and shapes",
                 [sys.executable, "-m", "ldm.prepare", "synth", "--output_dir", heldout, "--num_records",
                  str(s.heldout_records), "--resolution", str(s.resolution), "--records_per_shard",
                  str(s.heldout_records), "--seed", str(HELDOUT_SEED)], capture=True)
        loss_flags = ["--file_list", os.path.join(heldout, "shapes.filelist.list"), "--validation_samples",
                      str(s.heldout_records)]
        self.command("posthoc_ema", [sys.executable, "-m", "ldm.ema", "sweep", self.path("ldm"), "--sigma_rel",
                                     s.sweep_sigma_rels, "--metric", "heldout_loss", "--output", folder,
                                     "--keep_pipelines", "--", *loss_flags], capture=True)
        with open(os.path.join(folder, "sweep.json")) as f:
            sweep = json.load(f)
        own = json.loads(self.command("posthoc_ema", [sys.executable, "-m", "ldm.evaluate", "loss", "--model",
                                                      self.sampled, *loss_flags, "--json"], capture=True))
        rows = [{"weights": "last (the demo's)", "sigma_rel": None, "heldout_loss": own["loss"],
                 **shape_scores(evaluation["generated"])}]
        for row in sweep["results"]:
            pipeline = os.path.join(folder, f"sigma_rel-{row['sigma_rel']:g}", "pipeline")
            scored = json.loads(self.command("posthoc_ema", self.shapes_command(pipeline), capture=True))
            rows.append({"weights": f"post-hoc EMA {row['sigma_rel']:g}", "sigma_rel": row["sigma_rel"],
                         "heldout_loss": row["heldout_loss"], **shape_scores(scored["generated"])})
            shutil.rmtree(os.path.dirname(pipeline))
        plot_sweep(self.path("posthoc_ema.png"), rows, sweep["step"])
        best = min(rows[1:], key=lambda row: row["heldout_loss"])
        self.summary("posthoc_ema", f"held-out loss: last weights {own['loss']:.5f}, best sigma_rel "
                     f"{best['sigma_rel']:g} {best['heldout_loss']:.5f} (shape {best['shape']:.1%}); posthoc_ema.png")
        return {"step": sweep["step"], "tracked": s.ema_sigma_rels, "snapshot_steps": s.ema_snapshot_steps,
                "heldout_records": s.heldout_records, "rows": rows}


def default_processes() -> int:
    """Training processes for the demo: one per core up to two on a CPU, one on a GPU.

    Paddle runs a process's CPU kernels on one core (two processes of the demo's UNet step each
    keep their one-process speed), so a second process on a second core adds images per second
    (less than twice as many in the demo's LDM loop, where the ranks also wait for each other's
    gradients over gloo; docs/demo.md), as a second card would.
    """
    import paddle

    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        return 1
    return max(1, min(2, os.cpu_count() or 1))


def shown(path: str) -> str:
    """A path as the user would type it: relative to the project when inside it."""
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def last_scalar(logdir: str, tag: str) -> float:
    steps, values = read_scalars(logdir, tag)
    return values[-1] if values else float("nan")


def shape_scores(generated: dict) -> dict:
    """The classifier's accuracies of one model's generated images, and its shape misreads in words."""
    from apps.eval import misread_text

    return {key: generated[key] for key in ("object_colour", "background", "shape")} | {
        "misread": misread_text(generated)}


def sweep_table(rows: list[dict]) -> str:
    """The sweep's rows as a Markdown table (docs/demo.md has one)."""
    return "\n".join(["| weights | held-out loss | object colour | background | shape | misread |",
                      "|---|---|---|---|---|---|",
                      *(f"| {row['weights']} | {row['heldout_loss']:.5f} | {row['object_colour']:.1%} | "
                        f"{row['background']:.1%} | {row['shape']:.1%} | {row['misread'] or '-'} |" for row in rows)])


def plot_sweep(out: str, rows: list[dict], step: int) -> None:
    """posthoc_ema.png: held-out loss and shape accuracy against sigma_rel, the demo's last weights as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    own, swept = rows[0], rows[1:]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, key, label in ((axes[0], "heldout_loss", "held-out loss"), (axes[1], "shape", "shape accuracy")):
        ax.plot([row["sigma_rel"] for row in swept], [row[key] for row in swept], marker="o",
                label="post-hoc EMA")
        ax.axhline(own[key], color="grey", linestyle="--", label="last weights (the demo's)")
        ax.set_xlabel("sigma_rel")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"the demo's LDM at update {step}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def plot_losses(out: str, runs: dict[str, tuple[str, str]]) -> None:
    """loss.png: one panel per run, drawn from its VisualDL log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6))
    for ax, (title, (logdir, tag)) in zip(axes, runs.items(), strict=True):
        steps, values = read_scalars(logdir, tag)
        ax.plot(steps, values, marker="." if len(steps) < 20 else None)
        ax.set_title(title)
        ax.set_xlabel("optimizer update")
        ax.set_ylabel(tag)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="bash scripts/demo.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=os.path.join(ROOT, "outputs", "demo"))
    parser.add_argument("--quick", action="store_true", default=os.environ.get("LDM_DEMO_QUICK") == "1",
                        help="a few steps per stage, for tests (also: LDM_DEMO_QUICK=1)")
    parser.add_argument("--processes", type=int, default=0,
                        help="training processes (default: 2 on a CPU with 2+ cores, 1 on a GPU); the batch "
                             "sizes are global: it changes the speed, not the recipe")
    parser.add_argument("--seed", type=int, default=0, help="seed of the autoencoder and LDM training runs")
    parser.add_argument("--model", choices=tuple(OBJECTIVES), default=PRESET,
                        help="the LDM: a small UNet (default) or a small diffusion transformer (dit-demo)")
    parser.add_argument("--prediction_type", choices=("epsilon", "v_prediction", "flow_matching"), default="",
                        help="the LDM's objective (default: the model's: epsilon for ldm-demo, flow matching for "
                             "dit-demo)")
    parser.add_argument("--posthoc_ema", action="store_true",
                        help="also track post-hoc EMA profiles in the LDM stage and sweep their width after the "
                             "evaluation: held-out loss and shapes for each (docs/demo.md)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else replace(FULL, ldm_steps=LDM_STEPS.get(args.model, FULL.ldm_steps))
    if args.processes < 0 or args.processes and (settings.ldm_batch % args.processes
                                                  or settings.autoencoder_batch % args.processes):
        parser.error(f"--processes {args.processes}: must divide the batch sizes {settings.autoencoder_batch} "
                     f"(autoencoder) and {settings.ldm_batch} (LDM)")
    if args.posthoc_ema and args.model != PRESET:
        parser.error(f"--posthoc_ema: the sweep writes pipeline folders, and {args.model} (a transformer with "
                     "LDMBert) has no pipeline class")
    demo = Demo(args.output_dir, replace(settings, processes=args.processes, seed=args.seed, model=args.model,
                                        prediction_type=args.prediction_type, posthoc_ema=args.posthoc_ema))
    os.makedirs(demo.out, exist_ok=True)
    start = time.perf_counter()
    try:
        demo.corpus()
        demo.autoencoder()
        demo.latents()
        demo.ldm()
        demo.export()
        demo.samples()
        evaluation = demo.evaluate()
        if args.posthoc_ema:
            evaluation["posthoc_ema"] = demo.posthoc_ema(evaluation)
    except StageFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    plot_losses(demo.path("loss.png"), {
        "autoencoder (L1 reconstruction)": (demo.path("autoencoder", "visualdl"), "train/reconstruction_l1"),
        "LDM (training loss)": (demo.path("ldm", "visualdl"), "train/loss"),
    })
    total = round(time.perf_counter() - start, 1)
    report = {"quick": args.quick, "settings": asdict(demo.settings), "stage_seconds": demo.times,
              "total_seconds": total, **evaluation,
              "files": {name: demo.path(name) for name in ("pipeline", "samples.png", "reconstructions.png",
                                                           "loss.png", "report.json", "posthoc_ema.png")
                        if (name != "pipeline" or demo.sampled == demo.path("pipeline"))
                        and (name != "posthoc_ema.png" or args.posthoc_ema)}}
    with open(demo.path("report.json"), "w") as f:
        json.dump(report, f, indent=2)
    generated, recon = evaluation["generated"], evaluation["autoencoder"]["reconstructions"]
    reference = evaluation["classifier_on_corpus"]
    print(f"\n==> demo finished in {total:.0f} s ({', '.join(f'{k} {v:.0f}s' for k, v in demo.times.items())})")
    print(f"    generated, guidance {demo.settings.guidance_scale}: object colour {generated['object_colour']:.1%}, "
          f"background {generated['background']:.1%}, shape {generated['shape']:.1%} "
          f"({generated['images']} images, {evaluation['prompts']} prompts)")
    print(f"    autoencoder reconstructions: object colour {recon['object_colour']:.1%}, background "
          f"{recon['background']:.1%}, shape {recon['shape']:.1%}")
    print(f"    classifier on real corpus images: {reference['all_three']:.1%} of {reference['images']}")
    if args.posthoc_ema:
        print(sweep_table(evaluation["posthoc_ema"]["rows"]))
    for name in ("samples.png", "reconstructions.png", "loss.png", "report.json", "pipeline",
                 *(("posthoc_ema.png",) if args.posthoc_ema else ())):
        print(f"    {demo.path(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
