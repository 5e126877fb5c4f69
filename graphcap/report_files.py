"""Report files: where a report may be written, and writing it whole or not at all.

`check_report_path` refuses a path before a pass runs (a directory, an unwritable place, a file
graphcap did not write); `may_overwrite` tells a graphcap report (its first key `REPORT_MARKER`)
from anything else; `atomic_write` writes a temporary file beside the target and renames it, so a
reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from pathlib import Path

from graphcap.errors import ConfigError, ConfigProblem

__all__ = ["REPORT_MARKER", "atomic_write", "check_report_path", "may_overwrite"]

REPORT_MARKER = "graphcap_report"
"""The first key of every report graphcap writes: what `may_overwrite` looks for."""


def check_report_path(path: str | os.PathLike, *, not_same_as: tuple[str | os.PathLike, ...] = ()) -> None:
    """Refuse, before any work, a report path that cannot be written or must not be.

    Raises `ConfigError` (key `report.path`) when `path` is a directory, lies under a file, is
    in a directory without write permission, cannot be used at all (a name too long, a loop of
    links), is the same file as one of `not_same_as` (the config the report describes), or is
    an existing file that graphcap did not write (see `may_overwrite`).
    """
    target = Path(path)
    try:
        problem = _path_problem(path, target, not_same_as)
    except OSError as exc:  # ENAMETOOLONG, ELOOP, EACCES on a parent, ...
        problem = f"{path} cannot be used: {_os_reason(exc)}"
    if problem:
        raise ConfigError([ConfigProblem("report.path", problem)])


def _path_problem(path: str | os.PathLike, target: Path, not_same_as: tuple[str | os.PathLike, ...]) -> str | None:
    if target.is_dir():
        return f"{path} is a directory; give a file name ending in .json, .yaml or .yml"
    if target.exists() and any(Path(o).exists() and os.path.samefile(target, o) for o in not_same_as):
        return f"{path} is the config file itself; writing the report there would overwrite it: pick another path"
    if (target.exists() or target.is_symlink()) and not may_overwrite(target):
        return (
            f"{path} exists and is not a graphcap report (graphcap overwrites only files that start with its "
            f"{REPORT_MARKER!r} key, or empty ones): remove it or pick another path"
        )
    parent = target.parent
    while not parent.exists() and parent != parent.parent:  # the directories write() would create
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be written: no write permission in {parent}"
    return None


def may_overwrite(path: str | os.PathLike, marker: str = REPORT_MARKER) -> bool:
    """Whether graphcap may replace the file at `path`: it does not exist, is empty, or is a report
    graphcap wrote (a regular file whose first key is `marker`: `REPORT_MARKER`, or a post-mortem's).
    Anything else, a link, a device or a file some other program wrote, is left alone."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISREG(info.st_mode):
        return False
    if info.st_size == 0:
        return True
    with open(path, "rb") as handle:
        head = handle.read(256)
    return _marked(marker).match(head) is not None


def _marked(marker: str) -> re.Pattern[bytes]:
    """A file's head that starts with `marker` as its first key (JSON or YAML)."""
    return re.compile(rb'\s*(\{\s*"' + marker.encode() + rb'"\s*:|' + marker.encode() + rb"\s*:)")


def _os_reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0)
    reason = exc.strerror or str(exc)
    return f"{reason} ({name})" if name else reason


def atomic_write(path: Path | str, data: str | bytes) -> None:
    """Write `data` to `path` via a temporary file and `os.replace`: never half-written.

    The file keeps the mode of the file it replaces; a new file gets 0666 under the umask
    (usually 0644), like any file an editor writes. On any failure (also `KeyboardInterrupt`)
    the temporary file is removed and the old file is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = None
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: never follow a planted link or reuse a file; 0o666 lets the kernel apply the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
