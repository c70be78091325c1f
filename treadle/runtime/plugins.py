"""User code named in a config: ``module:function`` or ``path/to/file.py:function``, and
plug-ins (``algorithm.plugins``): modules or files imported for what they register.

Reward functions, agent loops and tools are given by such a spec. A spec whose left side ends
in ``.py`` or contains a path separator is a file, imported with importlib under a name unique
to the file (it need not be on ``sys.path`` or in a package); anything else is an importable
module. A
problem with the spec is a :class:`~treadle.runtime.errors.ConfigError` naming the config key.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from treadle.runtime.errors import ConfigError


def load_callable(spec: str, key: str) -> Callable[..., Any]:
    """The function ``spec`` names (``module:function`` or ``file.py:function``)."""
    left, sep, name = spec.rpartition(":")
    if not sep or not left or not name:
        raise ConfigError(f"{key}: {spec!r} is not 'module:function' or 'path/to/file.py:function'")
    module = _import_file(Path(left), key) if _is_file(left) else _import_module(left, key)
    obj = getattr(module, name, None)
    if obj is None:
        raise ConfigError(f"{key}: {left!r} has no function {name!r}")
    if not callable(obj):
        raise ConfigError(f"{key}: {name!r} in {left!r} is a {type(obj).__name__}, not a function")
    return obj  # type: ignore[no-any-return]


def require_call(
    fn: Callable[..., Any], spec: str, key: str, params: tuple[str, ...], how: str
) -> None:
    """A ConfigError when ``fn`` cannot be called with ``params`` positionally, as treadle
    calls it (``how``: the call as the docs show it); a function without a signature passes."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: found out when called
        return
    try:
        sig.bind(*params)
    except TypeError:
        raise ConfigError(
            f"{key}: {spec!r} has the signature {sig}, but it is called as {how}"
        ) from None


# The child of :func:`probe_import`: exit 0 when the module imports, 3 when treadle's own
# import of it raises a ConfigError (the parent's import then says the same).
_PROBE = """
import sys
from pathlib import Path
from treadle.runtime.errors import ConfigError
from treadle.runtime.plugins import _import_file, _import_module, _is_file
left, key = sys.argv[1:]
try:
    _import_file(Path(left), key) if _is_file(left) else _import_module(left, key)
except ConfigError:
    sys.exit(3)
"""


def probe_import(spec: str, key: str, timeout_s: float) -> None:
    """Import the module of ``spec`` (``module:function``, ``file.py:function``) in a child
    process first, for at most ``timeout_s`` seconds: a module that hangs where no signal
    reaches it (C code, SIGALRM blocked) or ends its process (``os._exit``, a crash) is a
    ConfigError naming ``key``, not a command that hangs or vanishes. What an import raises is
    left to the import in this process, whose message it is."""
    left, sep, _ = spec.rpartition(":")
    if not sep or not left:
        return
    try:
        child = subprocess.run(
            [sys.executable, "-c", _PROBE, left, key],
            check=False,
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"{key}: importing {left!r} did not finish in {timeout_s:g} s: a module must "
            "define its functions quickly when imported (load models or data on first call)"
        ) from None
    if child.returncode not in (0, 3):
        how = (
            f"was killed by signal {-child.returncode}"
            if child.returncode < 0
            else f"ended its process with exit code {child.returncode}"
        )
        raise ConfigError(f"{key}: importing {left!r} {how}: a module must not end its process")


def load_plugins(specs: list[str], key: str = "algorithm.plugins") -> None:
    """Import every module (``my_package.estimators``) or file (``path/to/file.py``) of
    ``specs``, for the functions they register (``@register_adv_estimator(...)``).

    Each is imported once per process (again it would register its names twice); one that
    cannot be imported or raises is a ConfigError naming ``key``.
    """
    for spec in specs:
        if spec.endswith(".py"):
            if _file_module_name(Path(spec)) not in sys.modules:
                _import_file(Path(spec), key)
            continue
        try:
            importlib.import_module(spec)
        except (Exception, SystemExit) as e:  # ImportError, or what the module raised
            raise ConfigError(f"{key}: importing {spec!r} {_raised(e)}") from e


def _is_file(left: str) -> bool:
    return left.endswith(".py") or "/" in left


def _import_module(name: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module {name!r} ({e})") from e
    except SystemExit as e:
        raise ConfigError(f"{key}: importing {name!r} {_raised(e)}") from e


def _raised(e: BaseException) -> str:
    """What an import did instead of defining its functions, for a ConfigError."""
    if isinstance(e, SystemExit):
        return (
            f"called sys.exit({e.code!r}): a module must not exit when imported (put the "
            "script's code under `if __name__ == '__main__':`)"
        )
    return f"raised {type(e).__name__}: {e}"


def _file_module_name(path: Path) -> str:
    """A module name unique per file, so two user files called tools.py do not collide."""
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    return f"treadle_user_{resolved.stem}_{digest}"


def _import_file(path: Path, key: str) -> ModuleType:
    if not path.is_file():
        raise ConfigError(f"{key}: file '{path}' does not exist")
    resolved = path.resolve()
    module_name = _file_module_name(path)
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{key}: cannot import '{path}' as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets the module use dataclasses, pickle, ...
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[module_name]
        raise ConfigError(f"{key}: importing '{path}' {_raised(e)}") from e
    return module
