"""The one validator of the Python front ends.

Every front end (``block_attn_res_fn``, the torch.library ops and their fake
implementations, ``attnres.nn.BlockAttnRes``, the binding in ``_native``, and the
seed-compatible functions in ``compat``) checks its arguments here, before any
pointer reaches the C ABI: the library can check pointers and sizes but not that a
tensor holds as many elements as the sizes claim. Every failure is a ``ValueError``
in one style::

    <function>: <argument> must be <expected>, got <actual>

The seed's own rules (3-D tensors, N <= 127, L <= 128, required gamma and caches)
are layered on top in ``seed_forward`` / ``seed_backward``, for the seed-compatible
functions only; the native API has no such limits.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

_DTYPE_NOTE = ("all inputs share one dtype: the op does not cast, also not under "
               "torch.autocast; cast the residual stream to one dtype")


class Names(NamedTuple):
    """What a front end calls the partial block, the pseudo-query, gamma and eps."""

    partial: str
    w: str
    gamma: str
    eps: str


NATIVE_NAMES = Names("partial", "w", "gamma", "eps")
SEED_NAMES = Names("partial_block", "proj_weight", "rmsnorm_gamma", "rmsnorm_eps")

# The seed's hardware limits, kept by the seed-compatible functions only.
SEED_MAX_BLOCKS = 127
SEED_MAX_SOURCES = 128


def error(function: str, argument: str, expected: str, actual: str,
          note: str = "") -> ValueError:
    message = f"{function}: {argument} must be {expected}, got {actual}"
    return ValueError(f"{message} ({note})" if note else message)


def _kind(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def tensor(function: str, name: str, t: object, shape: Optional[Sequence[int]],
           dtype: Optional[torch.dtype], device: torch.device, reference: str,
           shape_meaning: str) -> None:
    """Raises for the first of type, layout, dtype, device and shape of `t` that is off.
    `reference` names the argument that fixed dtype and device; `shape_meaning` says
    where `shape` comes from. dtype None accepts any dtype."""
    if not isinstance(t, torch.Tensor):
        raise error(function, name, "a torch.Tensor", _kind(t))
    if t.layout is not torch.strided:
        raise error(function, name, "a dense (strided) tensor", f"layout {t.layout}")
    if dtype is not None and t.dtype is not dtype:
        raise error(function, name, f"a {dtype} tensor (the dtype of {reference})",
                    str(t.dtype), _DTYPE_NOTE)
    if t.device != device:
        raise error(function, name, f"on {device} (the device of {reference})", str(t.device))
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise error(function, name, f"of shape {tuple(shape)} ({shape_meaning})",
                    f"shape {tuple(t.shape)}")


def first_source(function: str, blocks: object, partial: object,
                 names: Names = NATIVE_NAMES) -> Tuple[torch.Tensor, str]:
    """The first source and its name, once blocks is a list or tuple (a [B, T, D] tensor
    would otherwise be taken for B blocks of [T, D]) and that source is a tensor of a
    supported dtype with a last dimension D."""
    if not isinstance(blocks, (list, tuple)):
        raise error(function, "blocks", "a list or tuple of tensors", _kind(blocks))
    if len(blocks):
        first, first_name = blocks[0], "blocks[0]"
    elif partial is not None:
        first, first_name = partial, names.partial
    else:
        raise error(function, "blocks", f"non-empty when {names.partial} is None",
                    f"an empty {type(blocks).__name__}")
    if not isinstance(first, torch.Tensor):
        raise error(function, first_name, "a torch.Tensor", _kind(first))
    if first.dtype not in SUPPORTED_DTYPES:
        raise error(function, first_name, "a bfloat16, float16, float32 or float64 tensor",
                    str(first.dtype))
    if first.dim() == 0:
        raise error(function, first_name, "a tensor [..., D]", "a 0-d tensor")
    return first, first_name


def sources(function: str, blocks: object, partial: object, w: object, gamma: object,
            names: Names = NATIVE_NAMES) -> Tuple[List[torch.Tensor], int, torch.dtype]:
    """[*blocks, partial] once first_source() holds and every tensor agrees with the
    first source (dtype, device, dense layout; the sources' shape, [D] for w and gamma),
    with D and the dtype. gamma may be None. This runs on every call and its loop grows
    with L: the common case is one pass of cheap tests; messages are built only on failure."""
    first, first_name = first_source(function, blocks, partial, names)
    all_sources = list(blocks)
    if partial is not None:
        all_sources.append(partial)
    dtype, shape, device, dim = first.dtype, first.shape, first.device, first.shape[-1]
    on_cpu = first.is_cpu
    vectors = [(names.w, w)] + ([(names.gamma, gamma)] if gamma is not None else [])
    try:
        for t in all_sources + [v for _, v in vectors]:
            if (t.dtype is not dtype or t.layout is not torch.strided
                    or not (t.is_cpu if on_cpu else t.device == device)):
                break
        else:
            if all(t.shape == shape for t in all_sources) and all(
                    v.shape == (dim,) for _, v in vectors):
                return all_sources, dim, dtype
    except AttributeError:  # not a tensor: named below
        pass
    source_names = [f"blocks[{i}]" for i in range(len(blocks))] + (
        [names.partial] if partial is not None else [])
    for name, t in zip(source_names, all_sources):
        tensor(function, name, t, shape, dtype, device, first_name, f"the shape of {first_name}")
    for name, t in vectors:
        tensor(function, name, t, (dim,), dtype, device, first_name,
               f"D, the last dimension of {first_name}")
    raise AssertionError("unreachable: a check above fails")


def scalars(function: str, scale: float, eps: float, names: Names = NATIVE_NAMES) -> None:
    """scale finite, eps finite and >= 0 (a non-number raises TypeError). Checked here too
    because an empty batch returns before reaching the C ABI."""
    if not math.isfinite(scale):
        raise error(function, "scale", "finite", str(scale))
    if not (math.isfinite(eps) and eps >= 0):
        raise error(function, names.eps, "finite and >= 0", str(eps))


def inputs(function: str, blocks: object, partial: object, w: object, gamma: object,
           scale: float, eps: float) -> Tuple[List[torch.Tensor], int, torch.dtype]:
    """The checks of every native front end: sources() and scalars()."""
    result = sources(function, blocks, partial, w, gamma)
    scalars(function, scale, eps)
    return result


# ---------------------------------------------------------------------------------
# The eager fast path: the common case in one pass, no message built
# ---------------------------------------------------------------------------------

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact classes: no subclass takes the fast path
_STRIDED = torch.strided
_LISTS = (list, tuple)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_ACCUMULATION = {torch.bfloat16: torch.float32, torch.float16: torch.float32,
                 torch.float32: torch.float32, torch.float64: torch.float64}


_any_requires_grad = torch._C._any_requires_grad


class Layout(NamedTuple):
    """What a fast check (plain_inputs, plain_phase1, plain_phase2) found: the inputs
    are plain and valid, and so may take the eager fast path (attnres._op)."""

    pointers: Optional[list]  # the row inputs' data_ptr()s (None for phase 2)
    contiguous: bool          # every tensor input is contiguous
    requires_grad: bool       # some input requires grad (False outside grad mode)
    shape: torch.Size         # the row inputs' shape
    dtype: torch.dtype
_isfinite = math.isfinite


def _plain_head(t: object) -> Optional[tuple]:
    """``(dtype, shape, device)`` of a plain (torch.Tensor or nn.Parameter), strided
    tensor of a supported dtype with at least one dimension, on the CPU (device None)
    or a CUDA device; None for anything else."""
    if t.__class__ not in _PLAIN or t.layout is not _STRIDED:
        return None
    dtype, shape = t.dtype, t.shape
    if dtype not in _SUPPORTED or not shape:
        return None
    if t.is_cpu:
        return dtype, shape, None
    return (dtype, shape, t.device) if t.is_cuda else None


def _fold_alike(contiguous: bool, dtype, device, shape, tensors: tuple) -> Optional[bool]:
    """Whether `contiguous` still holds after `tensors`: None unless each is plain,
    strided, of `dtype` and `shape`, on `device` (None: the CPU)."""
    for t in tensors:
        if (t.__class__ not in _PLAIN or t.dtype is not dtype or t.layout is not _STRIDED
                or not (t.is_cpu if device is None else t.device == device)
                or t.shape != shape):
            return None
        if contiguous and not t.is_contiguous():
            contiguous = False
    return contiguous


def _plain_rows(sources: Sequence) -> Optional[tuple]:
    """The one pass of the fast path over its row tensors (non-empty): each like
    _plain_head() of the first, alike. Returns ``(pointers, contiguous, shape, dtype,
    device)`` (device None on the CPU) or None."""
    first = sources[0]
    try:
        head = _plain_head(first)
        if head is None:
            return None
        dtype, shape, device = head
        contiguous = first.is_contiguous()
        pointers = [first.data_ptr()]
        rest = iter(sources)
        next(rest)
        # _fold_alike() written out, without the layout test: this loop is the cost.
        # data_ptr() raises for every tensor without a strided storage (sparse,
        # mkldnn), which leaves the fast path.
        for t in rest:
            if (t.__class__ not in _PLAIN or t.dtype is not dtype
                    or not (t.is_cpu if device is None else t.device == device)
                    or t.shape != shape):
                return None
            if contiguous and not t.is_contiguous():
                contiguous = False
            pointers.append(t.data_ptr())
    except RuntimeError:  # no storage, or no shape (a nested tensor): the checks say what
        return None
    return pointers, contiguous, shape, dtype, device


def plain_inputs(blocks: object, partial: object, w: object, gamma: object, scale: float,
                 eps: float, grad: bool) -> Optional[Layout]:
    """The inputs of a native front end (what inputs() accepts) that the fast path
    takes, checked in one pass: a list or tuple of plain tensors (torch.Tensor or
    nn.Parameter, no subclass) plus the partial block, all of one supported dtype,
    strided, of one shape, on the CPU or one CUDA device; w and gamma (or None)
    plain, [D], alike; scale finite, eps finite and >= 0. `grad`: whether grad mode
    is on (requires_grad is only looked at then).

    Returns a Layout (the pointers of ``[*blocks, partial]``), or None for anything
    else -- the caller then runs inputs(), which names what is wrong, or takes the
    custom ops for what is right but unusual."""
    if blocks.__class__ not in _LISTS:
        return None
    sources = [*blocks, partial] if partial is not None else blocks
    if not sources or not (_isfinite(scale) and _isfinite(eps) and eps >= 0):
        return None
    scan = _plain_rows(sources)
    if scan is None:
        return None
    return _layout(scan, (scan[2][-1],), w, gamma, sources, grad)


def _layout(scan: tuple, weight_shape, w: object, gamma: object, rows: Sequence,
            grad: bool) -> Optional[Layout]:
    """The Layout of the row inputs `rows`, which _plain_rows() returned `scan` for, once
    w and gamma (or None) are plain and alike, of `weight_shape`."""
    pointers, contiguous, shape, dtype, device = scan
    contiguous = _fold_alike(contiguous, dtype, device, weight_shape,
                             (w, gamma) if gamma is not None else (w,))
    if contiguous is None:
        return None
    return Layout(pointers, contiguous, grad and _any_requires_grad(*rows, w, gamma), shape,
                  dtype)


def plain_phase1(blocks: object, w: object, gamma: object, eps: float, scale: float,
                 grad: bool) -> Optional[Layout]:
    """plain_inputs() for phase 1: blocks a non-empty list or tuple of plain tensors of
    one supported dtype, shape and device, strided; w [S, D] and gamma (or None) of
    w's shape, alike. Returns a Layout (the blocks' pointers) or None (then phase1()
    names what is wrong)."""
    if blocks.__class__ not in _LISTS or not blocks or not (
            _isfinite(scale) and _isfinite(eps) and eps >= 0):
        return None
    scan = _plain_rows(blocks)
    if scan is None or w.__class__ not in _PLAIN:
        return None
    queries = w.shape
    if len(queries) != 2 or queries[0] < 1 or queries[1] != scan[2][-1]:
        return None
    return _layout(scan, queries, w, gamma, blocks, grad)


def plain_phase2(out: object, lse: object, partial: object, w: object, gamma: object,
                 norm_weight: object, eps: float, scale: float, norm_eps: float,
                 grad: bool, update: object = None) -> Optional[tuple]:
    """plain_inputs() for phase 2: out a plain strided tensor [..., D] of a supported
    dtype on the CPU or a CUDA device; lse [...] in the accumulation dtype; partial (or
    None) like out; update (or None; only with partial) like out; w, gamma, norm_weight
    (or None) [D]; all plain, strided, on out's device; the scalars finite, eps and
    norm_eps >= 0. Returns a Layout (no pointers) or None (then phase2() names what is
    wrong)."""
    if not (_isfinite(scale) and _isfinite(eps) and eps >= 0 and _isfinite(norm_eps)
            and norm_eps >= 0):
        return None
    head = _plain_head(out)
    if head is None:
        return None
    dtype, shape, device = head
    if (lse.__class__ not in _PLAIN or lse.dtype is not _ACCUMULATION[dtype]
            or lse.layout is not _STRIDED or lse.shape != shape[:-1]
            or not (lse.is_cpu if device is None else lse.device == device)):
        return None
    contiguous = out.is_contiguous() and lse.is_contiguous()
    if update is not None:
        if partial is None:
            return None
        contiguous = _fold_alike(contiguous, dtype, device, shape, (partial, update))
    elif partial is not None:
        contiguous = _fold_alike(contiguous, dtype, device, shape, (partial,))
    if contiguous is not None:
        vectors = (w,) if gamma is None else (w, gamma)
        if norm_weight is not None:
            vectors += (norm_weight,)
        contiguous = _fold_alike(contiguous, dtype, device, (shape[-1],), vectors)
    if contiguous is None:
        return None
    requires_grad = grad and _any_requires_grad(out, lse, partial, w, gamma, norm_weight,
                                                update)
    return Layout(None, contiguous, requires_grad, shape, dtype)


def grad_out(function: str, name: str, t: object, first: torch.Tensor) -> None:
    """The upstream gradient has the sources' shape, dtype, device and a dense layout."""
    if not (isinstance(t, torch.Tensor) and t.shape == first.shape and t.dtype is first.dtype
            and t.layout is torch.strided and t.device == first.device):
        tensor(function, name, t, first.shape, first.dtype, first.device, "the sources",
               "the shape of the sources")


