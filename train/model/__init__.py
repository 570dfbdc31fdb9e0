"""The networks (docs/architecture.md): the generic machinery (the family interface and registry, loading a diffusers
directory into its training form: LoRA / full, fp8, streaming, offloaded blocks, kept attention; LoRA files; images;
edits to render and their pipelines' placement) and one folder per model family (its variant detection, components,
conditioning as its pipelines compute it, pipelines, tiny checkpoint and released sizes)."""
