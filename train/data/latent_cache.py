"""Precomputed target/reference latents and prompt embeddings, so that training loads only the transformer.

Built by the command train/cache.py, or inside a training run when `qwen_edit.data.cache = "auto"` and the
cache is missing. The cache lives in `data.cache_dir` ("" = OUTPUT/cache).

Each rank encodes its strided share of the rows (rank, rank + N, ...) with the frozen encoders exactly as
online training does (`train.data.sources.encode_batch`, one sample per call, so nothing is padded) and writes
`shard-RRRRR-of-NNNNN-PPPP.safetensors` files (a new part every ~2 GB so no rank holds more in memory).
Rank 0 writes `index.json` last and atomically, once every rank has finished: a directory without it is an
unfinished cache and counts as missing. Tensors per sample (row line `n`), in the encoder dtype:

    n.x0      L C    packed target latents (normalised VAE posterior mode; training takes them as float32)
    n.NAME    ...    the model family's conditioning of the sample (Conditioning.samples; Qwen-Image: n.ref, the
                     packed references one after the other, and n.embeds, Qwen2.5-VL's last hidden states of the
                     instruction, template prefix dropped, no padding)

The index records per sample its line, file, target size, the family's metadata of it and its category, and
`depends_on`: every input the tensors
depend on (model component files, variant, resolution policy, prompt template, encoder dtype, prompt
processing, the data rows and image files, library versions). Training compares it with the current run and
refuses a cache built for other inputs with a message naming each changed dependency and the fix; it is
never used or rebuilt silently.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from train import config
from train.data import pairs, sources
from train.model import family, loading
from train.model.interface import Encoders
from train.plan import cache_plan
from train.runtime import engine, write_failures
from train.runtime.console import print0, progress
from train.runtime.exports import apply_umask
from train.runtime.oom import out_of_memory

INDEX = "index.json"
FORMAT = 3  # bump when the layout or the meaning of the tensors changes (2: images opened by train/model/images.py;
# 3: a tRNS chunk's transparent colour composited over data.alpha_background)
PART_BYTES = 2 << 30  # a rank starts a new shard part after this many bytes of tensors
# Model components whose files the encodings depend on; files with these suffixes are large weights and are
# identified by name and size (reading 16 GB to hash it would take minutes), all others by content.
COMPONENTS = ("text_encoder", "vae", "processor", "tokenizer")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The aspect-ratio grid of the training sizes (pairs.aspect_steps): data.bucket_aspect_steps at micro-batch > 1.
SNAP_KEY = "data.bucket_aspect_steps (at micro-batch > 1; else 0, the pipelines' sizes)"
# Dependencies recorded since a later version, and the value every cache built before had.
UNRECORDED = {SNAP_KEY: "0"}


class CacheError(ValueError):
    """A cache that is missing (data.cache = "require") or was built for other inputs; the message says the fix."""


def cache_dir(cfg: config.Config) -> Path:
    """qwen_edit.data.cache_dir, or OUTPUT/cache when it is empty."""
    p = cfg.project
    return Path(p.data.cache_dir or Path(p.output.dir) / "cache")


# ---------------------------------------------------------------- what the cache depends on


def _sha(payload: bytes | str) -> str:
    return hashlib.sha256(payload.encode() if isinstance(payload, str) else payload).hexdigest()[:16]


def _file_sha(path: str) -> str:
    """Content hash of an optional settings file ("" = not set)."""
    return _sha(Path(path).read_bytes()) if path and Path(path).is_file() else f"none ({path!r})"


def model_files_digest(model_dir: str | Path) -> str:
    """Hash of the encoder components: config/tokenizer files by content, weight files by name and size."""
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    for component in COMPONENTS:
        for path in sorted((model_dir / component).rglob("*")):
            if not path.is_file():
                continue
            h.update(str(path.relative_to(model_dir)).encode())
            if path.suffix in WEIGHT_SUFFIXES:
                h.update(str(path.stat().st_size).encode())
            else:
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def rows_digest(data_dir: str | Path, rows: list[pairs.Row]) -> str:
    """Hash of the metadata file and of every row's prompt and image files (size and mtime, not content)."""
    data_dir = Path(data_dir)
    h = hashlib.sha256()
    for name in ("metadata.jsonl", "metadata.csv"):
        if (data_dir / name).is_file():
            h.update(name.encode() + (data_dir / name).read_bytes())
    for row in rows:
        h.update(json.dumps([row.line, row.target, row.references, row.prompt]).encode())
        for name in (row.target, *row.references):
            st = (data_dir / name).stat()
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def dependencies(cfg: config.Config, variant: str, rows: list[pairs.Row], dtype: torch.dtype) -> dict[str, str]:
    """{dependency: value or hash} of everything the cached tensors depend on; keys name what to change."""
    import diffusers
    import transformers

    d, fam = cfg.project.data, family.variant_family(variant)
    processing = json.dumps({"normalize_prompts": d.normalize_prompts, "prompt_mapping": _file_sha(d.prompt_mapping),
                             "blocked_terms": _file_sha(d.blocked_terms), "blocked_policy": d.blocked_policy})
    return {
        "format": str(FORMAT),
        "model files (text_encoder, vae, processor, tokenizer)": model_files_digest(cfg.project.model.path),
        "variant": variant,
        "model.encoder_dtype": str(dtype).removeprefix("torch."),
        "data.area": str(d.area),
        "data.condition_area": str(d.condition_area),
        SNAP_KEY: str(pairs.aspect_steps(d.bucket_aspect_steps, cfg.micro_batch_size, d.buckets)),
        "data.alpha_background": d.alpha_background,
        # the label older caches recorded for the prompt templates (now the model family's conditioning)
        "prompt template (train/model/conditioning.py)": _sha(fam.conditioning_fingerprint()),
        "prompt processing (data.normalize_prompts, prompt_mapping, blocked_terms, blocked_policy)": _sha(processing),
        "data rows and image files": rows_digest(d.path, rows),
        "library versions": f"diffusers {diffusers.__version__}, transformers {transformers.__version__}",
    }


