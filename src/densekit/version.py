"""densekit's version, which every artefact's manifest records (a module of its own, so that writing a
manifest imports nothing else of the package)."""

__version__ = "0.1.0"
