"""timm's own model tests (tests/test_models.py of pytorch-image-models) on every model revnets
registers with timm.

timm's test file is not copied into this repository and nothing is downloaded here: give the file,
a timm checkout, or timm's source distribution from PyPI (it ships tests/test_models.py):

    pip download "timm==$(python -c 'import timm; print(timm.__version__)')" \\
        --no-binary :all: --no-deps -d /tmp/timm-sdist
    python benchmarks/timm_model_tests.py /tmp/timm-sdist/timm-*.tar.gz

(or set TIMM_TEST_MODELS to the path). Every test of that file parametrized by ``model_name`` runs
on revnets' models, and on them only; timm's own filters decide which tests a model gets, as they
do for timm's models. The TorchScript tests are deselected: TorchScript is deprecated upstream,
and it cannot compile a Python autograd Function such as the reversible engine's. The last line
counts the outcomes (``timm_model_tests: N passed, N failed, N skipped``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import timm
from timm.models import model_entrypoint

import revnets.models  # noqa: F401  (registers the zoo with timm before timm's test module lists it)

ENV_VAR = "TIMM_TEST_MODELS"
# The markers timm's pyproject.toml declares (and pytest-timeout's), so that pytest knows them here.
TIMM_MARKERS = (
    "base", "forward", "backward", "cfg", "cfg_nonstd", "torchscript", "features", "fxforward",
    "fxbackward", "timeout(seconds): pytest-timeout's limit (enforced only if it is installed)",
)


def revnets_models() -> list[str]:
    """The model names whose timm entry points live in revnets."""
    return sorted(
        name for name in timm.list_models()
        if model_entrypoint(name).__module__.startswith("revnets.")
    )


def locate(source: str | os.PathLike[str], workdir: Path) -> Path:
    """timm's tests/test_models.py from the file itself, a timm checkout or timm's sdist."""
    path = Path(source)
    if path.is_dir():
        for candidate in (path / "tests" / "test_models.py", path / "test_models.py"):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"no tests/test_models.py under {path}")
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(path) as sdist:
            members = [m for m in sdist.getmembers() if m.name.endswith("/tests/test_models.py")]
            if not members:
                raise FileNotFoundError(f"{path} holds no tests/test_models.py")
            target = workdir / "sdist" / "test_models.py"
            target.parent.mkdir(parents=True)
            target.write_bytes(sdist.extractfile(members[0]).read())
            return target
    if path.is_file():
        return path
    raise FileNotFoundError(f"{path}: no such file or directory")


class RevnetsOnly:
    """A pytest plugin: keeps the tests timm parametrizes by one of ``models`` (TorchScript
    tests aside) and counts their outcomes."""

    def __init__(self, models: list[str]) -> None:
        self.models = set(models)
        self.outcomes: dict[str, str] = {}
        self.torchscript = 0

    def pytest_configure(self, config: pytest.Config) -> None:
        for marker in TIMM_MARKERS:
            config.addinivalue_line("markers", marker)

    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        keep, drop = [], []
        for item in items:
            callspec = getattr(item, "callspec", None)
            model = callspec.params.get("model_name", "") if callspec else ""
            if model.split(".")[0] not in self.models:  # some tests list "arch.tag" names
                drop.append(item)
            elif "torchscript" in item.name:
                self.torchscript += 1
                drop.append(item)
            else:
                keep.append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            # A failed teardown after a passed call still fails the case.
            if self.outcomes.get(report.nodeid) not in ("failed",):
                self.outcomes[report.nodeid] = report.outcome

    def summary(self) -> Counter[str]:
        return Counter(self.outcomes.values())


def run(test_file: Path, models: list[str], pytest_args: list[str]) -> tuple[int, RevnetsOnly]:
    """Run timm's test file from a fresh folder (no conftest or ini of timm's or ours applies)."""
    plugin = RevnetsOnly(models)
    with tempfile.TemporaryDirectory() as tmp:
        here = Path(tmp)
        shutil.copy(test_file, here / "test_models.py")
        (here / "pytest.ini").write_text("[pytest]\n")
        code = pytest.main(
            [str(here / "test_models.py"), "--rootdir", tmp, "-p", "no:cacheprovider", "-q",
             "-rfEs", "-W", "ignore::pytest.PytestAssertRewriteWarning", *pytest_args],
            plugins=[plugin],
        )
    return int(code), plugin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "source", nargs="?", default=os.environ.get(ENV_VAR),
        help=f"timm's test_models.py, a timm checkout or timm's sdist (default: ${ENV_VAR})",
    )
    parser.add_argument("--models", nargs="+", help="a subset of revnets' registered models")
    parser.epilog = "Arguments after -- go to pytest (e.g. -- -k forward -x)."
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    pytest_args = argv[split + 1:]
    if not args.source:
        parser.error(f"give timm's test_models.py (or a timm sdist or checkout), or set {ENV_VAR}")
    models = revnets_models()
    if args.models:
        unknown = sorted(set(args.models) - set(models))
        if unknown:
            parser.error(f"not revnets models: {', '.join(unknown)} (known: {', '.join(models)})")
        models = args.models
    with tempfile.TemporaryDirectory() as tmp:
        test_file = locate(args.source, Path(tmp))
        print(f"timm {timm.__version__}, {test_file}: {len(models)} revnets models")
        code, plugin = run(test_file, models, pytest_args)
    counts = plugin.summary()
    print(f"TorchScript tests deselected: {plugin.torchscript}")
    print(f"timm_model_tests: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped")
    return code


if __name__ == "__main__":
    sys.exit(main())
