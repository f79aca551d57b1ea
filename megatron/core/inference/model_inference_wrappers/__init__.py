"""Model wrappers of the inference engines."""
