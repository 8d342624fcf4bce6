"""Plans of modules, for models torch.fx cannot trace: the model's own forward runs, and some of
the modules it calls run as checkpoints, whole, selectively or as runs of several (NOTE [ Plans
of whole modules ] in plan.py): profile (what each module's calls cost: ModuleProfile, the
profiler, the runs its calls make), install (the checkpointed forwards set over the modules'
own for a step: NOTE [ Runs of modules ]), plan (CheckpointedModules, the search). Each imports
only those before it in that order; none imports the planning package's face."""
