"""revnets at transformers' own gradient checkpointing's peak: the plan `auto_checkpoint` makes
for the peak `revnets.measure_memory` measures under `model.gradient_checkpointing_enable()`,
and transformers' checkpointing itself, timed interleaved in one process, at two widths.

    python benchmarks/hf_checkpointing.py            # Llama and GPT-2, widths 256 and 1024
    python benchmarks/hf_checkpointing.py --quick    # small sizes, to check that it runs

Each model: 4 layers, vocabulary 4096, batch 4 x 256 tokens, random weights, ``use_cache=False``,
trained with cross-entropy on its logits. Peak: ``measure_memory``'s, as the planner's budget is
read. Time: median of interleaved steps. A checkpointed call's forward in revnets runs under the
replay's dispatcher watch (NOTE [ Replay ]), a cost per operator that the width does not change.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import revnets

from common import (
    RESULTS,
    MiB,
    interleaved_times,
    provenance,
    results_stem,
    write_csv,
    write_markdown,
)

VOCAB = 4096


def build(kind: str, width: int, layers: int, length: int) -> torch.nn.Module:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default configs' token ids outside VOCAB
        if kind == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=width, intermediate_size=int(2.75 * width),
                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                max_position_embeddings=length, use_cache=False))
        else:
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=8, n_positions=length,
                use_cache=False))
    return model.train()


def measure(kind: str, width: int, quick: bool, repeats: int) -> list[dict]:
    layers, length, batch = (2, 32, 2) if quick else (4, 256, 4)
    torch.manual_seed(0)
    model = build(kind, width, layers, length)
    x = torch.randint(0, VOCAB, (batch, length))
    y = torch.randint(0, VOCAB, (batch * length,))

    def loss_of(out):
        return F.cross_entropy(out.logits.reshape(-1, VOCAB), y)

    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable()

    def step_of(m):
        def step():
            m.zero_grad(set_to_none=True)
            loss_of(m(x)).backward()
        return step

    hf_peak = revnets.measure_memory(step_of(hf)).peak_bytes
    planned = revnets.auto_checkpoint(model, x, hf_peak, loss_fn=loss_of)
    steps = {"hf checkpointing": step_of(hf), "revnets at hf's peak": step_of(planned)}
    peaks = {"hf checkpointing": hf_peak,
             "revnets at hf's peak": revnets.measure_memory(step_of(planned)).peak_bytes}
    timings = interleaved_times(steps, repeats)
    seconds = timings.seconds
    hf_time = statistics.median(seconds["hf checkpointing"])
    return [{"model": kind, "width": width, "method": key,
             "parts": ("every layer" if key == "hf checkpointing" else
                       " ".join(planned.names)),
             "peak_mib": round(peaks[key] / MiB, 2),
             "step_ms": round(1000 * statistics.median(seconds[key]), 1),
             "time_vs_hf": round(statistics.median(seconds[key]) / hf_time, 3),
             "page_faults": int(statistics.median(timings.page_faults[key]))}
            for key in steps]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    widths = (64,) if args.quick else (256, 1024)
    rows = []
    for kind in ("llama", "gpt2"):
        for width in widths:
            for row in measure(kind, width, args.quick, 2 if args.quick else args.repeats):
                print("  ", row, flush=True)
                rows.append(row)
    stem = results_stem("hf_checkpointing") + ("-quick" if args.quick else "")
    write_csv(args.results / f"{stem}.csv", rows)
    write_markdown(args.results / f"{stem}.md", [
        "# revnets at transformers' checkpointing's own peak",
        "",
        provenance(" ".join(["hf_checkpointing.py", *(argv or [])])),
        "",
        "Peak: `revnets.measure_memory`'s (the budget given to `auto_checkpoint` is transformers' "
        f"peak). Time: median of {args.repeats} interleaved steps, over transformers' step; "
        "page faults: the median step's minor page faults (fresh memory from the system).",
        "",
        "| model | width | method | parts checkpointed | peak (MiB) | step (ms) | time / HF's | "
        "page faults |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {r['model']} | {r['width']} | {r['method']} | {r['parts']} | {r['peak_mib']} | "
          f"{r['step_ms']} | {r['time_vs_hf']} | {r['page_faults']} |" for r in rows],
    ])


if __name__ == "__main__":
    main(sys.argv[1:])
