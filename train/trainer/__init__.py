"""Training (docs/architecture.md): the builders and run shared by the commands and model_parallel, the loop, the
objective, validation."""
