"""The chaos soak (`scripts/soak.py`), short: a run through random faults on changing layouts, every guarantee
checked over the whole history."""

import re
import sys

import pytest
from conftest import ROOT
from entry import run_python


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)  # its segments start real interpreters: the suite's 300 s is too short on a loaded runner
def test_a_short_soak_finds_no_violation(tmp_path):
    # the graceful check (bit-identical weights after SIGTERMs) is left to the long soak: the SIGTERM resume
    # tests check it in the suite
    # a count of segments, not minutes: a busy machine fits fewer in a minute (no test asserts how much work fits
    # in a time budget)
    result = run_python([str(ROOT / "scripts" / "soak.py"), "--segments", "2", "--seed", "5", "--max_runs", "1",
                         "--paths", "loop", "--run_updates", "12", "16",
                         "--no_graceful", "--clean", "0", "--damage", "0.5", "--nan", "0.5",
                         "--work_dir", str(tmp_path / "soak")], timeout=900)
    print(result.stdout[-4000:], file=sys.stderr)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"soak: (\d+) segments, (\d+) faults, (\d+) records audited, 0 violations", last)
    assert match, last
    segments, faults, records = map(int, match.groups())
    assert segments == 2 and faults >= 1 and records > 0
