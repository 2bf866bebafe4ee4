"""The package's version, in a leaf module: code below the public root (the report) reads it without
importing the root, which exports the Lightning callbacks."""

__version__ = "0.1.0"
