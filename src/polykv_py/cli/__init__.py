"""The ``polykv`` command line: ``main`` is the console entry point."""

from .app import main

__all__ = ["main"]
