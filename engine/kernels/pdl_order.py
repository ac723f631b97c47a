"""What a Triton kernel of the engine touches before and after its PDL wait, read from its
source (Python's `ast`; nothing is compiled or run).

`engine.kernels.pdl` states the rule: before `gdc_wait` a kernel may load only what the launch
just before it does not write, and it must wait before it calls `gdc_launch_dependents`.
`memory_order` lists, per pointer parameter, where the kernel loads and stores it, so a test
can hand the kernels of a decode layer, in launch order, to `sim.launch_chain.check_chain` and
have every order the hardware allows searched for a stale read. Moving a load above the wait
in the source changes what this module reports, so the check follows the code.

The reading is conservative: a pointer counts as loaded where any `tl.load` (or atomic) names
it or a variable derived from it, in either arm of an `if` and in any loop; a store is any
`tl.store` or atomic. Pointer parameters are those named `*_ptr` (the engine's convention) and
tensor descriptors named `*_desc` (whose `.load` reads the tensor the descriptor names); a
load or store whose address derives from none of them is refused rather than skipped. A call
of a helper (a function of the kernel's module, or one named through a module it imports)
loads and stores, at the call, what the helper's own source loads and stores of the pointers
it is handed; a helper whose source cannot be read may load and store every pointer it is
handed, and one that waits or triggers is refused.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import NamedTuple

_LOADS = {"load"}
_STORES = {"store"}
_ATOMICS = {"atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min",
            "atomic_and", "atomic_or", "atomic_xor"}


@dataclass(frozen=True)
class MemoryOrder:
    """Pointer parameters of one kernel by where it uses them.

    Attributes:
        loads_before_wait / loads_after_wait: parameters loaded before / after the first
            `gdc_wait` in source order (a kernel without a wait loads everything "before":
            launched with PDL, nothing orders its loads after the previous kernel).
        stores: parameters stored or updated atomically anywhere.
        stores_before_wait: those stored before the wait (the rule allows none).
        trigger: "before wait", "after wait" or "at exit" (no `gdc_launch_dependents`), the
            names `sim.launch_chain` uses.
        waits: whether the kernel calls `gdc_wait` at all.
    """

    loads_before_wait: frozenset[str]
    loads_after_wait: frozenset[str]
    stores: frozenset[str]
    stores_before_wait: frozenset[str]
    trigger: str
    waits: bool


def memory_order(kernel, namespace: dict | None = None) -> MemoryOrder:
    """Read `kernel`'s source (a `triton.jit` function, a plain function or source text).

    Args:
        namespace: where the kernel's helpers are looked up by name (default: the module
            globals of `kernel`; source text has none unless given).
    Raises:
        ValueError: the source holds no function definition, or a load or store whose address
            derives from no `*_ptr` parameter.
    """
    fn_obj = None if isinstance(kernel, str) else getattr(kernel, "fn", kernel)
    src = kernel if fn_obj is None else inspect.getsource(fn_obj)
    if namespace is None:
        namespace = getattr(fn_obj, "__globals__", {})
    tree = ast.parse(textwrap.dedent(src))
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if fn is None:
        raise ValueError("no function definition in the kernel source")
    walker = _walk(fn, namespace)
    before = frozenset(p for p, waited in walker.loads if not waited)
    after = frozenset(p for p, waited in walker.loads if waited)
    stores = frozenset(p for p, _ in walker.stores)
    early_stores = frozenset(p for p, waited in walker.stores if not waited)
    if walker.trigger_waited is None:
        trigger = "at exit"
    else:
        trigger = "after wait" if walker.trigger_waited else "before wait"
    return MemoryOrder(before, after, stores, early_stores, trigger, walker.waited)


def _walk(fn: ast.FunctionDef, namespace: dict) -> "_Walker":
    pointers = {a.arg for a in fn.args.args if a.arg.endswith(("_ptr", "_desc"))}
    walker = _Walker(pointers, namespace)
    for stmt in fn.body:
        walker.visit(stmt)
    return walker


class HelperEffects(NamedTuple):
    """What a helper of a kernel does with the pointers it is handed, read from its source."""

    params: list[str]
    loads: set[str]
    stores: set[str]


def _helper_effects(name: str, helper) -> HelperEffects | None:
    """The `HelperEffects` of `helper` (a `triton.jit` or plain function) called as `name`,
    or None where its source cannot be read.

    Raises:
        ValueError: naming the helper: it waits or triggers (the kernel's PDL order would then
            depend on where the call sits, which this reading does not follow), or its source
            has a load or store of an address that derives from no `*_ptr` parameter.
    """
    fn_obj = getattr(helper, "fn", helper)
    try:
        src = inspect.getsource(fn_obj)
    except (OSError, TypeError):
        return None
    fn = next((n for n in ast.walk(ast.parse(textwrap.dedent(src)))
               if isinstance(n, ast.FunctionDef)), None)
    if fn is None:
        return None
    try:
        walker = _walk(fn, getattr(fn_obj, "__globals__", {}))
    except ValueError as exc:
        raise ValueError(f"helper {name}: {exc}") from None
    if walker.waited or walker.trigger_waited is not None:
        raise ValueError(f"helper {name} calls gdc_wait or gdc_launch_dependents; keep the "
                         "PDL wait and trigger in the kernel itself")
    return HelperEffects([a.arg for a in fn.args.args], {p for p, _ in walker.loads},
                         {p for p, _ in walker.stores})


def _helper(node: ast.Call, namespace: dict):
    """The function a call names in `namespace` (`_h(...)` or `module._h(...)`) where it is a
    helper the reading follows: a `triton.jit` function or a plain function not of Triton's
    own language (`tl.load`, `tl.where`, ...); else None."""
    if isinstance(node.func, ast.Name):
        return namespace.get(node.func.id)
    if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
        module = namespace.get(node.func.value.id)
        if inspect.ismodule(module) and not module.__name__.startswith("triton"):
            return getattr(module, node.func.attr, None)
    return None


def _is_descriptor_call(node: ast.Call) -> bool:
    """A method of a tensor descriptor (``w_desc.load(...)``), not a ``tl.`` function."""
    target = node.func.value if isinstance(node.func, ast.Attribute) else None
    return isinstance(target, ast.Name) and target.id != "tl"


def _call_name(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


class _Walker(ast.NodeVisitor):
    """Visits statements in source order, tracking which variables derive from which
    pointer parameters and whether the wait has been passed."""

    def __init__(self, pointers: set[str], namespace: dict):
        self.namespace = namespace
        self.derived = {p: {p} for p in pointers}
        self.waited = False
        self.trigger_waited: bool | None = None
        self.loads: list[tuple[str, bool]] = []
        self.stores: list[tuple[str, bool]] = []

    def _sources(self, node) -> set[str]:
        """Pointer parameters an expression's address derives from. A loaded value is data,
        not an address, so nothing inside a load counts (``tl.load(slots_ptr + b)`` used as an
        index derives from no pointer)."""
        if isinstance(node, ast.Call) and _call_name(node) in _LOADS | _ATOMICS:
            return set()
        if isinstance(node, ast.Name):
            return set(self.derived.get(node.id, ()))
        out: set[str] = set()
        for child in ast.iter_child_nodes(node):
            out |= self._sources(child)
        return out

    def visit_Assign(self, node):
        self.visit(node.value)
        sources = self._sources(node.value)
        for target in node.targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name):
                    if sources:
                        self.derived[sub.id] = set(sources)
                    else:  # rebound to data: no longer an address
                        self.derived.pop(sub.id, None)

    def visit_AugAssign(self, node):
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            sources = self._sources(node.value) | self.derived.get(node.target.id, set())
            if sources:
                self.derived[node.target.id] = sources

    def visit_Call(self, node):
        self.visit(node.func)  # a method call on a load: ``tl.load(...).to(tl.int64)``
        for arg in node.args:
            self.visit(arg)
        for kw in node.keywords:
            self.visit(kw.value)
        name = _call_name(node)
        helper = _helper(node, self.namespace)
        if (isinstance(node.func, ast.Name) or helper is not None) and \
                name not in _LOADS | _STORES | _ATOMICS:
            # a helper of the kernel (`_skinny_epilogue(...)`): what it loads and stores of
            # the pointers it is handed, at this point of the caller; one whose source cannot
            # be read may load and store every pointer it is handed
            effects = _helper_effects(name, helper) if helper is not None else None
            if effects is None:
                handed = [(None, arg) for arg in list(node.args)
                          + [kw.value for kw in node.keywords]]
            else:
                handed = (list(zip(effects.params, node.args))
                          + [(kw.arg, kw.value) for kw in node.keywords])
            for param, arg in handed:
                for p in self._sources(arg):
                    if effects is None or param in effects.loads:
                        self.loads.append((p, self.waited))
                    if effects is None or param in effects.stores:
                        self.stores.append((p, self.waited))
            return
        if name == "gdc_wait":
            self.waited = True
        elif name == "gdc_launch_dependents":
            if self.trigger_waited is None:
                self.trigger_waited = self.waited
        elif name in _LOADS | _STORES | _ATOMICS and isinstance(node.func, ast.Attribute):
            address = node.args[0] if node.args else next(
                (kw.value for kw in node.keywords if kw.arg == "pointer"), None)
            if _is_descriptor_call(node):  # ``w_desc.load([row, col])``: the tensor it names
                address = node.func.value
            sources = self._sources(address) if address is not None else set()
            if not sources:
                raise ValueError(f"line {node.lineno}: tl.{name} of an address that derives "
                                 f"from no pointer parameter named *_ptr; name it so that the "
                                 f"order can be read")
            for p in sources:
                if name in _LOADS or name in _ATOMICS:
                    self.loads.append((p, self.waited))
                if name in _STORES or name in _ATOMICS:
                    self.stores.append((p, self.waited))
