"""The `campugrid` command line."""
