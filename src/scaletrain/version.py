"""The package's version: a module of its own, so that any layer may read it without
importing the package's face (scaletrain/__init__.py, which imports the configuration)."""

__version__ = "0.1.0"
