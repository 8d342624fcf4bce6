"""The trainer: configs, the default run, overrides, data, resume, faults and DDP."""

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

import revnets
from revnets.training import (
    DataMismatchError,
    DataNotFoundError,
    NonFiniteLossError,
    SettingsError,
    build_loaders,
    create_model,
    train,
)
from revnets.training.loop import Trainer
from revnets.training.memory_options import MemoryConfigError, MemoryOptions, check_memory_overrides
from revnets.training.optim import build_optimizer
from revnets.training.progress import Progress
from revnets.training.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
SMALL = [
    "trainer.max_steps=4",
    "trainer.log_every=2",
    "trainer.checkpoint_every=2",
    "data.train_size=64",
    "data.val_size=32",
    "data.batch_size=16",
]


def config(*overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIGS)):
        return compose("config", overrides=list(overrides))


def model_of(cfg, device="meta"):
    """The model a run's settings make (the trainer resolves its config once, so do we)."""
    settings = cfg if isinstance(cfg, Settings) else Settings.of(cfg)
    return create_model(settings.model, settings.data.num_classes, device, settings.memory,
                        tokens=settings.data.name == "text")


def run_train_py(*args: str, cwd: Path, launcher=(sys.executable,)) -> subprocess.CompletedProcess:
    # One thread, as torchrun gives each process: kernels that split work differently round
    # differently, and a few steps of SGD on tiny batches amplify that.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*launcher, str(ROOT / "train.py"), *args, f"hydra.run.dir={cwd}"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )


