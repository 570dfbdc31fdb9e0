"""Tests for train/data/sampling.py and the dataset side of it (bucket keys, categories) in train/data/pairs.py.

Pure Python on synthetic bucket keys except where a dataset or the loader is the point; one end-to-end run
(marked slow) trains micro-batches of 2 through train/main.py on a dataset with three shape buckets.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from collections import Counter

import pytest
from conftest import run_trainer, write_config
from PIL import Image
from test_data import good, png, write_jsonl

from train.data.pairs import BadRowsError, EditDataset, assign_categories, build_loader, preflight, read_rows
from train.data.sampling import BucketBatchSampler, apportion
from train.data.sources import LoaderSource
from train.trainer.loop import start_position

AREA = 64 * 64


def keys_of(sizes: list[int], seed: int = 0) -> list[tuple]:
    """Bucket keys: sizes[i] samples of bucket i, in a shuffled dataset order."""
    keys = [(b, b) for b, n in enumerate(sizes) for _ in range(n)]
    random.Random(seed).shuffle(keys)
    return keys


def ranks(keys, micro: int, world: int, seed: int = 7, epoch: int = 0, **kw) -> list[list[list[int]]]:
    """Every rank's micro-batches of one epoch."""
    out = []
    for rank in range(world):
        sampler = BucketBatchSampler(keys, micro, rank, world, seed, **kw)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("micro, world", [(1, 1), (2, 2), (3, 4), (4, 3)])
def test_every_micro_batch_has_one_shape_and_ranks_are_disjoint(micro, world, shuffle):
    """Each micro-batch has `micro` samples of one bucket; ranks get equal counts and never share a sample."""
    keys = keys_of([23, 17, 9, 2, 31])
    for epoch in range(3):
        per_rank = ranks(keys, micro, world, epoch=epoch, shuffle=shuffle)
        assert len({len(r) for r in per_rank}) == 1 and per_rank[0]
        assert len(per_rank[0]) == len(BucketBatchSampler(keys, micro, 0, world, 7))
        for batch in (b for r in per_rank for b in r):
            assert len(batch) == micro and len({keys[i] for i in batch}) == 1, batch
        indices = [i for r in per_rank for b in r for i in b]
        assert len(indices) == len(set(indices))


def test_epoch_length_is_full_micro_batches_rounded_to_world():
    """T = sum over buckets of floor(n / micro), rounded down to a multiple of world; each rank gets T / world."""
    keys = keys_of([23, 17, 9, 2, 31])  # micro 4: 5 + 4 + 2 + 0 + 7 = 18 full micro-batches
    assert [len(BucketBatchSampler(keys, 4, 0, w, 0)) for w in (1, 2, 4, 5)] == [18, 9, 4, 3]


def test_same_seed_and_epoch_same_order_other_epoch_or_seed_differs():
    """The order is a function of (seed, epoch): rebuilt samplers agree; another epoch or seed reorders."""
    keys = keys_of([40, 25, 11])
    a = ranks(keys, 2, 2, seed=3, epoch=5)
    assert a == ranks(keys, 2, 2, seed=3, epoch=5)
    assert a != ranks(keys, 2, 2, seed=3, epoch=6) and a != ranks(keys, 2, 2, seed=4, epoch=5)


def test_one_rank_with_accumulation_sees_the_slots_of_two_ranks():
    """Global slot k = (step * GAS + micro) * world + rank holds the same micro-batch for 2 ranks x GAS 1 and
    1 rank x GAS 2 (what tests/test_train.py checks end to end on the weights)."""
    keys = keys_of([20, 12])
    two = ranks(keys, 1, 2, epoch=1)
    (one,) = ranks(keys, 1, 1, epoch=1)
    slots_two = {step * 2 + rank: two[rank][step] for rank in range(2) for step in range(len(two[0]))}
    assert [slots_two[k] for k in range(len(one))] == one


