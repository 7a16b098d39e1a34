"""The demo model's training text: the Python standard library source of the running interpreter."""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# NOTE: whole modules, so no line of theirs is seen in training; all exist in Python 3.10-3.13.
HELD_OUT_MODULES = ("json", "csv.py", "textwrap.py")
# Modules kept out of training to pick the best checkpoint (never used for the reported numbers).
VALIDATION_MODULES = ("fractions.py", "shlex.py", "heapq.py", "bisect.py")
# Folders skipped anywhere below the stdlib: installed packages, test suites (Docker images strip
# them, so they would make the corpus depend on the image), byte code, build configuration.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__", "lib-dynload", "pydoc_data", "_bundled"})
# Generated files: the build's sysconfig data and gencodec.py's character-map tables.
GENERATED_MARKERS = ("gencodec.py", "system configuration generated and used by")
MAX_FILE_BYTES = 400_000


@dataclass(frozen=True)
class SourceFile:
    """One stdlib .py file: its path relative to the stdlib root and its text."""
    rel: str
    text: str

    @property
    def module(self) -> str:
        """The top-level module it belongs to: `json` for json/decoder.py, `csv.py` for csv.py."""
        return self.rel.split("/", 1)[0]


@dataclass(frozen=True)
class CorpusSplit:
    train: list[SourceFile]
    validation: list[SourceFile]
    held_out: list[SourceFile]
    excluded: dict[str, int]  # reason -> number of files


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded_dir(part: str) -> bool:
    return part in EXCLUDED_DIRS or part.startswith("config-")


def collect_sources(root: str | Path | None = None, *,
                    max_files: int | None = None) -> tuple[list[SourceFile], dict[str, int]]:
    """Every kept .py file under root, sorted by path, and skip counts by reason."""
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise ValueError(f"stdlib folder {base} does not exist")
    kept: list[SourceFile] = []
    excluded = {"excluded folder": 0, "too large": 0, "generated": 0, "not utf-8": 0}
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        # NOTE: pruned in place so os.walk never descends into site-packages or test suites.
        skipped = [d for d in dirnames if _excluded_dir(d)]
        excluded["excluded folder"] += len(skipped)
        dirnames[:] = [d for d in dirnames if not _excluded_dir(d)]
        paths.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    for path in sorted(paths, key=lambda p: p.relative_to(base).as_posix()):
        rel = path.relative_to(base).as_posix()
        if not path.is_file():
            continue
        if path.name.startswith("_sysconfigdata"):
            excluded["generated"] += 1
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            excluded["too large"] += 1
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            excluded["not utf-8"] += 1
            continue
        if any(marker in text[:2000] for marker in GENERATED_MARKERS):
            excluded["generated"] += 1
            continue
        kept.append(SourceFile(rel, text))
    if max_files is not None:
        kept = _first_files_keeping_splits(kept, max_files)
    return kept, excluded


def _first_files_keeping_splits(files: list[SourceFile], max_files: int) -> list[SourceFile]:
    # NOTE: a tiny run keeps the held-out and validation modules so every split is non-empty.
    special = set(HELD_OUT_MODULES) | set(VALIDATION_MODULES)
    rest = [f for f in files if f.module not in special][:max_files]
    return sorted([f for f in files if f.module in special] + rest, key=lambda f: f.rel)


def split_sources(files: list[SourceFile], held_out: tuple[str, ...] = HELD_OUT_MODULES,
                  validation: tuple[str, ...] = VALIDATION_MODULES) -> CorpusSplit:
    """Train / validation / held-out split by whole module; each listed module must exist."""
    present = {f.module for f in files}
    missing = [m for m in (*held_out, *validation) if m not in present]
    if missing:
        raise ValueError(f"modules {missing} are not in the corpus (held-out and validation "
                         f"modules must exist in this Python's stdlib)")
    overlap = set(held_out) & set(validation)
    if overlap:
        raise ValueError(f"modules {sorted(overlap)} are both held out and validation")
    return CorpusSplit(
        train=[f for f in files if f.module not in held_out and f.module not in validation],
        validation=[f for f in files if f.module in validation],
        held_out=[f for f in files if f.module in held_out],
        excluded={})


def load_split(root: str | Path | None = None, *, max_files: int | None = None) -> CorpusSplit:
    """collect_sources + split_sources, with the exclusion counts kept."""
    files, excluded = collect_sources(root, max_files=max_files)
    split = split_sources(files)
    return CorpusSplit(split.train, split.validation, split.held_out, excluded)
