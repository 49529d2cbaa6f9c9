"""The weight-format registry the tests see: importing the test modules registers no format, a
test-only format is registered only inside its block, and the format-parametrized tests take
jaxinfer's own formats, so one test's format can neither leak into another's run nor add cases
(tests/test_gpu_quant.py once ran a `[test_channel_scaled]` case in a full `-m gpu` run)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import spine_parts

from jaxinfer.quant import WEIGHT_FORMATS, WeightFormat

TESTS = Path(__file__).resolve().parent


def test_the_registry_holds_only_jaxinfers_formats_once_every_test_module_is_imported():
    """As pytest's collection leaves any process: every module of tests/ imported (a full run has
    imported them already; this imports the rest), then no format from outside jaxinfer."""
    for path in sorted(TESTS.glob("*.py")):
        if path.stem != "conftest":  # (pytest's own, not importable by name)
            importlib.import_module(path.stem)
    foreign = {n: type(f).__module__ for n, f in WEIGHT_FORMATS.items()
               if not spine_parts.defined_by_jaxinfer(f)}  # fmt: skip
    assert not foreign, f"formats registered from outside jaxinfer (leaked by a test): {foreign}"
    # and what the format-parametrized tests take is all of them
    assert spine_parts.jaxinfer_formats() == sorted(WEIGHT_FORMATS)


def test_a_test_format_is_registered_only_inside_its_block():
    fmt = spine_parts.ChannelScaled("test_registry_probe")
    assert fmt.name not in WEIGHT_FORMATS
    with spine_parts.registered_format(fmt):
        assert WEIGHT_FORMATS[fmt.name] is fmt
        assert not spine_parts.defined_by_jaxinfer(fmt)
        assert fmt.name not in spine_parts.jaxinfer_formats()
    assert fmt.name not in WEIGHT_FORMATS
    with pytest.raises(RuntimeError), spine_parts.registered_format(fmt):  # removed on an error
        raise RuntimeError
    assert fmt.name not in WEIGHT_FORMATS


def test_a_name_registered_already_is_refused_and_kept():
    int8 = WEIGHT_FORMATS["int8"]
    probe = spine_parts.ChannelScaled("int8")
    with (
        pytest.raises(ValueError, match="'int8' is registered already"),
        spine_parts.registered_format(probe),
    ):
        pass
    assert WEIGHT_FORMATS["int8"] is int8 and isinstance(int8, WeightFormat)
