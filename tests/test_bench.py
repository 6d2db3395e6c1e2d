"""The benchmark's report: what a wrong provider's cell says."""

import math

from tvm_rmsquant.bench import Point, markdown_table


def test_a_wrong_provider_is_labelled_whether_or_not_it_was_timed():
    points = [
        Point("ours", "bf16_k4096_g128_row_fp32", 4096, 4096, 19.0, 2600.0, 0.62, "codes identical 1.0"),
        # torch.compile is timed even though Inductor folds the contract's roundings away
        Point("torch_compile", "bf16_k4096_g128_row_fp32", 4096, 4096, 60.0, 830.0, 0.2, "WRONG: codes identical 0.97"),
        # any other wrong provider is never timed
        Point("triton", "bf16_k4096_g128_row_fp32", 4096, 4096, math.nan, math.nan, math.nan, "WRONG: codes identical 0.5"),
    ]
    row = markdown_table(points, 4200.0).splitlines()[-1]
    assert row == "| bf16_k4096_g128_row_fp32 | 4096 | 19.00 (62%) | 60.00 (20%, wrong codes) | WRONG |"
