"""The language-model base class."""
