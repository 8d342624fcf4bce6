"""torch.compile on the zoo: the compiled training step against the eager one, per model and plan.

For every zoo model (timm-registered by revnets) and every memory plan that fits it, one eager and
one compiled (``revnets.compile_model(model)``: ``torch.compile`` with inductor, the model's layout
kept on CPU, NOTE [ Layout under torch.compile ]; ``--compiler torch`` for plain
``torch.compile``) copy of the same weights:

1. gradients: one training step on the same batch; the compiled gradients' largest difference
   from eager's, relative to the largest eager gradient of the same parameter (float32 compile
   reorders sums and fuses kernels, so bit equality is not expected), and both runs' differences
   from a float64 eager run of the same weights (which of the two is off);
2. training and evaluation alternate (train step, eval forward, train step, eval forward) with
   ``torch._dynamo.config.fail_on_recompile_limit_hit`` set: a recompile-limit hit is an error;
3. step times, eager and compiled interleaved round by round (``interleaved_times``), after the
   warm-up: the ratio compiled / eager, below 1 where compiling pays;
4. graph breaks (dynamo's counters) and the graphs compiled, over all of the above;
5. what compiling cannot speed up: the share of one profiled step's operator time (torch.profiler,
   self time) in matrix products, convolutions and attention, eager and compiled. Compiled code
   calls the same library kernels for these (inductor fuses the rest), so the eager share is
   about the lowest ratio compiling can reach.

``python benchmarks/compile_speed.py`` runs the small default set (a ResNet and a RevNet, every plan
that fits); pass ``--models all`` for the whole zoo (each deep model takes minutes to compile) or a
comma list (``--models irevnet163,revvit_small_patch16_224``), and ``--plans`` to choose plans;
``--transforms`` chooses how the reversible engine runs f and g: as the library's default does
(``compile_transforms=None``: compiled on the CPU, each block's backward step one compiled
function, NOTE [ Compiled block backward ]; eager on a GPU), ``eager`` (False) or ``compiled``
(True: also on a GPU).
Writes results/compile_speed-<device>-...{.csv,.md}.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import time
from collections.abc import Callable

import timm
import torch
import torch._dynamo
import torch.nn.functional as F
from timm_model_tests import revnets_models
from torch import nn
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

import revnets  # registers the zoo with timm
from revnets import ReversibleSequence
from revnets.plan import PRESETS

from common import (
    RESULTS,
    interleaved_times,
    provenance,
    ratio_summary,
    results_stem,
    train_step,
    write_csv,
    write_markdown,
)

DEFAULT_MODELS = ("resnet32", "revnet38")
# What the step runs on: 32x32 images, as the CIFAR models are built for; the ImageNet models at
# 64x64; a Rev-ViT at 32x32 in 4x4 patches (64 tokens) with its full width and depth.
INPUT = {"preact_resnet101": 64, "revnet104": 64}
KWARGS = {"revvit": {"img_size": 32, "patch_size": 4}}


def build(name: str, plan: str, device: str = "cpu") -> nn.Module | None:
    """The model with ``plan``, or None where the plan does not fit it (a ResNet reconstructs
    nothing)."""
    kwargs = next((kw for prefix, kw in KWARGS.items() if name.startswith(prefix)), {})
    torch.manual_seed(0)
    try:
        return timm.create_model(name, num_classes=10, memory=plan, **kwargs).to(device)
    except ValueError as error:
        if "does not fit" in str(error):
            return None
        raise


# Operators compiled code leaves to the same library kernels as eager code (extern calls):
# mm, addmm, bmm, baddbmm; every convolution, forward and backward; attention.
_PRODUCTS = re.compile(r"^aten::(\w*mm|\w*conv\w*|\w*attention\w*)$")


def product_share(step: Callable[[], object]) -> float:
    """The share of one ``step``'s operator self time in :data:`_PRODUCTS` (torch.profiler)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    products = sum(e.self_cpu_time_total for e in events if _PRODUCTS.match(e.key))
    return products / total if total else 0.0


