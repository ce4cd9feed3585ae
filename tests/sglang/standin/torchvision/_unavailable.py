"""What every name of the stand-in resolves to: importable, raising when used."""

from __future__ import annotations

from typing import Any


class Unavailable:
    """A name SGLang imports from torchvision at module level; calling it raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name}: kvconn's test stand-in for torchvision cannot run it (docs/sglang.md)")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self.name}.{attr}")


def resolve(module: str, name: str) -> Unavailable:
    """A module ``__getattr__``'s answer: dunders stay missing (the import system asks for them)."""
    if name.startswith("__"):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return Unavailable(f"{module}.{name}")
