"""The README's and the docs' examples run as written: every Python block, and every command of
every ```bash block, typed exactly as a reader would type it (or the reason it is not run here)."""

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_training import write_cifar

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# What the Python fragments take as given: a zoo model, its optimizer, a batch and a step.
GIVEN = """
import torch
import torch.nn.functional as F
import timm
import revnets

model = timm.create_model("revnet38")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, target = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
example_input = x

def train_step(model, optimizer, x, target):
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), target).backward()
    optimizer.step()
"""


def fenced(language: str) -> list[tuple[str, str]]:
    """(page, block) for every ```language block of the README and docs/."""
    return [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
            for block in re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)]


def shell_commands() -> list[str]:
    """Every command of every ```bash block, comments dropped, `a && b` as two commands."""
    commands = []
    for _, block in fenced("bash"):
        for line in block.splitlines():
            line = line.split(" # ")[0].strip()
            commands += [part.strip() for part in line.split(" && ") if part.strip()]
    return list(dict.fromkeys(commands))


PYTHON_BLOCKS = fenced("python")


def test_the_readme_and_docs_have_python_examples():
    pages = [page for page, _ in PYTHON_BLOCKS]
    assert pages.count("README.md") >= 1 and len(pages) >= 8


# What an example prints that its page quotes.
PRINTS = {
    "README.md": ["none                    49.0 MiB", "reversible              15.0 MiB",
                  "reversible+checkpoint    9.2 MiB"],
}


@pytest.mark.parametrize("page, block", PYTHON_BLOCKS,
                         ids=[f"{page}-{i}" for i, (page, _) in enumerate(PYTHON_BLOCKS)])
def test_python_example_runs(page, block, capsys):
    namespace: dict = {}
    exec(compile(GIVEN, "<given>", "exec"), namespace)
    exec(compile(block, f"{page} python block", "exec"), namespace)
    printed = capsys.readouterr().out
    for line in PRINTS.get(page, []) if "print(" in block else []:
        assert line in printed


# Commands of the README and docs that no test runs, and why.
CI = ".ci/run runs it as typed in a fresh virtual environment"
NOT_RUN = {
    "pip install -e '.[test]'": CI,
    "python -m pytest -q": CI,
    "pip install -e '.[bench]'": "installs the peer libraries the benchmarks compare with",
    "python benchmarks/run_all.py": "regenerates results/ (about three hours) and "
    "rewrites the committed files; each script's quick mode runs in tests/test_benchmarks.py",
    "pip download timm==1.0.31 --no-binary :all: --no-deps -d /tmp/timm-sdist": "downloads timm's "
    "source from PyPI, for the next command",
    "python benchmarks/timm_model_tests.py /tmp/timm-sdist/timm-1.0.31.tar.gz": "timm's own model "
    "tests, 6 to 23 minutes on 2 cores; tests/test_timm_suite.py runs it (slow) where "
    "TIMM_TEST_MODELS names the file",
    "python benchmarks/compile_speed.py": "compiles a model for each plan (minutes each on 2 "
    "cores) and rewrites the committed results; tests/test_compile.py checks the same properties",
    "python train.py experiment=revnet_cifar data.root=/path/to/data": "the paper's recipe, 80k "
    "steps on real CIFAR-10 on a GPU; its config composes and instantiates in "
    "tests/test_training.py",
}
# Run, but marked slow: many runs, or several processes.
SLOW = {
    "python train.py -m experiment=memory_vs_depth",
    "python train.py trainer.compile=true trainer.max_steps=4 trainer.eval_every=2",
    "torchrun --nproc_per_node=2 train.py trainer.distributed=ddp",
    "torchrun --nproc_per_node=2 train.py trainer.distributed=fsdp",
}
# Run as typed in the default run: one process of train.py through the sandbox's `python` (each
# is 7 to 19 s on 2 cores). The others run as typed with the slow tests; in the default run each
# one's trainer is built in this process from its words (test_train_command_sets_up_as_typed),
# and tests/test_training.py trains each one's settings at a smaller scale.
AS_TYPED = {"python train.py memory=reversible memory.store_last_blocks=2 trainer.max_steps=2"}
# What a command's output must show, beyond finishing without an error.
EXPECTED = {
    "python train.py": "memory plan of revnet38: reversible",
    "python train.py memory=reversible memory.store_last_blocks=2 trainer.max_steps=2":
        "memory plan of revnet38: stages=reconstruct(store_last_blocks=2), rest=store",
    "python train.py memory=reversible_checkpoint memory.keep_input_every=16 trainer.max_steps=2":
        "memory plan of revnet38: stages=reconstruct(keep_input_every=16), rest=checkpoint",
    "python train.py model=resnet32 memory=checkpoint memory.segments=4 memory.selective=true "
    "trainer.max_steps=2":
        "memory plan of resnet32: stages=checkpoint(segments=4, selective=true), rest=store",
    "python train.py model.exact=true trainer.precision=bf16 trainer.max_steps=2":
        "memory plan of revnet38: reversible, exact arithmetic",
}
RUN = [command for command in shell_commands() if command not in NOT_RUN]


