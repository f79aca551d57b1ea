"""GPT inference wrapper."""
