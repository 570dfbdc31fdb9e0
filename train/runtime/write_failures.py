"""A write of the run's own files that the disk stopped (full, over quota, read-only, not writable): its cause,
found also where torch and safetensors report it without an errno, and the one line a run ends with."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

# How torch reports a failed write: RuntimeError without an errno ('[enforce fail at inline_container.cc:672] .
# unexpected pos ...', 'PytorchStreamWriter failed writing file ...', 'Parent directory ... does not exist').
_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "Parent directory", "file write failed")
MIN_FREE_BYTES = 64 * 2**20


def write_cause(error: Exception, directory: Path) -> tuple[int, str]:
    """(errno, what it says) of a write into `directory` that failed: the error's own errno; the 'os error N' that
    safetensors puts in its message; or, for torch's errno-less RuntimeError, what the file system says (little
    free space, or no write permission)."""
    code = getattr(error, "errno", None)
    quoted = re.search(r"\(os error (\d+)\)", str(error))
    if code is None and quoted:
        code = int(quoted.group(1))
    if code is None:
        try:
            full = shutil.disk_usage(directory).free < MIN_FREE_BYTES
        except OSError:
            full = False
        code = errno.ENOSPC if full else errno.EACCES if not os.access(directory, os.W_OK) else errno.EIO
    return code, (getattr(error, "strerror", None) or os.strerror(code))


def is_write_failure(error: Exception) -> bool:
    """Whether `error` is how a failed write shows: an OSError, or torch's errno-less RuntimeError."""
    return isinstance(error, OSError) or (
        isinstance(error, RuntimeError) and any(s in str(error) for s in _TORCH_WRITE_FAILURES)
    )


# What a full or unwritable disk raises: these errnos, and safetensors' error quoting one of them ('os error 28').
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def disk_failure(error: BaseException, out_dir: str | Path) -> str | None:
    """For a write anywhere in the run (an export, metrics, validation images, ...) that a full or unwritable disk
    stopped: the line naming the file (or, where the error does not say, `out_dir`), the cause and the fix; None for
    any other error."""
    quoted = re.search(r"\(os error (\d+)\)", str(error))
    code = getattr(error, "errno", None) or (int(quoted.group(1)) if quoted else None)
    torch_write = isinstance(error, RuntimeError) and any(s in str(error) for s in _TORCH_WRITE_FAILURES)
    named = getattr(error, "filename", None)
    outside = named is not None and not Path(os.path.abspath(named)).is_relative_to(os.path.abspath(out_dir))
    if (code not in DISK_ERRNOS and not torch_write) or outside:  # not a write of the run's own files
        return None
    code, cause = write_cause(error, Path(out_dir))
    fix = (
        "free disk space there"
        if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        else "point --output_dir at a writable file system"
        if code == errno.EROFS
        else f"make {out_dir} writable for this user"
    )
    return (
        f"writing {named or f'into {out_dir}'} failed ({cause}); {fix}. --resume continues from the last "
        "complete checkpoint"
    )
