"""The `fuselm` command line: one module per command, each a thin click layer over the API."""
