"""Layer specs of heterogeneous GPT models (`heterogeneous_layer_specs.get_gpt_heterogeneous_layer_spec`)."""
