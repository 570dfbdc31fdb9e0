"""What the trainer reads (docs/architecture.md): the dataset's rows, the pre-flight, dataset and loader, prompt
processing, sampling, the latent cache, and the sources of encoded micro-batches."""
