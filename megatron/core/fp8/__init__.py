"""Native FP8 training (`--fp8-format`): FP8 GEMMs for the transformer layers' linears without Transformer Engine.

Pure math below the tensor-parallel layers: the package imports nothing of megatron but `megatron.core.utils`
(docs/design.md, "Layering"); the optimisation plan switches the linears to it (`optimization_plan.apply`).
"""
