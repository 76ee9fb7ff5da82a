"""The ctypes side of the CPU kernels agrees with the C side: every `fdlp_*` function the bindings
call has, in `CpuKernels`, exactly the argument and return types of its C definition, and the
structs passed by pointer (`fdlp_linear_t`, `fdlp_attention_t`, the LoRA ones) have the same fields
in the same order and types in C and in Python. The C side is read from the preprocessed source (macro-made
functions included), with the compiler the build uses; a mismatch would otherwise pass arguments
silently wrong."""

from __future__ import annotations

import ctypes
import functools
import re
import shutil
import subprocess

import pytest

from fastdeploy_lp.model import cpu_kernels
from fastdeploy_lp.model.cpu_kernels import _Attention, _Linear
from fastdeploy_lp.model.cpu_kernels.build import SOURCE
from fastdeploy_lp.model.cpu_kernels.structs import _LoRA, _LoRAWeight

_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "double": ctypes.c_double, "float": ctypes.c_float,
            "void": None}


@functools.cache
def _preprocessed() -> str:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    done = subprocess.run([compiler, "-E", "-P", "-std=gnu11", str(SOURCE)], capture_output=True, text=True,
                          cwd=SOURCE.parent)
    assert done.returncode == 0, done.stderr[-500:]
    return done.stdout


def _ctype(declaration: str):
    """The ctypes type a C parameter or return type is passed as (any pointer: c_void_p)."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = [w for w in declaration.replace("const ", "").split() if w]
    return _SCALARS[words[0]]


def c_functions() -> dict[str, tuple[object, list]]:
    """name -> (return ctype, [argument ctypes]) of every exported `fdlp_*` definition."""
    functions = {}
    for ret, name, params in re.findall(r"^((?:const )?[A-Za-z_]\w*\s*\**)\s*(fdlp_\w+)\(([^)]*)\)\s*\{",
                                        _preprocessed(), flags=re.M):
        if ret.strip() == "static":
            continue
        args = [] if params.strip() == "void" else [_ctype(p.rsplit(None, 1)[0] if "*" not in p else p)
                                                     for p in params.split(",")]
        functions[name] = (_SCALARS.get(ret.strip()) if "*" not in ret else ctypes.c_void_p, args)
    return functions


def c_struct(name: str) -> list[tuple[str, object, int]]:
    """(field, ctype, array length or 0) of `typedef struct {...} name;`, in order."""
    body = re.search(r"typedef struct \{([^{}]*)\}\s*" + name + ";", _preprocessed()).group(1)
    fields = []
    for declaration in filter(None, (d.strip() for d in body.split(";"))):
        kind, names = re.match(r"((?:const )?[A-Za-z_]\w*)\s+(.*)", declaration).groups()
        for item in (n.strip() for n in names.split(",")):
            pointer, field, length = re.match(r"(\**)\s*(\w+)(?:\[(\d+)\])?", item).groups()
            fields.append((field, ctypes.c_void_p if pointer else _SCALARS[kind.replace("const ", "")],
                           int(length or 0)))
    return fields


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load()
    if k is None:
        pytest.skip("the CPU kernels are not built on this machine")
    return k


def test_every_bound_function_has_its_c_signature(kernels):
    functions = c_functions()
    bound = {fn.__name__: fn for fn in vars(kernels).values()
             if isinstance(fn, ctypes._CFuncPtr) and fn.__name__.startswith("fdlp_")}
    for group in vars(kernels).values():  # the per-dtype tables
        if isinstance(group, dict):
            bound.update({fn.__name__: fn for fn in group.values() if isinstance(fn, ctypes._CFuncPtr)})
    assert len(bound) >= 15, sorted(bound)
    wrong = []
    for name, fn in sorted(bound.items()):
        ret, args = functions[name]
        if list(fn.argtypes or []) != args:
            wrong.append(f"{name}: argtypes {fn.argtypes} but C takes {args}")
        if fn.restype is not ret:
            wrong.append(f"{name}: restype {fn.restype} but C returns {ret}")
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("struct, c_name", [(_Linear, "fdlp_linear_t"), (_Attention, "fdlp_attention_t"),
                                            (_LoRAWeight, "fdlp_lora_weight_t"), (_LoRA, "fdlp_lora_t")])
def test_the_structs_match_their_c_typedefs(struct, c_name):
    python = []
    for field, kind in struct._fields_:
        length = getattr(kind, "_length_", 0)
        python.append((field, kind._type_ if length else kind, length))
    c_fields = c_struct(c_name)
    assert [(f, k, n) for f, k, n in python] == c_fields
