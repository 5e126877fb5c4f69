"""Another revision of graphcap, importable beside this one in the same process (`graphcap_base`).

A before/after benchmark that runs the two versions in separate processes compares two machine
states; importing both into one process lets the timed calls of the two alternate round by round.
`load(rev)` extracts `graphcap/` of a git revision (`git archive`), renames the package to
`graphcap_base` in its imports and module paths, and imports it. The copy lives in a temporary
folder removed at exit. Only the package's own Python files are rewritten: torch, numpy and the
rest stay shared, so both versions time the same kernels.
"""

from __future__ import annotations

import atexit
import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

NAME = "graphcap_base"

_IMPORT = re.compile(r"^(\s*)(from|import)(\s+)graphcap\b", re.MULTILINE)
_DOTTED = re.compile(r"(?<![\w/.])graphcap\.(?=[a-z_])")
_LITERAL = re.compile(r"([\"'])graphcap\1")  # resources.files("graphcap"), the logger's name


def rewrite(source: str) -> str:
    """`source` with every import of, dotted module path into and string naming `graphcap` naming `graphcap_base`."""
    source = _IMPORT.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}{NAME}", source)
    source = _LITERAL.sub(lambda m: f"{m.group(1)}{NAME}{m.group(1)}", source)
    return _DOTTED.sub(f"{NAME}.", source)


def load(rev: str, repo: Path | None = None) -> ModuleType:
    """`graphcap` as of `rev` in `repo` (this checkout by default), imported as `graphcap_base`."""
    repo = repo or Path(__file__).resolve().parent.parent
    try:
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", rev, "graphcap"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise SystemExit(
            f"--baseline {rev}: cannot read graphcap/ at that revision: {detail.decode().strip() or exc}"
        ) from None
    root = Path(tempfile.mkdtemp(prefix="graphcap-base-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    (root / "graphcap").rename(root / NAME)
    for path in (root / NAME).rglob("*.py"):
        path.write_text(rewrite(path.read_text()))
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(NAME)
    finally:
        sys.path.remove(str(root))