def read_index(directory: Path) -> dict | None:
    """The finished cache's index, or None when there is none (no cache, or an unfinished one); CacheError naming
    it when it is damaged."""
    path = Path(directory) / INDEX
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CacheError(f"{path} is damaged ({type(e).__name__}: {e}); {REBUILD.format(directory=directory)}") \
            from None


REBUILD = "delete {directory}: data.cache \"auto\" (or python -m train.cache) then builds it again"


def stale_message(directory: Path, index: dict, wanted: dict[str, str]) -> str | None:
    """None when the cache was built for exactly `wanted`; otherwise the refusal naming each change and the fix."""
    have = {**UNRECORDED, **index.get("depends_on", {})}  # an older cache's value of what it did not record
    changed = [f"{key}: cache {have.get(key, '(not recorded)')!r}, now {value!r}"
               for key, value in wanted.items() if have.get(key) != value]
    if not changed:
        return None
    listing = "\n".join(f"  - {c}" for c in changed)
    return (f"the cache in {directory} was built for other inputs, so it is not used:\n{listing}\n"
            f"Rebuild it: delete {directory} (data.cache = \"auto\" then rebuilds it), or run "
            "python -m train.cache with this run's arguments")


# ---------------------------------------------------------------- building


def _write_part(directory: Path, rank: int, world_size: int, part: int, tensors: dict) -> str:
    name = f"shard-{rank:05d}-of-{world_size:05d}-{part:04d}.safetensors"
    save_file(tensors, str(directory / name), metadata={"format": f"qwen_edit cache {FORMAT}"})
    apply_umask(directory / name)  # safetensors writes 0600: a cache shared with a group would be unreadable to it
    return name


def _prepare_dir(directory: Path) -> None:
    """Rank 0 removes the index (the cache is unfinished from here on) and old shards."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / INDEX).unlink(missing_ok=True)
    for old in directory.glob("shard-*.safetensors"):
        old.unlink()


def _row_size(raw: dict) -> str:
    """A collated sample's image sizes for a message: "target WxH px, references WxH, WxH px"."""
    def wh(x: torch.Tensor) -> str:
        return f"{x.shape[-1]}x{x.shape[-2]}"

    refs = [wh(r) for r in raw["reference_pixels"]]
    return f"target {wh(raw['target'])} px" + (f", references {', '.join(refs)} px" if refs else "")


