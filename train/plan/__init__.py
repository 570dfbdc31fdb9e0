"""The memory plan (docs/architecture.md), above the model: sizes counted (sizes, host), blocks measured (measure), the
pure choice (choice) and its words (explain), the run's plan (run_plan, keys), the cache build's decision
(cache_plan) and train.infer's placement (inference). Every call that builds or runs a specific architecture goes
through arch, the model family's hooks."""
