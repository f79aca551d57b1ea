"""Native FP8 training (`--fp8-format`): FP8 GEMMs for the transformer layers' linears without Transformer Engine."""
