"""The package's shape: no import cycle in `ldm/`, between modules or between packages; the packages stand in one
order, each using only those below it; the top of `ldm/` holds only the commands users call; the run folder is
filesystem policy only; and `import ldm` changes nothing in the process.

Every import counts, at the top of a module or inside a function: a cycle through a deferred import is
still a cycle a reader has to hold in their head.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "ldm")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def modules() -> dict[str, str]:
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[module_name(path)] = path
    return found


def imports_of(path: str, name: str, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports (`from ldm.a import b` counts as ldm.a.b where that is a module)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target != "ldm":
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, name, set(found)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def test_cycle_detection_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph()) == []


# bottom to top: each package may import only those before it (the order of the README's map)
LAYERS = ["runtime", "models", "checkpoint", "data", "prepare", "config", "inference", "evaluation", "train"]
# `python -m ldm.X`: may use every package
COMMANDS = {"ldm.ema", "ldm.evaluate", "ldm.export", "ldm.generate", "ldm.launch", "ldm.plot"}


def package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def test_packages_depend_on_each_other_one_way_in_the_documented_order():
    graph = import_graph()
    packages = {package_of(m) for m in graph if m.count(".") >= 2 or m.endswith("__init__")}
    assert set(LAYERS) <= packages, packages
    upward = sorted((m, t) for m, targets in graph.items() for t in targets
                    if m not in COMMANDS and package_of(m) != package_of(t)
                    and package_of(m) in LAYERS and (package_of(t) not in LAYERS
                                                     or LAYERS.index(package_of(t)) > LAYERS.index(package_of(m))))
    assert upward == []
    # `python -m ldm.data` included: it runs `ldm.prepare` by name, not by an import
    package_graph = {p: {package_of(t) for m, ts in graph.items() if package_of(m) == p
                         for t in ts if package_of(t) != p} for p in LAYERS}
    assert cycles(package_graph) == []


def test_the_top_of_the_package_holds_only_commands():
    top = {name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py")} - {"__init__", "__main__"}
    # a command made of parts is a package that `python -m` runs (`ldm/launch/__main__.py`), beside the layers
    top |= {name for name in os.listdir(PACKAGE)
            if name not in LAYERS and os.path.isfile(os.path.join(PACKAGE, name, "__main__.py"))}
    assert {f"ldm.{name}" for name in top} == COMMANDS
    assert len(top) <= 6
    for name in LAYERS:  # every package says what it owns and what it may use
        with open(os.path.join(PACKAGE, name, "__init__.py")) as f:
            doc = ast.get_docstring(ast.parse(f.read()))
        assert doc and ("May use" in doc or "imports nothing of `ldm`" in doc or "may use every" in doc), name


def test_run_folder_is_filesystem_policy_only():
    assert import_graph()["ldm.checkpoint.run_folder"] == {"ldm.checkpoint.lock", "ldm.runtime.errors",
                                                           "ldm.runtime.files"}
    assert import_graph()["ldm.checkpoint.lock"] == {"ldm.runtime.errors"}


def test_import_ldm_leaves_the_environment_alone():
    """The CPU tuning is the entry points' explicit start-up (`ldm.runtime.device.use_fast_cpu_kernels`), not an
    import side effect."""
    # the libraries first: OpenCV sets LD_LIBRARY_PATH when imported, which is not ldm's doing
    code = ("import os, sys, cv2, paddle, paddlenlp, ppdiffusers; before = dict(os.environ); "
            "import ldm, ldm.data.dataset, ldm.config.args, ldm.train.loop; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
            "import paddle.nn.functional as F; conv = F.conv2d; import ldm.models.build, ldm.inference.load; "
            "assert F.conv2d is conv")
    env = {k: v for k, v in os.environ.items() if k != "MKL_DEBUG_CPU_TYPE"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=120)


@pytest.mark.parametrize("module", ["ldm.evaluate", "ldm.export", "ldm.generate", "ldm.plot", "ldm.data"])
def test_a_commands_help_is_printed_without_importing_paddle(module):
    """--help is read in a second, not after the seconds of Paddle's import."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['{module}', '--help']\n"
            "try:\n"
            f"    runpy.run_module('{module}', run_name='__main__', alter_sys=True)\n"
            "except SystemExit:\n"
            "    pass\n"
            "assert 'paddle' not in sys.modules, sorted(m for m in sys.modules if m.startswith('paddle'))[:5]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_the_data_library_stands_on_the_runtime_alone():
    """The data path imports nothing of the model side: the corpus tools that do (encoding latents, reading a
    checkpoint's data position) live above it, in `ldm.prepare`."""
    graph = import_graph()
    outside = sorted((m, t) for m, targets in graph.items() for t in targets
                     if package_of(m) == "data" and not m.endswith(".__main__")
                     and package_of(t) not in ("data", "runtime") and t != "ldm.models.buckets")
    assert outside == []