def cache(function: str, name: str, t: object, shape: Tuple[int, ...]) -> None:
    """A cache of the native API: any dtype and shape holding prod(shape) values (it is
    converted to the accumulation dtype, contiguous, on the sources' device)."""
    if not isinstance(t, torch.Tensor):
        raise error(function, name, "a torch.Tensor", _kind(t))
    if t.layout is not torch.strided:
        raise error(function, name, "a dense (strided) tensor", f"layout {t.layout}")
    if t.numel() != math.prod(shape):
        raise error(function, name, f"a tensor of {math.prod(shape)} values ([..., L] = {shape})",
                    f"shape {tuple(t.shape)}")


# ---------------------------------------------------------------------------------
# The seed's rules, on top of the above
# ---------------------------------------------------------------------------------

def _seed_blocks(function: str, blocks: object) -> None:
    if isinstance(blocks, (list, tuple)) and not blocks:
        raise error(function, "blocks", "a non-empty list of tensors (the seed needs N >= 1)",
                    "an empty list")
    first_source(function, blocks, None, SEED_NAMES)
    if blocks[0].dim() != 3:
        raise error(function, "blocks[0]", "a 3-D tensor [B, T, D]",
                    f"shape {tuple(blocks[0].shape)}")


def seed_forward(blocks, proj_weight, partial_block, scale, rmsnorm_eps, rmsnorm_gamma,
                 enable_rmsnorm, rms_out_flag) -> None:
    """The seed's _validate_forward_inputs, its limit N <= 127, and the native checks."""
    function = "block_attn_res"
    _seed_blocks(function, blocks)
    if len(blocks) > SEED_MAX_BLOCKS:
        raise error(function, "blocks", f"at most {SEED_MAX_BLOCKS} tensors (the seed's limit "
                    f"N <= {SEED_MAX_BLOCKS}, L <= {SEED_MAX_SOURCES}; attnres.block_attn_res_fn "
                    "has none)", f"N = {len(blocks)}")
    # The seed checks a given gamma even when RMSNorm is off.
    sources(function, blocks, partial_block, proj_weight, rmsnorm_gamma, SEED_NAMES)
    scalars(function, scale, rmsnorm_eps, SEED_NAMES)
    if enable_rmsnorm and rmsnorm_gamma is None:
        raise error(function, "rmsnorm_gamma", "a [D] tensor when enable_rmsnorm=True", "None")
    if rms_out_flag and not enable_rmsnorm:
        raise error(function, "rms_out_flag", "False when enable_rmsnorm=False (there is no "
                    "RMSNorm output to cache)", "True")


