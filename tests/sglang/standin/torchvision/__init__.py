"""A stand-in for torchvision, only so that SGLang's config modules import on this machine.

Named and explained in docs/sglang.md ("The test tier"): the package index serves torchvision only as
builds that do not match the pinned ``torch==2.13.0`` CPU build (importing one fails on its operators),
and SGLang imports it at module level in a few multimodal config modules (``sglang.srt.configs``) that
its memory pools import transitively; transformers, seeing a torchvision, imports more of it. Nothing
the storage tier runs uses it: every submodule imports, and every name in one is an object that
raises when called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

from ._unavailable import resolve

__version__ = "0.0.0+kvconn-standin"


def __getattr__(name: str) -> Any:
    return resolve(__name__, name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every ``torchvision.*`` module as an empty package whose names are :func:`resolve`'s."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(f"{__name__}.") or fullname == f"{__name__}._unavailable":
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: resolve(spec.name, name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_Submodules())