def ldm_names(path: str) -> set[str]:
    """The `ldm` names a module imports (`from ldm.a import b, c`: b and c; `import ldm.a`: ldm.a), anywhere in it."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ldm"):
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("ldm")}
    return names


def longest_function(path: str) -> tuple[int, str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return max((node.end_lineno - node.lineno + 1, node.name) for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))


def test_the_two_drivers_share_one_run_lifecycle_instead_of_copying_it():
    """The hand-written loop and the Trainer path each wire a handful of building blocks; the run's life (set-up,
    the update's vote, logging, saves, stops, teardown) is `ldm.train.run`'s, not theirs twice."""
    loop, trainer = (ldm_names(os.path.join(PACKAGE, "train", f"{name}.py")) for name in ("loop", "trainer"))
    assert len(loop) <= 20 and len(trainer) <= 20, (sorted(loop), sorted(trainer))
    assert len(loop & trainer) <= 6, sorted(loop & trainer)
    assert "ldm.train.run.TrainingRun" in loop & trainer
    lines, name = longest_function(os.path.join(PACKAGE, "train", "loop.py"))
    assert lines <= 80, f"{name} is {lines} lines"


def test_the_checkpoint_package_owns_saving_and_resuming():
    """The checkpoint manager (parts, per-rank layout, background writes, sealing, loading) and the resume view live
    below training; training only says when to save and what the run state is made of."""
    defined = {}
    for module, path in modules().items():
        with open(path) as f:
            for node in ast.parse(f.read(), path).body:
                if isinstance(node, ast.ClassDef):
                    defined[node.name] = module
    assert defined["CheckpointManager"] == "ldm.checkpoint.manager"
    assert defined["Resume"] == "ldm.checkpoint.resume"
    assert defined["UpdateVote"] == "ldm.runtime.vote"  # neither the guard's nor the manager's
    # the checkpoint is read once, by the resume view: no module of training reads a checkpoint's files itself
    readers = sorted(m for m, path in modules().items() if package_of(m) == "train" for name in ldm_names(path)
                     if name in ("ldm.checkpoint.format.read_training_state", "ldm.checkpoint.format.read_model_record",
                                 "ldm.checkpoint.format.recorded_autoencoder",
                                 "ldm.checkpoint.format.recorded_autoencoder_folder"))
    assert readers == []


# What names a model family outside `ldm/models`: the families every version had (their names, their parts'
# classes, their pipelines), and whatever the registry and the text encoders define now (`family_words`)
KNOWN_FAMILY_WORDS = {"ldm", "sd", "unet", "pixart", "sd3", "ldmbert", "clip", "t5", "UNet2DConditionModel",
                      "Transformer2DModel", "PixArtTransformer2DModel", "SD3Transformer2DModel", "LDMBertModel",
                      "LDMBertConfig", "CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel",
                      "TextEncoderSet", "LDMTextToImagePipeline", "StableDiffusionPipeline", "PixArtAlphaPipeline",
                      "StableDiffusion3Pipeline", "UNET", "PIXART", "SD3", "LDM", "SD", "LDMBERT", "CLIP", "T5",
                      "SD3_TEXT", "sdxl", "SDXL", "SDXL_TEXT", "StableDiffusionXLPipeline", "SD3TextEncoders",
                      "SDXLTextEncoders"}
# attributes only some families' parts have: asking for one asks which family it is
FAMILY_ATTRIBUTES = {"text_projection", "states_length", "encoders", "tokenizers", "caption_projection", "adaln_single",
                     "time_text_embed", "to_logits", "add_embedding", "encoder_parts", "force_zeros_for_empty_prompt"}
FAMILY_CLASS_FIELDS = {"name", "backbone_class", "config_names", "pipeline_class"}


def family_words() -> set[str]:
    """The names, classes and pipelines of the families `ldm/models` defines (their modules' `ModelFamily` fields and
    instances, the text encoders' `TextFamily` instances), and `KNOWN_FAMILY_WORDS`."""
    words = set(KNOWN_FAMILY_WORDS)
    models = os.path.join(PACKAGE, "models")
    paths = [os.path.join(models, "text.py")] + [os.path.join(folder, name) for folder, _, names in
                                                 os.walk(os.path.join(models, "families")) for name in names
                                                 if name.endswith(".py")]
    for path in filter(os.path.isfile, paths):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id in FAMILY_CLASS_FIELDS
                                                            for t in item.targets):
                        words |= {c.value for c in ast.walk(item.value)
                                  if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        for node in tree.body:  # LDM = LDMFamily(), CLIP = TextFamily("clip", ...)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and getattr(
                    node.value.func, "id", "").endswith("Family"):
                words |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                if node.value.args and isinstance(node.value.args[0], ast.Constant):
                    words.add(node.value.args[0].value)
    return words


