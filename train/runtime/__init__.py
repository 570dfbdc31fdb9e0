"""The run's machinery, below the model (docs/architecture.md): processes and DeepSpeed's engine, checkpoints and
exports, metrics, GPU monitoring, fault injection, out-of-memory advice, the output directory, preemption."""
