"""Setup for the SGLang plugin tests: the real SGLang 0.5.23 classes on a CPU-only machine.

scripts/install-sglang-cpu.sh installs SGLang (scripts/test.sh runs it). These tests run in their own
pytest process (`pytest tests/sglang`; the main run skips this directory, see tests/conftest.py),
because of the torchvision stand-in below.

torchvision: SGLang imports it at module level (sglang/srt/configs, sglang/srt/multimodal), only for image
preprocessing the plugin never uses, and PyPI's torchvision cannot load against the CPU torch. When no
working torchvision is importable, a stand-in answers `import torchvision` and any submodule (seen:
torchvision.transforms, torchvision.transforms.functional) with modules whose every non-dunder attribute
is a placeholder class. Dunder lookups raise AttributeError: `inspect.getmodule` (reached from
torch.library) probes every module in sys.modules for `__file__` and friends. `__version__` is set.
transformers' own torchvision checks are evaluated (and cached) before the stand-in goes in, so
transformers keeps seeing the truth: no torchvision.

SGLANG_USE_CPU_ENGINE is removed from the environment: with it set to 1, SGLang's memory pools and
allocator import `sgl_kernel` (its CPU kernel build, not installable here) at module level.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

os.environ.pop("SGLANG_USE_CPU_ENGINE", None)

TORCHVISION_STAND_IN_VERSION = "0.0.0+kvflow.stand.in"
TORCHVISION_STAND_IN_MODULES: list[str] = []  # the torchvision modules the stand-in has answered, in order


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class _PlaceholderMeta(type):
    """Attributes of a placeholder class are placeholder classes (`InterpolationMode.BICUBIC`, ...)."""

    def __getattr__(cls, name: str) -> type:
        if _is_dunder(name):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


class _Placeholder(metaclass=_PlaceholderMeta):
    """Stands for any torchvision object: callable, subclassable, attributes are placeholders too."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return self

    def __getattr__(self, name: str) -> type:
        if _is_dunder(name):
            raise AttributeError(name)
        return _placeholder(name)


def _placeholder(name: str) -> type:
    return _PlaceholderMeta(name, (_Placeholder,), {"__module__": "torchvision"})


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `torchvision` and every `torchvision.*` submodule; first on sys.meta_path."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        TORCHVISION_STAND_IN_MODULES.append(module.__name__)
        module.__path__ = []  # a package: submodules come from this finder too
        module.__version__ = TORCHVISION_STAND_IN_VERSION

        def __getattr__(name: str) -> type:  # PEP 562 module attribute hook
            if _is_dunder(name):
                raise AttributeError(name)
            return _placeholder(f"{module.__name__}.{name}")

        module.__getattr__ = __getattr__


def _real_torchvision_works() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # missing, or PyPI's build failing to load against the CPU torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def _install_torchvision_stand_in() -> None:
    if any(isinstance(finder, _TorchvisionStandIn) for finder in sys.meta_path):
        return
    try:
        from transformers.utils import import_utils
    except ImportError:
        pass
    else:  # lru_cached: answered now, without the stand-in
        import_utils.is_torchvision_available()
        import_utils.is_torchvision_v2_available()
    sys.meta_path.insert(0, _TorchvisionStandIn())


if not _real_torchvision_works():
    _install_torchvision_stand_in()


# ---- fixtures ----

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def sglang_plugin() -> None:
    """The plugin registered and its hooks installed, as SGLang's `load_plugins()` does in each of
    its processes; SGLang's scheduler-side config published as its own test kits do."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from kvflow_ray.engines.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1,
                                                    radix_eviction_policy="kvflow"))
