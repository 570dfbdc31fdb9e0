"""Which samples each rank trains on, micro-batch by micro-batch: shape buckets and category balancing.

`BucketBatchSampler` is the DataLoader's `batch_sampler`. Every rank computes the same global list of
micro-batches for an epoch from (seed, epoch) alone and takes every world_size-th of it, so ranks never share a
micro-batch and all get the same number (collectives stay in lock-step). The rules:

- Buckets: samples with equal `dataset.bucket_keys()` (target and reference latent sizes) form a bucket; a
  micro-batch is cut from one bucket only, so it stacks. With buckets off, all samples are one bucket.
- Groups: without balancing, all samples are one group. With `category_weights`, each category is a group
  (rows without a category form the group ""); every category in the data needs a weight (0 leaves it out).
- Cycles: a group's samples are shuffled within each bucket and cut into micro-batches; each bucket's remainder
  (fewer than a micro-batch) is left out of that cycle, and the cycle's micro-batches are shuffled. Cycle j of
  epoch e is seeded by (seed, group, e, j), so every cycle leaves out other samples. A bucket with fewer samples
  than a micro-batch is thus never drawn (`never_drawn` lists them). With `fill` (data.bucket_fill) each bucket's
  remainder is completed to a full micro-batch with repeats of the same bucket's samples (taken in the cycle's
  order), so every sample is drawn every cycle and a lone shape trains too (repeated within its micro-batch).
- Epochs: an epoch has T micro-batches, T = the number of full micro-batches the whole dataset cuts into (as
  without balancing), rounded down to a multiple of world_size. Group g gets t_g of them, the largest-remainder
  share of T by weight (so |t_g / T - w_g / sum w| < 1 / T), and takes the first t_g micro-batches of its
  cycles (e, 0), (e, 1), ... in a row: a large, lightly weighted category is subsampled (other samples each
  epoch), a small, heavily weighted one repeats, cycle after cycle. A category whose t_g rounds to 0 is never
  drawn (`never_drawn` lists its samples too). Without balancing, t = T: an epoch is one
  cycle less the < world_size micro-batches of the rounding. A sample appears twice in an epoch only when its
  category is drawn more often than its micro-batches (t_g > cycle length), so otherwise ranks are disjoint.
- Dealing: the epoch's micro-batches are shuffled, seeded by (seed, epoch), and micro-batch j goes to rank
  j mod world_size; every rank gets T / world_size. So global slot (step * GAS + micro) * world + rank is the same
  sample whether the world is 2 ranks x GAS 1 or 1 rank x GAS 2 (at one micro-batch size).
- shuffle=False keeps every order above deterministic without shuffling: buckets in order of first appearance,
  rows in dataset order, groups in sorted order. All cycles are then alike, so epoch e starts at position
  e t_g mod (cycle length) of the repeating cycle, to go round all the data (which the remainders leave out
  stays the same).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Hashable, Iterator

from torch.utils.data import Sampler

_WEIGHTS = "qwen_edit.data.category_weights"


class SamplingError(ValueError):
    """The data cannot be sampled as configured (too few rows, categories without weights, ...)."""


def apportion(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Split `total` by `weights`, largest remainder first (ties by name); the parts sum to `total`."""
    norm = sum(weights.values())
    exact = {g: total * w / norm for g, w in weights.items()}
    parts = {g: math.floor(x) for g, x in exact.items()}
    by_remainder = sorted(weights, key=lambda g: (parts[g] - exact[g], g))
    for g in by_remainder[: total - sum(parts.values())]:
        parts[g] += 1
    return parts


