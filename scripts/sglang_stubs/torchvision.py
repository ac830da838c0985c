"""A stand-in for torchvision, for `python -m sglang.bench_serving` on a CPU-only machine.

SGLang's model-config modules import torchvision when bench_serving is imported
(`import torchvision.transforms as T`, `from torchvision.transforms import InterpolationMode`);
the benchmark client never calls it. PyPI's torchvision cannot load beside the CPU torch 2.13.0
(`operator torchvision::nms does not exist`), and one that matches pulls a CUDA torch. So this
module answers those imports: every `torchvision.*` submodule is made up on import, every name
in it is a class that refuses to run, and the two enums SGLang reads at import are real.
Put this directory on PYTHONPATH only where torchvision is not installed. It has no package
metadata, so transformers still finds torchvision unavailable and does not use it.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"
__path__: list[str] = []  # a package: `import torchvision.transforms` comes to the finder below


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


class _Absent:
    """Any other torchvision name: importable and constructible, never runnable."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("torchvision is a stub here (scripts/sglang_stubs): install the real one to use it")


_REAL = {"InterpolationMode": InterpolationMode, "ImageReadMode": ImageReadMode}


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)
    return _REAL.get(name, _Absent)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Submodules())
