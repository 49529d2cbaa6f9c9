"""experiments/kernel_times.py reads Nsight Compute's raw CSV (no GPU here: a report as ncu
prints it, with its units row and thousands separators)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import kernel_times

REPORT = """==PROF== Connected to process 123 (/usr/bin/python3)
==PROF== Profiling "loop_slice_fusion": 0%....50%....100% - 1 pass
"ID","Process ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"
"","","","byte","byte","nsecond"
"0","123","loop_slice_fusion_1","12,032","0","3,264"
"1","123","body_mosaic_gpu_kernel","31,278,336","4,096","37,696"
==PROF== Disconnected from process 123
"""


def test_the_report_gives_each_kernel_in_launch_order_in_microseconds_and_megabytes():
    rows = kernel_times.parse(REPORT)
    assert [r["kernel"] for r in rows] == ["loop_slice_fusion_1", "body_mosaic_gpu_kernel"]
    assert [r["us"] for r in rows] == [3.264, 37.696]
    assert rows[1]["dram_read_MB"] == pytest.approx(31.278336)
    assert rows[1]["dram_write_MB"] == pytest.approx(0.004096)


def test_a_report_without_kernels_is_empty_and_a_bad_op_names_itself():
    assert kernel_times.parse("==PROF== no kernels were profiled\n") == []
    with pytest.raises(ValueError, match="--op 'gemm:1:2:3'"):
        kernel_times.make_op("gemm:1:2:3")


def test_extra_metrics_are_read_per_kernel():
    report = REPORT.replace('"gpu__time_duration.sum"', '"gpu__time_duration.sum","sm__pipe_fma"')
    report = report.replace('"nsecond"', '"nsecond","%"').replace('"3,264"', '"3,264","12.5"')
    report = report.replace('"37,696"', '"37,696","n/a"')
    rows = kernel_times.parse(report, ("sm__pipe_fma",))
    assert [r["metrics"] for r in rows] == [{"sm__pipe_fma": 12.5}, {"sm__pipe_fma": "n/a"}]
    assert "metrics" not in kernel_times.parse(report)[0]
