"""The version of this meshtrain (a module of its own: the run record and the CLI read it
without importing the package's API)."""

__version__ = "0.1.0"
