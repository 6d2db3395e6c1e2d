"""Integrations with other projects' model code: ``tvm_rmsquant.integrations.transformers``
runs Hugging Face transformers' fine-grained FP8 models on this package's kernels."""
