"""The libraries' known noise, filtered at its source in one place, so that a command's console shows what matters.

Every command imports this module before anything else of the project (`import train.runtime.quiet`): the filters
must be in place before the libraries are imported, since some of them log while they are. Each entry below is a
message that tells a user of this trainer nothing they can act on; everything else the libraries say still shows,
and the test of a plain CPU run's console (tests/test_train.py) fails when it gains a line.
"""

from __future__ import annotations

import logging
import warnings

# logger name -> parts of the messages it logs that are noise here, and why
LOG_NOISE = {
    # torchao (setup.cfg's bench extra) registers its enums the way torch 2.14 deprecates, at import
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
    # diffusers' torchao quantizer, imported with the model classes, fails to find the objects an installed torchao
    # moved; this trainer never loads a torchao checkpoint
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
    "DeepSpeed": (
        # the engine asks its warm-up schedule for the learning rate once before the first step
        "Attempting to get learning rate from scheduler before it has started",
        # the accelerator's auto-detection when torch sees no GPU: the run's own line says it trains on the CPU
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it",
    ),
}
# (category, regular expression the message starts with) of Python warnings that are noise here
WARNING_NOISE = (
    # DeepSpeed's ZeRO gathers its partitions with the collective torch deprecates (its call, not ours)
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
)


class _Drop(logging.Filter):
    """Drops the records whose message contains one of `parts`."""

    def __init__(self, parts: tuple[str, ...]):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


def install() -> None:
    """Install the filters (once: a second call adds nothing)."""
    for name, parts in LOG_NOISE.items():
        logger = logging.getLogger(name)  # the same object the library gets when it imports, now or later
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(parts))
    for category, message in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)


install()
