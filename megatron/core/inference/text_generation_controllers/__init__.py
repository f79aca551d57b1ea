"""Text-generation controllers."""
