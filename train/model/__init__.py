"""The networks (docs/architecture.md): loading a diffusers directory into its training form (LoRA / full, fp8,
streaming, offloaded blocks), the conditioning as the pipelines compute it, the pipelines, LoRA
files, the tiny checkpoint and the released sizes."""
