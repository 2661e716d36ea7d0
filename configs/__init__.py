"""Data files: the default ladder and the device table."""
