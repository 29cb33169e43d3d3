"""PyTorch adapter: a module's parameters live in a shmps store, and the optimizer
step runs in shmps (in C, exact, with its state shared by every process).

Replaces torch's Hogwild recipe (``model.share_memory()`` + a torch optimizer in
each process), which races on every update and keeps one optimizer state per
process (pytorch#39949), with two lines::

    import shmps, shmps.torch
    store = shmps.attach("mnist")
    model = Net()
    shmps.torch.share(model, store, optimizer=shmps.Adam(lr=1e-3))  # params -> shared memory
    opt = shmps.torch.Pusher(model)                                  # step() = push every .grad
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

``param.data`` becomes a zero-copy, writable view of the shared tensor
(:meth:`shmps.DenseTensor.view` with ``writable=True``): the forward pass reads the
live values (racy by design, like Hogwild reads), and ``step()`` pushes each
``.grad`` once, so the shmps updater applies it exactly.  torch never needs to
write the parameters; if it does (``load_state_dict``, ``nn.init``), the write goes
straight to shared memory, unsynchronised: do it before training starts.

Only parameters are shared (not buffers such as BatchNorm's running statistics),
on the CPU, of dtype float16, float32 or float64.  docs/torch.md has the details.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised where torch is absent
    raise ImportError("shmps.torch needs PyTorch, which is not installed: "
                      "pip install torch (see https://pytorch.org)") from exc

import numpy as np

from .dense import DenseTensor
from .checks import check_flag
from .errors import InvalidArgument, SchemaError
from .tensor import PushHandle
from .updaters import UpdaterLike

__all__ = ["share", "Pusher", "shared_tensors"]

_ATTR = "_shmps_shared"
_DTYPES = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}


def share(module: "torch.nn.Module", store: Any, optimizer: UpdaterLike = None,
          prefix: str = "", *, mode: Optional[str] = None, aggregate: Optional[str] = None,
          workers: Optional[int] = None) -> dict[str, DenseTensor]:
    """Put every parameter of ``module`` in ``store`` and make ``param.data`` a view.

    One dense tensor per parameter, named ``prefix + name`` (``"fc1.weight"``), of
    the parameter's shape and dtype, with updater ``optimizer`` (a shmps updater,
    e.g. ``shmps.SGD(lr=0.1)``, ``shmps.Adam(lr=1e-3)``).  Get-or-create: the
    first process creates each tensor from its module's current values; the
    others adopt the stored values (their own initial values are dropped), so
    every process starts from the same parameters.  ``mode``, ``aggregate`` and
    ``workers`` are passed to :meth:`shmps.Store.dense` (``aggregate="mean"``
    gives synchronous data-parallel SGD: see docs/consistency.md).

    Returns ``{name: tensor}`` (also kept on the module for :class:`Pusher`).
    Cost: one tensor creation or lookup and one mapping per parameter.
    Raises SchemaError if an existing tensor differs (shape, dtype, optimizer
    given), InvalidArgument for parameters that are not on the CPU."""
    # Three passes, so that a refused parameter changes nothing: every parameter is
    # checked (device, dtype, and the schema of a tensor that exists) before any tensor
    # is created, and no parameter's memory is swapped until every tensor is there.
    # (One pass shared the parameters before the refused one, and created their
    # tensors, while the call raised.)  A creation that fails in the second pass (no
    # room in /dev/shm) leaves the tensors made before it, which a retry gets.
    params = list(module.named_parameters())
    kw: dict[str, Any] = {"optimizer": optimizer, "mode": mode}
    if aggregate is not None or workers is not None:
        kw.update(aggregate=aggregate, workers=workers)
    found: dict[str, DenseTensor] = {}
    for name, p in params:
        if p.device.type != "cpu":
            raise InvalidArgument(f"parameter {name!r} is on {p.device}",
                                  "shmps shares CPU memory: call share() before .to(device)")
        if p.dtype not in _DTYPES:
            raise SchemaError(f"parameter {name!r} has dtype {p.dtype}",
                              "shmps stores float16, float32 or float64 parameters")
        full = prefix + name
        if full in store:   # (no init: a lookup, SchemaError if it differs)
            found[name] = store.dense(full, shape=tuple(int(x) for x in p.shape),
                                      dtype=_DTYPES[p.dtype], **kw)
    shared: dict[str, DenseTensor] = {}
    for name, p in params:
        t = found.get(name)
        if t is None:   # get-or-create: another process may have made it meanwhile
            t = store.dense(prefix + name, shape=tuple(int(x) for x in p.shape),
                            dtype=_DTYPES[p.dtype], init=p.detach().cpu().numpy(), **kw)
        shared[name] = t
    views = {name: t.view(writable=True) for name, t in shared.items()}
    with torch.no_grad():
        for name, p in params:
            p.data = torch.from_numpy(views[name])
    setattr(module, _ATTR, shared)
    return shared


def shared_tensors(module: "torch.nn.Module") -> dict[str, DenseTensor]:
    """The ``{name: tensor}`` that :func:`share` made for ``module``."""
    shared = getattr(module, _ATTR, None)
    if shared is None:
        raise InvalidArgument("this module was not shared",
                              "call shmps.torch.share(module, store, optimizer=...) first")
    return shared


class Pusher:
    """An optimizer-like object: ``step()`` pushes every parameter's ``.grad`` to its
    shmps tensor (one push per tensor; the tensor's updater does the update).

    ``wait=False``: pushes run on the store's push thread while this process goes
    on (the next forward pass overlaps them); the next ``step()`` (or
    ``zero_grad(set_to_none=False)``, or ``wait()``) first waits for them.  The
    default ``zero_grad()`` drops the gradients (``set_to_none=True``) without
    waiting: the pending pushes keep the old gradient tensors alive.

    Sparse gradients (``nn.Embedding(sparse=True)``) are pushed as ``rows=``.
    Cost per step: one push per parameter with a gradient (see
    :meth:`shmps.DenseTensor.push`); no copy of contiguous gradients.
    """

    def __init__(self, module: "torch.nn.Module", *, wait: bool = True) -> None:
        wait = check_flag(wait, "wait")
        shared = shared_tensors(module)
        params = dict(module.named_parameters())
        self._pairs = [(params[name], t) for name, t in shared.items() if name in params]
        self.wait_each = wait
        self._pending: list[tuple[PushHandle, Any]] = []

    @property
    def tensors(self) -> list[DenseTensor]:
        return [t for _, t in self._pairs]

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Push every ``.grad`` (parameters without one are skipped); returns the
        closure's loss if a closure is given (as ``torch.optim`` does).

        Every gradient is checked for NaN/Inf (where its tensor refuses them) before
        any is pushed: a step with one bad gradient raises NonFinite and changes no
        parameter (with ``wait=False`` too, at once).  Each gradient is still read for
        NaN/Inf once: the pushes skip their own check of a gradient checked here."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait()
        # (tensor, gradient, rows or None, what keeps the gradient alive), all taken
        # before the first push: pushed one after the other, the bad gradient of the
        # last parameter raised after every parameter before it had been updated
        todo: list[tuple[DenseTensor, np.ndarray, Optional[np.ndarray], Any]] = []
        for p, t in self._pairs:
            g = p.grad
            if g is None:
                continue
            g = g.detach()
            if g.is_sparse:
                g = g.coalesce()
                rows = g.indices()[0].numpy()
                vals = np.ascontiguousarray(g.values().numpy())
                todo.append((t, vals, rows, (g, vals)))
            else:
                if not g.is_contiguous():
                    g = g.contiguous()
                arr = g.numpy()
                todo.append((t, arr, None, (g, arr)))
        for t, arr, _, _ in todo:
            t._require_finite(arr)
        # each gradient is read for NaN/Inf once: the pushes skip their own check of
        # it (_push_prechecked; a step read every gradient twice, ~40% of the step's
        # time for 8 float32 4 MiB parameters with SGD)
        for t, arr, rows, keep in todo:
            h = t._push_prechecked(arr, rows, self.wait_each)
            if h is not None:
                self._pending.append((h, keep))
        return loss

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every push of the previous ``step(...)`` is applied (``timeout``
        for each).  One that times out (shmps.Timeout) stays pending, with every later
        one, and their gradients referenced: a next ``wait()`` waits for them."""
        # Threads may wait at once (a training thread's step() and a checkpoint
        # thread's wait()): each removes the entry it waited for, by identity, and only
        # if still there (list.remove: one step under the GIL; a tuple compares its
        # handle first, by identity, so no gradient array is ever compared).  Each
        # popped the head before: the second pop dropped a push nobody had waited for
        # (that wait returned with it running), or raised IndexError on an empty list
        # (review H11 of 2026-11-28).  No lock: none is held across a fork.
        while True:
            try:
                entry = self._pending[0]
            except IndexError:
                return
            entry[0].wait(timeout)
            try:
                self._pending.remove(entry)
            except ValueError:
                pass   # another thread's wait took it off

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients (``set_to_none=True``, no wait), or zero them in
        place after waiting for pending pushes (which read them)."""
        set_to_none = check_flag(set_to_none, "set_to_none")
        if not set_to_none:
            self.wait()
        for p, _ in self._pairs:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