def test_every_shell_command_is_run_or_says_why_not():
    commands = shell_commands()
    for command in RUN:
        assert command.startswith(("python train.py", "torchrun ")), (
            f"{command!r} is neither run here nor in NOT_RUN with a reason")
    assert set(NOT_RUN) <= set(commands) and SLOW <= set(RUN) and set(EXPECTED) <= set(RUN)


def test_ci_runs_the_readme_set_up_as_typed():
    ci = (ROOT / ".ci" / "run").read_text()
    for command, reason in NOT_RUN.items():
        if reason == CI:
            assert f"\n{command}\n" in ci
    # Then the slow tests the default run leaves out; pytest's 5 (nothing selected) is no failure.
    assert ci.endswith("\npython -m pytest -q\npython -m pytest -q -m slow || [ $? -eq 5 ]\n")


def test_every_train_command_in_the_text_is_one_that_runs():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in re.findall(r"`(python train\.py[^`]*)`", text):
            assert " ".join(span.split()) in shell_commands(), f"{page.name}: {span}"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> tuple[Path, dict]:
    """A folder to run commands in as a reader would in the repository (train.py and configs/,
    Hydra's outputs/ kept out of the checkout), with a small CIFAR-100 in ./data, in the real
    format, for the commands that name it."""
    from torchvision.datasets import CIFAR100

    folder = tmp_path_factory.mktemp("sandbox")
    for name in ("train.py", "configs"):
        (folder / name).symlink_to(ROOT / name)
    # One batch of the docs' commands (data.batch_size=100) per split.
    digests = write_cifar(folder / "data", "cifar100", per_file=100)
    # torchvision checks the published md5 sums: every Python started here is pointed at those
    # of the small files (as tests/test_training.py's cifar fixture does in-process).
    tools = folder / ".tools"
    tools.mkdir()
    (tools / "sitecustomize.py").write_text(
        "from torchvision.datasets import CIFAR100\n"
        f"CIFAR100.train_list = [['train', {digests['train']!r}]]\n"
        f"CIFAR100.test_list = [['test', {digests['test']!r}]]\n"
        f"CIFAR100.meta = {{**CIFAR100.meta, 'md5': {digests['meta']!r}}}\n"
    )
    assert CIFAR100.base_folder == "cifar-100-python"
    # `python` and `torchrun` are this interpreter's (called by path, so a venv stays a venv).
    torchrun = Path(sys.executable).parent / "torchrun"
    for name, program in (("python", sys.executable), ("torchrun", torchrun)):
        (tools / name).write_text(f'#!/bin/sh\nexec "{program}" "$@"\n')
        (tools / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": f"{tools}{os.pathsep}{ROOT}"}
    return folder, env


def run(command: str, folder: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, executable=shutil.which("bash"), cwd=folder,
                          env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.parametrize("command", [
    command if command in AS_TYPED else pytest.param(command, marks=pytest.mark.slow)
    for command in RUN
])
def test_shell_command_runs_as_typed(command, sandbox):
    folder, env = sandbox
    resumed = re.search(r"trainer\.resume=(\S+)", command)
    if resumed and not (folder / resumed[1]).exists():  # the run it continues, stopped early
        done = run(f"python train.py trainer.max_steps=2 hydra.run.dir={resumed[1]}", folder, env)
        assert done.returncode == 0, done.stderr
    done = run(command, folder, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert EXPECTED.get(command, "") in done.stdout
    if resumed:  # some run's log says it continued from the earlier run's step 2
        records = [json.loads(line) for log in (folder / "outputs").rglob("metrics.jsonl")
                   for line in log.read_text().splitlines()]
        assert {"event": "resumed", "from": resumed[1], "step": 2} in records


RESULTS = ROOT / "results"
RESULT_LINK = re.compile(r"\]\((?:\.\./)?results/([^)#\s]+)")


def cited_results() -> dict[str, list[str]]:
    """results/ file name -> the pages (README.md, docs/*.md) that link to it."""
    cited: dict[str, list[str]] = {}
    for page in PAGES:
        for name in RESULT_LINK.findall(page.read_text()):
            cited.setdefault(name, []).append(page.relative_to(ROOT).as_posix())
    return cited


def test_every_results_link_names_a_file_that_exists():
    missing = {name: pages for name, pages in cited_results().items()
               if not (RESULTS / name).is_file()}
    assert not missing, f"results/ links to files that do not exist: {missing}"


def test_every_file_in_results_is_cited():
    """A table's .md is linked from a page; its data (.csv, .png) goes with it: a data file is
    cited if it is linked, or if the result .md whose name is the longest prefix of its own is."""
    cited = cited_results()
    reports = sorted((path.stem for path in RESULTS.glob("*.md")), key=len, reverse=True)
    uncited = []
    for path in sorted(RESULTS.iterdir()):
        if path.name in cited:
            continue
        owner = next((stem for stem in reports if path.suffix != ".md"
                      and (path.stem == stem or path.stem.startswith(stem + "-"))), None)
        if owner is None or f"{owner}.md" not in cited:
            uncited.append(path.name)
    assert not uncited, f"results/ files no page cites: {uncited}"


def sweep(arguments: list[str]) -> list[list[str]]:
    """The runs of a command line's overrides: one, or under ``-m`` one for each combination of
    the comma-separated values (the basic sweeper's)."""
    if "-m" not in arguments:
        return [arguments]
    runs = [[]]
    for argument in (a for a in arguments if a != "-m"):
        key, _, values = argument.partition("=")
        runs = [run + [f"{key}={value}"] for run in runs for value in values.split(",")]
    return runs


@pytest.mark.parametrize("command", [
    command for command in RUN
    if command.startswith("python train.py") and command not in AS_TYPED | SLOW
])
def test_train_command_sets_up_as_typed(command, sandbox, monkeypatch, capsys, tmp_path):
    """What train.py does with the command's words before its first step, in this process: the
    memory keys checked, the overrides composed with configs/, and the trainer built (settings
    checked, data read, the model made and its plan printed, a resumed run's checkpoint loaded),
    printing what the command's output must show."""
    from hydra import compose, initialize_config_dir
    from torchvision.datasets import CIFAR100

    from revnets.training.loop import Trainer
    from revnets.training.memory_options import check_memory_overrides

    folder, _ = sandbox
    (tmp_path / "data").symlink_to(folder / "data")  # beside its own outputs/
    monkeypatch.chdir(tmp_path)
    # The md5 sums of the sandbox's small CIFAR-100, as its sitecustomize.py sets them.
    digest = {path.name: hashlib.md5(path.read_bytes()).hexdigest()
              for path in (folder / "data" / CIFAR100.base_folder).iterdir()}
    monkeypatch.setattr(CIFAR100, "train_list", [["train", digest["train"]]])
    monkeypatch.setattr(CIFAR100, "test_list", [["test", digest["test"]]])
    monkeypatch.setattr(CIFAR100, "meta", {**CIFAR100.meta, "md5": digest["meta"]})
    arguments = shlex.split(command)[2:]
    check_memory_overrides(arguments)
    resumed = re.search(r"trainer\.resume=(\S+)", command)
    for index, overrides in enumerate(sweep(arguments)):
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "configs")):
            cfg = compose("config", overrides=overrides)
            if resumed:  # the run it continues, stopped at step 2 (small batches: 2 s)
                from revnets.training import train

                train(compose("config", overrides=[
                    "trainer.max_steps=2", "data.train_size=16", "data.val_size=8",
                    "data.batch_size=4", "trainer.memory_report=false"]), tmp_path / resumed[1])
        trainer = Trainer(cfg, tmp_path / f"run{index}")
        try:
            assert EXPECTED.get(command, "") in capsys.readouterr().out
            if resumed:
                assert trainer.step == 2
        finally:
            trainer.close()