def train_py_in_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python train.py *args`` run in this process (``runpy``, ``sys.argv`` as typed): what
    the process would print and its exit status. For commands whose point is an error line or
    a small run; those comparing several runs' weights take a process each (run_train_py). An
    exception the script lets out fails the test (a traceback in a real run)."""
    argv, cwd_before, handlers = sys.argv, os.getcwd(), logging.root.handlers[:]
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [str(ROOT / "train.py"), *args, f"hydra.run.dir={cwd}"]
    code: int | str | None = 0
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as exit:
        code = exit.code
    finally:
        sys.argv = argv
        os.chdir(cwd_before)
        logging.root.handlers = handlers  # Hydra configures logging for its run
    if isinstance(code, str):  # SystemExit("error: ..."): Python prints it, exits 1
        err.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess(sys.argv, code or 0, out.getvalue(), err.getvalue())


def final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]


@pytest.mark.parametrize("group", ["model", "data", "optim", "memory", "trainer", "experiment"])
def test_every_config_composes_and_instantiates(group):
    for option in sorted(p.stem for p in (CONFIGS / group).glob("*.yaml")):
        if group == "memory" and option != "default":
            continue  # checked below against the models that accept them
        settings = Settings.of(config(f"{group}={option}"))
        if settings.model.name.startswith("hf:") and "LM" in settings.model.name:
            settings = Settings.of(config(f"{group}={option}", "data=text"))  # takes tokens
        elif settings.data.name == "text":
            settings = Settings.of(config(f"{group}={option}", "model=hf_gpt2"))  # makes them
        model = model_of(settings)
        assert build_optimizer(settings.optim, model).param_groups


@pytest.mark.parametrize("strategy", ["none", "checkpoint", "reversible", "reversible_checkpoint"])
def test_memory_options_instantiate(strategy):
    model = model_of(config("model=revnet38", f"memory={strategy}"))
    assert model.memory.name == strategy.replace("_", "+")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[dict, str, Path]:
    """One run of the small default (SMALL: 4 steps, the memory report on), shared by the tests
    that read what it printed, logged and wrote: (result, standard output, run folder)."""
    folder = tmp_path_factory.mktemp("small-run")
    printed = io.StringIO()  # not a terminal, as pytest's capture is not
    torch.manual_seed(0)
    with contextlib.redirect_stdout(printed):
        result = train(config(*SMALL), folder)
    return result, printed.getvalue(), folder


def test_default_run_reports_memory_against_baseline(small_run):
    result, out, tmp_path = small_run
    assert "baseline (none) MiB" in out and "revnet38" in out and "reversible" in out
    assert result["step"] == 4 and 0 <= result["val_accuracy"] <= 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    assert (tmp_path / "checkpoint.pt").is_file()
    assert "memory plan of revnet38: reversible" in out
    assert {"event": "memory_plan", "plan": "reversible", "stages": "reconstruct",
            "rest": "store", "exact": False} in records


@pytest.mark.parametrize("overrides, plan", [
    (["memory=reversible", "memory.store_last_blocks=2"],
     revnets.MemoryPlan(revnets.Reconstruct(store_last_blocks=2), revnets.Store())),
    (["memory=reversible", "memory.keep_input_every=16"],
     revnets.MemoryPlan(revnets.Reconstruct(keep_input_every=16), revnets.Store())),
    (["memory=reversible_checkpoint", "memory.store_last_blocks=1", "memory.keep_input_every=4"],
     revnets.MemoryPlan(revnets.Reconstruct(1, 4), revnets.Checkpoint())),
    (["memory=checkpoint", "memory.segments=4"],
     revnets.MemoryPlan(revnets.Checkpoint(segments=4), revnets.Store())),
    (["memory=none"], revnets.PRESETS["none"]),
    (["memory=default"], revnets.PRESETS["reversible"]),  # a RevNet's own plan
])
def test_memory_options_given_as_keys_reach_the_model(overrides, plan):
    model = model_of(config("model=revnet38", *overrides))
    assert model.memory == plan
    if isinstance(plan.stages, revnets.Reconstruct):
        assert model.stages[1].reversible.memory == plan.stages


def test_every_option_of_every_preset_is_a_memory_key():
    # The keys Hydra accepts are the fields of the presets' decisions, nothing hand-listed.
    decision_fields = {f for options in revnets.plan.preset_options().values() for f in options}
    schema_fields = {f.name for f in dataclasses.fields(MemoryOptions)}
    assert schema_fields == {"preset", "budget"} | decision_fields  # budget: memory=auto's
    assert decision_fields == {"segments", "selective", "store_last_blocks", "keep_input_every"}


@pytest.mark.parametrize("overrides, message", [
    (["memory=checkpoint", "memory.store_last_blocks=2"],
     "memory plan 'checkpoint' has no option 'store_last_blocks'; its options: segments"),
    (["memory=none", "memory.segments=2"], "memory plan 'none' has no option 'segments'"),
    (["memory.store_last_blocks=2"], "memory=default is the model's own plan and takes no options"),
    (["memory=reversible", "memory.store_last_blocks=-1"],
     "store_last_blocks must be a non-negative integer, got -1"),
    (["memory.preset='reversible(store_last_blocks=2)'"], "unknown memory plan"),
    (["model=resnet32", "memory=reversible"], "presets that do: none, checkpoint"),
])
def test_memory_options_a_plan_cannot_take_are_refused_naming_them(overrides, message):
    with pytest.raises(MemoryConfigError, match=re.escape(message)):
        model_of(config("model=revnet38", *overrides))


def test_misspelt_memory_keys_are_refused_before_hydra_naming_the_valid_ones():
    check_memory_overrides(["-m", "memory=reversible", "memory.store_last_blocks=1,2",
                            "+memory.keep_input_every=4", "hydra.run.dir=x", "model=resnet32"])
    for argument in ("memory.store_last_block=2", "+memory.store_last_block=2",
                     "++memory.segmentz=2", "memory.strategy=reversible"):
        with pytest.raises(MemoryConfigError) as refused:
            check_memory_overrides(["memory=reversible", argument])
        key = argument.lstrip("+").split("=")[0].removeprefix("memory.")
        assert f"unknown memory option {key!r}" in str(refused.value)
        assert "store_last_blocks (memory=reversible|reversible_checkpoint)" in str(refused.value)
        assert "segments (memory=checkpoint)" in str(refused.value)


def test_memory_keys_on_the_command_line(tmp_path):
    tiny = ["data.train_size=32", "data.val_size=16", "data.batch_size=16",
            "trainer.max_steps=2", "trainer.memory_report=false"]
    done = train_py_in_process("memory=reversible", "memory.store_last_blocks=2", *tiny,
                               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "memory plan of revnet38: stages=reconstruct(store_last_blocks=2), rest=store" in (
        done.stdout)
    done = train_py_in_process("memory=reversible", "memory.store_last_block=2", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "unknown memory option 'store_last_block'; did you mean memory.store_last_blocks?" in (
        done.stderr)


def test_synthetic_task_is_learned(tmp_path):
    overrides = ["model=resnet32", "trainer.max_steps=60", "trainer.log_every=60",
                 "trainer.memory_report=false", "optim.schedule=constant", "optim.lr=0.05"]
    result = train(config(*overrides), tmp_path)
    assert result["val_accuracy"] > 0.5  # chance is 0.1


def test_command_line_overrides(tmp_path):
    done = train_py_in_process("model=resnet32", "optim.lr=0.05", *SMALL, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["config"]
    assert saved["model"]["name"] == "resnet32" and saved["optim"]["optimizer"]["lr"] == 0.05
    assert "resnet32" in done.stdout


def test_unknown_model_and_key_name_the_choices(tmp_path):
    done = train_py_in_process("model=revnet39", cwd=tmp_path)
    assert done.returncode != 0 and "revnet38" in done.stderr and "revnet39" in done.stderr
    done = train_py_in_process("trainer.max_stepz=3", cwd=tmp_path)
    assert done.returncode != 0 and "max_stepz" in done.stderr
    done = train_py_in_process("memory=reversible", "model=resnet32", cwd=tmp_path)
    assert done.returncode != 0 and "presets that do: none, checkpoint" in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_data_is_a_message_not_a_traceback(tmp_path):
    empty = tmp_path / "nowhere"
    done = train_py_in_process("data=cifar10", f"data.root={empty}", cwd=tmp_path)
    assert done.returncode == 1
    assert "cifar10 was not found in" in done.stderr and "data.download=true" in done.stderr
    assert "Traceback" not in done.stderr


def write_cifar(root: Path, name: str = "cifar10", per_file: int = 20) -> dict:
    """A small CIFAR-10 or CIFAR-100 in its real on-disk format: pickled dicts of uint8 rows,
    labels and meta, as the python version of the data sets ships them."""
    classes = 10 if name == "cifar10" else 100
    folder = root / ("cifar-10-batches-py" if name == "cifar10" else "cifar-100-python")
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    digests = {}

    def dump(file_name, obj):
        with open(folder / file_name, "wb") as file:
            pickle.dump(obj, file)
        digests[file_name] = hashlib.md5((folder / file_name).read_bytes()).hexdigest()

    if name == "cifar10":
        files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        label_key, meta = "labels", ("batches.meta", "label_names")
    else:
        files, label_key, meta = ["train", "test"], "fine_labels", ("meta", "fine_label_names")
    for file_name in files:
        labels = rng.integers(0, classes, per_file).tolist()
        data = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)
        data[:, 0] = labels  # so the test can check that images and labels stay paired
        # Keys as Python 2 wrote them (str); torchvision unpickles with encoding="latin1".
        dump(file_name, {"batch_label": file_name, label_key: labels, "data": data})
    dump(meta[0], {meta[1]: [f"class{i}" for i in range(classes)]})
    return digests


@pytest.fixture(params=["cifar10", "cifar100"])
def cifar(request, tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10, CIFAR100

    name = request.param
    root = tmp_path / "data"
    digests = write_cifar(root, name)
    # torchvision checks the published md5 sums; point it at those of the small files.
    cls = CIFAR10 if name == "cifar10" else CIFAR100
    train_files = [f for f in digests if f.startswith("data_batch") or f == "train"]
    test_files = ["test_batch" if name == "cifar10" else "test"]
    meta_file = "batches.meta" if name == "cifar10" else "meta"
    monkeypatch.setattr(cls, "train_list", [[f, digests[f]] for f in train_files])
    monkeypatch.setattr(cls, "test_list", [[f, digests[f]] for f in test_files])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": digests[meta_file]})
    return name, root, 20 * len(train_files)


def test_cifar_loader_reads_the_real_format(cifar):
    name, root, train_size = cifar
    cfg = config(f"data={name}", f"data.root={root}", "data.num_workers=0",
                 "data.batch_size=10", "data.augment=false")
    loaders = build_loaders(cfg.data, seed=0)
    assert len(loaders.train.dataset) == train_size and len(loaders.val.dataset) == 20
    assert cfg.data.num_classes == len(loaders.train.dataset.classes)
    x, y = next(iter(loaders.train))
    assert x.shape == (10, 3, 32, 32) and x.dtype == torch.float32
    # Pixel (0, 0, 0) was written as the label, then normalised by the CIFAR mean and std.
    assert torch.allclose(x[:, 0, 0, 0] * 0.2470 + 0.4914, y.float() / 255, atol=1e-4)


def test_training_on_cifar_files(cifar, tmp_path):
    name, root, _ = cifar
    common = [f"data={name}", f"data.root={root}", "data.num_workers=0", "data.batch_size=10",
              "trainer.max_steps=2", "trainer.memory_report=false"]
    assert train(config(*common), tmp_path / "run")["step"] == 2
    with pytest.raises(DataMismatchError, match=r"classes but data.num_classes=5; set data.num_c"):
        train(config(*common, "data.num_classes=5"), tmp_path / "run2")


def test_a_training_set_smaller_than_one_batch_is_refused_instead_of_looping_forever(cifar):
    name, root, train_size = cifar
    cfg = config(f"data={name}", f"data.root={root}", "data.num_workers=0",
                 f"data.batch_size={train_size + 1}")
    with pytest.raises(DataMismatchError, match=rf"has {train_size} samples, fewer than one "
                       rf"batch of data.batch_size={train_size + 1}; set data.batch_size to at "
                       rf"most {train_size}"):
        build_loaders(cfg.data, seed=0)


def write_imagenet(root: Path, classes=("n01440764", "n01443537", "n01484850")) -> None:
    """A small ImageNet as ImageFolder reads it: <root>/{train,val}/<wnid>/<name>.JPEG, JPEG
    files of assorted sizes, each a flat grey whose level encodes the class."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("val", 2)):
        for index, wnid in enumerate(classes):
            (root / split / wnid).mkdir(parents=True)
            for k in range(count):
                height, width = rng.integers(40, 90, 2)
                pixels = np.full((height, width, 3), 40 + 60 * index, dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / wnid / f"{wnid}_{k}.JPEG", quality=95)


