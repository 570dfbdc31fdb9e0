"""Reading the latent cache (train/data/latent_cache.py writes it): the dataset over its shards in the rows' order,
the collate that joins a micro-batch's conditioning as its family joins it, the batch on the training device, and
the training source that builds a missing cache first."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from train import config
from train.config import files
from train.data import pairs, sources
from train.data.latent_cache import INDEX, REBUILD, CacheError, cache_dir, ensure
from train.model import family
from train.model.interface import Batch
from train.runtime import engine
from train.runtime.console import print0


class CachedDataset(torch.utils.data.Dataset):
    """The cached samples of `rows`, in their order (so the sampler picks the same samples as online)."""

    def __init__(self, directory: str | Path, index: dict, rows: list[pairs.Row]):
        self.directory, self.variant = Path(directory), index["variant"]  # whose family reads the conditioning
        by_line = {s["line"]: s for s in index["samples"]}
        missing = [row.line for row in rows if row.line not in by_line]
        if missing:  # the rows digest makes this unreachable unless the index was edited by hand
            raise CacheError(f"{self.directory}/{INDEX} lacks rows {missing[:10]}; rebuild the cache")
        # the shards' headers (a few KB each): a truncated or missing shard is named now, not at the step that reads it
        damaged = files.weights_file_problems(sorted({self.directory / s["file"] for s in index["samples"]}),
                                              REBUILD.format(directory=self.directory))
        if damaged:
            raise CacheError("; ".join(damaged))
        self.samples = [by_line[row.line] for row in rows]
        self._categories = [row.category for row in rows]  # the run's own (category_rules may have changed)
        self._files: dict[str, tuple[object, dict[int, list[str]]]] = {}  # opened lazily: each worker maps its own

    def __len__(self) -> int:
        return len(self.samples)

    def _bucket(self, s: dict) -> tuple:
        return family.variant_family(self.variant).cached_bucket_key(tuple(s["target_hw"]), _conditioning_meta(s))

    def bucket_keys(self) -> list[tuple[tuple[int, int], ...]]:
        """Per sample: latent (h, w) of the target, then of each reference (as pairs.EditDataset.bucket_keys)."""
        return [self._bucket(s) for s in self.samples]

    def categories(self) -> list[str | None]:
        return list(self._categories)

    def _opened(self, name: str) -> tuple[object, dict[int, list[str]]]:
        """The shard file and, per line, the names of its conditioning tensors (all but x0)."""
        if name not in self._files:
            f = safe_open(str(self.directory / name), framework="pt")
            names: dict[int, list[str]] = {}
            for key in f.keys():
                line, _, tensor = key.partition(".")
                if tensor != "x0":
                    names.setdefault(int(line), []).append(tensor)
            self._files[name] = f, names
        return self._files[name]

    def __getitem__(self, i: int) -> dict:
        """The sample's tensors (x0 and the conditioning's, by name) and SAMPLE_KEYS."""
        s = self.samples[i]
        try:
            f, names = self._opened(s["file"])
            tensors = {k: f.get_tensor(f"{s['line']}.{k}") for k in ("x0", *names[s["line"]])}
        except (OSError, SafetensorError) as e:  # checked when the run started, so the file changed since
            raise CacheError(f"{self.directory / s['file']} cannot be read any more ({e}); "
                             f"{REBUILD.format(directory=self.directory)}") from None
        return {**tensors, "meta": _conditioning_meta(s), "target_hw": tuple(s["target_hw"]), "line": s["line"],
                "bucket": self._bucket(s), "variant": self.variant}


# what a cached item holds besides the conditioning's tensors (which must not take these names)
SAMPLE_KEYS = ("x0", "meta", "target_hw", "line", "bucket", "variant")


def _conditioning_meta(sample: dict) -> dict:
    """The family's metadata of a cached sample: its index record less what the cache itself records."""
    return {k: v for k, v in sample.items() if k not in ("line", "file", "target_hw", "category")}


def collate(samples: list[dict]) -> dict:
    """Stack cached samples of one shape bucket; their conditioning is joined as the family joins it (prompts
    right-padded with a mask, as the online encoding pads them)."""
    lines = [s["line"] for s in samples]
    grids = {s["bucket"] for s in samples}
    if len(grids) > 1:
        raise ValueError(f"micro-batch of rows {lines} mixes latent sizes (target, references) {sorted(grids)}; "
                         "use train_micro_batch_size_per_gpu = 1 or data.buckets = true")
    parts = [(s["meta"], {k: v for k, v in s.items() if k not in SAMPLE_KEYS}) for s in samples]
    cond = family.variant_family(samples[0]["variant"]).join_conditioning(parts)
    return {"x0": torch.stack([s["x0"] for s in samples]), "cond": cond, "target_hw": samples[0]["target_hw"],
            "lines": lines}


def to_batch(raw: dict, device: torch.device) -> Batch:
    """A collated cached micro-batch on the training device, as sources.encode_batch returns the same samples."""
    return Batch(raw["x0"].to(device, non_blocking=True).float(), tuple(raw["target_hw"]), raw["cond"].to(device))


def cached_source(cfg: config.Config, d: engine.Dist, variant: str, rows: list[pairs.Row],
                  dataset) -> sources.LoaderSource:
    """Training input from the cache (built first when missing and data.cache = "auto"); no encoder is loaded.

    `dataset` is the online EditDataset of `rows`, used only to build a missing cache.
    """
    p = cfg.project
    index = ensure(cfg, d, variant, rows, dataset, rebuild_stale=False)
    cached = CachedDataset(cache_dir(cfg), index, rows)
    print0(f"training from the cache in {cache_dir(cfg)} ({len(cached)} samples); the VL encoder and VAE are "
           "not loaded", rank=d.rank)
    loader = pairs.build_loader(cached, cfg.micro_batch_size, d.rank, d.world_size, p.train.seed, p.data.num_workers,
                               p.data.pin_memory, p.data.shuffle, collate_fn=collate, buckets=p.data.buckets,
                               category_weights=p.data.category_weights, bucket_fill=p.data.bucket_fill)
    return sources.LoaderSource(loader, lambda raw: to_batch(raw, d.device))