def encode_share(directory: Path, dataset, encoders: Encoders, variant: str, d: engine.Dist,
                 num_workers: int = 0) -> list[dict]:
    """Encode dataset items rank, rank + world, ... into this rank's shard parts; their index records."""
    share = torch.utils.data.Subset(dataset, range(d.rank, len(dataset), d.world_size))
    loader = torch.utils.data.DataLoader(share, batch_size=1, num_workers=num_workers, collate_fn=pairs.collate)
    records, tensors, pending, part = [], {}, [], 0
    for raw in progress(loader, desc="encoding", unit="sample", disable=not d.is_main):
        line = raw["lines"][0]
        try:
            b = sources.encode_batch(raw, encoders, variant)  # one sample: nothing padded, prompt mask None
        except torch.cuda.OutOfMemoryError as e:
            raise out_of_memory(e, f"building the cache, encoding row {line} ({_row_size(raw)})",
                                       "cache") from e
        (meta, cond), = b.cond.samples()
        sample = {"x0": b.x0[0].to(encoders.vae.dtype), **cond}  # x0 in the encoder dtype, as the conditioning
        tensors.update({f"{line}.{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in sample.items()})
        pending.append({"line": line, "target_hw": list(b.target_hw), **meta})
        if sum(t.nbytes for t in tensors.values()) >= PART_BYTES:
            name = _write_part(directory, d.rank, d.world_size, part, tensors)
            records += [{**r, "file": name} for r in pending]
            tensors, pending, part = {}, [], part + 1
    if tensors:
        name = _write_part(directory, d.rank, d.world_size, part, tensors)
        records += [{**r, "file": name} for r in pending]
    return records


def write_index(directory: Path, records: list[dict], rows: list[pairs.Row], wanted: dict[str, str],
                variant: str, world_size: int) -> None:
    """index.json, written last through a temporary file and a rename (its presence marks a finished cache)."""
    category = {row.line: row.category for row in rows}
    by_line = {r["line"]: r for r in records}
    samples = [{**by_line[row.line], "category": category[row.line]} for row in rows]
    index = {"format": FORMAT, "variant": variant, "world_size": world_size, "num_samples": len(samples),
             "depends_on": wanted, "samples": samples}
    tmp = directory / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    tmp.replace(directory / INDEX)


def write_cache(directory: Path, dataset, rows: list[pairs.Row], encoders: Encoders, variant: str,
                wanted: dict[str, str], d: engine.Dist, num_workers: int = 0) -> None:
    """Every rank encodes its share (a collective: all ranks call it); rank 0 writes the index last. A write that
    fails on any rank (a full disk, no permission) stops every rank together with CacheError naming the folder."""
    directory = Path(directory)
    _agree(d, directory, lambda: _prepare_dir(directory) if d.is_main else None)
    mine = _agree(d, directory, lambda: encode_share(directory, dataset, encoders, variant, d, num_workers))
    records = pairs.gather_lists(mine)
    _agree(d, directory, lambda: write_index(directory, records, rows, wanted, variant, d.world_size) if d.is_main
           else None)


def _agree(d: engine.Dist, directory: Path, write):
    """write()'s result, once every rank has learnt every rank's outcome (a collective): a write into `directory` that
    failed on any rank (a full disk, no permission) raises CacheError on all of them, so that none waits for the
    others in a later collective."""
    result, failure = None, None
    try:
        result = write()
    except (OSError, SafetensorError) as e:
        code, cause = write_failures.write_cause(e, directory)
        fix = {errno.ENOSPC: "free disk space there", errno.EDQUOT: "free space within your quota",
               errno.EROFS: "its file system is read-only", errno.EACCES: f"make {directory} writable for this user",
               errno.EPERM: f"make {directory} writable for this user"}.get(code, "check permissions and free space")
        failure = (f"writing the cache into {directory} failed on rank {d.rank} ({cause}); {fix}, or set "
                   "qwen_edit.data.cache_dir to a disk with room. The unfinished cache counts as missing: "
                   "data.cache \"auto\" (or python -m train.cache) builds it again")
    failures = [f for f in engine.all_gather_objects(failure) if f]
    if failures:
        raise CacheError(failures[0])
    return result


def build(cfg: config.Config, d: engine.Dist, variant: str, rows: list[pairs.Row], dataset,
          wanted: dict[str, str]) -> None:
    """Load the frozen encoders, write the cache, free the encoders (their memory returns before training)."""
    p = cfg.project
    directory = cache_dir(cfg)
    print0(f"building the cache of {len(rows)} rows in {directory} on {d.world_size} rank(s)", rank=d.rank)
    dtype = loading.encoder_dtype(p.model.encoder_dtype, d.device)
    # The plan's budget holds here too: where the VL encoder does not fit it, its blocks stream from host memory.
    stream = cache_plan.stream_vl_for_cache(cfg, d, dataset.bucket_keys())
    try:
        encoders = family.variant_family(variant).load_encoders(p.model.path, dtype, d.device,
                                                                stream_text_encoder=stream,
                                                                vae_2d_frames=p.model.vae_2d_frames)
    except torch.cuda.OutOfMemoryError as e:
        raise out_of_memory(e, "loading the encoders for the cache", "cache") from e
    write_cache(directory, dataset, rows, encoders, variant, wanted, d, p.data.num_workers)
    del encoders
    gc.collect()
    if d.device.type == "cuda":
        torch.cuda.empty_cache()


def ensure(cfg: config.Config, d: engine.Dist, variant: str, rows: list[pairs.Row], dataset, rebuild_stale: bool):
    """The index of a cache built for exactly this run's inputs; builds it when missing (data.cache = "auto",
    or always from the command), rebuilds a stale one only when `rebuild_stale` (the command), else refuses."""
    p = cfg.project
    directory = cache_dir(cfg)
    wanted = dependencies(cfg, variant, rows, loading.encoder_dtype(p.model.encoder_dtype, d.device))
    index = read_index(directory)
    if index is None and p.data.cache == "require" and not rebuild_stale:
        raise CacheError(f"qwen_edit.data.cache is \"require\" but {directory} holds no finished cache (no {INDEX}); "
                         "build it first with python -m train.cache and this run's arguments, or set data.cache to "
                         "\"auto\" to build it before training")
    stale = index is not None and stale_message(directory, index, wanted)
    if stale and not rebuild_stale:
        raise CacheError(stale)
    if index is None or stale:
        build(cfg, d, variant, rows, dataset, wanted)
        index = read_index(directory)
    return index
