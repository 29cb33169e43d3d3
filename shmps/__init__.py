"""shmps: an embedded shared-memory parameter server.

Sample usage (every worker process)::

    import shmps
    store = shmps.attach("model")
    w = store.dense("fc.w", shape=(1024, 256), optimizer=shmps.SGD(lr=0.1))
    w.push(grad)          # exact, applied in place by C, from this process
    a = w.pull()          # private copy
"""
from __future__ import annotations

from .errors import (CapacityError, Closed, CorruptFile, CorruptSegment, Error,
                     InvalidArgument, NonFinite, NotFound, OutOfRange, PushesLost, SchemaError,
                     Timeout)
from .store import Store, attach
from .tensor import PushHandle
from .updaters import FTRL, SGD, Adagrad, Adam, Assign, Max, Min, Momentum, Sum, Updater
from .dense import DenseTensor
from .table import Table
from .csr import CSRTensor
from .files import CSR
from .checkpoint import restore

__version__ = "0.1.0"

__all__ = [
    "attach", "restore", "Store", "DenseTensor", "Table", "CSRTensor", "CSR", "PushHandle",
    "Sum", "Assign", "Max", "Min", "SGD", "Momentum", "Adagrad", "Adam", "FTRL", "Updater",
    "Error", "SchemaError", "NotFound", "CapacityError", "CorruptSegment", "CorruptFile",
    "InvalidArgument", "OutOfRange", "NonFinite", "Timeout", "Closed", "PushesLost",
]