def gradient_error(compiled: nn.Module, eager: nn.Module) -> float:
    """max over parameters of max|g_compiled - g_eager| / max|g_eager| (in float64), the scale
    floored at 1e-4 of the model's largest gradient entry: a gradient that is zero in exact
    arithmetic (an attention key's bias, a bias before batch norm) is round-off noise in both."""
    pairs = []
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"{name}: a gradient in one run only")
        if q.grad is not None:
            pairs.append((p.grad.double(), q.grad.double()))
    floor = 1e-4 * max(reference.abs().max().item() for _, reference in pairs)
    return max(
        (g - reference).abs().max().item() / max(reference.abs().max().item(), floor)
        for g, reference in pairs
    )


def measure(
    name: str, plan: str, batch: int, repeats: int, transforms: str = "default",
    device: str = "cpu",
    size: int | None = None, compiler: str = "revnets",
) -> dict | None:
    model = build(name, plan, device)
    if model is None:
        return None
    if transforms != "default":  # f and g inside the engine: never, or always compiled
        for sequence in model.modules():
            if isinstance(sequence, ReversibleSequence):
                sequence.compile_transforms = transforms == "compiled"
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = revnets.compile_model(model) if compiler == "revnets" else torch.compile(model)
    if size is None or any(name.startswith(prefix) for prefix in KWARGS):
        size = INPUT.get(name, 32)
    x = torch.randn(batch, 3, size, size, device=device)
    target = torch.randint(0, 10, (batch,), device=device)

    exact = copy.deepcopy(eager).double()
    start = time.perf_counter()
    for net, batch_ in ((compiled, x), (eager, x), (exact, x.double())):
        net.train()
        net.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        F.cross_entropy(net(batch_), target).backward()
    error = gradient_error(model, eager)
    compiled_error, eager_error = gradient_error(model, exact), gradient_error(eager, exact)
    del exact
    optimizers = {
        key: torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        for key, net in (("eager", eager), ("compiled", compiled))
    }
    for _ in range(2):  # training and evaluation alternate, as in any loop
        for net in (compiled, eager):
            net.train()
            train_step(net, optimizers["compiled" if net is compiled else "eager"], x, target)
            net.eval()
            with torch.no_grad():
                net(x)
            net.train()
    warm_s = time.perf_counter() - start

    def step(key: str, net: nn.Module):
        return lambda: train_step(net, optimizers[key], x, target)

    timings = interleaved_times(
        {"eager": step("eager", eager), "compiled": step("compiled", compiled)}, repeats
    )
    shares = {key: product_share(step(key, net))
              for key, net in (("eager", eager), ("compiled", compiled))}
    breaks = counters["graph_break"]
    return {
        "model": name,
        "plan": plan,
        "compiler": compiler,
        "transforms": transforms,
        "batch": batch,
        "input": size,
        "grad_rel_error": float(f"{error:.2e}"),
        "compiled_vs_float64": float(f"{compiled_error:.2e}"),
        "eager_vs_float64": float(f"{eager_error:.2e}"),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(breaks.values()),
        "break_reasons": "; ".join(sorted({r.splitlines()[0][:80] for r in breaks})),
        "compile_and_warmup_s": round(warm_s, 1),
        "eager_step_s": round(sorted(timings.seconds["eager"])[repeats // 2], 4),
        "products_share_eager": round(shares["eager"], 3),
        "products_share_compiled": round(shares["compiled"], 3),
        **ratio_summary(timings.seconds["compiled"], timings.seconds["eager"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated zoo names, or 'all' (default: %(default)s)")
    parser.add_argument("--plans", default=",".join(PRESETS),
                        help="comma-separated memory plans (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transforms", choices=("default", "eager", "compiled"),
                        default="default",
                        help="f and g inside the reversible engine: as the library's default "
                        "(compiled on the CPU), eager, or compiled also on a GPU, where they "
                        "allow it (NOTE [ Compiled transforms ])")
    parser.add_argument("--compiler", choices=("revnets", "torch"), default="revnets",
                        help="revnets.compile_model (the trainer's) or plain torch.compile")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--out", default=None, help="results file stem (default: timm-style)")
    parser.add_argument("--size", type=int, default=None,
                        help="image side for the CNNs (default: 64 for the ImageNet ones, else "
                        "32); the Rev-ViTs keep their 32x32 configuration")
    args = parser.parse_args(argv)
    zoo = revnets_models()
    models = zoo if args.models == "all" else args.models.split(",")
    unknown = [m for m in models if m not in zoo]
    if unknown:
        parser.error(f"not zoo models: {', '.join(unknown)}; the zoo: {', '.join(zoo)}")
    plans = args.plans.split(",")
    unknown = [p for p in plans if p not in PRESETS]
    if unknown:
        parser.error(f"not memory plans: {', '.join(unknown)}; plans: {', '.join(PRESETS)}")
    # A recompile-limit hit raises instead of silently falling back to eager.
    torch._dynamo.config.fail_on_recompile_limit_hit = True

    rows: list[dict] = []
    stem = args.out or results_stem("compile_speed", torch.device(args.device).type) + (
        "-torch-compile" if args.compiler == "torch" else "")
    command = " ".join(["compile_speed.py", *(sys.argv[1:] if argv is None else argv)])
    for name in models:
        for plan in plans:
            row = measure(name, plan, args.batch, args.repeats, args.transforms, args.device,
                          args.size, args.compiler)
            if row is not None:
                print({k: v for k, v in row.items() if k != "break_reasons"}, flush=True)
                rows.append(row)
                # After every row: a run over the whole zoo takes hours, and a cut-off one keeps
                # what it measured.
                write_results(stem, rows, command, args.device)


_TRANSFORMS = {
    "default": "Reversible engine: as by default (`compile_transforms=None`: on the CPU f and g "
               "compiled, each block's backward step one compiled function; eager on a GPU). ",
    "eager": "Reversible engine: f and g eager (`compile_transforms=False`). ",
    "compiled": "Reversible engine: f and g compiled, each block's backward step one compiled "
                "function where both are (`compile_transforms=True`). ",
}


def write_results(stem: str, rows: list[dict], command: str, device: str) -> None:
    write_csv(RESULTS / f"{stem}.csv", rows)
    lines = [
        "# torch.compile: compiled / eager training step",
        "",
        provenance(command, device),
        "",
        ("compiled: `revnets.compile_model` (torch.compile, inductor, the model's layout kept "
         "on CPU: NOTE [ Layout under torch.compile ] in revnets/compiling.py). "
         if rows[0].get("compiler", "revnets") == "revnets" else
         "compiled: plain `torch.compile` (inductor's defaults). ")
        + _TRANSFORMS[rows[0].get("transforms", "default")]
        + "ratio: median compiled step / median eager step (below 1: compiling pays); paired: "
        "min / median / max of the per-round ratios. grad error: max |compiled - eager| / "
        "max |eager| over each parameter's gradient (at least 1e-4 of the model's largest), "
        "worst parameter; the same for compiled and for eager against a float64 eager run. "
        "Graphs and breaks: dynamo's counts over "
        "the gradient check, two rounds of training and evaluation and the timed steps. No "
        "run hit the recompile limit (it would have raised). products: the share of one "
        "profiled step's operator time (torch.profiler, self time) in matrix products, "
        "convolutions and attention, eager / compiled; compiled code calls the same library "
        "kernels for these, so the eager share is about the lowest ratio compiling can reach.",
        "",
        "| model | plan | ratio | paired | eager step s | products | grad error | "
        "compiled / eager vs float64 | graphs | breaks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['ratio']:.2f} | {r['ratio_min']:.2f} / "
            f"{r['ratio_median']:.2f} / {r['ratio_max']:.2f} | {r['eager_step_s']:.3f} | "
            f"{r['products_share_eager']:.0%} / {r['products_share_compiled']:.0%} | "
            f"{r['grad_rel_error']:.1e} | {r['compiled_vs_float64']:.1e} / "
            f"{r['eager_vs_float64']:.1e} | {r['graphs']} | {r['graph_breaks']} |"
        )
    reasons = sorted({reason for r in rows for reason in r["break_reasons"].split("; ") if reason})
    if reasons:
        lines += ["", "Graph break reasons seen: " + "; ".join(f"`{r}`" for r in reasons) + "."]
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main()