def terminal_name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def family_branches(path: str, words: set[str]) -> list[str]:
    """Where a module asks which family a model is: a comparison with a family's name, instance, class or pipeline,
    an isinstance check or an import of a family's class or instance, a probe of an attribute only some families'
    parts have, a family's class named (a shim of its library's class)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []

    def named(node, by_name: bool = False) -> bool:
        """`node` names a family: an instance or a class (capitalised), or a family's name where `by_name` (a
        lower-case word, "clip", is also the CLIP score's model)."""
        values = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
        return any((isinstance(v, ast.Constant) and v.value in words and (by_name or not v.value.islower()))
                   or (terminal_name(v) in words and not terminal_name(v).islower()) for v in values)

    def asks_name(node) -> bool:
        text = ast.unparse(node)
        return "family" in text or text.endswith(("name", "_class_name", "__name__"))

    for node in ast.walk(tree):
        where = f"{os.path.relpath(path, ROOT)}:{getattr(node, 'lineno', 0)}"
        operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
        if any(named(o, any(asks_name(other) for other in operands if other is not o)) for o in operands):
            found.append(f"{where} compares with a family: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (hits := [a.name for a in node.names if a.name in words]):
            found.append(f"{where} imports {', '.join(hits)} from {node.module}")
        elif isinstance(node, ast.Call) and terminal_name(node.func) in ("isinstance", "issubclass") and len(
                node.args) == 2 and named(node.args[1]):
            found.append(f"{where} checks a family's class: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and terminal_name(node.func) in ("hasattr", "getattr") and len(
                node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in FAMILY_ATTRIBUTES:
            found.append(f"{where} probes a family's part: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in (
                "ppdiffusers", "paddlenlp") and node.attr in words:
            found.append(f"{where} uses a family's class: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and node.value in words and not str(node.value).islower():
            found.append(f"{where} names a family's class: {node.value!r}")
    return found


def test_the_family_scan_finds_each_kind_of_branch(tmp_path):
    path = tmp_path / "module.py"
    path.write_text("from ldm.models.text import LDMBERT\nfrom ppdiffusers import UNet2DConditionModel\n"
                    "a = family.name == 'sd3'\nb = family is LDMBERT\nc = name in ('t5', 'x')\n"
                    "d = isinstance(m, UNet2DConditionModel)\ne = hasattr(m, 'text_projection')\n"
                    "f = ppdiffusers.PixArtAlphaPipeline\ng = family.name == 'other'\n"
                    "h = getattr(module, 'SD3Transformer2DModel')\n")
    found = family_branches(str(path), family_words())
    assert [int(line.split()[0].rsplit(":", 1)[1]) for line in found] == [1, 2, 3, 4, 5, 6, 7, 8, 10], found


def test_no_family_branch_stands_outside_the_models_package():
    """A model family is one object in `ldm/models` (`ldm.models.families`): everything else asks it what to do,
    and never which family a model is, so that adding a family touches its module and the registry."""
    words = family_words()
    found = [line for module, path in sorted(modules().items()) if package_of(module) != "models"
             for line in family_branches(path, words)]
    assert found == [], "\n".join(found)
