"""Glue between the REST server and the inference engine."""
