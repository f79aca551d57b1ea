"""Request parsing of the REST server's routes."""
