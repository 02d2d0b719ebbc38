"""One module per architecture family; importing this package registers every one of them
(export/family.py is the registry), so adding a family is adding a module here."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
