"""The training loop behind ``train.py``: data, model, optimisation, logging, checkpoints,
resume."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import revnets  # noqa: F401  (registers the zoo with timm)
from revnets.compiling import compile_model
from revnets.facts import MiB
from revnets.memory import cuda_allocator_history, record_timeline
from revnets.planning import PlanningError, auto_checkpoint
from revnets.training.data import build_loaders
from revnets.training.distributed import (
    Distributed,
    all_finite,
    setup_distributed,
    shard_model,
)
from revnets.training.factory import correct_of, create_model, logits_of, loss_of, memory_plan_of
from revnets.training.memory_options import AutoPlan, MemoryConfigError
from revnets.training.optim import build_optimizer, build_scheduler
from revnets.training.progress import Progress, Throughput
from revnets.training.report import (
    MemoryComparison,
    predict_baseline,
    summary_table,
    write_timelines,
)
from revnets.training.settings import (
    Settings,
    SettingsError,
    check_image_size,
    check_sequence_length,
    check_settings,
)
from revnets.training.state import (
    CHECKPOINT_NAME,
    capture_rng,
    load_checkpoint,
    load_sharded,
    restore_rng,
    save_checkpoint,
    save_sharded,
)

__all__ = ["NonFiniteLossError", "train"]

TIMELINE_NAME = "memory_timeline.png"  # the first step's memory beside the baseline's
CUDA_HISTORY_NAME = "cuda_memory_snapshot.pickle"  # on CUDA: the allocator's own record of it


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


def resolve_device(choice: str, state: Distributed) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "trainer.device=cuda but no CUDA device is available; use auto or cpu"
            )
        return torch.device("cuda", state.local_rank)
    if choice == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown trainer.device {choice!r}; valid: 'auto', 'cpu', 'cuda'")


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        if device.type != "cuda":
            raise ValueError("trainer.precision=fp16 needs a GPU; on CPU use bf16")
        return torch.autocast("cuda", dtype=torch.float16)
    raise ValueError(f"unknown trainer.precision {precision!r}; valid: 'fp32', 'bf16', 'fp16'")


class _StopRequest:
    """SIGTERM / SIGINT ask for a checkpoint at the next step boundary, then a clean exit."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals to the caller
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """One run: ``settings`` (or a config, resolved once into them) say what to train."""

    def __init__(self, settings: Settings | DictConfig, output_dir: str | Path) -> None:
        if not isinstance(settings, Settings):
            settings = Settings.of(settings)
        self.settings = settings
        trainer = settings.trainer
        self.output_dir = Path(output_dir)
        self.dist = setup_distributed(trainer.distributed)
        check_settings(settings, self.dist.world_size)
        self.device = resolve_device(trainer.device, self.dist)
        torch.manual_seed(settings.seed)
        self.loaders = build_loaders(settings.data, settings.seed, self.dist.world_size,
                                     self.dist.rank)
        auto = settings.memory if isinstance(settings.memory, AutoPlan) else None
        if auto is not None and self.dist.mode == "fsdp":
            raise SettingsError("memory=auto plans one process's whole model; with "
                                "trainer.distributed=fsdp its shards are not that model: use "
                                "trainer.distributed=ddp, or a preset")
        self.model = create_model(settings.model, settings.data.num_classes, self.device,
                                  None if auto else settings.memory, self.loaders.image_size,
                                  self.loaders.tokens)
        check_image_size(settings, self.model, self.loaders.image_size)  # before a step fails
        check_sequence_length(settings, self.model)
        if self.dist.mode == "fsdp":
            shard_model(self.model)  # before the optimizer: sharding replaces the parameters
        self.optimizer = build_optimizer(settings.optim, self.model)
        if auto is not None:  # the planned model shares the parameters the optimizer holds
            self.model = self._planned(auto.budget)
        self.plan = memory_plan_of(self.model)
        self.plan_label = self.plan.name if auto is None else f"auto ({auto.budget / MiB:.1f} MiB)"
        self.total_steps = self._total_steps()
        self.scheduler = build_scheduler(settings.optim, self.optimizer, self.total_steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=trainer.precision == "fp16")
        self.autocast = autocast_for(trainer.precision, self.device)
        self.step = self.epoch = self.position = 0
        self.writer = self._tensorboard()
        plan, exact = self.plan, settings.model.exact
        self._log({"event": "memory_plan", "plan": self.plan_label, "stages": str(plan.stages),
                   "rest": str(plan.rest), "exact": exact,
                   **({"parts": [(part.name, str(part.decision)) for part in plan.parts]}
                      if plan.parts else {})})
        if self.dist.is_main:
            arithmetic = ", exact arithmetic" if exact else ""
            shown = f"{self.plan_label}\n{plan}" if plan.parts else str(plan)
            print(f"memory plan of {settings.model.name}: {shown}{arithmetic}", flush=True)
        if trainer.resume:
            self._resume(trainer.resume)
        self.net: nn.Module = self.model
        if self.dist.mode == "ddp":
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=ids)
        if trainer.compile:
            self.net = compile_model(self.net)  # NOTE [ Layout under torch.compile ]
        self.step_times: list[float] = []
        self.throughput = Throughput()
        self.progress: Progress | None = None
        self.memory: MemoryComparison | None = None

    # -- set-up ----------------------------------------------------------------------------------
    def _total_steps(self) -> int:
        trainer = self.settings.trainer
        if trainer.epochs is not None:
            return trainer.epochs * len(self.loaders.train)
        return trainer.max_steps

    def _planned(self, budget: int) -> nn.Module:
        """The model planned by auto_checkpoint to train one micro-batch within ``budget``, with
        this run's optimizer (``memory=auto``); a budget no plan reaches names the least one."""
        data, trainer = self.settings.data, self.settings.trainer
        micro = max(data.batch_size // self.dist.world_size // trainer.accumulate, 1)
        inputs, targets = next(iter(self.loaders.val))  # a batch's shapes and types, no draw
        x = torch.zeros(micro, *inputs.shape[1:], dtype=inputs.dtype, device=self.device)
        y = torch.zeros(micro, *targets.shape[1:], dtype=torch.long, device=self.device)
        try:
            return auto_checkpoint(
                self.model, x, budget, lambda out: loss_of(logits_of(out), y), self.optimizer)
        except PlanningError as error:
            least = error.smallest_budget
            fix = "" if least is None else f"; set memory.budget={least} (bytes) or more"
            raise MemoryConfigError(f"memory=auto: {str(error).rstrip('.')}{fix}") from None

    def _resume(self, run_dir: str) -> None:
        state = load_checkpoint(run_dir)
        if "sharded" in state:
            where = Path(run_dir).expanduser()  # the run's folder, or its checkpoint.pt
            where = where if where.is_dir() else where.parent
            load_sharded(where / state["sharded"], self.model, self.optimizer)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        restore_rng(state["rng"][min(self.dist.rank, len(state["rng"]) - 1)])
        self._log({"event": "resumed", "from": str(run_dir), "step": self.step})

    def _tensorboard(self):
        if not (self.settings.trainer.tensorboard and self.dist.is_main):
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise RuntimeError(
                "trainer.tensorboard=true needs the tensorboard package: pip install tensorboard"
            ) from error
        return SummaryWriter(self.output_dir / "tensorboard")

    # -- one step --------------------------------------------------------------------------------
    def train_step(
        self, net: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over ``trainer.accumulate`` micro-batches, then one update."""
        optimizer.zero_grad(set_to_none=True)
        parts = self.settings.trainer.accumulate
        total_loss = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        for i in range(parts):
            # Interleaved slices: the same split torch's DistributedSampler makes across ranks.
            xs, ys = x[i::parts], y[i::parts]
            sync = i == parts - 1 or not self.dist.enabled
            if self.dist.mode == "fsdp":
                self.model.set_requires_gradient_sync(sync)
            ddp_skip = not sync and self.dist.mode == "ddp"
            with net.no_sync() if ddp_skip else contextlib.nullcontext(), self.autocast:
                logits = logits_of(net(xs))
                loss = loss_of(logits, ys) / parts
            correct += correct_of(logits.detach(), ys)
            del logits  # not held through the backward (a language model's are its largest)
            self.scaler.scale(loss).backward()
            total_loss += loss.detach()
        if not all_finite(total_loss, self.dist):
            raise NonFiniteLossError(
                f"the loss is {total_loss.item()} at step {self.step + 1}: stopping before the "
                f"update. The last good checkpoint is {self.output_dir / CHECKPOINT_NAME} "
                "(try a smaller optim.lr, or trainer.precision=fp32)"
            )
        self.scaler.step(optimizer)
        self.scaler.update()
        return total_loss, correct

    def _measured_step(
        self, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first step of the run, measured; the baseline is predicted on the meta device."""
        history = self.output_dir / CUDA_HISTORY_NAME if self.device.type == "cuda" else None
        with cuda_allocator_history(history):
            report, timeline = record_timeline(self.train_step, self.net, self.optimizer, x, y)
        rank_peaks: tuple[int, ...] = ()
        if self.dist.enabled:
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, report.peak_bytes)
            rank_peaks = tuple(gathered)
        if self.dist.is_main:
            baseline, baseline_timeline = predict_baseline(self.settings, self.train_step_meta,
                                                           x, y, self.loaders.tokens)
            unsharded = None
            if self.dist.mode == "fsdp":
                unsharded, _ = predict_baseline(self.settings, self.train_step_meta, x, y,
                                                self.loaders.tokens, plan=self.plan)
            self.memory = MemoryComparison(report, baseline, timeline, baseline_timeline,
                                           rank_peaks, unsharded)
            write_timelines(self.settings, self.plan_label, self.memory,
                            self.output_dir / TIMELINE_NAME)
        return report.result

    def train_step_meta(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
    ) -> None:
        """One plain step (no accumulation, autocast or loss scaling), run on the meta device
        to predict the baseline's memory."""
        optimizer.zero_grad(set_to_none=True)
        loss_of(logits_of(model(x)), y).backward()
        optimizer.step()

    # -- the loop --------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        trainer = self.settings.trainer
        start_step = self.step
        self.progress = Progress(self.total_steps, start_step, enabled=self.dist.is_main)
        with _StopRequest() as stop:
            while self.step < self.total_steps:
                per_rank = self.loaders.train.batch_size
                self.loaders.sampler.set_position(self.epoch, self.position * per_rank)
                for x, y in self.loaders.train:
                    x = x.to(self.device, non_blocking=True)
                    y = y.to(self.device, non_blocking=True)
                    self.net.train()
                    begin = time.perf_counter()
                    if self.step == start_step and trainer.memory_report:
                        loss, correct = self._measured_step(x, y)
                    else:
                        loss, correct = self.train_step(self.net, self.optimizer, x, y)
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                        if self.step > start_step:
                            self.step_times.append(time.perf_counter() - begin)
                            self.throughput.add(len(y), self.step_times[-1])  # samples
                    self.scheduler.step()
                    self.step += 1
                    self.position += 1
                    self.progress.step()
                    if self.step % trainer.log_every == 0 or self.step == self.total_steps:
                        self._log_step(loss, correct, y.numel())
                    if trainer.eval_every and self.step % trainer.eval_every == 0:
                        self._log(self.evaluate())
                    if trainer.checkpoint_every and self.step % trainer.checkpoint_every == 0:
                        self.save()
                    if stop.signal is not None or self.step >= self.total_steps:
                        break
                else:
                    self.epoch += 1
                    self.position = 0
                if stop.signal is not None:
                    self.save()
                    self._log({"event": "stopped", "signal": stop.signal, "step": self.step})
                    return {"interrupted": True, "step": self.step}
        self.save()
        result = {"interrupted": False, "step": self.step, **self.evaluate()}
        self._log(result)
        return result

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.net.eval()
        total, loss_sum, correct = 0, 0.0, 0
        batches = self.loaders.val
        if self.progress is not None:
            batches = self.progress.evaluation(batches, len(self.loaders.val))
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast:
                logits = logits_of(self.net(x))
            loss_sum += loss_of(logits, y, reduction="sum").item()
            correct += correct_of(logits, y).item()
            total += y.numel()  # samples, or tokens
        self.net.train()
        return {"step": self.step, "val_loss": loss_sum / total, "val_accuracy": correct / total}

    def save(self) -> None:
        """Every rank contributes its RNG state; rank 0 writes the checkpoint."""
        rng = [capture_rng()]
        if self.dist.enabled:
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, rng[0])
            rng = gathered
        if self.dist.mode == "fsdp":
            # Every rank writes its own shards; checkpoint.pt then names them, so the previous
            # checkpoint stays whole until the new one is.
            weights = {"sharded": save_sharded(self.output_dir, self.step, self.model,
                                               self.optimizer, self.dist)}
        else:
            weights = {"model": self.model.state_dict(),
                       "optimizer": self.optimizer.state_dict()}
        if self.dist.is_main:
            state = {
                **weights,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "step": self.step,
                "epoch": self.epoch,
                "position": self.position,
                "rng": rng,
                "config": dict(self.settings.config),
            }
            previous = self._checkpoint_shards() if "sharded" in state else None
            save_checkpoint(self.output_dir / CHECKPOINT_NAME, state)
            if previous not in (None, state.get("sharded")):
                shutil.rmtree(self.output_dir / previous, ignore_errors=True)
        self.dist.barrier()

    def _checkpoint_shards(self) -> str | None:
        path = self.output_dir / CHECKPOINT_NAME
        return load_checkpoint(path).get("sharded") if path.is_file() else None

    # -- logging ---------------------------------------------------------------------------------
    def _log_step(self, loss: torch.Tensor, correct: torch.Tensor, batch: int) -> None:
        samples_per_s = self.throughput.take()  # this process's share of the global batch
        if samples_per_s is not None and self.dist.enabled:
            samples_per_s *= self.dist.world_size
        if self.dist.enabled:  # report the global batch, not this process's share
            totals = torch.stack([loss.float() * batch, correct.float()]).to(self.device)
            torch.distributed.all_reduce(totals)
            batch *= self.dist.world_size
            loss, correct = totals[0] / batch, totals[1]
        record = {
            "step": self.step,
            "loss": loss.item(),
            "accuracy": correct.item() / batch,
            "lr": self.scheduler.get_last_lr()[0],
            "samples_per_s": samples_per_s,
        }
        if self.memory is not None:
            record["peak_mib"] = self.memory.report.peak_bytes / MiB
        self.progress.log(self.step, record)
        self._log(record)

    def _log(self, record: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with open(self.output_dir / "metrics.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(key, value, record.get("step", self.step))

    def summary(self, result: dict[str, Any]) -> str:
        step_time = statistics.median(self.step_times) if self.step_times else float("nan")
        return summary_table(self.settings, self.plan_label, self.memory, step_time, result)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()
        self.dist.shutdown()


def train(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """Train as ``cfg`` says, writing metrics and checkpoints to ``output_dir``; print a summary."""
    trainer = Trainer(Settings.of(cfg), output_dir)
    try:
        result = trainer.fit()
        if trainer.progress is not None:
            trainer.progress.close()  # the bar ends before the summary is printed
        if trainer.dist.is_main and not result["interrupted"]:
            print(trainer.summary(result), flush=True)
        return result
    finally:
        trainer.close()
