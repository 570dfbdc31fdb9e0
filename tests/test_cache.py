"""The latent/embedding cache: same tensors and losses as online encoding, sharding, refusal of stale caches.

In-process tests build the cache with a world of one (no process group); the trainer and the 2-rank
precompute run as subprocesses through the real entry points.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import warm
from conftest import (
    REPO,
    launcher_command,
    metrics,
    patch_family,
    run_trainer,
    small_tmpfs,
    start_refused,
    write_config,
)
from safetensors.torch import load_file

from train import config
from train.data import cache_reader, latent_cache, pairs, sources
from train.model.qwen_image import components, conditioning
from train.runtime import engine

WORLD_OF_ONE = engine.Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One CPU thread here and in the subprocesses: the CI cores are shared, and spinning OpenMP threads made
    the tiny encoders ~8x slower there. Comparisons are made between runs with the same thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


def load_cfg(tiny: Path, tmp: Path, **changes) -> config.Config:
    path = write_config(tmp / "cfg.json", **{"qwen_edit.data.num_workers": 0, **changes})
    args = config.parse_args(["--ds_config", str(path), "--model", str(tiny / "model"), "--data", str(tiny / "data"),
                              "--output_dir", str(tmp / "out")])
    return config.load_config(args, 1, has_gpu=False)


def data_of(cfg: config.Config) -> tuple[str, list[pairs.Row], pairs.EditDataset]:
    """Rows and dataset exactly as training reads them (train.trainer.build.build_data, as the cache command does)."""
    from train.trainer import build

    variant = components.detect_variant(cfg.project.model.path)
    rows, loader = build.build_data(cfg, WORLD_OF_ONE, variant)
    return variant, rows, loader.dataset


def copy_tiny(tiny: Path, to: Path, num_rows: int | None = None, longer_prompt: int | None = None) -> Path:
    """The tiny dataset copied (the model linked), cut to `num_rows`, row `longer_prompt` with a longer prompt."""
    import shutil

    shutil.copytree(tiny / "data", to / "data")
    (to / "model").symlink_to(tiny / "model")
    meta = to / "data" / "metadata.jsonl"
    records = [json.loads(line) for line in meta.read_text().splitlines()][:num_rows]
    if longer_prompt is not None:
        records[longer_prompt]["prompt"] += " and keep the background as it is"
    meta.write_text("".join(json.dumps(r) + "\n" for r in records))
    return to


@pytest.fixture(scope="module", params=["tiny_edit", "tiny_plus"])
def built(request, tmp_path_factory):
    """A cache built in-process for v1 and for 2509 (two references per row), on 12 rows of which row 2 has a
    longer prompt: (cfg, variant, rows, dataset, index)."""
    torch.set_num_threads(1)  # (module fixtures run before the autouse one)
    tmp = tmp_path_factory.mktemp(request.param)
    cfg = load_cfg(copy_tiny(request.getfixturevalue(request.param), tmp, num_rows=12, longer_prompt=1), tmp)
    variant, rows, dataset = data_of(cfg)
    index = latent_cache.ensure(cfg, WORLD_OF_ONE, variant, rows, dataset, rebuild_stale=True)
    return cfg, variant, rows, dataset, index


def test_cached_tensors_equal_online_encoding(built):
    """Every cached sample equals sources.encode_batch on the same row exactly (CPU fp32, micro-batch 1)."""
    cfg, variant, rows, dataset, index = built
    assert index["num_samples"] == len(rows) and [s["line"] for s in index["samples"]] == [r.line for r in rows]
    encoders = components.load_encoders(cfg.project.model.path, torch.float32, torch.device("cpu"))
    cached = cache_reader.CachedDataset(latent_cache.cache_dir(cfg), index, rows)
    for i in range(0, len(rows), 3):
        online = sources.encode_batch(pairs.collate([dataset[i]]), encoders, variant)
        got = cache_reader.to_batch(cache_reader.collate([cached[i]]), torch.device("cpu"))
        assert got.target_hw == online.target_hw
        assert got.cond.reference_shapes == online.cond.reference_shapes
        assert len(got.cond.reference_shapes) == (2 if variant == "edit_plus" else 1)
        assert online.cond.prompt_mask is None and got.cond.prompt_mask is None
        for a, b in ((got.x0, online.x0), (got.cond.reference_tokens, online.cond.reference_tokens),
                     (got.cond.prompt_embeds, online.cond.prompt_embeds)):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b), f"row {rows[i].line}: max |difference| {(a - b).abs().max():.3g}"


def test_cache_files_follow_the_users_umask(built):
    """The shards (safetensors alone writes 0600) and the index are readable as the user's umask allows."""
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    files = [f for f in latent_cache.cache_dir(built[0]).rglob("*") if f.is_file()]
    assert any(f.suffix == ".safetensors" for f in files)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: 0o666 & ~mask for f in files}


