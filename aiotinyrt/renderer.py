"""Renderers: a portable kernel description to source code for a backend."""

from __future__ import annotations


class Renderer:
    """Turns a portable kernel into source for one backend (C-style renderers subclass this)."""

    device: str = ""
    #: Whether rendered kernels take the launch's global size and loop over it themselves.
    has_local: bool = False
