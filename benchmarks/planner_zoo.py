"""auto_checkpoint on models nobody here tuned it to: how long planning takes, whether the plan
meets its budget, and whether its predicted peak is the measured one.

Each model (random init, nothing downloaded) trains one step at a small batch on this CPU. Its
budget is the measured peak of the unplanned step with its activation part (the peak above
parameters and their gradients) cut by 50 % and by 70 %. ``revnets.auto_checkpoint`` plans it
(planning seconds: wall clock of that call, times measured included); the planned step is then
measured (``revnets.measure_memory``) and compared with the plan's predicted peak, and timed
against the unplanned step (overhead). A refusal must name the smallest budget that plans: that
budget is asked for in turn, and the row records whether it planned within it.

    python benchmarks/planner_zoo.py                  # every model (writes results/planner_zoo-*)
    python benchmarks/planner_zoo.py --only resnet    # models whose name contains "resnet"
    python benchmarks/planner_zoo.py --set torchvision --cuts 0.5 --repeats 1
        # every classification model torchvision registers, at 64x64 where it takes any size
    python benchmarks/planner_zoo.py --set timm --cuts 0.5 --repeats 1
        # 84 timm models of its families, at 64x64 where they take it
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

import revnets
from revnets.planning import CheckpointedModules, PlanningError

from common import (
    RESULTS,
    MiB,
    interleaved_times,
    provenance,
    results_stem,
    write_csv,
    write_markdown,
)

CUTS = (0.5, 0.7)


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, Any]]  # (model input, target)
    loss: str = "cross_entropy"  # or "sum"
    # False: too large to run on this machine; the input is a meta tensor standing for one on
    # the CPU, the budget's base is predicted, and the plan's peak is not measured.
    measured: bool = True


class GPT(nn.Module):
    """A GPT-2-like language model: pre-norm causal attention blocks, head tied to the token
    embedding."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(1, length, width))
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.position[:, : tokens.shape[1]]
        return self.head(self.norm(self.blocks(x))).flatten(0, 1)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class LSTMClassifier(nn.Module):
    """Embedding, a 2-layer bidirectional nn.LSTM, a linear head on the last time step."""

    def __init__(self, vocab: int = 1000, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


def images(batch: int, size: int, classes: int = 1000) -> Callable[[], tuple[Tensor, Tensor]]:
    return lambda: (torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,)))


def tokens(batch: int, length: int, vocab: int, per_token: bool):
    targets = (batch * length,) if per_token else (batch,)
    classes = vocab if per_token else 10
    return lambda: (torch.randint(0, vocab, (batch, length)), torch.randint(0, classes, targets))


def tv(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: getattr(torchvision.models, name)(weights=None, **kwargs)


def tm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, **kwargs)


CASES = [
    # torchvision: one model of each family, 128x128 images
    Case("tv_resnet18", tv("resnet18"), images(2, 128)),
    Case("tv_resnet50", tv("resnet50"), images(2, 128)),
    Case("tv_densenet121", tv("densenet121"), images(2, 128)),
    Case("tv_mobilenet_v2", tv("mobilenet_v2"), images(2, 128)),
    Case("tv_mobilenet_v3_small", tv("mobilenet_v3_small"), images(2, 128)),
    Case("tv_efficientnet_b0", tv("efficientnet_b0"), images(2, 128)),
    Case("tv_regnet_y_400mf", tv("regnet_y_400mf"), images(2, 128)),
    Case("tv_shufflenet_v2_x0_5", tv("shufflenet_v2_x0_5"), images(2, 128)),
    Case("tv_squeezenet1_1", tv("squeezenet1_1"), images(2, 128)),
    Case("tv_mnasnet0_5", tv("mnasnet0_5"), images(2, 128)),
    Case("tv_googlenet", tv("googlenet", aux_logits=False, init_weights=False), images(2, 128)),
    Case("tv_inception_v3", tv("inception_v3", aux_logits=False, init_weights=False),
         images(2, 128)),
    Case("tv_convnext_tiny", tv("convnext_tiny"), images(2, 128)),
    Case("tv_swin_t", tv("swin_t"), images(1, 128)),
    Case("tv_vit_b_16", tv("vit_b_16", image_size=128), images(1, 128)),
    # timm: CNNs, ViTs, a window transformer, an MLP-mixer, hybrids
    Case("timm_resnet26d", tm("resnet26d"), images(2, 128)),
    Case("timm_efficientnet_b0", tm("efficientnet_b0"), images(2, 128)),
    Case("timm_convnext_atto", tm("convnext_atto"), images(2, 128)),
    Case("timm_vit_small", tm("vit_small_patch16_224", img_size=128), images(2, 128)),
    Case("timm_deit_tiny", tm("deit_tiny_patch16_224", img_size=128), images(2, 128)),
    Case("timm_swin_tiny", tm("swin_tiny_patch4_window7_224", img_size=128, window_size=4),
         images(1, 128)),
    Case("timm_mixer_s16", tm("mixer_s16_224", img_size=128), images(2, 128)),
    Case("timm_levit_128s", tm("levit_128s"), images(2, 224)),
    Case("timm_coatnet_nano", tm("coatnet_nano_rw_224", img_size=128), images(2, 128)),
    # sequence models
    Case("gpt_4x256", lambda: GPT(2048, 256, 4, 4, 128), tokens(2, 128, 2048, per_token=True)),
    Case("lstm_2x128_bidirectional", LSTMClassifier, tokens(2, 64, 1000, per_token=False)),
    # the 1000-layer zoo model at batch 128
    Case("revnet992_b128", lambda: timm.create_model("revnet992", memory="none"),
         images(128, 32, 10),
         measured=False),
]


