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


def test_a_peer_with_other_numerics_is_judged_by_its_dequantized_error():
    """The flashinfer provider's verdict: its dequantized output against fp64, next to the
    contract's own error, and its residual bit for bit; a broken peer is WRONG."""
    from tvm_rmsquant import reference
    from tvm_rmsquant.bench import FlashInferProvider, dequantized_verdict
    from tvm_rmsquant.checks import random_inputs
    from tvm_rmsquant.spec import VariantSpec

    spec = VariantSpec("bf16", 1024, 128, True, "col", "fp32")
    inputs = random_inputs(spec, 9, 1024, seed=3)
    oracle = reference.rms_norm_group_quant(inputs["x"], inputs["weight"], 1e-6, spec, inputs["residual"])
    ratio = FlashInferProvider.ERROR_RATIO
    verdict = dequantized_verdict(spec, oracle, inputs, 1e-6, oracle, ratio, extra_bytes=9 * 1024 * 2)
    assert not verdict.startswith("WRONG") and "residual identical" in verdict and "+0.0184 MB written besides" in verdict
    # Scales twice as large: every value dequantizes to twice itself.
    doubled = dequantized_verdict(spec, (oracle[0], oracle[1] * 2, oracle[2]), inputs, 1e-6, oracle, ratio)
    assert doubled.startswith("WRONG: dequantized error 0.99")
    residual = oracle[2].clone()
    residual[0, 0] += 1
    assert "residual DIFFERS" in dequantized_verdict(spec, (oracle[0], oracle[1], residual), inputs, 1e-6, oracle, ratio)
    assert FlashInferProvider.supports(None, spec) and not FlashInferProvider.supports(None, VariantSpec("bf16", 1024, 128, False, "col", "fp32"))


def test_the_flashinfer_provider_says_how_to_build_its_library(tmp_path):
    import pytest

    from tvm_rmsquant.bench import FlashInferProvider

    with pytest.raises(ValueError, match=r"needs .*missing.so: build it with python3 scripts/build_flashinfer_peer.py"):
        FlashInferProvider(str(tmp_path / "missing.so"))
