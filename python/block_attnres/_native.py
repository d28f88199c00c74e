"""ctypes binding of libattnres: the one place where Python meets the C ABI.

Tensors are passed by pointer. A tensor is read in place when its rows of D
elements are contiguous and its leading dimensions collapse to one row stride
(e.g. contiguous, or a slice ``x[..., :D]`` of a wider tensor); otherwise it is
copied once with ``.contiguous()``. Nothing is stacked. The library itself does
not link against libtorch, so one build serves every torch version. Arguments are
checked by ``_validate`` before any pointer is taken, and the struct that carries
them is checked against the library's own layout at import.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from . import _validate

DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
ELEMENT_BYTES = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 2, torch.float16: 2}
_DEVICE_CPU, _DEVICE_CUDA = 0, 1
_ABI_VERSION = 3

# attnres_status values (include/attnres/attnres.h) and the Python error for each.
_ERRORS = {1: ValueError, 2: ValueError, 3: ValueError, 4: ValueError, 5: MemoryError,
           6: RuntimeError, 7: RuntimeError, 8: RuntimeError}


_I32, _I64, _F64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_double
_PTR, _PTRS = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)


class _Params(ctypes.Structure):
    """Mirror of attnres_params, grouped as in the header; field order and types must
    match it (checked against the library's own layout at import)."""

    _fields_ = [
        ("abi_version", _I32),
        # Sizes.
        ("num_tokens", _I64), ("dim", _I64), ("num_blocks", _I64), ("dtype", _I32),
        ("device", _I32), ("stream", _PTR),
        # Inputs.
        ("blocks", _PTRS), ("partial", _PTR), ("source_row_stride", _I64),
        ("proj_weight", _PTR), ("gamma", _PTR), ("scale", _F64), ("eps", _F64),
        ("rmsnorm", _I32),
        # Forward outputs.
        ("out", _PTR), ("out_row_stride", _I64), ("rms_cache", _PTR), ("alpha_cache", _PTR),
        # Backward.
        ("grad_out", _PTR), ("grad_out_row_stride", _I64), ("grad_blocks", _PTRS),
        ("grad_partial", _PTR), ("grad_source_row_stride", _I64),
        ("grad_proj_weight", _PTR), ("grad_gamma", _PTR),
        # ABI 2: the two-phase schedule.
        ("num_queries", _I64), ("query_outs", _PTRS), ("query_lses", _PTRS),
        ("grad_query_outs", _PTRS), ("grad_query_lses", _PTRS), ("accumulate_grads", _I32),
        ("query_out", _PTR), ("query_lse", _PTR), ("grad_query_out", _PTR),
        ("grad_query_lse", _PTR), ("input_norm", _I32), ("norm_eps", _F64),
        ("norm_weight", _PTR), ("grad_norm_weight", _PTR),
        # ABI 3: phase 2's fused partial-block update.
        ("partial_update", _PTR), ("new_partial", _PTR), ("grad_partial_in", _PTR),
    ]


class _Field(ctypes.Structure):
    """Mirror of attnres_field: one entry of the library's own layout of attnres_params."""

    _fields_ = [("name", ctypes.c_char_p), ("offset", ctypes.c_int64), ("size", ctypes.c_int64)]


Layout = List[Tuple[str, int, int]]  # (name, offset, size) of each field, in declaration order


def params_layout(structure=_Params) -> Layout:
    """The layout ctypes gives a mirror of attnres_params."""
    return [(name, getattr(structure, name).offset, getattr(structure, name).size)
            for name, _ in structure._fields_]


def check_params_layout(python: Layout, python_size: int, library: Layout,
                        library_size: int) -> None:
    """Raises ImportError at the first field whose name, offset or size differs between
    the Python mirror and the library, or when the struct sizes differ: a call with a
    mismatched struct would hand the library pointers in the wrong places."""
    def describe(field) -> str:
        if field is None:
            return "no field"
        return f"{field[0]!r} at offset {field[1]}, size {field[2]}"

    for i in range(max(len(python), len(library))):
        ours = python[i] if i < len(python) else None
        theirs = library[i] if i < len(library) else None
        if ours != theirs:
            raise ImportError(
                f"attnres_params field {i}: the Python mirror (attnres._native._Params) has "
                f"{describe(ours)}, libattnres has {describe(theirs)}; the package and the "
                "library come from different versions (rebuild or reinstall both)")
    if python_size != library_size:
        raise ImportError(f"attnres_params size: the Python mirror has {python_size} bytes, "
                          f"libattnres has {library_size}")


def _find_library() -> Path:
    override = os.environ.get("ATTNRES_LIBRARY")
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent / "lib"
    for name in ("libattnres.so", "libattnres.dylib", "attnres.dll"):
        if (here / name).exists():
            return here / name
    raise ImportError(
        f"libattnres not found in {here}; install the package with `pip install .` "
        "or point ATTNRES_LIBRARY at a built libattnres.so")


# A call passes the arrays of pointers it refers to (blocks, grad_blocks, the
# two-phase lists) followed by attnres_params, packed by struct in the C layout ("@":
# native sizes and alignment), in a buffer that is reused from call to call: one
# pack_into and no ctypes object per call. The formats come from _Params so that the
# two cannot drift apart; the defaults (those of attnres_params_init) are read from
# the library once at import.
_STRUCT_CODES = {ctypes.c_int32: "i", ctypes.c_int64: "q", ctypes.c_double: "d"}
_FIELD_CODES = [_STRUCT_CODES.get(t, "P") for _, t in _Params._fields_]
_PARAMS_FORMAT = "@" + "".join(_FIELD_CODES)
_PARAMS_SIZE = struct.calcsize(_PARAMS_FORMAT)
_POINTER_SIZE = ctypes.sizeof(ctypes.c_void_p)
if _PARAMS_SIZE != ctypes.sizeof(_Params) or _PARAMS_SIZE % _POINTER_SIZE:
    raise ImportError("attnres._native: the struct format of attnres_params disagrees with _Params")
FIELDS = {name: i for i, (name, _) in enumerate(_Params._fields_)}  # name -> position


def _library_layout(lib) -> Tuple[Layout, int]:
    """The layout of attnres_params that the library was compiled with."""
    try:
        fields, size = lib.attnres_params_fields, lib.attnres_params_size
    except AttributeError:
        raise ImportError(f"{lib._name} does not export attnres_params_fields: it predates "
                          f"ABI version {_ABI_VERSION}; rebuild or reinstall it") from None
    fields.argtypes = [ctypes.POINTER(ctypes.c_int32)]
    fields.restype = ctypes.POINTER(_Field)
    size.restype = ctypes.c_int64
    count = ctypes.c_int32()
    table = fields(ctypes.byref(count))
    return [(f.name.decode(), f.offset, f.size) for f in table[:count.value]], size()


_lib = ctypes.CDLL(str(_find_library()))
check_params_layout(params_layout(), ctypes.sizeof(_Params), *_library_layout(_lib))
for _name in ("attnres_forward", "attnres_backward", "attnres_phase1_forward",
              "attnres_phase1_backward", "attnres_phase2_forward", "attnres_phase2_backward"):
    getattr(_lib, _name).argtypes = [ctypes.c_void_p]  # the address of the packed params
    getattr(_lib, _name).restype = ctypes.c_int
_lib.attnres_params_init.argtypes = [ctypes.c_void_p]
for _name in ("attnres_version", "attnres_last_error", "attnres_cpu_isa", "attnres_cpu_isas"):
    getattr(_lib, _name).restype = ctypes.c_char_p
_lib.attnres_set_num_threads.argtypes = [ctypes.c_int]
_lib.attnres_get_num_threads.restype = ctypes.c_int
_lib.attnres_set_cpu_isa.argtypes = [ctypes.c_char_p]
_lib.attnres_cuda_available.restype = ctypes.c_int

__version__ = _lib.attnres_version().decode()


def _defaults() -> tuple:
    """The values of attnres_params_init, in field order."""
    p = _Params()
    _lib.attnres_params_init(ctypes.addressof(p))
    return struct.unpack(_PARAMS_FORMAT, bytes(p))


DEFAULTS = _defaults()
_ABI_VERSION_FIELD = DEFAULTS[FIELDS["abi_version"]]
if _ABI_VERSION_FIELD != _ABI_VERSION:
    raise ImportError(f"libattnres has ABI version {_ABI_VERSION_FIELD}, the package "
                      f"{_ABI_VERSION}; rebuild or reinstall both")


def entry_call(entry: str, fields: Sequence[str], arrays: Sequence[str] = ()):
    """A function call(like, *values, *arrays) that calls the ABI's `entry` with
    attnres_params whose `fields` are `values`, whose `arrays` fields point at the
    given lists of pointers, every other field at its default (attnres_params_init),
    with `like`'s CUDA device current when it is on one.

    The function is generated once, so that a call packs in one pack_into with no
    per-field Python. Each call site keeps, per thread and per total number of
    pointers, a buffer that holds the pointers and then the params, whose fields past
    the last one this call site sets hold their defaults from the start: a call packs
    the pointers and the params only up to that field. One buffer per thread: ctypes
    releases the GIL during a call, so another thread may pack its own call meanwhile;
    within a thread a call has returned before the next one packs."""
    unknown = [n for n in (*fields, *arrays) if n not in FIELDS]
    if unknown or len(set((*fields, *arrays))) != len(fields) + len(arrays):
        raise ValueError(f"entry_call: unknown or repeated fields {unknown or (fields, arrays)}")
    last = max(FIELDS[n] for n in (*fields, *arrays))
    head = "".join(_FIELD_CODES[:last + 1])
    last_field = getattr(_Params, _Params._fields_[last][0])
    if struct.calcsize("@" + head) != last_field.offset + last_field.size:
        raise ImportError(f"attnres._native: the head of attnres_params for {entry} is misaligned")
    given = {name: f"v_{name}" for name in fields}
    given.update({name: f"o_{name}" for name in arrays})
    values = ", ".join(given.get(name, f"D[{i}]")
                       for i, (name, _) in enumerate(_Params._fields_[:last + 1]))
    parameters = [f"v_{n}" for n in fields] + [f"a_{n}" for n in arrays]
    lines = [f"def call(like, {', '.join(parameters)}):"]
    lines.append(f"    count = {' + '.join(f'len(a_{n})' for n in arrays) or '0'}")
    lines.append("    try:")
    lines.append("        buf, base, packer = local.buffers[count]")
    lines.append("    except (AttributeError, KeyError):")
    lines.append("        buf, base, packer = new_buffer(count)")
    offset = "base"
    for name in arrays:
        lines.append(f"    o_{name} = {offset}")
        offset = f"o_{name} + PS * len(a_{name})"
    pointers = "".join(f"*a_{n}, " for n in arrays)
    lines.append(f"    packer.pack_into(buf, 0, {pointers}{values})")
    lines.append("    params = base + PS * count")
    lines.append("    if like.is_cpu:")
    lines.append("        status = function(params)")
    lines.append("        if status:")
    lines.append("            check(status)")
    lines.append("    else:")
    lines.append("        call_entry(function, params, like)")
    local = threading.local()

    def new_buffer(count: int):
        """This thread's buffer for `count` pointers: defaults in place, and its packer."""
        buf = ctypes.create_string_buffer(_POINTER_SIZE * count + _PARAMS_SIZE)
        struct.pack_into(_PARAMS_FORMAT, buf, _POINTER_SIZE * count, *DEFAULTS)
        entry = (buf, ctypes.addressof(buf), struct.Struct(f"@{count}P" + head))
        try:
            local.buffers[count] = entry
        except AttributeError:
            local.buffers = {count: entry}
        return entry

    namespace = {"D": DEFAULTS, "local": local, "new_buffer": new_buffer, "PS": _POINTER_SIZE,
                 "call_entry": _call, "check": _check, "function": getattr(_lib, entry)}
    exec("\n".join(lines), namespace)  # noqa: S102  (the source is built above from names)
    call = namespace["call"]
    call.__doc__ = f"{entry} with {', '.join(fields)}; arrays {', '.join(arrays) or 'none'}"
    return call


def set_num_threads(n: int) -> None:
    """Threads of the CPU kernels; n <= 0 restores the default (the cores, or
    ATTNRES_NUM_THREADS / OMP_NUM_THREADS when set)."""
    _lib.attnres_set_num_threads(int(n))


def get_num_threads() -> int:
    return int(_lib.attnres_get_num_threads())


def cpu_isa() -> str:
    """The CPU kernel variant in use: "avx512bf16", "avx512", "avx2" or "baseline"."""
    return _lib.attnres_cpu_isa().decode()


def cpu_isas() -> List[str]:
    """The CPU kernel variants this build compiled in and this CPU runs, best first:
    the names set_cpu_isa() accepts."""
    return _lib.attnres_cpu_isas().decode().split()


def set_cpu_isa(name: Optional[str]) -> None:
    """Force a CPU kernel variant, one of cpu_isas() (None: the best this CPU runs)."""
    _check(_lib.attnres_set_cpu_isa(None if name is None else name.encode()))


def cuda_available() -> bool:
    return bool(_lib.attnres_cuda_available())


# Large outputs on the CPU: fresh tensors of tens of MB come straight from mmap,
# and the first write of each 4 KB page is a fault plus a clear. Backed by 2 MB
# pages (transparent huge pages, on request) the faults are 512x fewer
# (docs/PYTORCH.md measures it). The advice covers only tensors this module
# allocates; ATTNRES_HUGEPAGES=0 turns it off (torch's THP_MEM_ALLOC_ENABLE=1 does
# the same for every allocation).
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_madvise = None
if os.environ.get("ATTNRES_HUGEPAGES", "1") != "0" and sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def new_output(like: torch.Tensor, nbytes: int) -> torch.Tensor:
    """An uninitialised contiguous tensor like `like` (nbytes of it), asking for
    huge pages when it is large and on the CPU. Failure of the advice is harmless."""
    if nbytes < _LARGE_OUTPUT and like.is_contiguous():
        return _empty_like(like)  # the common small case, in one call
    out = _empty_like(like, memory_format=torch.contiguous_format)
    if nbytes >= _LARGE_OUTPUT and _madvise is not None and out.is_cpu:
        start = out.data_ptr()
        first = (start + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
        last = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if last > first:
            _madvise(first, last - first, _MADV_HUGEPAGE)
    return out


_LARGE_OUTPUT = 2 * _HUGE_PAGE  # smaller outputs span too few huge pages to advise
_empty_like = torch.empty_like


# ---------------------------------------------------------------------------------
# The eager fast path
# ---------------------------------------------------------------------------------

def _missing() -> bool:  # a check this torch lacks: never take the fast path
    return True


_is_compiling = torch.compiler.is_compiling
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", _missing)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", _missing)
_functorch = getattr(torch._C, "_are_functorch_transforms_active", _missing)
_jit_tracing = getattr(torch._C, "_get_tracing_state", _missing)


def eager() -> bool:
    """True when a call may go to the library directly instead of through the
    torch.library custom ops: nothing is tracing or transforming it. Not under
    torch.compile / torch.export (dynamo folds is_compiling() to True, so the rest is
    never traced), not with a TorchDispatchMode active (FakeTensorMode,
    FunctionalTensorMode, make_fx's proxy mode, selective checkpointing), nor a
    TorchFunctionMode (e.g. `with torch.device(...)`), nor inside a torch.func
    transform or torch.jit.trace. The front ends also require plain tensors (torch.Tensor
    or nn.Parameter, no subclass) on the CPU or a CUDA device; everything else goes
    through the custom ops, which all that machinery understands."""
    return not (_is_compiling() or _dispatch_modes() or _function_modes() or _functorch()
                or _jit_tracing())


def _check(status: int) -> None:
    if status != 0:
        message = _lib.attnres_last_error().decode()
        raise _ERRORS.get(status, RuntimeError)(message)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the caches: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_stride(x: torch.Tensor, dim: int) -> Optional[int]:
    """The single stride between consecutive rows of x viewed as [tokens, dim], or
    None when the leading dimensions do not collapse to one (or rows overlap)."""
    if x.dim() == 0 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        return None
    stride = None
    expected = None
    for size, step in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if stride is None:
            stride, expected = step, step * size
        elif step != expected:
            return None
        else:
            expected = step * size
    if stride is None:  # zero or one row
        return dim
    return stride if stride >= dim else None


def rows(tensors: Sequence[torch.Tensor], dim: int) -> Tuple[List[torch.Tensor], int]:
    """The tensors with one shared row stride (the ABI's one stride per group of row
    tensors), copying only those that need it."""
    for t in tensors:  # a plain loop: cheaper than all() over a generator
        if not t.is_contiguous():
            break
    else:
        return tensors, dim
    strides = [row_stride(t, dim) for t in tensors]
    if strides and all(s == strides[0] for s in strides) and strides[0] is not None:
        return list(tensors), strides[0]
    return [t if s == dim else t.contiguous() for t, s in zip(tensors, strides)], dim


def _call(function, address: int, like: torch.Tensor) -> None:
    """Calls an entry point of the ABI on the params packed at `address`; on CUDA with
    the tensors' device current, as the kernels launch on the current device and
    torch's current stream for it."""
    if like.is_cuda:
        with torch.cuda.device(like.device):
            _check(function(address))
    else:
        _check(function(address))


def device_and_stream(function: str, x: torch.Tensor) -> Tuple[int, int]:
    """The ABI's (device, stream) fields for tensors on x's device; torch's current
    stream on CUDA. Errors name `function`."""
    if x.is_cpu:
        return _DEVICE_CPU, 0
    if x.is_cuda:
        return _DEVICE_CUDA, torch.cuda.current_stream(x.device).cuda_stream
    raise _validate.error(function, "blocks", "on the CPU or a CUDA device", str(x.device))


def ptr(t: Optional[torch.Tensor]) -> int:
    """t's data pointer, or 0 (NULL) for None."""
    return t.data_ptr() if t is not None else 0


def row_bytes(like: torch.Tensor, dim: int) -> Tuple[int, int]:
    """(tokens, bytes) of a tensor of like's shape and dtype viewed as [tokens, dim]."""
    tokens = like.numel() // dim if dim else 0
    return tokens, tokens * dim * ELEMENT_BYTES[like.dtype]


def zero_sums(tensors) -> None:
    """Zeroes the given gradients (None skipped): sums over no tokens."""
    for t in tensors:
        if t is not None:
            t.zero_()