def test_imagenet_loader_reads_an_image_folder(tmp_path):
    write_imagenet(tmp_path / "imagenet")
    cfg = config("data=imagenet", f"data.root={tmp_path / 'imagenet'}", "data.num_workers=0",
                 "data.batch_size=6", "data.image_size=32")
    loaders = build_loaders(cfg.data, seed=0)
    assert len(loaders.train.dataset) == 12 and len(loaders.val.dataset) == 6
    assert loaders.train.dataset.classes == ["n01440764", "n01443537", "n01484850"]
    x, y = next(iter(loaders.val))
    assert x.shape == (6, 3, 32, 32)
    # The grey level, de-normalised, gives the class back: images and labels stay paired.
    level = (x[:, 0].mean((1, 2)) * 0.229 + 0.485) * 255
    assert torch.allclose((level - 40) / 60, y.float(), atol=0.05)


def test_imagenet_training_and_too_many_classes(tmp_path):
    write_imagenet(tmp_path / "imagenet")
    common = ["data=imagenet", f"data.root={tmp_path / 'imagenet'}", "data.num_workers=0",
              "data.batch_size=6", "data.image_size=32", "model=resnet32",
              "trainer.max_steps=2", "trainer.memory_report=false"]
    assert train(config(*common, "data.num_classes=3"), tmp_path / "run")["step"] == 2
    with pytest.raises(DataMismatchError, match=r"has 3 classes but data.num_classes=2"):
        train(config(*common, "data.num_classes=2"), tmp_path / "run2")
    (tmp_path / "cli").mkdir()
    done = train_py_in_process(*common, "data.num_classes=2", cwd=tmp_path / "cli")
    assert done.returncode != 0 and "set data.num_classes=3" in done.stderr
    assert "Traceback" not in done.stderr


