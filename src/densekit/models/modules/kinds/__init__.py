"""Every module kind, one file each (a spec class and its `ModuleKind`, registered); importing the
package imports them all, in the order of their file names, so each registers itself. A new kind is one
new file here."""

from densekit.registry import import_every_module

import_every_module(__name__, __path__)
