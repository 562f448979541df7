"""How `DiffusionPipeline.from_pretrained` and `AutoPipelineForText2Image` find `LMLPPipeline`: diffusers gets a
module `__getattr__` that imports our pipeline on first read, and its text-to-image mapping an entry, by a one-shot
import hook if need be, so that neither package's import loads the other."""

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


# The pipelines diffusers can find by `_class_name`: name -> the module that defines it.
PIPELINES = {"LMLPPipeline": "diffusers_lmlp.pipelines.pipeline_lmlp"}
# The text-to-image pipelines among them, by the key `AutoPipelineForText2Image`'s mapping files them under.
TEXT2IMAGE_PIPELINES = {"lmlp": "LMLPPipeline"}
AUTO_PIPELINE_MODULE = "diffusers.pipelines.auto_pipeline"


def find_pipeline(name: str) -> type:
    """The diffusers package's module `__getattr__`: our pipelines by name, imported on first use."""
    if name not in PIPELINES:
        raise AttributeError(name)
    pipeline_class = getattr(importlib.import_module(PIPELINES[name]), name)
    setattr(sys.modules["diffusers"], name, pipeline_class)  # later reads skip this function
    return pipeline_class


def add_lookup(diffusers: ModuleType) -> None:
    """Give the diffusers package `find_pipeline` as its module `__getattr__` (unless it has one of its own)."""
    diffusers.__dict__.setdefault("__getattr__", find_pipeline)


def add_auto_pipelines(auto_pipeline: ModuleType) -> None:
    """Enter `TEXT2IMAGE_PIPELINES` in diffusers' `AUTO_TEXT2IMAGE_PIPELINES_MAPPING`, leaving diffusers' own keys."""
    for key, name in TEXT2IMAGE_PIPELINES.items():
        auto_pipeline.AUTO_TEXT2IMAGE_PIPELINES_MAPPING.setdefault(key, find_pipeline(name))


class AfterImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: when module `name` is first imported, run `callback(module)` right after its code."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the other finders find the module itself
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = CallbackLoader(spec.loader, self.callback)
        return spec


class CallbackLoader(importlib.abc.Loader):
    """A module's own loader, followed by `callback(module)`; anything else is the wrapped loader's."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]):
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        # A package may replace itself in sys.modules as its code runs (diffusers installs a lazy module object).
        self.callback(sys.modules[module.__name__])

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def register_with_diffusers() -> None:
    """Let diffusers and its auto pipelines find `LMLPPipeline`: now, or by a hook when they are imported."""
    for name, register in (("diffusers", add_lookup), (AUTO_PIPELINE_MODULE, add_auto_pipelines)):
        if name in sys.modules:
            register(sys.modules[name])
        elif not any(isinstance(finder, AfterImport) and finder.name == name for finder in sys.meta_path):
            sys.meta_path.insert(0, AfterImport(name, register))