# torchvision models that need another input than 2x3x64x64, or arguments to train from scratch.
_TV_SIZES = {"inception_v3": 80, "maxvit_t": 224, "vit_h_14": 56}  # 75 at least; fixed; 14 | side
_TV_KWARGS = {name: {"aux_logits": False, "init_weights": False}
              for name in ("googlenet", "inception_v3")}


def torchvision_cases() -> list[Case]:
    """Every classification model torchvision registers, random init, batch 2 at 64x64 (a ViT
    built for that size) where the model takes any size."""
    cases = []
    for name in torchvision.models.list_models(module=torchvision.models):
        size = _TV_SIZES.get(name, 64)
        kwargs = {**_TV_KWARGS.get(name, {}), **({"image_size": size} if name.startswith("vit_")
                                                 else {})}
        cases.append(Case(f"tv_{name}", tv(name, **kwargs), images(2, size)))
    return cases


# timm: models of its families (CNNs, mobile nets, ViTs, hierarchical, window and hybrid
# transformers, MLPs, a recurrent Sequencer), random init, batch 2 at 64x64 (built for that size
# where the model takes ``img_size``), at its own size where it needs one.
TIMM_MODELS = (
    "seresnext26d_32x4d", "res2net50_14w_8s", "resnest14d", "regnetx_002", "regnety_002",
    "regnetz_005", "mobilenetv3_small_050", "mobilenetv4_conv_small", "ghostnet_050",
    "ghostnetv2_100", "repghostnet_050", "lcnet_050", "mnasnet_small", "fbnetc_100",
    "hrnet_w18_small", "dla34", "dpn68", "cspresnet50", "cs3darknet_focus_s", "ese_vovnet19b_dw",
    "rexnet_100", "tinynet_e", "repvgg_a0", "hgnetv2_b0", "nf_resnet26", "eca_nfnet_l0",
    "inception_v3", "densenet121", "vgg11", "xception41", "skresnet18", "selecsls42b",
    "ecaresnet26t", "fasternet_t0", "starnet_s1", "convnextv2_atto", "inception_next_tiny",
    "rdnet_tiny", "mambaout_femto", "edgenext_xx_small", "efficientformer_l1",
    "efficientformerv2_s0", "fastvit_t8", "mobilevit_xxs", "mobilevitv2_050", "efficientvit_b0",
    "efficientvit_m0", "shvit_s1", "tiny_vit_5m_224", "poolformer_s12", "poolformerv2_s12",
    "resmlp_12_224", "gmlp_ti16_224", "sequencer2d_s", "vit_tiny_patch16_224",
    "deit3_small_patch16_224", "beit_base_patch16_224", "eva02_tiny_patch14_224",
    "vitamin_small_224", "cait_xxs24_224", "xcit_nano_12_p16_224", "crossvit_tiny_240",
    "pit_ti_224", "tnt_s_patch16_224", "convit_tiny", "volo_d1_224", "visformer_tiny",
    "twins_pcpvt_small", "pvt_v2_b0", "coat_lite_tiny", "nest_tiny", "swinv2_cr_tiny_ns_224",
    "focalnet_tiny_srf", "davit_tiny", "gcvit_xxtiny", "mvitv2_tiny", "hiera_tiny_224",
    "maxvit_nano_rw_256", "csatv2_21m", "bat_resnext26ts", "halonet26t", "lambda_resnet26t",
    "botnet26t_256", "sebotnet33ts_256",
)
_TIMM_SIZES = {"inception_v3": 299, "efficientformer_l1": 224, "crossvit_tiny_240": 240,
               "bat_resnext26ts": 256, "halonet26t": 256}