def test_streamed_text_encoder_encodes_the_same(built):
    """Qwen2.5-VL streamed from host memory (loading.stream_from_host: a BlockOffloader per block list, as the
    cache build uses it where the encoder does not fit the budget) gives exactly the resident encoder's
    embeddings; every block's matrices are in the offloaders' host buffers, the rest stays a parameter."""
    cfg, variant, rows, dataset, _ = built
    cpu = torch.device("cpu")
    resident = components.load_encoders(cfg.project.model.path, torch.float32, cpu)
    streamed = components.load_encoders(cfg.project.model.path, torch.float32, cpu, stream_text_encoder=True)
    vl = streamed.text_encoder
    vision, text = vl.stream_offloaders
    assert len(vision.blocks) == len(vl.model.visual.blocks) and len(text.blocks) == len(vl.model.language_model.layers)
    assert all(t.dim() < 2 for b in [*vl.model.visual.blocks, *vl.model.language_model.layers]
               for t in b.parameters())  # the matrices became the offloaders' buffers
    for i in (0, 1):
        raw = pairs.collate([dataset[i]])
        a, b = (sources.encode_batch(raw, e, variant).cond.prompt_embeds for e in (resident, streamed))
        assert torch.equal(a, b)
    assert text.fetches == 2 * len(text.blocks) and text.copies >= len(text.blocks)  # each block came from the host


def test_a_streamed_build_writes_the_same_cache(built, tmp_path, monkeypatch):
    """When the memory plan says Qwen2.5-VL must stream (cache_plan.stream_vl_for_cache, faked here: on a CPU it never
    streams), the build loads it streamed and writes the same tensors as the resident build."""
    import dataclasses

    from train.plan import cache_plan

    cfg, variant, rows, dataset, index = built
    p = dataclasses.replace(cfg.project, data=dataclasses.replace(cfg.project.data, cache_dir=str(tmp_path / "s")))
    streamed_cfg = dataclasses.replace(cfg, project=p)
    assert not cache_plan.stream_vl_for_cache(streamed_cfg, WORLD_OF_ONE, dataset.bucket_keys())  # CPU: never
    loads = []
    real = components.load_encoders
    monkeypatch.setattr(cache_plan, "stream_vl_for_cache", lambda c, d, keys: True)
    patch_family(monkeypatch, load_encoders=lambda *a, **k: loads.append(k) or real(*a, **k))
    latent_cache.build(streamed_cfg, WORLD_OF_ONE, variant, rows, dataset, index["depends_on"])
    assert loads == [{"stream_text_encoder": True, "vae_2d_frames": True}]  # model.vae_2d_frames passed on
    a = cache_reader.CachedDataset(latent_cache.cache_dir(cfg), index, rows)
    b = cache_reader.CachedDataset(tmp_path / "s", latent_cache.read_index(tmp_path / "s"), rows)
    for i in (0, len(rows) - 1):
        for x, y in zip(a[i].values(), b[i].values(), strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_out_of_memory_while_building_names_the_row(built, tmp_path, monkeypatch):
    """A CUDA out-of-memory error while the cache encodes a row stops the build with the trainer's OutOfMemory (no
    traceback): the row, its image sizes, torch's figures and the cache build's own levers; no index is left, so the
    next run rebuilds the cache instead of reading a partial one."""
    import dataclasses

    from train.runtime import oom

    cfg, variant, rows, dataset, index = built
    p = dataclasses.replace(cfg.project, data=dataclasses.replace(cfg.project.data, cache_dir=str(tmp_path / "c")))
    real, calls = sources.encode_batch, []

    def encode_batch(raw, encoders, variant):
        calls.append(raw["lines"][0])
        if len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 144.00 MiB. GPU 0 has a total "
                                              "capacity of 139.8 GiB of which 1 GiB is free. Of the allocated "
                                              "memory 12.54 GiB is allocated by PyTorch, and 2.35 GiB is reserved "
                                              "by PyTorch but unallocated.")
        return real(raw, encoders, variant)

    monkeypatch.setattr(sources, "encode_batch", encode_batch)
    with pytest.raises(oom.OutOfMemory) as e:
        latent_cache.build(dataclasses.replace(cfg, project=p), WORLD_OF_ONE, variant, rows, dataset,
                           index["depends_on"])
    message = str(e.value)
    h, w = dataset[2]["target"].shape[-2:]
    assert f"while building the cache, encoding row {calls[2]} (target {w}x{h} px" in message, message
    assert "tried to allocate 144.00 MiB; 12.54 GiB allocated and 2.35 GiB reserved but free" in message
    assert message.endswith(oom.oom_advice("cache", 1)) and "python -m train.cache" in message
    assert "micro_batch" not in message and e.value.without_traceback
    assert latent_cache.read_index(tmp_path / "c") is None


