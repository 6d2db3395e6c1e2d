"""Run every variant of a bundle at several M, for compute-sanitizer to watch.

    compute-sanitizer --tool memcheck  --error-exitcode 1 python3 scripts/sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize.py
    compute-sanitizer --tool initcheck --error-exitcode 1 python3 scripts/sanitize.py

Each variant runs on random inputs at M in {1, 3, 257, 4096} (``--rows``), dynamic-K
variants at the smallest and largest preset hidden size they accept. Every K is a
multiple of G (the spec refuses others), so no group is ragged. Outputs are checked against the reference on a few rows, so a
run that the sanitizer passes but that computes garbage still fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

from tvm_rmsquant import ops, reference
from tvm_rmsquant.checks import compare, random_inputs
from tvm_rmsquant.loader import open_bundle
from tvm_rmsquant.presets import preset
from tvm_rmsquant.spec import VariantSpec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,3,257,4096")
    parser.add_argument("--bundle")
    parser.add_argument("--only", default="", help="run only variants whose name contains this")
    args = parser.parse_args()
    rows_list = [int(value) for value in args.rows.split(",")]
    bundle = open_bundle(args.bundle)
    ops.use_bundle(bundle)
    # Dynamic-K variants at the smallest and largest preset hidden size they accept.
    hidden_sizes = sorted({spec.hidden for spec in preset("default") if spec.hidden is not None})
    runs = failures = 0
    names = [name for name in bundle.names() if args.only in name]
    for name in names:
        spec = VariantSpec.parse(name)
        accepted = [k for k in hidden_sizes if spec.accepts_hidden(k) is None]
        for hidden in [spec.hidden] if spec.hidden is not None else sorted({accepted[0], accepted[-1]}):
            static = spec.with_hidden(hidden)
            for rows in rows_list:
                inputs = random_inputs(static, rows, hidden, seed=rows, device="cuda")
                residual, scale_ub = inputs["residual"], inputs["scale_ub"]
                before = None if residual is None else residual[:2].cpu()
                if spec.residual:
                    q, scales = ops.fused_add_rms_norm_group_quant(inputs["x"], residual, inputs["weight"], 1e-6, name, scale_ub)
                else:
                    q, scales = ops.rms_norm_group_quant(inputs["x"], inputs["weight"], 1e-6, name, scale_ub)
                torch.cuda.synchronize()
                want = reference.rms_norm_group_quant(
                    inputs["x"][:2].cpu(), inputs["weight"].cpu(), 1e-6, static, before, None if scale_ub is None else scale_ub.cpu()
                )
                got = (q[:2], scales[:2], None if residual is None else residual[:2])
                agreement = compare(static, got, want, hidden)
                runs += 1
                if not agreement.passed:
                    failures += 1
                    print(f"WRONG {name} K={hidden} M={rows}: {agreement.describe()}", flush=True)
    print(f"sanitize: {runs} runs over {len(names)} variants, {failures} wrong", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