def test_shuffle_false_is_deterministic_and_goes_round_the_data():
    """Without shuffling the order is fixed: buckets by first appearance, rows in order; epochs rotate."""
    keys = [("a",), ("b",), ("a",), ("a",), ("b",), ("a",), ("b",)]
    (epoch0,) = ranks(keys, 2, 1, shuffle=False)
    assert epoch0 == [[0, 2], [3, 5], [1, 4]]
    (epoch1,) = ranks(keys, 2, 1, shuffle=False, epoch=1)
    assert epoch1 == epoch0  # T equals the cycle length: every epoch is the same cycle
    rotated = ranks(keys, 2, 2, shuffle=False, epoch=1)  # T = 2 of 3: epoch 1 starts at position 2
    assert rotated == [[[1, 4]], [[0, 2]]]


def test_shuffled_batches_are_not_in_bucket_order():
    """With shuffling, micro-batches of different buckets interleave and rows are mixed inside buckets."""
    keys = keys_of([50, 50])
    (order,) = ranks(keys, 2, 1)
    buckets = [keys[b[0]] for b in order]
    assert sum(x != y for x, y in zip(buckets, buckets[1:], strict=False)) > 10
    assert any(b[1] != b[0] + 1 for b in order)


@pytest.mark.parametrize("world", [1, 3])
def test_skip_next_resumes_exactly(world):
    """skip_next(n) before an epoch yields this rank's micro-batches from the (n+1)-th on; only once."""
    keys = keys_of([30, 14, 7])
    for rank in range(world):
        sampler = BucketBatchSampler(keys, 2, rank, world, 1)
        sampler.set_epoch(2)
        full = list(sampler)
        sampler.skip_next(3)
        assert list(sampler) == full[3:]
        assert list(sampler) == full  # the skip applies to the next iteration only