def test_cached_micro_batch_pads_prompts_like_online(built):
    """A micro-batch of prompts of different lengths: the same mask and padding as online, values within 5e-5
    absolute on values of order 1 (online encodes the two samples as one batch, the cache one at a time, and CPU
    kernels round a batch of 2 differently: ~1e-5 measured)."""
    cfg, variant, rows, dataset, index = built
    lengths = [s["prompt_tokens"] for s in index["samples"]]
    i, j = 0, 1
    assert lengths[j] > lengths[i], lengths
    encoders = components.load_encoders(cfg.project.model.path, torch.float32, torch.device("cpu"))
    cached = cache_reader.CachedDataset(latent_cache.cache_dir(cfg), index, rows)
    online = sources.encode_batch(pairs.collate([dataset[i], dataset[j]]), encoders, variant)
    got = cache_reader.to_batch(cache_reader.collate([cached[i], cached[j]]), torch.device("cpu"))
    assert torch.equal(got.cond.prompt_mask, online.cond.prompt_mask)
    for a, b in ((got.x0, online.x0), (got.cond.reference_tokens, online.cond.reference_tokens),
                 (got.cond.prompt_embeds, online.cond.prompt_embeds)):
        assert a.shape == b.shape and (a - b).abs().max() < 5e-5, (a - b).abs().max()
    assert not got.cond.prompt_embeds[i, lengths[i]:].any()  # zero padding, as online


def test_bucket_keys_and_categories(built):
    """One hashable per sample (target grid + reference grids) and one category (None: no category column)."""
    cfg, _, rows, _, index = built
    cached = cache_reader.CachedDataset(latent_cache.cache_dir(cfg), index, rows)
    keys = cached.bucket_keys()
    assert len(keys) == len(rows) and len(set(keys)) >= 1 and all(hash(k) is not None for k in keys)
    assert keys[0][0] == tuple(index["samples"][0]["target_hw"])
    assert cached.categories() == [None] * len(rows)


def refusal(cfg: config.Config, variant: str, rows: list[pairs.Row], dataset) -> str:
    with pytest.raises(latent_cache.CacheError) as e:
        latent_cache.ensure(cfg, WORLD_OF_ONE, variant, rows, dataset, rebuild_stale=False)
    return str(e.value)


def test_changed_resolution_is_refused(built, tmp_path):
    """data.area changed: the cache is refused, naming the dependency, both values and the fix."""
    cfg, variant, rows, dataset, _ = built
    cfg.project.data.area = 64 * 64
    try:
        message = refusal(cfg, variant, rows, dataset)
    finally:
        cfg.project.data.area = 128 * 128
    assert "data.area: cache '16384', now '4096'" in message
    assert "python -m train.cache" in message and "delete" in message


def test_snapped_sizes_are_a_dependency_and_older_caches_count_as_unsnapped(built):
    """At micro-batch > 1 the images are cropped to snapped aspect ratios (data.bucket_aspect_steps), so a cache
    built at micro-batch 1 is refused there, naming the key; an index from before the key was recorded stands for
    the pipelines' sizes (0), as every such cache was built."""
    cfg, variant, rows, dataset, index = built
    cfg.deepspeed["train_micro_batch_size_per_gpu"] = 2
    try:
        message = refusal(cfg, variant, rows, dataset)
    finally:
        cfg.deepspeed["train_micro_batch_size_per_gpu"] = 1
    assert f"{latent_cache.SNAP_KEY}: cache '0', now '8'" in message
    wanted = latent_cache.dependencies(cfg, variant, rows, torch.float32)
    older = {**index, "depends_on": {k: v for k, v in index["depends_on"].items() if k != latent_cache.SNAP_KEY}}
    assert latent_cache.stale_message(Path("cache"), older, wanted) is None


