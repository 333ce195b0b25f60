"""Every pre-training objective, one file each (a `PretrainTask` subclass, registered, and the section
of its settings); importing the package imports them all, in the order of their file names, so each
registers itself. A new objective is one new file here."""

from densekit.registry import import_every_module

import_every_module(__name__, __path__)
