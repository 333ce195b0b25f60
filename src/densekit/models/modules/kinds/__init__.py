"""Every module kind, one file each (a spec class and its `ModuleKind`, registered); importing the
package imports them all, in the order of their file names, so each registers itself. A new kind is one
new file here."""

import importlib
import pkgutil

for _found in sorted(pkgutil.iter_modules(__path__), key=lambda found: found.name):
    importlib.import_module(f"{__name__}.{_found.name}")
