"""scripts/device/ncu_summary.py against a hand-written Nsight Compute text report: kernel heads,
units, thousands separators, metrics of other sections ignored."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.script_modules import load_script

REPORT = """[9370] python3.12@127.0.0.1
  _decode_kernel (3, 2, 64)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    SM Frequency                    Ghz         1.50
    Elapsed Cycles                cycle       20,628
    DRAM Throughput                   %        25.41
    Duration                         us        13.73
    SM Active Cycles              cycle    10,616.06
    Compute (SM) Throughput           %        12.73
    ----------------------- ----------- ------------
    Section: Launch Statistics
    Grid Size                                                    384
  nvjet_sm90_tst_256x128_coopA_TNT (2, 66, 1)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         ms         1.25
    DRAM Throughput                   %        70.47
"""


@pytest.fixture(scope="module")
def summary() -> ModuleType:
    return load_script("device/ncu_summary")


def test_parse_reads_each_kernel_and_its_metrics(summary: ModuleType) -> None:
    decode, gemm = summary.parse(REPORT.splitlines())
    assert (decode.name, decode.grid, decode.block) == ("_decode_kernel", (3, 2, 64), (128, 1, 1))
    assert decode.duration_us() == pytest.approx(13.73)
    assert decode.value("DRAM Throughput") == pytest.approx(25.41)
    assert decode.active_share() == pytest.approx(100 * 10616.06 / 20628)
    assert "Grid Size" not in decode.metrics  # not a wanted metric
    assert gemm.name.startswith("nvjet_sm90") and gemm.grid == (2, 66, 1)
    assert gemm.duration_us() == pytest.approx(1250.0)  # ms -> µs
    assert gemm.active_share() is None  # no cycles reported


def test_table_has_a_row_per_kernel(summary: ModuleType) -> None:
    rows = summary.table(summary.parse(REPORT.splitlines())).splitlines()
    assert len(rows) == 4
    assert rows[2].startswith(
        "| 0 | _decode_kernel | 3 × 2 × 64 | 128 | 13.73 | 25.4 | 12.7 | 51% |"
    )
    assert "| 1250.00 | 70.5 |" in rows[3]
