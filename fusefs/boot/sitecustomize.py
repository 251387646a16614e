"""Loaded by every Python process that `fusefs run` starts (this folder leads its PYTHONPATH):
hints each torch DataLoader over a fusefs mount with its epoch's order (fusefs/autohint.py).

Standard library only, and nothing but registering happens here: the hinting is imported
once torch.utils.data.dataloader has run, in the processes that import it. Three steps:
1. the sitecustomize this one stands in front of (Debian's, a virtual environment's) runs
   as it would have;
2. `fusefs` becomes importable in an interpreter that lacks it (such as Debian's python3
   beside a virtual environment with fusefs): a finder for that one name, asked last, looks
   in FUSEFS_RUN_HOME (the folder that holds the launcher's fusefs package) and nowhere else;
3. a finder asked first sees torch.utils.data.dataloader imported and, once the module has
   run, calls fusefs.autohint.install on it.
Whatever fails here says so in one line and leaves the program to run unhinted.
"""
import os
import sys

HOME_ENV = "FUSEFS_RUN_HOME"
TARGET = "torch.utils.data.dataloader"


def _say(text):
    try:
        print("fusefs run: " + text, file=sys.stderr, flush=True)
    except Exception:
        pass


def _run_the_next_sitecustomize(here):
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec
    others = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(module_from_spec(spec))


class _FusefsFinder:
    """Finds the top-level name `fusefs` in FUSEFS_RUN_HOME only (asked after every other
    finder: an interpreter's own fusefs comes first)."""

    def __init__(self, home):
        self.home = home

    def find_spec(self, name, path=None, target=None):
        if name != "fusefs":
            return None
        from importlib.machinery import PathFinder
        return PathFinder.find_spec(name, [self.home])


class _AfterImport:
    """Asked first for TARGET: finds it with the other finders, and runs `then` on the
    module once it has been executed."""

    def __init__(self, then):
        self.then = then

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        sys.meta_path.remove(self)  # (once is all it takes)
        spec.loader = _Then(spec.loader, self.then)
        return spec


class _Then:
    def __init__(self, loader, then):
        self._loader, self._then = loader, then

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._then(module)


def _install(module):
    try:
        from fusefs import autohint
        autohint.install(module)
    except Exception as e:
        _say(f"DataLoaders run unhinted: the hinting did not load ({type(e).__name__}: {e})")


def _boot():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        _run_the_next_sitecustomize(here)
    except Exception as e:
        _say(f"the sitecustomize after fusefs's failed: {type(e).__name__}: {e}")
    home = os.environ.get(HOME_ENV)
    if home:
        sys.meta_path.append(_FusefsFinder(home))
    if TARGET in sys.modules:
        _install(sys.modules[TARGET])
    else:
        sys.meta_path.insert(0, _AfterImport(_install))


try:
    _boot()
except Exception as e:  # (nothing here may stop the program)
    _say(f"DataLoaders run unhinted: {type(e).__name__}: {e}")