def seed_backward(grad_h, blocks, proj_weight, alpha_cache, partial_block, rmsnorm_gamma,
                  rms_cache, scale, enable_rmsnorm) -> None:
    """The seed's _validate_backward_inputs, its limit L <= 128, and the native checks."""
    function = "block_attn_res_backward"
    _seed_blocks(function, blocks)
    # gamma plays no part (and is not checked) without RMSNorm, as in the seed.
    gamma = rmsnorm_gamma if enable_rmsnorm else None
    all_sources, _, _ = sources(function, blocks, partial_block, proj_weight, gamma, SEED_NAMES)
    scalars(function, scale, 0.0, SEED_NAMES)  # the seed's backward takes no eps
    first = all_sources[0]
    b, t, _ = first.shape
    num_sources = len(all_sources)
    grad_out(function, "grad_h", grad_h, first)
    if alpha_cache is None:
        raise error(function, "alpha_cache", "a [B, T, L] tensor", "None")
    tensor(function, "alpha_cache", alpha_cache, (b, t, num_sources), None, first.device,
           "blocks[0]", f"[B, T, L] with L = {num_sources}")
    if enable_rmsnorm:
        if rmsnorm_gamma is None:
            raise error(function, "rmsnorm_gamma", "a [D] tensor when enable_rmsnorm=True",
                        "None")
        if rms_cache is None:
            raise error(function, "rms_cache", "a [B, T, L, 1] tensor when enable_rmsnorm=True",
                        "None")
        tensor(function, "rms_cache", rms_cache, (b, t, num_sources, 1), None, first.device,
               "blocks[0]", f"[B, T, L, 1] with L = {num_sources}")
    if num_sources > SEED_MAX_SOURCES:
        raise error(function, "blocks + partial_block", f"at most {SEED_MAX_SOURCES} sources "
                    f"(the seed's limit L <= {SEED_MAX_SOURCES}; attnres.block_attn_res_fn has "
                    "none)", f"L = {num_sources}")


