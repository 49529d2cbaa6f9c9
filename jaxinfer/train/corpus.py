"""The training corpus every machine has: the Python standard library of the running interpreter.

File list: every `*.py` under `sysconfig.get_paths()["stdlib"]`, sorted by relative path, minus
test suites (`TEST_DIRS`), third-party `site-packages` and a few demo/legacy folders
(`EXCLUDED_DIRS`). Split: by file, on a hash of the relative path (`crc32(path) % 1000 <
1000 * heldout_fraction` is held out), so the split of a given file is the same on every machine and
Python version. `include_tests=True` adds the test suites (about 18 MB more) to the train split
only, for models big enough to over-fit the ~10 MB of library code; the held-out split is the same.
Python 3.11 (CPU machines) and 3.12 (the GPU machine) ship slightly different files; results files
record the interpreter version with every perplexity.
"""

from __future__ import annotations

import ast
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

TEST_DIRS = frozenset({"test", "tests", "idle_test"})
EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "__pycache__",
    }
)


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[Path, ...]  # relative to root
    heldout: tuple[Path, ...]

    def texts(self, split: str) -> list[str]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        files = self.train if split == "train" else self.heldout
        return [(self.root / f).read_text(encoding="utf-8", errors="replace") for f in files]


def is_heldout(relative: Path, heldout_fraction: float) -> bool:
    return zlib.crc32(relative.as_posix().encode()) % 1000 < round(1000 * heldout_fraction)


def stdlib_corpus(
    root: str | Path | None = None, heldout_fraction: float = 0.05, include_tests: bool = False
) -> Corpus:
    """The deterministic file list and train/held-out split (see module docstring)."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    files, tests = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        folders = set(rel.parts[:-1])
        if folders & EXCLUDED_DIRS:
            continue
        (tests if folders & TEST_DIRS else files).append(rel)
    if not files:
        raise FileNotFoundError(f"no *.py files under {root}")
    heldout = tuple(f for f in files if is_heldout(f, heldout_fraction))
    train = [f for f in files if not is_heldout(f, heldout_fraction)]
    if include_tests:
        train = sorted(train + tests)
    return Corpus(root, tuple(train), heldout)


def english_texts(corpus: Corpus | None = None) -> list[str]:
    """English prose every machine has offline: the Python documentation's topics
    (`pydoc_data/topics.py`, ~465 kB on 3.11; a file in the corpus's *train* split, so the models
    trained here have seen it) and the module docstrings of the held-out files (which they have
    not), in a fixed order."""
    from pydoc_data.topics import topics

    corpus = corpus or stdlib_corpus()
    texts = [topics[key] for key in sorted(topics)]
    for f in corpus.heldout:
        doc = ast.get_docstring(ast.parse((corpus.root / f).read_text(encoding="utf-8")))
        if doc:
            texts.append(doc)
    return texts
