"""Regenerate everything in results/ (about three hours on 2 CPU cores; needs
`.[bench]`).

    pip install -e '.[bench]' && python benchmarks/run_all.py
"""

import accuracy
import budget_sweep
import compile_speed
import exact_accuracy
import exact_error_vs_depth
import exact_step_time
import frontier
import hf_capture
import hf_checkpointing
import memory_timeline
import memory_vs_depth
import peers
import peers_overhead
import plan_example
import planner_zoo
import planning_lstm
import planning_torchvision
import vit_memory

import reversible_stack
import zoo_memory

if __name__ == "__main__":
    # Timing-sensitive scripts first, while the allocator is fresh.
    for script in (reversible_stack, peers, peers_overhead, exact_step_time, compile_speed,
                   zoo_memory, vit_memory, memory_timeline, memory_vs_depth, accuracy,
                   planning_torchvision, planning_lstm, plan_example, planner_zoo, budget_sweep,
                   exact_error_vs_depth, exact_accuracy, frontier, hf_checkpointing, hf_capture):
        print(f"== {script.__name__}", flush=True)
        script.main([])
    # The tables these scripts write under other arguments.
    for script, arguments in ((planner_zoo, ["--set", "torchvision", "--cuts", "0.5",
                                             "--repeats", "1"]),
                              (planner_zoo, ["--set", "timm", "--cuts", "0.5", "--repeats", "1"]),
                              (budget_sweep, ["--measured"])):
        print(f"== {script.__name__} {' '.join(arguments)}", flush=True)
        script.main(arguments)