def test_loader_source_resumes_inside_an_epoch(tmp_path):
    """LoaderSource.start_epoch(epoch, skip) on a fresh loader with a persistent worker (as a resumed run has)
    reads exactly the micro-batches that an uninterrupted epoch had left."""
    ds = EditDataset(write_jsonl(tmp_path, [good(tmp_path, i) for i in range(1, 11)]),
                     preflight(tmp_path, "edit", "stop"), "edit", AREA, AREA // 4)

    def source() -> LoaderSource:
        loader = build_loader(ds, 2, rank=0, world_size=1, seed=0, num_workers=1, pin_memory=False, shuffle=True)
        return LoaderSource(loader, lambda raw: raw["lines"])

    uninterrupted, resumed = source(), source()
    epoch, taken = start_position(start_step=7, gas=1, batches_per_epoch=len(resumed))
    assert (epoch, taken) == (1, 2)
    resumed.start_epoch(epoch, taken)
    uninterrupted.start_epoch(1, 0)
    whole = list(uninterrupted)
    assert list(resumed) == whole[taken:] and len(whole) == 5
    resumed.start_epoch(2, 0)
    uninterrupted.start_epoch(2, 0)
    assert list(resumed) == list(uninterrupted)  # the skip held for one epoch only


# --- balancing ----------------------------------------------------------------------------------------------------


def test_apportion_largest_remainder():
    """Parts sum to the total and are within 1 of the exact share; ties go by name."""
    assert apportion(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    parts = apportion(97, {"x": 0.5, "y": 0.3, "z": 0.2})
    assert sum(parts.values()) == 97 and all(abs(parts[g] - 97 * w) < 1 for g, w in
                                             {"x": 0.5, "y": 0.3, "z": 0.2}.items())


@pytest.mark.parametrize("micro, world", [(1, 1), (2, 2), (4, 2)])
def test_balanced_proportions_within_one_micro_batch(micro, world):
    """Over an epoch each category's share of samples is its weight's share within 1/T (T micro-batches),
    however unbalanced the data: 600 'a' rows, 60 'b', 15 'c', 25 uncategorised."""
    cats = ["a"] * 600 + ["b"] * 60 + ["c"] * 15 + [None] * 25
    order = random.Random(1).sample(range(len(cats)), len(cats))
    cats = [cats[i] for i in order]
    keys = [(i % 3,) for i in range(len(cats))]  # three shape buckets across the categories
    weights = {"a": 2.0, "b": 1.0, "c": 1.0, "": 0.0}
    for epoch in range(2):
        per_rank = ranks(keys, micro, world, epoch=epoch, categories=cats, category_weights=weights)
        samples = [i for r in per_rank for b in r for i in b]
        num_batches = len(samples) // micro
        assert num_batches == len(BucketBatchSampler(keys, micro, 0, world, 7)) * world  # as without balancing
        counts = Counter(cats[i] or "" for i in samples)
        for category, weight in weights.items():
            share = counts[category] / len(samples)
            assert abs(share - weight / 4) < 1 / num_batches, (category, share, counts)
        for batch in (b for r in per_rank for b in r):
            assert len({keys[i] for i in batch}) == 1


def test_balancing_repeats_small_categories_evenly_and_subsamples_large_ones():
    """An upweighted small category repeats each row about equally; a downweighted one has no repeats."""
    cats = ["big"] * 90 + ["small"] * 10
    keys = [()] * 100
    (order,) = ranks(keys, 1, 1, categories=cats, category_weights={"big": 1, "small": 1})
    counts = Counter(i for b in order for i in b)
    assert sorted(counts[i] for i in range(90, 100)) == [5] * 10  # 50 draws over 10 rows: 5 each
    assert all(counts[i] <= 1 for i in range(90)) and sum(counts[i] for i in range(90)) == 50
    (later,) = ranks(keys, 1, 1, epoch=1, categories=cats, category_weights={"big": 1, "small": 1})
    assert {i for b in later for i in b if i < 90} != {i for b in order for i in b if i < 90}


def test_category_without_weight_is_an_error():
    """Every category in the data needs a weight; the error names the categories and their row counts."""
    with pytest.raises(ValueError, match=r"no weight for categories '' \(1 rows\), 'b' \(2 rows\)"):
        BucketBatchSampler([()] * 5, 1, 0, 1, 0, categories=["a", "a", "b", "b", None], category_weights={"a": 1})


def test_weight_without_rows_is_an_error():
    with pytest.raises(ValueError, match=r"category_weights\['zzz'\] = 1, but no row has category 'zzz'"):
        BucketBatchSampler([()] * 2, 1, 0, 1, 0, categories=["a", "a"], category_weights={"a": 1, "zzz": 1})


def test_category_that_fills_no_micro_batch_is_an_error():
    """A weighted category whose buckets are all smaller than a micro-batch cannot be drawn: an error."""
    keys = [(1,)] * 8 + [(1,), (2,)]
    with pytest.raises(ValueError, match=r"category 'b': its 2 rows fill no micro-batch of 2"):
        BucketBatchSampler(keys, 2, 0, 1, 0, categories=["a"] * 8 + ["b"] * 2, category_weights={"a": 1, "b": 1})


def test_too_few_rows_per_bucket_is_an_error():
    """Buckets that together fill fewer micro-batches than ranks: the error names rows, buckets and the fix."""
    with pytest.raises(ValueError, match=r"5 rows in 3 shape bucket\(s\) \(the largest has 2\) cut into 2 "
                                         r"micro-batch\(es\) of 2, fewer than one for each of 3 rank"):
        BucketBatchSampler([(1,), (1,), (2,), (2,), (3,)], 2, 0, 3, 0)


# --- the dataset side ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant, refs", [("edit", 1), ("edit_plus", 2)])
def test_bucket_keys_match_the_tensors_the_dataset_yields(tmp_path, variant, refs):
    """bucket_keys() (from preflight's header sizes, no decoding) equals the latent (h, w) of each tensor."""
    rows = [good(tmp_path, i, refs) for i in range(1, 5)]
    png(tmp_path / "t2.png", size=(128, 64))
    png(tmp_path / "r3_0.png", size=(48, 96))
    ds = EditDataset(write_jsonl(tmp_path, rows), preflight(tmp_path, variant, "stop"), variant, AREA, AREA // 4)
    keys = ds.bucket_keys()
    for i, key in enumerate(keys):
        sample = ds[i]
        tensors = [sample["target"], *sample["reference_pixels"]]
        assert key == tuple((t.shape[1] // 8, t.shape[2] // 8) for t in tensors)
    assert len(set(keys)) == 3 and keys[0] == keys[3]
    unchecked = EditDataset(tmp_path, read_rows(tmp_path)[0], variant, AREA, AREA // 4)  # rows without sizes
    assert unchecked.bucket_keys() == keys


def test_categories_from_column_then_rules(tmp_path):
    """The `category` column wins; empty ones take the first matching rule; no match stays None."""
    rows = [{**good(tmp_path, 1), "category": "portrait"}, {**good(tmp_path, 2), "prompt": "make the sky red"},
            {**good(tmp_path, 3), "category": "  ", "prompt": "a RED hat"}, {**good(tmp_path, 4), "prompt": "blue"}]
    write_jsonl(tmp_path, rows)
    rules = {"sky": r"\bsky\b", "colour": r"(?i)red|green"}
    got = preflight(tmp_path, "edit", "stop", category_rules=rules)
    assert [r.category for r in got] == ["portrait", "sky", "colour", None]
    assert EditDataset(tmp_path, got, "edit", AREA, AREA // 4).categories() == ["portrait", "sky", "colour", None]
    assert assign_categories(got, {}) == got


def test_csv_category_column(tmp_path):
    for i in (1, 2):
        good(tmp_path, i)
    (tmp_path / "metadata.csv").write_text("image,edit_image,prompt,category\nt1.png,r1_0.png,a,faces\n"
                                           "t2.png,r2_0.png,b,\n")
    assert [r.category for r in read_rows(tmp_path)[0]] == ["faces", None]


def test_non_text_category_names_the_line(tmp_path):
    write_jsonl(tmp_path, [good(tmp_path, 1), {**good(tmp_path, 2), "category": 3}])
    rows, problems = read_rows(tmp_path)
    assert [r.line for r in rows] == [1]
    assert problems == ["metadata.jsonl line 2: category 3 is not text; write it as a string (or leave it empty)"]


def test_build_loader_batches_mixed_sizes_and_reports_missing_weights(tmp_path):
    """Micro-batch 2 over two aspect ratios stacks (one bucket each); categories without weights stop."""
    rows = [good(tmp_path, i) for i in range(1, 9)]
    for i in range(1, 9, 2):
        png(tmp_path / f"t{i}.png", size=(128, 64))
    ds = EditDataset(write_jsonl(tmp_path, rows), preflight(tmp_path, "edit", "stop"), "edit", AREA, AREA // 4)
    loader = build_loader(ds, 2, rank=0, world_size=1, seed=0, num_workers=0, pin_memory=False, shuffle=True)
    shapes = Counter(tuple(b["target"].shape) for b in loader)
    assert shapes == {(2, 3, 32, 96): 2, (2, 3, 64, 64): 2}
    with pytest.raises(BadRowsError, match="no weight for categories"):
        build_loader(ds, 2, 0, 1, 0, 0, False, True, category_weights={"x": 1.0})
    with pytest.raises(ValueError, match="mixes target sizes"):  # collate's safety net when buckets are off
        list(build_loader(ds, 2, 0, 1, 0, 0, False, False, buckets=False))


# --- aspect-ratio snapping (data.bucket_aspect_steps) and the defaults that train every row ---------------------

# 16 rows of assorted shapes (target and reference of one size each, as most edit pairs are): squares, 5:4 / 4:3 /
# 1.3, 3:4 / 4:5, 3:2 / 16:10, 16:9 / 1.85, and three shapes alone even after snapping: a 4:1 panorama, an A4 page
# scan and a 5:6 face crop. At the released pipelines' 1024^2 their own sizes put 12 of the 16 alone in a bucket.
ASSORTED = [(64, 64)] * 4 + [(100, 80), (120, 90), (130, 100), (90, 120), (80, 100), (150, 100), (160, 100),
                             (160, 90), (185, 100), (200, 50), (70, 99), (100, 120)]
LONE = {14, 15, 16}  # lines of the panorama, the page scan and the face crop
SNAP_AREA = 384 * 384


def assorted(tmp_path) -> list:
    """The ASSORTED rows written (each reference a copy of its target) and pre-flighted."""
    rows = []
    for i, size in enumerate(ASSORTED, start=1):
        png(tmp_path / f"t{i}.png", size=size, seed=i)
        shutil.copy(tmp_path / f"t{i}.png", tmp_path / f"r{i}.png")
        rows.append({"image": f"t{i}.png", "edit_image": f"r{i}.png", "prompt": f"edit {i}"})
    write_jsonl(tmp_path, rows)
    return preflight(tmp_path, "edit", "stop", area=SNAP_AREA, condition_area=SNAP_AREA // 4, steps=8)


def test_snapped_sizes_are_a_fixed_set_that_similar_ratios_share():
    """conditioning.dimensions with aspect_steps: 0 is the pipelines' own calculate_dimensions; 8 maps ratios to
    2^(k/8), so near ratios get one size; the crop that fit makes keeps the snapped ratio and cuts at most
    1 - 2^(-1/16) of one side, at the centre."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    from train.model.qwen_image import conditioning

    area = 1024 * 1024
    for w, h in ASSORTED + [(4032, 3024), (3000, 2000), (1, 7)]:
        im = Image.new("RGB", (w, h))
        assert conditioning.dimensions(area, im) == tuple(int(x) for x in calculate_dimensions(area, w / h))
        sw, sh = conditioning.dimensions(area, im, 8)
        assert sw % 32 == 0 and sh % 32 == 0
        cropped, size = conditioning.fit(im, area, 8)
        assert size == (sw, sh) and (cropped.width == w or cropped.height == h)
        assert min(cropped.width / w, cropped.height / h) >= 2 ** (-1 / 16) - 1 / min(w, h)
        ratio = conditioning.snapped_ratio(w / h, 8)
        assert abs(cropped.width / cropped.height / ratio - 1) <= 1 / min(cropped.size), (w, h)
    sizes = {conditioning.dimensions(area, Image.new("RGB", s), 8) for s in [(100, 80), (120, 90), (130, 100)]}
    assert sizes == {(1152, 896)}  # 5:4, 4:3 and 1.3 share one bucket; the pipelines give them 3 sizes
    marked = Image.new("RGB", (160, 100), "black")
    marked.paste((255, 0, 0), (0, 0, 2, 100))  # a red stripe at the left edge: 16:10 -> 1.54 trims 2 px per side
    cropped, _ = conditioning.fit(marked, area, 8)
    assert cropped.size == (154, 100) and cropped.getpixel((0, 50)) == (0, 0, 0)


def test_default_sampling_trains_every_row_of_assorted_shapes(tmp_path):
    """The config's defaults at micro-batch 2 (snapped ratios, remainders completed): every one of 16 assorted rows
    is drawn in each of 6 epochs (the first through the real loader: every micro-batch stacks), and the log says
    so and names no row; the snapping makes fewer buckets than the pipelines' own sizes."""
    from train.config import DataConfig
    from train.data.pairs import aspect_steps, sampling_summary

    d = DataConfig()
    steps = aspect_steps(d.bucket_aspect_steps, 2, d.buckets)
    assert steps == 8 and d.bucket_fill and aspect_steps(d.bucket_aspect_steps, 1, d.buckets) == 0
    rows = assorted(tmp_path)
    ds = EditDataset(tmp_path, rows, "edit", SNAP_AREA, SNAP_AREA // 4, steps=steps)
    pipeline_sizes = EditDataset(tmp_path, rows, "edit", SNAP_AREA, SNAP_AREA // 4)
    assert len(set(ds.bucket_keys())) == 8 < len(set(pipeline_sizes.bucket_keys())) == 10
    loader = build_loader(ds, 2, 0, 1, seed=3, num_workers=0, pin_memory=False, shuffle=d.shuffle,
                          bucket_fill=d.bucket_fill)
    text = sampling_summary(loader.batch_sampler, rows)
    assert "so every row is drawn each cycle" in text and "never drawn" not in text, text
    batches = list(loader)  # decoded, resized and stacked: every micro-batch has one shape
    assert {line for b in batches for line in b["lines"]} == set(range(1, 17))
    assert all(b["target"].shape[0] == 2 for b in batches)
    keys = ds.bucket_keys()  # from the header sizes: the snapped sizes the pixels have
    assert all(keys[b["lines"][0] - 1] == tuple((t.shape[2] // 8, t.shape[3] // 8)
                                                for t in [b["target"], *b["reference_pixels"]]) for b in batches)
    lone = [b["lines"] for b in batches if set(b["lines"]) & LONE]
    assert sorted(lone) == [[14, 14], [15, 15], [16, 16]]  # each alone in its bucket: repeated
    for epoch in range(1, 6):  # the sampler alone for the later epochs (the same index lists the loader takes)
        loader.batch_sampler.set_epoch(epoch)
        assert {rows[i].line for b in loader.batch_sampler for i in b} == set(range(1, 17))


def test_without_fill_the_log_names_the_rows_never_drawn_and_the_rest_vary(tmp_path):
    """data.bucket_fill false: exactly the three rows alone in their snapped bucket are never drawn in 20 epochs,
    the log names them and says how many others are left out at random; those vary from cycle to cycle, so every
    other row is drawn."""
    from train.data.pairs import sampling_summary

    rows = assorted(tmp_path)
    keys = EditDataset(tmp_path, rows, "edit", SNAP_AREA, SNAP_AREA // 4, steps=8).bucket_keys()
    sampler = BucketBatchSampler(keys, 2, 0, 1, seed=3)
    text = sampling_summary(sampler, rows)
    assert ("4 rows per cycle left out in bucket remainders (1 at random each cycle, 3 never drawn: their bucket is "
            "smaller than a micro-batch)") in text
    assert ("sampling: 3 row(s) are never drawn: their shape bucket has fewer rows than a micro-batch of 2: row 14 "
            "(t14.png), row 15 (t15.png), row 16 (t16.png). To train them, set qwen_edit.data.bucket_fill = true") \
        in text
    left_out = []
    for epoch in range(20):
        sampler.set_epoch(epoch)
        drawn = {rows[i].line for b in sampler for i in b}
        left_out.append(frozenset(set(range(1, 17)) - drawn))
    assert all(LONE <= out and len(out) == 4 for out in left_out)
    assert set().union(*left_out) - LONE != set() and len(set(left_out)) > 1
    assert set.intersection(*map(set, left_out)) == LONE  # no other row is left out of every epoch


def test_a_category_too_light_for_one_micro_batch_is_named():
    """A weight > 0 whose share of an epoch rounds to 0 micro-batches draws nothing: never_drawn lists its rows and
    the summary says why (bucket_fill cannot help there)."""
    keys = [(0, 0)] * 20 + [(1, 1)] * 2
    cats = ["big"] * 20 + ["rare"] * 2
    s = BucketBatchSampler(keys, 2, 0, 1, 0, categories=cats, category_weights={"big": 1, "rare": 0.01}, fill=True)
    assert s.quota == {"big": 11, "rare": 0} and s.never_drawn() == [20, 21]  # T = 10 + 1 micro-batches
    assert "so every row of a category drawn is drawn each cycle; 2 rows never drawn: their category's share rounds " \
           "to 0 micro-batches per epoch" in s.summary()
    assert not {i for e in range(5) for i in (s.set_epoch(e) or [i for b in s for i in b])} & {20, 21}


def test_snapped_pairs_stay_aligned_and_the_vl_copy_is_the_crop(tmp_path):
    """A target and a reference of one size get the same crop (their pixels stay equal); 2509's VL copy of a
    reference is made from that crop; the pre-flight's alignment check compares the snapped sizes."""
    from train.data import alignment
    from train.model import family
    from train.model.qwen_image import conditioning

    misfit = functools.partial(alignment.misfit, fam=family.family_named("qwen_image"))

    png(tmp_path / "a.png", size=(160, 100), seed=1)
    shutil.copy(tmp_path / "a.png", tmp_path / "b.png")
    write_jsonl(tmp_path, [{"image": "a.png", "edit_image": "b.png", "prompt": "p"}])
    rows = preflight(tmp_path, "edit_plus", "stop")
    sample = EditDataset(tmp_path, rows, "edit_plus", SNAP_AREA, SNAP_AREA // 4, steps=8)[0]
    assert sample["target"].shape == sample["reference_pixels"][0].shape == (3, 320, 480)
    assert sample["target"].equal(sample["reference_pixels"][0])
    crop = conditioning.crop_size(Image.new("RGB", (160, 100)), 8)
    vl = sample["vl_images"][0]
    assert crop == (154, 100) and vl.size == conditioning.dimensions(SNAP_AREA // 4, Image.new("RGB", crop))
    # The pre-flight's alignment check compares the snapped sizes: ratios 0.15% apart across a snapping boundary
    # (2^(4.5/8) = 1.4768) are cropped to 1.41 and 1.54 and named; a same-size pair never is.
    assert misfit((1476, 1000), (1478, 1000), 1024 * 1024) is None
    assert "round to different sizes" in misfit((1476, 1000), (1478, 1000), 1024 * 1024, 8)
    assert misfit((1477, 1000), (1477, 1000), 1024 * 1024, 8) is None


# --- end to end ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_micro_batch_two_trains_on_mixed_aspect_ratios(tiny_edit, tmp_path):
    """train/main.py with micro-batch 2 on three shape buckets, categories, a mapping and a blocked term: it
    trains, prints the prompt and sampling reports, and never stacks mixed sizes."""
    data = tmp_path / "data"
    shutil.copytree(tiny_edit / "data", data)
    lines = [json.loads(t) for t in (data / "metadata.jsonl").read_text().splitlines()]
    for k, row in enumerate(lines):
        names = [row["image"], row["edit_image"]] if k % 3 == 1 else [row["edit_image"]] if k % 3 == 2 else []
        for name in names:
            with Image.open(data / name) as im:
                im.convert("RGB").resize((192, 96)).save(data / name)
        row["category"] = "wide" if k % 3 == 1 else ""
    lines[0]["prompt"] = "forbidden  edit"
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "blocked.txt").write_text("# one term per line\nforbidden\n")
    (tmp_path / "mapping.json").write_text(json.dumps({"circle": "round shape"}))
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "model").symlink_to(tiny_edit / "model")
    (tiny / "data").symlink_to(data)
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=2, **{
        "qwen_edit.data.num_workers": 0, "qwen_edit.output.log_every_steps": 1,
        "qwen_edit.data.blocked_terms": str(tmp_path / "blocked.txt"),
        "qwen_edit.data.prompt_mapping": str(tmp_path / "mapping.json"),
        "qwen_edit.data.category_rules": {"square": "square"},
        "qwen_edit.data.category_weights": {"wide": 1, "square": 1, "": 1}})
    out = tmp_path / "out"
    proc = run_trainer(tiny, out, config=cfg, extra=("--max_steps", "4"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "prompts: 32 rows, 1 normalised" in proc.stdout and "1 with a blocked term (dropped): rows 1" in proc.stdout
    assert "sampling: 31 rows in 3 shape bucket(s), 16 micro-batches of 2 per rank" in proc.stdout, proc.stdout
    assert "categories per epoch" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize("shuffle", [True, False])
def test_bucket_fill_draws_every_row_every_epoch(shuffle):
    """data.bucket_fill: a bucket's remainder is completed with repeats of its own samples, so every sample (also one
    alone in its shape) is drawn in every epoch, micro-batches still one shape each; without it the lone sample and
    a too-small bucket are never drawn, and never_drawn() lists exactly them."""
    keys = keys_of([5, 1, 3, 2])  # micro 3: buckets of 1 and 2 are smaller than a micro-batch
    lone = [i for i, k in enumerate(keys) if k == (1, 1)] + [i for i, k in enumerate(keys) if k == (3, 3)]
    plain = BucketBatchSampler(keys, 3, 0, 1, seed=7, shuffle=shuffle)
    assert plain.never_drawn() == sorted(lone)
    assert plain.summary().endswith(
        "5 rows per cycle left out in bucket remainders (2 at random each cycle, 3 never drawn: their bucket is "
        "smaller than a micro-batch)" if shuffle else "5 rows per cycle left out in bucket remainders (always the "
        "same rows)")
    for epoch in range(4):
        drawn = {i for b in ranks(keys, 3, 1, epoch=epoch, shuffle=shuffle)[0] for i in b}
        assert not drawn & set(lone)
    filled = BucketBatchSampler(keys, 3, 0, 1, seed=7, shuffle=shuffle, fill=True)
    assert filled.never_drawn() == [] and len(filled) == 2 + 1 + 1 + 1
    assert filled.summary().endswith("3 bucket remainder(s) completed with 4 repeat(s) of their own rows per cycle "
                                     "(data.bucket_fill), so every row is drawn each cycle")
    for epoch in range(4):
        batches = ranks(keys, 3, 1, epoch=epoch, shuffle=shuffle, fill=True)[0]
        assert {i for b in batches for i in b} == set(range(len(keys)))
        assert all(len(b) == 3 and len({keys[i] for i in b}) == 1 for b in batches)
    single = [b for b in batches if keys[b[0]] == (1, 1)]
    assert len(single) == 1 and len(set(single[0])) == 1  # the lone sample, repeated within its micro-batch


def test_never_drawn_rows_are_named_in_the_log(tmp_path):
    """The loader's log names every row that can never be drawn, by line and target, with the fixes; a weight-0
    category is left out on purpose and not listed."""
    from train.data.pairs import sampling_summary

    rows = [good(tmp_path, i) for i in range(1, 6)]
    png(tmp_path / "t5.png", size=(128, 32))  # a panorama target: a shape of its own
    write_jsonl(tmp_path, rows)
    got = preflight(tmp_path, "edit", "stop")
    ds = EditDataset(tmp_path, got, "edit", AREA, AREA // 4)
    loader = build_loader(ds, 2, 0, 1, seed=0, num_workers=0, pin_memory=False, shuffle=True)
    text = sampling_summary(loader.batch_sampler, got)
    assert ("sampling: 1 row(s) are never drawn: their shape bucket has fewer rows than a micro-batch of 2: "
            "row 5 (t5.png). To train them, set qwen_edit.data.bucket_fill = true") in text
    filled = build_loader(ds, 2, 0, 1, seed=0, num_workers=0, pin_memory=False, shuffle=True, bucket_fill=True)
    assert "never drawn" not in sampling_summary(filled.batch_sampler, got)
    assert 5 in {line for batch in filled for line in batch["lines"]}
    weighted = BucketBatchSampler(ds.bucket_keys(), 2, 0, 1, 0, True, ["a"] * 4 + ["pano"], {"a": 1.0, "pano": 0})
    assert weighted.never_drawn() == []
