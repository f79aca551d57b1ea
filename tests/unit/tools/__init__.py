"""Tests of tools/ (checkpoint converters)."""
