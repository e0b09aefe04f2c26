"""Make SGLang 0.5.23's model code importable on a CPU-only machine, for tests.

SGLang's wheel pulls in CUDA-only packages (``sgl_kernel``/``sglang-kernel``,
flashinfer, ...) and ``torchvision`` (whose PyPI build links CUDA torch
libraries and fails to load beside the CPU ``torch==2.13.0``).  The draft-model
modules only touch them at import time (``import torchvision.transforms as T``
in multimodal helpers, optional kernel imports), never in the code paths the
loader tests run.  ``install()`` registers an import hook that serves an inert
stand-in for each such top-level package *only when it is not installed*; a
real installation always wins.  Anything that actually calls into a stand-in
raises, so a test cannot silently pass through stub code.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# Top-level packages SGLang imports that cannot (or need not) be installed on CPU.
STUBBED = ("torchvision", "sgl_kernel")


class _Inert:
    """Stands for any attribute of a missing package: usable in class bodies,
    decorators, annotations and isinstance checks; raises when called for real work."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Inert:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a CPU test stand-in (sglang_shims); it cannot run")

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())

    def __repr__(self) -> str:
        return f"<inert {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        root = fullname.split(".")[0]
        if root not in self.roots:
            return None
        # Serve a top-level stand-in only to SGLang's own imports: availability probes
        # elsewhere (transformers' ``importlib.util.find_spec("torchvision")``) must
        # keep seeing the package as absent.
        if fullname == root and not _imported_by_sglang():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__sglang_shim__ = True
        return module

    def exec_module(self, module) -> None:
        pass


def _imported_by_sglang() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("importlib", "_frozen_importlib")) and module != __name__:
            return module == "sglang" or module.startswith("sglang.")
        frame = frame.f_back
    return False


_installed: _StubFinder | None = None


def install() -> tuple[str, ...]:
    """Register the stand-ins for the STUBBED packages that are not installed; idempotent."""
    global _installed
    if _installed is None:
        # Appended last: an installed package is always found by the normal finders first.
        missing = tuple(name for name in STUBBED if importlib.util.find_spec(name) is None)
        _installed = _StubFinder(missing)
        sys.meta_path.append(_installed)
    return _installed.roots