# ---------------------------------------------------------------------------------
# The two-phase ops (attnres.two_phase)
# ---------------------------------------------------------------------------------

def phase1(function: str, blocks: object, w: object, gamma: object, eps: float,
           scale: float) -> Tuple[List[torch.Tensor], int, int]:
    """Phase 1: blocks a non-empty list of [..., D] tensors of one dtype, device and
    shape; w and gamma (or None) [S, D]. Returns (blocks, D, S)."""
    if not isinstance(blocks, (list, tuple)) or not blocks:
        actual = (_kind(blocks) if not isinstance(blocks, (list, tuple))
                  else f"an empty {type(blocks).__name__}")
        raise error(function, "blocks", "a non-empty list or tuple of tensors", actual)
    first, _ = first_source(function, blocks, None)
    dim = first.shape[-1]
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[-1] != dim or w.shape[0] < 1:
        raise error(function, "w", f"a tensor [S, D] with D = {dim} (one row per query)",
                    _kind(w))
    for i, b in enumerate(blocks):
        tensor(function, f"blocks[{i}]", b, first.shape, first.dtype, first.device,
               "blocks[0]", "the shape of blocks[0]")
    tensor(function, "w", w, None, first.dtype, first.device, "blocks[0]", "")
    if gamma is not None:
        tensor(function, "gamma", gamma, w.shape, first.dtype, first.device, "blocks[0]",
               "the shape of w")
    scalars(function, scale, eps)
    return list(blocks), dim, w.shape[0]