def timm_cases() -> list[Case]:
    """The models of ``TIMM_MODELS``, 1000 classes, batch 2."""
    return [Case(f"timm_{name}", _timm_at(name, _TIMM_SIZES.get(name, 64)),
                 images(2, _TIMM_SIZES.get(name, 64))) for name in TIMM_MODELS]


def _timm_at(name: str, size: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        try:
            return timm.create_model(name, pretrained=False, num_classes=1000, img_size=size)
        except TypeError:  # takes any size
            return timm.create_model(name, pretrained=False, num_classes=1000)

    return build


SETS = {"zoo": lambda: CASES, "torchvision": torchvision_cases, "timm": timm_cases}


def train_step(model: nn.Module, x: Any, loss: Callable[[Tensor], Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    loss(model(x)).backward()


def plan(
    model: nn.Module, x: Any, budget: int, loss: Callable
) -> tuple[Any, float, PlanningError | None]:
    start = time.perf_counter()
    try:
        planned = revnets.auto_checkpoint(model, x, budget, loss_fn=loss)
    except PlanningError as error:
        return None, time.perf_counter() - start, error
    return planned, time.perf_counter() - start, None


def run_case(case: Case, repeats: int, device: torch.device = torch.device("cpu"),
             cuts: tuple[float, ...] = CUTS) -> list[dict]:
    torch.manual_seed(0)
    model = case.build().train().to(device)
    x, y = (t.to(device) for t in case.inputs())
    loss = ((lambda out: F.cross_entropy(out, y)) if case.loss == "cross_entropy"
            else (lambda out: out.float().sum()))
    if not case.measured:
        x = x.to("meta")  # the labels stay real: the prediction makes them fake on first use
    elif device.type == "cuda":  # cuBLAS and cuDNN make their handles and workspaces once
        train_step(model, x, loss)
    measure = functools.partial(
        revnets.measure_memory if case.measured else revnets.predict_memory, train_step)
    unplanned = measure(model, x, loss).peak_bytes
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    rows, previous_peak = [], None
    for cut in cuts:
        budget = int(state + (1 - cut) * (unplanned - state))
        row: dict[str, Any] = {"model": case.name, "input": "x".join(map(str, x.shape)),
                               "cut_asked_pct": round(100 * cut), "budget_mib":
                               round(budget / MiB, 2)}
        try:
            planned, seconds, refusal = plan(model, x, budget, loss)
        except TypeError as error:  # a forward of the model's own that torch.fx cannot trace
            row["verdict"] = f"refused by name: {str(error).split(';')[0]}"
            rows.append(row)
            continue
        row["planning_s"] = round(seconds, 2)
        if planned is None:
            named = refusal.smallest_budget
            row["refused_named_mib"] = round(named / MiB, 2)
            planned, _, again = plan(model, x, named, loss)
            if planned is None:
                row["verdict"] = "WRONG: the named budget is refused too"
                rows.append(row)
                continue
            budget = named
        predicted = planned.memory_plan.peak_bytes
        peak = measure(planned, x, loss).peak_bytes if case.measured else predicted
        overhead = math.nan
        if case.measured:
            times = interleaved_times({"plain": functools.partial(train_step, model, x, loss),
                                       "planned": functools.partial(train_step, planned, x, loss)},
                                      repeats).seconds
            step = statistics.median(times["plain"])
            overhead = statistics.median(times["planned"]) / step - 1
            row["step_ms"] = round(1000 * step, 1)
            row["planning_steps"] = round(seconds / step)
        ok = peak == predicted and peak <= budget and (previous_peak is None
                                                       or peak <= previous_peak)
        row.update({
            "cut_reached_pct": round(100 * (unplanned - peak) / (unplanned - state), 1),
            "measured_mib": round(peak / MiB, 2) if case.measured else "-",
            "predicted_mib": round(predicted / MiB, 2),
            "measured_minus_predicted_b": peak - predicted if case.measured else "-",
            "measured_eq_predicted": peak == predicted if case.measured else "-",
            "overhead_pct": round(100 * overhead, 1) if case.measured else "-",
            "verdict": (("refused, named budget plans" if "refused_named_mib" in row
                         else "planned") + _whole_modules(planned)) if ok else "WRONG",
        })
        previous_peak = peak
        rows.append(row)
    return rows


def _whole_modules(planned: nn.Module) -> str:
    if isinstance(planned, CheckpointedModules):
        return " (whole modules: torch.fx cannot trace its own forward)"
    return ""


FIELDS = ["model", "input", "cut_asked_pct", "budget_mib", "refused_named_mib", "cut_reached_pct",
          "planning_s", "step_ms", "planning_steps", "measured_mib", "predicted_mib",
          "measured_minus_predicted_b", "measured_eq_predicted",
          "overhead_pct", "verdict"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="",
                        help="models whose name contains this (several: comma-separated)")
    parser.add_argument("--skip", default=None, help="leave out models whose name contains this")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps for the overhead")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where tables go")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--set", choices=SETS, default="zoo",
                        help="zoo: the models above; torchvision: every classification model "
                        "torchvision registers; timm: TIMM_MODELS")
    parser.add_argument("--cuts", default=",".join(map(str, CUTS)),
                        help="shares of the activation part cut (default: %(default)s)")
    args = parser.parse_args(argv)
    cuts = tuple(float(cut) for cut in args.cuts.split(","))
    args.command = " ".join(["planner_zoo.py", *(sys.argv[1:] if argv is None else argv)])
    torch.set_num_threads(torch.get_num_threads())
    rows = []
    for case in SETS[args.set]():
        if not any(name in case.name for name in args.only.split(",")) or (
            args.skip and args.skip in case.name
        ):
            continue
        start = time.perf_counter()
        for row in run_case(case, args.repeats, torch.device(args.device), cuts):
            print("  ", row, flush=True)
            rows.append(row)
        print(f"{case.name}: {time.perf_counter() - start:.0f} s", flush=True)
        write(rows, args)  # after every model: an interrupted run keeps what it measured


def write(rows: list[dict], args: argparse.Namespace) -> None:
    suffix = ("-" + args.only.replace(",", "+") if args.only else "") + (
        f"-{args.set}" if args.set != "zoo" else "")
    stem = results_stem("planner_zoo", torch.device(args.device).type) + suffix
    write_csv(args.results / f"{stem}.csv", [{f: r.get(f, "") for f in FIELDS} for r in rows])
    lines = [
        "# auto_checkpoint on models it was not tuned to",
        "",
        provenance(args.command, args.device),
        "",
        "Budget: the measured peak of one unplanned training step (cross-entropy on random "
        "labels the loss closes over) with its activation part (above "
        "parameters and gradients) cut by the share asked. Planning: wall-clock seconds of "
        "`auto_checkpoint` (forward times measured included). Measured: `measure_memory` of the "
        "planned step (on CUDA: the caching allocator's peak, after one warm-up step that "
        "makes cuBLAS's and cuDNN's handles); predicted: the plan's `peak_bytes`. A refusal "
        "is followed by a request for the budget it names, which must plan. " + (
            "RevNet-992 (stored, unplanned) at batch 128 needs more memory than this machine "
            "has: it is planned on a meta input standing for a CPU one (no forward times "
            "measured), its budget's base predicted, its plan's peak not measured. "
            if args.set == "zoo" else "") + "Overhead: "
        f"median of {args.repeats} interleaved steps, planned over unplanned; step: the "
        "unplanned step's median in the same run, and planning in those steps (the machine's "
        "speed moves from hour to hour, the ratio much less). Timing columns are "
        "from whatever machine ran this; the memory columns are deterministic.",
        "",
        "| model | input | cut asked | budget (MiB) | refused, named (MiB) | cut reached | "
        "planning (s) | step (ms) | planning (steps) | measured (MiB) | predicted (MiB) | "
        "measured - predicted (B) | measured == predicted | overhead | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(f, "-")) for f in FIELDS) + " |")
    write_markdown(args.results / f"{stem}.md", lines)


if __name__ == "__main__":
    main(sys.argv[1:])
