"""The optimisation plan: how a built model runs (FP8 GEMMs, compiled layers, traced linears, CUDA graphs,
the tensor-parallel overlap transport, the fused kernels), decided once and applied in one step.

A model is built plain from its specs. `resolve.resolve_plan(config, DeviceFacts)` then turns the config's
flags (each `auto` included) into an `OptimizationPlan`, a pure function of its two inputs, which
`resolve.format_plan` prints as one table (decision, value, why) and `OptimizationPlan.as_dict` stores with
the checkpoint args; `apply.apply_optimization_plan(model_chunks, plan)` carries it out, step by step, in a
fixed order (the way torchtitan's `parallelize_*` applies its job config). `megatron.training.get_model`
runs the three for every training and tool run.

Import from the submodules: `resolve` is light (configs and the FP8 rules), `apply` imports the model
packages.
"""
