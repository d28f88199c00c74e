"""How an op of attnres becomes a PyTorch op: one declaration (``OpDef``) per op, from
which this module derives the rest, so that every op reaches torch the same way.

An op declares (``attnres/ops/<op>.py``):

* ``inputs``: its tensor arguments as ``(name, kind)``, kind ``"Tensor"``, ``"Tensor?"``
  or ``"Tensor[]"`` (at most one list, and first: the blocks); ``attrs``: its other
  arguments as ``(name, "float" | "bool")``; ``returns``: the schema of its results;
* ``forward(*inputs, *attrs, layout=None)``: the native call on checked inputs;
  ``layout`` is what the op's fast check found (pointers, contiguity), or None;
* ``check(function, *inputs, *attrs)``: the validator; errors name ``function``;
* ``fake(*inputs, *attrs)``: empty results of the right shapes (after ``check``);
* ``save(flat_inputs, attrs, outputs)``: the tensors autograd keeps (None allowed:
  nothing to keep, and then no gradient); by default the flat inputs themselves;
* ``backward(grads, saved, attrs, needs)``: the native backward. ``grads`` has one
  entry per result (None: zero), ``needs`` one flag per saved tensor (only where that
  tensor is not None); it returns one gradient per saved tensor (None where unneeded);
* for an op that saves something else than its inputs (phase2_update saves the new
  partial block in place of the old one and the update), ``saved_needs`` and
  ``input_grads`` map between the gradients of the inputs and of the saved tensors.

Derived (``OpDef.__init__``):

* ``attnres::<name>`` with its fake, counted in ``custom_op_calls``;
* ``attnres::<name>_backward(Tensor?[] grads, Tensor?[] saved, <attrs>, bool[] needs)
  -> Tensor[]``: the needed gradients in order; its fake makes each like its saved
  tensor;
* the autograd formula of ``attnres::<name>``;
* ``function``: the ``autograd.Function`` of the eager fast path, applied as
  ``apply(attrs, layout, *flat_inputs)``; it saves what the formula saves.

Both the formula and ``function`` end in one backward (``_grads``). The formula calls
the backward op (what a traced graph records); ``function`` calls the op's native
``backward`` directly in eager mode without grad mode, and the backward op otherwise
(compiled autograd, ``create_graph=True``), which has no formula of its own, so a
double backward is refused as by the op. Both paths run the same native calls on the
same saved tensors: the same bits.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional, Sequence, Tuple

import torch

from . import _native

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"attnres needs torch >= 2.4 (torch.library.custom_op), found torch "
                      f"{torch.__version__}")

# How many times each custom op's implementation has run (the op name -> count), a
# diagnostic: in eager mode the front ends take the fast path and these stay put;
# under torch.compile, make_fx or a torch.func transform they count.
custom_op_calls: Counter = Counter()

_eager = _native.eager
_grad_enabled = torch.is_grad_enabled


def fast_apply(cls):
    """cls.apply without autograd.Function.apply's Python preamble (binding default
    arguments for a setup_context, which these classes do not define, and unwrapping
    functorch's dead wrappers, which plain tensors outside any transform are not):
    the C entry point it ends in. Falls back to cls.apply."""
    apply = getattr(torch._C, "_FunctionBase", None)
    apply = apply.__dict__.get("apply") if apply is not None else None
    return apply.__get__(None, cls) if apply is not None else cls.apply


def _identity(values):
    return values


class OpDef:
    """One op's declaration, and what is derived from it (see the module docstring)."""

    def __init__(self, name: str, *, inputs: Sequence[Tuple[str, str]],
                 attrs: Sequence[Tuple[str, str]], returns: str, forward: Callable,
                 check: Callable, fake: Callable, backward: Callable,
                 save: Optional[Callable] = None, saved_needs: Callable = _identity,
                 input_grads: Callable = _identity) -> None:
        self.name = f"attnres::{name}"
        self.inputs, self.attrs, self.returns = tuple(inputs), tuple(attrs), returns
        self.forward, self.check, self.fake, self.backward = forward, check, fake, backward
        self.save = save or (lambda flat, attrs, outputs: flat)
        self.saved_needs, self.input_grads = saved_needs, input_grads
        self.has_list = any(kind == "Tensor[]" for _, kind in inputs)
        if self.has_list and inputs[0][1] != "Tensor[]":
            raise ValueError(f"{self.name}: a list input must come first")
        self.op = self._define_forward()
        self.backward_op = self._define_backward(name + "_backward")
        self.op.register_autograd(self._formula, setup_context=self._setup_context)
        self.function = self._define_function()
        self.apply = fast_apply(self.function)

    # -- the flat view of the inputs (the list spread out), as autograd.Function sees them

    def flatten(self, inputs: Sequence) -> list:
        return [*inputs[0], *inputs[1:]] if self.has_list else list(inputs)

    def unflatten(self, flat: Sequence) -> tuple:
        if not self.has_list:
            return tuple(flat)
        count = len(flat) - (len(self.inputs) - 1)
        return (list(flat[:count]), *flat[count:])

    # -- the custom ops -------------------------------------------------------------

    def _schema(self, arguments) -> str:
        return "(" + ", ".join(f"{kind} {name}" for name, kind in arguments) + ")"

    def _define_forward(self):
        def implementation(*args):
            custom_op_calls[self.name] += 1
            self.check(self.name, *args)
            return self.forward(*args)

        def fake(*args):
            self.check(self.name, *args)
            return self.fake(*args)

        schema = self._schema((*self.inputs, *self.attrs)) + " -> " + self.returns
        op = torch.library.custom_op(self.name, implementation, mutates_args=(), schema=schema)
        op.register_fake(fake)
        return op

    def _define_backward(self, name: str):
        qualified = f"attnres::{name}"
        attrs = len(self.attrs)

        def implementation(grads, saved, *rest):
            custom_op_calls[qualified] += 1
            attr_values, needs = tuple(rest[:attrs]), rest[attrs]
            needs = [bool(n) and s is not None for n, s in zip(needs, saved)]
            result = self.backward(list(grads), list(saved), attr_values, needs)
            # A saved tensor that plays no part (gamma given without rmsnorm) has a zero
            # gradient; the fake promises one tensor per need.
            return [g if g is not None else torch.zeros_like(s)
                    for g, s, need in zip(result, saved, needs) if need]

        def fake(grads, saved, *rest):
            return [s.new_empty(s.shape) for s, need in zip(saved, rest[attrs])
                    if need and s is not None]

        schema = (self._schema((("grads", "Tensor?[]"), ("saved", "Tensor?[]"), *self.attrs,
                                ("needs", "bool[]"))) + " -> Tensor[]")
        op = torch.library.custom_op(qualified, implementation, mutates_args=(), schema=schema)
        op.register_fake(fake)
        return op

    # -- autograd: one backward for the formula and for the eager Function -----------


    def _grads(self, ctx, grads: Sequence, input_needs: Sequence[bool], direct: bool) -> list:
        """The gradients of the flat inputs, None where not needed; through the native
        backward itself when `direct`, else through the backward op."""
        if all(g is None for g in grads):  # nothing flowed back: every gradient is zero
            return [None] * len(input_needs)
        saved = list(ctx.saved_tensors)  # read once: a saved-tensor hook may unpack once
        needs = [bool(n) and s is not None for n, s in zip(self.saved_needs(input_needs),
                                                             saved)]
        if direct:
            result = self.backward(list(grads), saved, ctx.attrs, needs)
        else:
            computed = iter(self.backward_op(list(grads), saved, *ctx.attrs, needs))
            result = [next(computed) if need else None for need in needs]
        return [g if need else None for g, need in zip(self.input_grads(result), input_needs)]

    def _setup_context(self, ctx, inputs, output):
        split = len(self.inputs)
        ctx.attrs = attrs = tuple(inputs[split:])
        ctx.save_for_backward(*self.save(self.flatten(inputs[:split]), attrs, output))

    def _formula(self, ctx, *grads):
        if self.returns == "Tensor[]":
            (grads,) = grads
        needs = ctx.needs_input_grad[:len(self.inputs)]
        flat = self._grads(ctx, grads, self.flatten(needs), direct=False)
        return (*self.unflatten(flat), *(None,) * len(self.attrs))

    def _define_function(self):
        op = self

        def forward(ctx, attrs, layout, *flat):
            outputs = op.forward(*op.unflatten(flat), *attrs, layout=layout)
            ctx.attrs = attrs
            ctx.save_for_backward(*op.save(flat, attrs, outputs))
            ctx.set_materialize_grads(False)  # a missing gradient is zero to the kernels
            return tuple(outputs) if op.returns == "Tensor[]" else outputs

        def backward(ctx, *grads):
            # create_graph=False and nothing traced: the native backward itself.
            direct = _eager() and not _grad_enabled()
            return (None, None, *op._grads(ctx, grads, ctx.needs_input_grad[2:], direct))

        # Made with type() so that the class (and its grad_fn, e.g. BlockAttnResBackward)
        # carries the op's name.
        name = "".join(part.title() for part in self.name.split("::")[1].split("_"))
        return type(name, (torch.autograd.Function,), {
            "__doc__": f"apply(attrs, layout, *flat_inputs): {self.name} on the eager fast path.",
            "forward": staticmethod(forward), "backward": staticmethod(backward)})

    # -- the call every public function makes ----------------------------------------

    def __call__(self, function: str, inputs: tuple, attrs: tuple, layout):
        """The op on `inputs`: on the eager fast path when `layout` (what the op's fast
        check returned; None: it declined) says the inputs are plain, through the custom
        op otherwise, after the validator (so that torch.compile reports an error while
        tracing, naming `function`)."""
        if layout is not None:
            if layout.requires_grad:
                return self.apply(attrs, layout, *self.flatten(inputs))
            return self.forward(*inputs, *attrs, layout=layout)
        self.check(function, *inputs, *attrs)
        if self.has_list:
            inputs = (list(inputs[0]), *inputs[1:])
        attrs = [float(a) if kind == "float" else bool(a)
                 for a, (_, kind) in zip(attrs, self.attrs)]
        return self.op(*inputs, *attrs)
