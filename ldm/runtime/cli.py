"""The parser every command of the project shares (`python -m ldm.prepare`, `ldm.generate`, `apps.eval`, the
benchmarks), and the one-line answer to an unknown flag that the entry points' parsers give too."""

from __future__ import annotations

import argparse
import sys

from ldm.runtime.home import writable_caches_or_exit

# A setting both entry points have, under the other path's name: the Trainer path takes PaddleNLP's.
OTHER_PATH_NAMES = {
    "--per_device_train_batch_size": "--train_batch_size", "--max_steps": "--max_train_steps",
    "--dataloader_num_workers": "--num_workers", "--lr_scheduler_type": "--lr_scheduler",
    "--warmup_steps": "--lr_warmup_steps", "--save_total_limit": "--checkpoints_total_limit",
    "--fp16": "--mixed_precision fp16", "--bf16": "--mixed_precision bf16", "--logging_dir": "--output_dir",
}
OTHER_PATH_NAMES.update({new: old for old, new in OTHER_PATH_NAMES.items() if " " not in new})



def unknown_flags_message(unknown: list[str], known: list[str]) -> str:
    """One line naming each unknown flag with the closest known one ("did you mean --train_batch_size?")."""
    import difflib

    parts = []
    for flag in dict.fromkeys(a.split("=")[0] for a in unknown if a.startswith("--")):
        other = OTHER_PATH_NAMES.get(flag)
        guess = other if other and other.split()[0] in known else next(
            iter(difflib.get_close_matches(flag, known, n=1, cutoff=0.6)), None)
        parts.append(f"{flag} (did you mean {guess}?)" if guess else flag)
    stray = [a for a in unknown if not a.startswith("--")]
    if not parts:
        return f"unexpected argument(s) {' '.join(stray)}: every value follows its --flag"
    return f"unknown flag(s) for this entry point: {', '.join(parts)}; see --help"


class ToolParser(argparse.ArgumentParser):
    """argparse for the tools (`python -m ldm.prepare`, `ldm.generate`, `apps.eval`, …): whole flag names only
    (argparse would take any unambiguous prefix, so a typo could silently set another flag), and an
    unknown flag named with the closest flag of that command."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        writable_caches_or_exit()  # before the tool's first import of Paddle, which a read-only HOME fails
        args = sys.argv[1:] if args is None else [str(a) for a in args]
        # before argparse: its "required: --file_list" would otherwise hide the typo that caused it
        known = self._flags_of(args)
        unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in known]
        if not unknown:
            parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.exit(2, f"{self.prog}: error: {unknown_flags_message(unknown, known)}\n")
        return parsed

    def _flags_of(self, args: list[str]) -> list[str]:
        """The flags of this parser and of the subcommand named in `args`."""
        flags = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):  # argparse's only handle on its subcommands
                chosen = next((action.choices[a] for a in args if a in action.choices), None)
                if chosen is not None:
                    flags += [o for a in chosen._actions for o in a.option_strings if o.startswith("--")]
        return flags
