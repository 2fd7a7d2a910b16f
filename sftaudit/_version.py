"""The package version: a leaf both halves import (the shim never imports the package root)."""

__version__ = "0.1.0"
