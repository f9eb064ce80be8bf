import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the common umask, whatever the machine's: the tests of the modes of what is written then tell 0600 from 0644
# (the runs forked for the tests inherit it from this process)
os.umask(0o022)
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory):
    """A local WordPiece vocabulary, so tokenization works offline."""
    from ldm.data.tokenize import write_vocab

    folder = tmp_path_factory.mktemp("tokenizer")
    words = ["a", "an", "the", "photo", "of", "image", "red", "green", "blue", "circle", "square", "on", "background"]
    write_vocab(words, str(folder))
    return str(folder)


def loader_leftovers() -> list[str]:
    """Data loader threads and worker processes alive in this process."""
    import multiprocessing
    import threading

    threads = [t.name for t in threading.enumerate() if "_thread_loop" in t.name or t.name == "ldm-data-watchdog"]
    return threads + [f"process {p.pid} ({p.name})" for p in multiprocessing.active_children()]


@pytest.fixture(autouse=True)
def no_loader_left_behind():
    """Fail a test that leaves loader threads or workers behind: a later loader forks its workers while
    they run, and a worker that inherits a lock one of them held hangs (seen in this suite)."""
    import time

    before = set(loader_leftovers())
    yield
    deadline = time.monotonic() + 10  # worker processes take a moment to exit after the loader stops
    while (left := set(loader_leftovers()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"the test left data loader threads or processes running: {sorted(left)}"


@pytest.fixture(scope="session")
def img2dataset_corpus(tmp_path_factory):
    """The img2dataset corpus of tests/img2dataset_corpus.py (tars and parquets), downloaded once per run of the
    suite: the first pytest-xdist worker that needs it builds it under a file lock in the run's temporary folder,
    the others read it there (the tests only read it; each worker built its own before, 15-20 s each)."""
    import pickle

    from filelock import FileLock
    from img2dataset_corpus import build

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's, above each worker's own folder
    made = shared / "img2dataset.pkl"
    with FileLock(str(shared / "img2dataset.lock")):
        if made.is_file():
            return pickle.loads(made.read_bytes())
        folder = shared / f"img2dataset-{os.getpid()}"  # a worker whose build failed leaves its own folder
        folder.mkdir()
        paths = build(folder)
        made.write_bytes(pickle.dumps(paths))
    return paths


def metrics_lines(folder) -> list[dict]:
    """The training and evaluation records of a run's metrics.jsonl; each save's own record (`checkpoint/*`) is
    left out."""
    import json

    lines = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if not any(key.startswith("checkpoint/") for key in line)]


def pytest_collection_modifyitems(items):
    """The modules with the most long tests (marked slow or distributed) first, each kept whole so its module
    fixtures are set up once: pytest-xdist's workers start on the long tests and the short ones fill the end,
    rather than one long test running alone while the other workers wait (alphabetical order put the soak last)."""
    from collections import Counter

    weight = Counter()
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("distributed"):
            weight[item.module.__name__] += 1
        timeout = item.get_closest_marker("timeout")
        if timeout is not None and timeout.args:  # a test given more than the suite's 300 s is among the longest:
            weight[item.module.__name__] += timeout.args[0] / 100  # started late, it ran alone at the end (the demo)
    items.sort(key=lambda item: -weight[item.module.__name__])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With LDM_TEST_CPU_LOG=FILE: each test's CPU-seconds (this process and the children it waited for: training
    subprocesses, launched ranks) and wall seconds, one JSON line a test, to find what the suite spends its CPU on
    (docs/benchmarks.md). Forked ranks of the preloaded server count where that server reaps them."""
    log = os.environ.get("LDM_TEST_CPU_LOG")
    if not log:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
        from multiprocessing import forkserver

        server = getattr(forkserver._forkserver, "_forkserver_pid", None)  # the fork server reaps its forks
        try:
            with open(f"/proc/{server}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
        except (OSError, TypeError, ValueError):
            pass
        return total

    start_cpu, start = cpu(), time.monotonic()
    yield
    with open(log, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu": round(cpu() - start_cpu, 2),
                            "wall": round(time.monotonic() - start, 2)}) + "\n")