def phase2(function: str, out: object, lse: object, partial: object, w: object,
           gamma: object, norm_weight: object, eps: float, scale: float,
           norm_eps: float, update: object = None) -> None:
    """Phase 2: out [..., D] (phase 1's output), lse [...] fp32 (fp64 for fp64), partial
    (or None) like out, update (or None) like partial and only with it, w, gamma and
    norm_weight (or None) [D]."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        raise error(function, "out", "a tensor [..., D] (phase 1's output)", _kind(out))
    if out.dtype not in SUPPORTED_DTYPES:
        raise error(function, "out", "a bfloat16, float16, float32 or float64 tensor",
                    str(out.dtype))
    dim = out.shape[-1]
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    tensor(function, "lse", lse, out.shape[:-1], acc, out.device, "out",
           "the leading dimensions of out; fp32, fp64 for fp64 inputs")
    if partial is not None:
        tensor(function, "partial", partial, out.shape, out.dtype, out.device, "out",
               "the shape of out")
    if update is not None:
        # Added into the partial block: without one there is nothing to update.
        if partial is None:
            raise error(function, "update", "None when partial is None (it is added into "
                        "the partial block)", _kind(update))
        tensor(function, "update", update, partial.shape, partial.dtype, partial.device,
               "partial", "the shape of partial")
    tensor(function, "w", w, (dim,), out.dtype, out.device, "out", "D")
    for name, t in (("gamma", gamma), ("norm_weight", norm_weight)):
        if t is not None:
            tensor(function, name, t, (dim,), out.dtype, out.device, "out", "D")
    scalars(function, scale, eps)
    if not (math.isfinite(norm_eps) and norm_eps >= 0):
        raise error(function, "norm_eps", "finite and >= 0", str(norm_eps))