def test_sigterm_checkpoint_and_resume_equal_an_uninterrupted_run(tmp_path, monkeypatch):
    overrides = [*SMALL, "trainer.max_steps=6", "trainer.checkpoint_every=0",
                 "trainer.memory_report=false", "model.drop_rate=0.3"]  # RNG in use
    train(config(*overrides), tmp_path / "straight")

    real_step = Trainer.train_step

    def step_then_sigterm(self, *args):
        out = real_step(self, *args)
        if self.step == 2:  # during the third step
            signal.raise_signal(signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_sigterm)
    result = train(config(*overrides), tmp_path / "interrupted")
    assert result == {"interrupted": True, "step": 3}
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = train(config(*overrides, f"trainer.resume={tmp_path / 'interrupted'}"),
                    tmp_path / "resumed")
    assert resumed["step"] == 6
    straight, again = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    for name in straight:
        assert torch.equal(straight[name], again[name]), name


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    cfg = config(*SMALL, "trainer.checkpoint_every=1", "optim.lr=1e30",
                 "trainer.memory_report=false", "optim.schedule=constant")
    with pytest.raises(NonFiniteLossError, match=r"at step \d+: stopping before the update"):
        train(cfg, tmp_path)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert state["step"] >= 1
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_resume_from_a_missing_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        train(config(*SMALL, f"trainer.resume={tmp_path / 'nothing'}"), tmp_path / "run")


