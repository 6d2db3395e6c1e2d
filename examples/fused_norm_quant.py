"""Select the fused norm + quant per layer at init, compile with the fusion pass, run.

    python examples/fused_norm_quant.py            # CPU (llvm build or the reference)
    python examples/fused_norm_quant.py --cuda     # the bundle's CUDA kernels
"""

import sys

import torch

import tvm_rmsquant
from tvm_rmsquant import fusion, reference


class NormThenFP8Linear(torch.nn.Module):
    """RMSNorm -> per-token-group FP8 quant -> a linear reading the FP8 activations."""

    def __init__(self, hidden: int, out: int, consumer: str, device):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(hidden, device=device, dtype=torch.bfloat16), requires_grad=False)
        self.weight = torch.nn.Parameter(torch.randn(out, hidden, device=device).bfloat16() / hidden**0.5, requires_grad=False)
        # Decided once, here, from the consumer: never while torch.compile traces.
        self.kernel = tvm_rmsquant.select(hidden, torch.bfloat16, residual=True, consumer=consumer, device=device, consumer_weight=self.weight)

    def forward(self, x, residual):
        y, residual = reference.rms_norm(x, self.norm, 1e-5, residual)
        q, scales = reference.group_quant(y, self.kernel.spec)
        return reference.dequantize(q, scales, self.kernel.spec).bfloat16() @ self.weight.t(), residual


def main(device: str) -> None:
    model = torch.nn.Sequential()
    layers = [NormThenFP8Linear(1024, 1024, consumer, device) for consumer in ("deepgemm_sm90", "triton")]
    for layer in layers:
        print(layer.kernel.variant, "-", layer.kernel.why[-1].reason)
    compiled = [fusion.compile(layer, fullgraph=True) for layer in layers]
    x, residual = torch.randn(32, 1024, device=device).bfloat16(), torch.randn(32, 1024, device=device).bfloat16()
    with torch.no_grad():
        for layer, run in zip(layers, compiled):
            out, residual = run(x, residual)
            print(f"{layer.kernel.spec.layout}/{layer.kernel.spec.format}: fused ops per graph {run.fusion_pass.graphs}, out {tuple(out.shape)}")


if __name__ == "__main__":
    main("cuda" if "--cuda" in sys.argv else "cpu")
