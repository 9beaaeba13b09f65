"""A restricted unpickler: admits plain containers and numpy arrays, nothing that can execute code."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import IO, Any

from .errors import ActlakeError, UnsafePickleError

_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("builtins", name)
        for name in ("dict", "list", "tuple", "set", "frozenset", "str", "int", "float", "complex", "bool", "slice")
    }
    | {("collections", "OrderedDict"), ("_codecs", "encode")}
    | {
        (module, name)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name in ("_reconstruct", "scalar")
    }
    | {("numpy", "ndarray"), ("numpy", "dtype")}
    | {("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}
)


def _sized_only(factory: Any, source: str | Path | None) -> Any:
    """`bytes` / `bytearray` that refuse an integer size: `bytes(10**12)` in a pickle is a memory bomb."""

    def build(*args: Any) -> Any:
        if args and isinstance(args[0], int):
            raise UnsafePickleError(f"pickle asks for {factory.__name__}({args[0]}), which is not allowed", source)
        return factory(*args)

    return build


def _empty_reconstruct(reconstruct: Any, source: str | Path | None) -> Any:
    """numpy's `_reconstruct`, admitted only for the empty shell numpy itself pickles (data comes via setstate)."""

    def build(cls: Any, shape: Any, dtype: Any) -> Any:
        size = 1
        for n in shape if isinstance(shape, tuple) else (shape,):
            size *= int(n)
        if size > 1:
            raise UnsafePickleError(f"pickle asks numpy to allocate shape {shape!r} up front", source)
        return reconstruct(cls, shape, dtype)

    return build


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler whose find_class refuses everything outside a small allow-list."""

    def __init__(self, file: IO[bytes], *, source: str | Path | None = None) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocol <= 2 pickles name Python 2's module
            module = "builtins"
        if module == "builtins" and name in ("bytes", "bytearray"):
            return _sized_only(super().find_class(module, name), self._source)
        if name == "_reconstruct" and (module, name) in _ALLOWED:
            return _empty_reconstruct(super().find_class(module, name), self._source)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module.startswith("numpy") and name.endswith("DType") and module.endswith("dtypes"):
            return super().find_class(module, name)  # numpy >= 1.25 pickles dtypes by class
        raise UnsafePickleError(f"pickle refers to {module}.{name}, which is not allowed", self._source)


def safe_load(file: IO[bytes], *, source: str | Path | None = None) -> Any:
    """Load one pickle from an open binary file with the restricted unpickler."""
    try:
        return RestrictedUnpickler(file, source=source).load()
    except ActlakeError:  # refused by the unpickler or by the stream it reads (a capped decompression)
        raise
    except Exception as exc:  # corrupt stream: EOFError, UnpicklingError, ValueError...
        raise UnsafePickleError(f"cannot unpickle: {type(exc).__name__}: {exc}", source) from exc


def safe_loads(data: bytes, *, source: str | Path | None = None) -> Any:
    """Load one pickle from bytes with the restricted unpickler."""
    return safe_load(io.BytesIO(data), source=source)


#: modules whose callables run code or touch the system when a pickle names them
CODE_RUNNING_MODULES = frozenset({
    "os", "posix", "nt", "subprocess", "sys", "shutil", "importlib", "runpy", "code", "codeop", "ctypes",
    "socket", "pickle", "_pickle", "marshal", "types", "pty", "webbrowser", "multiprocessing", "signal",
})
#: builtins that run code, import modules or reach attributes when a pickle calls them
CODE_RUNNING_BUILTINS = frozenset({
    "eval", "exec", "compile", "__import__", "getattr", "setattr", "delattr", "open", "input", "breakpoint",
    "globals", "locals", "vars", "memoryview",
})


def pickle_globals(data: bytes, *, source: str | Path | None = None) -> list[str]:
    """The `module.name` globals a pickle refers to, read from its opcodes without executing anything.

    For telling a pickled class the restricted unpickler refuses (e.g. a dataset class of another
    tool) from a broken stream: UnsafePickleError when the stream does not parse to its STOP.
    """
    import pickletools

    found: list[str] = []
    strings: list[Any] = []  # recently pushed values, for STACK_GLOBAL's two string arguments
    memo: dict[int, Any] = {}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name == "GLOBAL":
                found.append(str(arg).replace(" ", ".", 1))
            elif name == "STACK_GLOBAL":
                module, attr = (strings[-2:] if len(strings) >= 2 else ["?", "?"])
                found.append(f"{module}.{attr}")
            if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                memo[len(memo) if name == "MEMOIZE" else int(arg)] = strings[-1] if strings else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                strings.append(memo.get(int(arg)))
            elif name not in ("FRAME", "PROTO"):
                strings.append(arg if isinstance(arg, str) and name != "GLOBAL" else None)
    except Exception as exc:  # truncated or corrupt stream: ValueError from genops
        raise UnsafePickleError(f"not a complete pickle: {type(exc).__name__}: {exc}", source) from exc
    return found


def runs_code(global_name: str) -> bool:
    """Whether a pickled global (`module.name`) is a callable that runs code or touches the system."""
    module, _, name = global_name.rpartition(".")
    top = module.split(".", 1)[0]
    return top in CODE_RUNNING_MODULES or (module in ("builtins", "__builtin__") and name in CODE_RUNNING_BUILTINS)
