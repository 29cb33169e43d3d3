"""A store against a numpy model (hypothesis state machine): create tensors of random
dtype, shape, sharding and updater; push whole and rows= (with duplicates); pull whole
and rows; after every step the store and helpers.Model agree (exactly for integers, to
rounding for floats; float16 is modelled in float32 rounded to float16 per push)."""
from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant,
                                 precondition, rule)

import shmps
from helpers import Model, remove_store

pytestmark = pytest.mark.timeout(120)

DTYPES = ["int8", "int32", "float16", "float32", "float64"]
REDUCTIONS = {"sum": shmps.Sum(), "assign": shmps.Assign(), "max": shmps.Max(),
              "min": shmps.Min()}
FLOAT_ONLY = {"sgd": shmps.SGD(lr=0.5), "sgd_wd": shmps.SGD(lr=0.25, weight_decay=0.5),
              "momentum": shmps.Momentum(lr=0.5, momentum=0.5)}


def values(dtype: str, shape: tuple) -> st.SearchStrategy:
    """Gradient arrays: int8 over its whole range (sums wrap), other dtypes small
    integers and halves (exact in float16 too, so only the updater rounds)."""
    if dtype == "int8":
        elems = st.integers(-128, 127)
    elif dtype == "int32":
        elems = st.integers(-1000, 1000)
    else:
        elems = st.integers(-64, 64).map(lambda k: k / 2)
    size = int(np.prod(shape, dtype=np.int64))
    return st.lists(elems, min_size=size, max_size=size).map(
        lambda xs: np.array(xs, dtype=np.float64 if dtype.startswith("f") else dtype)
        .reshape(shape))


@st.composite
def tensor_specs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    nrows = draw(st.integers(1, 9))
    row = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
    names = list(REDUCTIONS) + (list(FLOAT_ONLY) if dtype.startswith("f") else [])
    opt = draw(st.sampled_from(names))
    shard_rows = draw(st.none() | st.integers(1, nrows))
    init = draw(st.integers(-5, 5))
    return dtype, (nrows,) + row, opt, shard_rows, init


class StoreVersusModel(RuleBasedStateMachine):
    tensors = Bundle("tensors")

    def __init__(self) -> None:
        super().__init__()
        self.name = f"h{uuid.uuid4().hex[:12]}"
        self.store = shmps.attach(self.name)
        self.models: dict[str, Model] = {}

    def teardown(self) -> None:
        self.store.destroy()
        remove_store(self.name)

    @initialize(target=tensors, spec=tensor_specs())
    def first_tensor(self, spec):
        return self._create(spec)

    @precondition(lambda self: len(self.models) < 6)
    @rule(target=tensors, spec=tensor_specs())
    def create(self, spec):
        return self._create(spec)

    def _create(self, spec) -> str:
        dtype, shape, opt, shard_rows, init = spec
        name = f"t{len(self.models)}.{dtype}.{opt}"
        updater = {**REDUCTIONS, **FLOAT_ONLY}[opt]
        t = self.store.dense(name, shape=shape, dtype=dtype, optimizer=updater, init=init,
                             shard_rows=shard_rows)
        assert t.shape == shape and t.dtype == np.dtype(dtype)
        self.models[name] = Model(shape, dtype, updater, init)
        return name

    @rule(name=tensors, data=st.data())
    def push_whole(self, name, data):
        m = self.models[name]
        g = data.draw(values(m.dtype.name, m.w.shape), label="grad")
        self.store[name].push(g)
        m.push(g)

    @rule(name=tensors, data=st.data())
    def push_rows(self, name, data):
        m = self.models[name]
        nrows = m.w.shape[0]
        rows = data.draw(st.lists(st.integers(0, nrows - 1), min_size=0, max_size=2 * nrows),
                         label="rows")
        g = data.draw(values(m.dtype.name, (len(rows),) + m.w.shape[1:]), label="grad")
        self.store[name].push(g, rows=np.array(rows, np.int64))
        m.push(g, rows=rows)

    @rule(name=tensors, consistent=st.booleans())
    def pull_whole(self, name, consistent):
        m = self.models[name]
        m.check(self.store[name].pull(consistent=consistent), what=f"{name} pull()")

    @rule(name=tensors, data=st.data())
    def pull_rows(self, name, data):
        m = self.models[name]
        rows = data.draw(st.lists(st.integers(0, m.w.shape[0] - 1), max_size=12), label="rows")
        out = np.empty((len(rows),) + m.w.shape[1:], m.dtype)
        as_array = data.draw(st.booleans(), label="int64 array")   # C checks the rows
        got = self.store[name].pull(rows=np.array(rows, np.int64) if as_array else rows,
                                    out=out)
        assert got is out
        m.check(got, rows=rows, what=f"{name} pull(rows={rows})")

    @rule(name=tensors)
    def get_or_create_again(self, name):
        """Any process may run the creator's line again: it returns the same tensor."""
        m = self.models[name]
        t = self.store.dense(name, shape=m.w.shape, dtype=m.dtype.name)
        m.check(t.pull(), what=f"{name} after get-or-create")

    @invariant()
    def steps_count_pushes(self):
        for name, m in self.models.items():
            assert self.store[name].stats()["step"] == m.step


StoreVersusModel.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
test_store_versus_model = StoreVersusModel.TestCase
