"""The run's machinery, below the model (docs/architecture.md): processes and DeepSpeed's engine, checkpoints and
exports, metrics, GPU monitoring, fault injection, the output directory, preemption."""
