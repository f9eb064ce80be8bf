"""The package's shape: no import cycle in `ldm/`, the data layer never reaches up into training, the run
folder is filesystem policy only, and `import ldm` changes nothing in the process.

Every import counts, at the top of a module or inside a function: a cycle through a deferred import is
still a cycle a reader has to hold in their head.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

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


def test_data_layer_does_not_import_training():
    graph = import_graph()
    upward = sorted((m, t) for m, targets in graph.items() if m.startswith("ldm.data")
                    for t in targets if t.startswith("ldm.train"))
    assert upward == []


def test_run_folder_is_filesystem_policy_only():
    assert import_graph()["ldm.run_folder"] == set()


def test_import_ldm_leaves_the_environment_alone():
    """The CPU tuning is the entry points' explicit start-up (`ldm.runtime.tune_process`), not an import side effect."""
    # the libraries first: OpenCV sets LD_LIBRARY_PATH when imported, which is not ldm's doing
    code = ("import os, sys, cv2, paddle, paddlenlp, ppdiffusers; before = dict(os.environ); "
            "import ldm, ldm.data.dataset, ldm.args, ldm.train.loop; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
            "import paddle.nn.functional as F; conv = F.conv2d; import ldm.models.build, ldm.inference; "
            "assert F.conv2d is conv")
    env = {k: v for k, v in os.environ.items() if k != "MKL_DEBUG_CPU_TYPE"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=120)