def test_changed_template_is_refused(built, monkeypatch):
    """A different prompt template in qwen_image/conditioning.py: the cache is refused, naming the template."""
    cfg, variant, rows, dataset, _ = built
    monkeypatch.setitem(conditioning.PROMPT_TEMPLATES, variant, conditioning.PROMPT_TEMPLATES[variant] + " ")
    message = refusal(cfg, variant, rows, dataset)
    assert "prompt template (train/model/conditioning.py)" in message
    assert "data.area" not in message  # only what changed is named


def test_changed_image_and_model_file_are_refused(tiny_edit, tmp_path):
    """A re-saved image and a changed encoder config file each make the cache stale (on copies of the data)."""
    import shutil

    tiny = copy_tiny(tiny_edit, tmp_path / "tiny", num_rows=4)
    (tiny / "model").unlink()
    shutil.copytree(tiny_edit / "model", tiny / "model")
    cfg = load_cfg(tiny, tmp_path)
    variant, rows, dataset = data_of(cfg)
    latent_cache.ensure(cfg, WORLD_OF_ONE, variant, rows, dataset, rebuild_stale=True)
    image = tiny / "data" / rows[3].target
    image.write_bytes(image.read_bytes() + b"\0")  # PNG readers ignore trailing bytes: still a valid row
    assert "data rows and image files" in refusal(cfg, variant, rows, dataset)
    latent_cache.ensure(cfg, WORLD_OF_ONE, variant, rows, dataset, rebuild_stale=True)  # the command's rebuild
    vae_config = tiny / "model" / "vae" / "config.json"
    vae_config.write_text(vae_config.read_text().replace("\n", "\n ", 1))
    assert "model files" in refusal(cfg, variant, rows, dataset)


def test_unfinished_cache_counts_as_missing(built, tmp_path):
    """Shards without index.json (an interrupted build) are a missing cache: require-mode refuses it."""
    cfg, variant, rows, dataset, _ = built
    directory = tmp_path / "partial"
    directory.mkdir()
    for shard in latent_cache.cache_dir(cfg).glob("shard-*"):
        (directory / shard.name).write_bytes(shard.read_bytes())
    assert latent_cache.read_index(directory) is None
    cfg.project.data.cache, cfg.project.data.cache_dir = "require", str(directory)
    try:
        message = refusal(cfg, variant, rows, dataset)
    finally:
        cfg.project.data.cache, cfg.project.data.cache_dir = "off", ""
    assert "no finished cache" in message and "python -m train.cache" in message