def test_two_process_ddp_equals_one_process_on_the_same_global_batch(tmp_path):
    common = [*SMALL, "trainer.max_steps=3", "trainer.memory_report=false", "model=revnet38"]
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--master_port=29533")
    (tmp_path / "ddp").mkdir()
    ddp = run_train_py(*common, "trainer.distributed=ddp", cwd=tmp_path / "ddp",
                       launcher=torchrun)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    (tmp_path / "single").mkdir()
    single = run_train_py(*common, "trainer.accumulate=2", cwd=tmp_path / "single")
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = final_weights(tmp_path / "ddp"), final_weights(tmp_path / "single")
    params = [k for k in a if "running" not in k and "num_batches" not in k]
    assert params
    for name in params:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-7), name
    # The logged loss is the mean over both processes, as in the single run.
    def first_logged_loss(out: str) -> str:
        return next(line for line in out.splitlines() if "|" in line).split("|")[1]

    assert first_logged_loss(ddp.stdout) == first_logged_loss(single.stdout)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.accumulate=0"], "trainer.accumulate must be a whole number of at least 1, got 0"),
    (["trainer.accumulate=32"], "trainer.accumulate=32 splits a batch of 16 samples"),
    (["trainer.max_steps=-1"], "trainer.max_steps must be a whole number of at least 1"),
    (["trainer.epochs=0"], "trainer.epochs must be a whole number of at least 1 or null"),
    (["trainer.log_every=0"], "trainer.log_every must be a whole number of at least 1"),
    (["data.batch_size=0"], "data.batch_size must be a whole number of at least 1"),
    (["data.image_size=0"], "data.image_size must be a whole number of at least 1, got 0"),
])
def test_settings_that_would_train_nothing_are_refused_before_the_run(overrides, message, tmp_path):
    """``accumulate=0`` ran no micro-batch and no backward, and exited 0 as if it had
    trained; ``max_steps=-1`` trained nothing; more micro-batches than samples made the loss
    NaN, reported as a learning-rate problem."""
    with pytest.raises(SettingsError, match=re.escape(message)):
        Trainer(config(*SMALL, *overrides), tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (["model=irevnet163", "data.image_size=7"], "data.image_size=7 does not fit model=irevnet163: "
     "an input of 7x7 pixels does not split into its space-to-depth blocks: its sides must be "
     "multiples of 4 (the smallest is 4; 8 is the nearest above)"),
    (["model=revvit_small_patch16_224", "data.image_size=32"], "data.image_size=32 does not fit "
     "model=revvit_small_patch16_224: an input of 32x32 pixels; the position embedding is for "
     "224x224: create the model with img_size=(32, 32)"),
])
def test_an_image_size_the_model_cannot_take_is_refused_before_a_step(overrides, message, tmp_path):
    """i-RevNet's space to depth failed at the first step (a ValueError traceback), Rev-ViT's
    position embedding with an AssertionError; each model states its own rule."""
    with pytest.raises(SettingsError, match=re.escape(message)):
        Trainer(config(*SMALL, *overrides), tmp_path)


