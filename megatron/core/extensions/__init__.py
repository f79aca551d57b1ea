"""Adapters to optional libraries (Megatron Core's `megatron.core.extensions` path).

`transformer_engine` holds the Transformer Engine layers (`TELinear`, `TENorm`, ...) and
`transformer_engine_spec_provider` the backend that puts them into layer specs. Importing this package
or its modules never imports Transformer Engine: it is imported the first time a TE layer is built.
"""