def test_a_damaged_cache_is_named_with_the_fix(built, tmp_path):
    """A truncated shard is named when the run opens the cache (from the shards' headers), not at the step that
    reads it; a damaged index.json likewise: each with the file and the fix, never a traceback."""
    import shutil

    cfg, variant, rows, dataset, index = built
    directory = Path(shutil.copytree(latent_cache.cache_dir(cfg), tmp_path / "cache"))
    shard = directory / index["samples"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(latent_cache.CacheError, match=f"^{shard} is truncated: .*; delete {directory}: data.cache "
                                                      r'"auto" \(or python -m train.cache\) then builds it again$'):
        cache_reader.CachedDataset(directory, index, rows)
    (directory / latent_cache.INDEX).write_text('{"samples": [')
    with pytest.raises(latent_cache.CacheError, match=f"^{directory / latent_cache.INDEX} is damaged "
                                                      r"\(JSONDecodeError: .*; delete "):
        latent_cache.read_index(directory)


def test_a_full_disk_while_building_names_the_folder(built):
    """A cache build that fills a real file system (safetensors reports it as 'os error 28') stops with CacheError
    naming the folder, the cause and the fixes; no index is written, so the next run builds the cache again."""
    cfg, variant, rows, dataset, index = built
    with small_tmpfs(Path(cfg.project.output.dir).parent / "full", "8k") as disk:
        encoders = components.load_encoders(cfg.project.model.path, torch.float32, torch.device("cpu"))
        with pytest.raises(latent_cache.CacheError) as e:
            latent_cache.write_cache(disk / "cache", dataset, rows, encoders, variant, index["depends_on"],
                                     WORLD_OF_ONE)
        assert str(e.value).startswith(f"writing the cache into {disk / 'cache'} failed on rank 0 (No space left "
                                       "on device); free disk space there, or set qwen_edit.data.cache_dir to a "
                                       "disk with room."), str(e.value)
        assert latent_cache.read_index(disk / "cache") is None


def test_cache_dir_that_is_a_file_is_a_config_error(tiny_edit, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(config.ConfigError, match=r"qwen_edit.data.cache_dir: the cache directory .* is a file"):
        load_cfg(tiny_edit, tmp_path, **{"qwen_edit.data.cache": "auto", "qwen_edit.data.cache_dir":
                                         str(tmp_path / "file")})


# ---------------------------------------------------------------- through the entry points (slow)


def check(proc) -> None:
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{tail}"


@pytest.mark.slow
def test_cached_training_equals_online_and_sharded_precompute(tiny_edit, online_run, tmp_path):
    """6 steps from the cache (data.cache = auto builds it first) give the online run's (conftest.online_run, one
    thread as here) losses exactly; a 2-rank `deepspeed train/cache.py` writes one shard per rank whose tensors
    equal the 1-process cache's."""
    cfg = write_config(tmp_path / "auto.json", **{"qwen_edit.data.cache": "auto",
                                                  "qwen_edit.output.log_every_steps": 1})
    proc = run_trainer(tiny_edit, tmp_path / "auto", config=cfg, extra=("--max_steps", "6"))
    check(proc)
    losses = {}
    for mode, out in (("off", online_run), ("auto", tmp_path / "auto")):
        records = metrics(out)
        losses[mode] = [r["loss"] for r in records]
        assert all(0 <= r["data_wait_fraction"] <= 1 for r in records), records
    assert "the VL encoder and VAE are not loaded" in proc.stdout
    assert len(losses["off"]) == 6 and losses["auto"] == losses["off"], losses  # exact: same tensors, same noise

    sharded = tmp_path / "sharded"
    cfg = write_config(tmp_path / "sharded.json", **{"qwen_edit.data.cache_dir": str(sharded)})
    cmd = [*launcher_command(2), str(REPO / "train" / "cache.py"), "--ds_config", str(cfg), "--model",
           str(tiny_edit / "model"), "--data", str(tiny_edit / "data"), "--output_dir", str(tmp_path / "unused")]
    check(subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900))
    index = json.loads((sharded / "index.json").read_text())
    one = json.loads((tmp_path / "auto" / "cache" / "index.json").read_text())
    assert index["world_size"] == 2 and index["depends_on"] == one["depends_on"]
    assert {s["file"] for s in index["samples"]} == {"shard-00000-of-00002-0000.safetensors",
                                                     "shard-00001-of-00002-0000.safetensors"}
    assert [s["line"] for s in index["samples"]] == [s["line"] for s in one["samples"]]
    a = {k: v for f in sharded.glob("shard-*") for k, v in load_file(f).items()}
    b = {k: v for f in (tmp_path / "auto" / "cache").glob("shard-*") for k, v in load_file(f).items()}
    assert a.keys() == b.keys()
    # 1e-5: the 2 ranks run with 1 thread each, the 1-process build with 2, and CPU GEMMs sum in another order.
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, f"max |difference| {worst:.3g}"


@pytest.mark.slow
def test_require_without_cache_exits_2(tiny_edit, tmp_path):
    """data.cache = require and no cache: exit 2 with the message, before any model loads or step runs."""
    cfg = write_config(tmp_path / "require.json", **{"qwen_edit.data.cache": "require"})
    code, err = start_refused(tiny_edit, tmp_path / "out", config=cfg, extra=("--max_steps", "2"))
    assert code == 2, err[-3000:]
    assert 'qwen_edit.data.cache is "require" but' in err and "python -m train.cache" in err
    assert not list((tmp_path / "out").glob("global_step*"))


@pytest.mark.slow
def test_bench_data_cpu_smoke(tmp_path):
    """`python -m train.bench_data --tiny --train_step` runs both phases on CPU and reports every figure > 0
    (timings are printed, never asserted)."""
    from train.benchmarks import inputs

    out = tmp_path / "bench_data.jsonl"
    proc = warm.run(["-m", "train.bench_data", "--tiny", "--train_step", "--samples", "2", "--warmup", "1",
                     "--num_workers", "1", "--json", str(out)], cwd=REPO, timeout=600)
    check(proc)
    assert "cached / online" in proc.stdout
    record = json.loads(out.read_text().splitlines()[-1])
    bad = {k: record.get(k) for k in inputs.NUMERIC_FIELDS
           if not isinstance(record.get(k), (int, float)) or isinstance(record.get(k), bool) or record[k] <= 0}
    assert not bad, f"missing or non-positive fields: {bad}"
    assert 0 <= record["online_data_wait_fraction"] <= 1 and 0 <= record["cached_data_wait_fraction"] <= 1
    assert record["device_type"] == "cpu" and record["model"] == "tiny" and record["train_step"] is True
