"""Mixture of experts (Megatron Core's `megatron.core.transformer.moe` package): router, token dispatchers,
experts, shared experts and the MoE layer. Importing the package loads nothing; import the modules."""
