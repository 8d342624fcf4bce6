"""timm's own model tests (tests/test_models.py of pytorch-image-models) pass on every model
revnets registers with timm, TorchScript's aside, run by benchmarks/timm_model_tests.py.

timm's test file is not part of this repository: TIMM_TEST_MODELS names it, a timm checkout or
timm's source distribution, which PyPI serves with its tests (see the script's docstring)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
def test_timm_model_tests_pass_on_every_registered_model():
    source = os.environ.get("TIMM_TEST_MODELS")
    if not source:
        pytest.skip(
            "TIMM_TEST_MODELS is not set: point it at timm's tests/test_models.py, a timm "
            "checkout or timm's sdist (pip download timm==<installed version> --no-binary "
            ":all: --no-deps)"
        )
    done = subprocess.run(
        [sys.executable, "timm_model_tests.py", source],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = re.fullmatch(r"timm_model_tests: (\d+) passed, (\d+) failed, (\d+) skipped", summary)
    assert counts, done.stdout[-3000:] + done.stderr[-3000:]
    passed, failed, skipped = map(int, counts.groups())
    assert done.returncode == 0 and failed == 0 and skipped == 0, done.stdout[-10000:]
    # Six tests a model in timm 1.0.31's file and at aa4b5850: forward, backward, default_cfgs,
    # features_only, torch.fx forward and backward.
    models = int(re.search(r"(\d+) revnets models", done.stdout)[1])
    assert passed >= 6 * models
