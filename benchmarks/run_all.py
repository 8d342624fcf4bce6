"""Regenerate everything in results/ (about 70 minutes on 2 CPU cores; needs `.[bench]`).

    pip install -e '.[bench]' && python benchmarks/run_all.py
"""

import accuracy
import memory_timeline
import memory_vs_depth
import peers
import plan_example
import planning_torchvision
import vit_memory

import reversible_stack
import zoo_memory

if __name__ == "__main__":
    for script in (reversible_stack, peers, zoo_memory, vit_memory, memory_timeline,
                   memory_vs_depth, accuracy, planning_torchvision, plan_example):
        print(f"== {script.__name__}", flush=True)
        script.main([])