class BucketBatchSampler(Sampler[list[int]]):
    """Micro-batches (index lists) of one bucket each, for one rank; see the module docstring for the rules."""

    def __init__(self, bucket_keys: list[Hashable], micro_batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool = True, categories: list[str | None] | None = None,
                 category_weights: dict[str, float] | None = None, fill: bool = False):
        assert 0 <= rank < world_size and micro_batch_size >= 1
        self.micro_batch_size, self.rank, self.world_size, self.fill = micro_batch_size, rank, world_size, fill
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self._skip = 0, 0
        self.num_samples = len(bucket_keys)
        self.num_buckets = len(set(bucket_keys))
        bucket_sizes = Counter(bucket_keys)
        num_full = sum(self._num_batches(n) for n in bucket_sizes.values())
        self.num_batches = num_full // world_size * world_size  # T: micro-batches of all ranks per epoch
        if self.num_batches == 0:
            largest = max(bucket_sizes.values(), default=0)
            raise SamplingError(
                f"{self.num_samples} rows in {self.num_buckets} shape bucket(s) (the largest has {largest}) cut into "
                f"{num_full} micro-batch(es) of {micro_batch_size}, fewer than one for each of {world_size} rank(s); "
                "add rows of a common size, or lower train_micro_batch_size_per_gpu"
            )
        self.weighted = weighted = bool(category_weights)
        groups = ["" if c is None else c for c in categories] if weighted else [""] * self.num_samples
        self.weights = dict(category_weights) if weighted else {"": 1.0}
        # group -> bucket key -> sample indices, both in order of first appearance
        self._groups: dict[str, dict[Hashable, list[int]]] = {}
        for i, (group, key) in enumerate(zip(groups, bucket_keys, strict=True)):
            self._groups.setdefault(group, {}).setdefault(key, []).append(i)
        self._check_groups()
        drawn = {g: w for g, w in sorted(self.weights.items()) if w > 0}
        self.quota = apportion(self.num_batches, drawn)  # t_g
        self.cycle_length = {g: self._cycle_length(g) for g in drawn}

    def _num_batches(self, num_samples: int) -> int:
        """Micro-batches a bucket of `num_samples` cuts into per cycle (its remainder filled, or left out)."""
        return -(-num_samples // self.micro_batch_size) if self.fill else num_samples // self.micro_batch_size

    def _cycle_length(self, group: str) -> int:
        return sum(self._num_batches(len(ix)) for ix in self._groups[group].values())

    def too_small(self) -> list[int]:
        """Samples of a drawn category whose shape bucket (within the category) has fewer samples than a
        micro-batch: without `fill` no epoch draws them."""
        if self.fill:
            return []
        return sorted(i for g, q in self.quota.items() if q > 0 for ix in self._groups.get(g, {}).values()
                      if len(ix) < self.micro_batch_size for i in ix)

    def unshared(self) -> list[int]:
        """Samples of a category with a weight > 0 too small for one micro-batch of the epoch (t_g rounds to 0)."""
        return sorted(i for g, q in self.quota.items() if q == 0 for ix in self._groups.get(g, {}).values()
                      for i in ix)

    def never_drawn(self) -> list[int]:
        """Samples no epoch ever draws (`too_small` and `unshared`). Categories of weight 0 are left out on purpose,
        not listed."""
        return sorted(self.too_small() + self.unshared())

    def _check_groups(self) -> None:
        sizes = {g: sum(map(len, b.values())) for g, b in self._groups.items()}
        problems = []
        unweighted = [g for g in sizes if g not in self.weights]
        if unweighted:
            listed = ", ".join(f"{g!r} ({sizes[g]} rows)" for g in sorted(unweighted))
            problems.append(f"{_WEIGHTS} has no weight for categories {listed} ('' = rows without a category); "
                            "give each a weight (0 leaves it out), or extend qwen_edit.data.category_rules")
        for g, w in sorted(self.weights.items()):
            if w > 0 and g not in sizes:
                problems.append(f"{_WEIGHTS}[{g!r}] = {w}, but no row has category {g!r}; set it to 0 or remove it "
                                "(the proportions could not be met)")
            elif w > 0 and self._cycle_length(g) == 0:
                problems.append(f"category {g!r}: its {sizes[g]} rows fill no micro-batch of {self.micro_batch_size} "
                                "in any shape bucket; add rows of a common size or lower its weight to 0")
        if self.weighted and not any(w > 0 and g in sizes for g, w in self.weights.items()):
            problems.append(f"{_WEIGHTS}: no category with a weight > 0 has rows")
        if problems:
            raise SamplingError("cannot balance categories:\n" + "\n".join(problems))

    def __len__(self) -> int:
        """Micro-batches of this rank per epoch (the same on every rank and in every epoch)."""
        return self.num_batches // self.world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, num_micro_batches: int) -> None:
        """Start the next iteration after this rank's first `num_micro_batches` (resume inside an epoch)."""
        self._skip = num_micro_batches

    def _rng(self, *parts) -> random.Random:
        return random.Random(":".join(map(repr, (self.seed, *parts))))  # str seeds hash stably (sha512)

    def _cycle(self, group: str, epoch: int, j: int) -> list[list[int]]:
        """Cycle j of a group in `epoch`: shuffled within buckets, cut, remainders left out, batches shuffled."""
        rng = self._rng("cycle", group, epoch, j)
        batches = []
        for indices in self._groups[group].values():
            indices = list(indices)
            if self.shuffle:
                rng.shuffle(indices)
            b = self.micro_batch_size
            if self.fill and len(indices) % b:  # complete the remainder with this bucket's first samples, cyclically
                indices += [indices[k % len(indices)] for k in range(b - len(indices) % b)]
            batches += [indices[i:i + b] for i in range(0, len(indices) - b + 1, b)]
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def _take(self, group: str, epoch: int, count: int) -> list[list[int]]:
        """`count` micro-batches of a group for `epoch`: its cycles (epoch, 0), (epoch, 1), ... in a row (unshuffled
        cycles are all alike, so there the window starts where the previous epoch's ended)."""
        length = self.cycle_length[group]
        out, position = [], 0 if self.shuffle else epoch * count % length
        while len(out) < count:
            j, offset = divmod(position, length)
            out += self._cycle(group, epoch, j)[offset:offset + count - len(out)]
            position = (j + 1) * length
        return out

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' micro-batches of `epoch` in global order (rank r takes items r, r + world, ...)."""
        batches = [b for g, t in self.quota.items() for b in self._take(g, epoch, t)]
        if self.shuffle:
            self._rng("epoch", epoch).shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        # A generator, so the skip is taken on the first next(): a DataLoader with workers calls iter() twice on
        # its first epoch and drops the first iterator unused, which must not consume the skip.
        skip, self._skip = self._skip, 0
        yield from self.epoch_batches(self.epoch)[self.rank::self.world_size][skip:]

    def summary(self) -> str:
        """One line for the log: buckets, micro-batches per rank, what is left out or repeated, and what
        balancing draws."""
        b = self.micro_batch_size
        drawn = [bk for g, bk in self._groups.items() if self.weights.get(g, 0) > 0 and self.quota[g] > 0]
        remainders = [len(ix) % b for bk in drawn for ix in bk.values() if len(ix) % b]
        small = len(self.too_small())
        if self.fill:
            every = "every row" if len(drawn) == len(self._groups) else "every row of a category drawn"
            rest = (f"{len(remainders)} bucket remainder(s) completed with {sum(b - r for r in remainders)} repeat(s) "
                    f"of their own rows per cycle (data.bucket_fill), so {every} is drawn each cycle")
        elif not self.shuffle:
            rest = f"{sum(remainders)} rows per cycle left out in bucket remainders (always the same rows)"
        else:
            parts = [f"{sum(remainders) - small} at random each cycle"] if sum(remainders) > small else []
            parts += [f"{small} never drawn: their bucket is smaller than a micro-batch"] if small else []
            rest = f"{sum(remainders)} rows per cycle left out in bucket remainders ({', '.join(parts) or 'none'})"
        if self.unshared():
            rest += (f"; {len(self.unshared())} rows never drawn: their category's share rounds to 0 micro-batches "
                     "per epoch")
        text = (f"sampling: {self.num_samples} rows in {self.num_buckets} shape bucket(s), {len(self)} micro-batches "
                f"of {b} per rank per epoch on {self.world_size} rank(s); " + rest)
        if self.weighted:
            parts = [f"{g or '<none>'}: {sum(map(len, self._groups.get(g, {}).values()))} rows, weight {w:g}, "
                     f"{self.quota.get(g, 0)} micro-batches" for g, w in sorted(self.weights.items())]
            text += "; categories per epoch: " + "; ".join(parts)
        return text