def test_image_sizes_a_model_takes_pass_the_check():
    from revnets.training.settings import check_image_size

    for overrides in (["model=irevnet163", "data.image_size=8"], ["data.image_size=7"],
                      ["model=revvit_small_patch16_224", "data.image_size=32",
                       "+model.dynamic_img_size=true"]):
        cfg = config(*overrides)
        # the ResNets and RevNets take any size
        settings = Settings.of(cfg)
        check_image_size(settings, model_of(settings), cfg.data.image_size)


def test_cifar_images_a_model_cannot_take_are_refused_before_a_step(cifar, tmp_path):
    """CIFAR's configs have no image size: its 32x32 images reached the Rev-ViT's assertion."""
    name, root, _ = cifar
    cfg = config(f"data={name}", f"data.root={root}", "data.batch_size=4",
                 "data.num_workers=0", "model=revvit_small_patch16_224")
    with pytest.raises(SettingsError, match=re.escape(
            f"data={name} (32x32 images) does not fit model=revvit_small_patch16_224: an input "
            "of 32x32 pixels; the position embedding is for 224x224")):
        Trainer(cfg, tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.accumulate=0"], "error: trainer.accumulate must be a whole number of at least 1"),
    (["model=irevnet163", "data.image_size=7"], "error: data.image_size=7 does not fit "
     "model=irevnet163"),
])
def test_a_setting_out_of_range_is_an_error_line_not_a_traceback(overrides, message, tmp_path):
    done = train_py_in_process(*overrides, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert message in done.stderr


def test_missing_data_raises_in_process(tmp_path):
    with pytest.raises(DataNotFoundError, match="data.download=true"):
        build_loaders(config("data=cifar100", f"data.root={tmp_path}").data, seed=0)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    from revnets.training import state as state_module

    path = tmp_path / "checkpoint.pt"
    state_module.save_checkpoint(path, {"step": 1})

    def crash_midway(obj, file):
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(state_module.torch, "save", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        state_module.save_checkpoint(path, {"step": 2})
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.slow
def test_compiled_training_runs(tmp_path):
    result = train(config(*SMALL, "trainer.compile=true", "trainer.max_steps=2"), tmp_path)
    assert result["step"] == 2


def test_bfloat16_training_on_cpu(tmp_path, capsys):
    result = train(config(*SMALL, "trainer.precision=bf16"), tmp_path)
    assert result["step"] == 4 and np.isfinite(result["val_loss"])
    assert "predicted on the meta device, in float32" in capsys.readouterr().out


def test_rev_vit_trains_at_224_and_reports_memory_against_its_none_baseline(tmp_path):
    done = train_py_in_process(
        "model=revvit_small_patch16_224", "data.image_size=224", "optim=adamw",
        "trainer.max_steps=1", "trainer.log_every=1", "trainer.checkpoint_every=0",
        "data.train_size=4", "data.val_size=2", "data.batch_size=2", cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    table = done.stdout.splitlines()
    row = next(line for line in table if line.startswith("revvit_small_patch16_224"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[1] == "reversible"
    # At batch 2 the peak is parameters and AdamW state; activations show what was saved, against
    # the same model under ordinary autograd, predicted on meta.
    above = re.search(r"above model state: ([\d.]+) MiB vs baseline ([\d.]+) MiB", done.stdout)
    assert float(above.group(2)) > 5 * float(above.group(1))


def test_progress_is_plain_lines_when_not_on_a_terminal(small_run):
    _, out, _ = small_run
    assert "\r" not in out  # no bar redrawing itself in a log
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert all(re.search(r"\| \d+ samples/s \| mem [\d.]+ MiB$", line) for line in lines)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal():
    stream = Terminal()
    progress = Progress(total_steps=4, stream=stream)
    for step in range(1, 5):
        progress.step()
        if step % 2 == 0:
            progress.log(step, {"loss": 0.5, "accuracy": 0.75, "samples_per_s": 120.0,
                                "peak_mib": 12.5})
    list(progress.evaluation(range(3), total=3))
    progress.close()
    out = stream.getvalue()
    assert "\r" in out and "train" in out and "4/4" in out
    assert "samples/s=120" in out and "mem=12.5 MiB" in out and "loss=0.5000" in out
    assert "step 2/4" not in out  # no plain lines besides the bar


def test_samples_per_s_counts_training_steps_only(tmp_path):
    """The rate logged every 2 steps is the images of those 2 steps over their step times:
    the evaluations and checkpoint writes after every step are not in it, nor is the first,
    measured step."""
    overrides = [*SMALL, "trainer.max_steps=6", "trainer.eval_every=1",
                 "trainer.checkpoint_every=1", "model=resnet32"]
    trainer = Trainer(config(*overrides), tmp_path)
    try:
        trainer.fit()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["samples_per_s"] for r in records if "samples_per_s" in r}
    times = trainer.step_times  # steps 2 to 6: the first step is measured, not timed
    assert rates[2] == pytest.approx(16 / times[0])
    assert rates[4] == pytest.approx(32 / (times[1] + times[2]))
    assert rates[6] == pytest.approx(32 / (times[3] + times[4]))


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")  # installed by the test extra: pip install -e '.[test]'
    train(config(*SMALL, "trainer.tensorboard=true"), tmp_path)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_the_first_step_draws_its_memory_timeline_beside_the_baseline(small_run):
    _, _, tmp_path = small_run
    assert (tmp_path / "memory_timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_model_keys_beyond_the_name_reach_the_builder():
    """``+model.units=[2,2,2]`` builds a shallower zoo model; a misspelt key is an error, not
    silently dropped."""
    model = model_of(config("model=irevnet163", "+model.units=[2,2,2]"))
    # A coupling of two i-RevNet blocks per stage, after space to depth in the strided ones.
    assert len(model.blocks) == 5
    with pytest.raises(TypeError, match="chanels"):
        model_of(config("model=revnet38", "+model.chanels=[1]"))


@pytest.mark.slow  # three runs of train.py, two of them through torchrun: about 30 s
def test_two_process_fsdp_equals_one_process_and_resumes_exactly_from_its_shards(tmp_path):
    """FSDP2 over a RevNet (each reversible sequence sharded): two steps, a checkpoint written
    with torch.distributed.checkpoint, a resumed third step; the weights equal one process's
    after three steps on the same global batches."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # A constant learning rate: a schedule would depend on each run's max_steps.
    common = [*SMALL, "trainer.memory_report=false", "model=revnet38", "optim.schedule=constant"]
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--master_port=29534")
    for name in ("first", "resumed", "single"):
        (tmp_path / name).mkdir()
    first = run_train_py(*common, "trainer.max_steps=2", "trainer.distributed=fsdp",
                         cwd=tmp_path / "first", launcher=torchrun)
    assert first.returncode == 0, first.stderr[-3000:]
    shards = torch.load(tmp_path / "first" / "checkpoint.pt", weights_only=False)["sharded"]
    assert (tmp_path / "first" / shards).is_dir()
    resumed = run_train_py(*common, "trainer.max_steps=3", "trainer.distributed=fsdp",
                           f"trainer.resume={tmp_path / 'first'}", "trainer.memory_report=true",
                           cwd=tmp_path / "resumed", launcher=torchrun)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "peak per rank (fsdp), MiB: rank 0:" in resumed.stdout
    single = run_train_py(*common, "trainer.max_steps=3", "trainer.accumulate=2",
                          cwd=tmp_path / "single")
    assert single.returncode == 0, single.stderr[-3000:]
    state = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)
    dcp_to_torch_save(tmp_path / "resumed" / state["sharded"], tmp_path / "resumed.pt")
    a = torch.load(tmp_path / "resumed.pt", weights_only=False)["model"]
    b = final_weights(tmp_path / "single")
    params = [k for k in b if "running" not in k and "num_batches" not in k]
    assert params and sorted(a) == sorted(b)
    for name in params:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-7), name
    # The third step's loss, the mean over both processes, is the single process's.
    assert step_loss(tmp_path / "resumed", 3) == pytest.approx(step_loss(tmp_path / "single", 3),
                                                              rel=1e-5)


def step_loss(run_dir: Path, step: int) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in records if r.get("step") == step and "loss" in r)


def test_distributed_modes_are_parsed_at_the_edge():
    from revnets.training.distributed import parse_mode

    assert [parse_mode(v) for v in (False, True, "none", "DDP", "fsdp")] == [
        "none", "ddp", "none", "ddp", "fsdp"]
    with pytest.raises(ValueError, match="not one of none, ddp, fsdp"):
        parse_mode("zero3")
