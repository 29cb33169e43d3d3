"""shmps.torch: parameters as zero-copy views of shared tensors, Pusher as the
optimizer; equal to torch.optim on one process, and optimizer state shared across
processes (which torch's own Hogwild recipe does not do: pytorch#39949)."""
from __future__ import annotations

import copy
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmps  # noqa: E402
import shmps.torch  # noqa: E402
from helpers import CTX, Workers  # noqa: E402

pytestmark = pytest.mark.timeout(120)

STEPS = 8


def make_model(seed: int = 0) -> "torch.nn.Module":
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def batch(worker: int, step: int) -> tuple:
    """The minibatch of ``worker`` at its ``step`` (the same in every process)."""
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)


def train_step(model, opt, worker: int, step: int) -> None:
    opt.zero_grad()
    x, y = batch(worker, step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def max_diff(a, b) -> float:
    return max(float((p.detach() - q.detach()).abs().max())
               for p, q in zip(a.parameters(), b.parameters()))


# ---- worker functions (run in spawned children) -------------------------------------

def alternating_trainer(store: str, worker: int, turn, nsteps: int, lr: float) -> int:
    """Share the model (Adam in shmps), then take ``nsteps`` steps, each only when
    ``turn[0] == 2 * step + worker`` (the two workers alternate strictly)."""
    s = shmps.attach(store)
    try:
        model = make_model()
        shmps.torch.share(model, s, optimizer=shmps.Adam(lr=lr))
        opt = shmps.torch.Pusher(model)
        for j in range(nsteps):
            deadline = time.monotonic() + 30
            while turn[0] != 2 * j + worker:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"turn {2 * j + worker} never came ({turn[0]})")
                time.sleep(0.0002)
            train_step(model, opt, worker, j)
            turn[0] += 1
        return nsteps
    finally:
        s.close()


def hogwild_trainer(store: str, worker: int, nsteps: int) -> int:
    """Share the model (Adam), then take ``nsteps`` non-blocking steps as fast as
    possible, concurrently with the other worker."""
    s = shmps.attach(store)
    try:
        model = make_model()
        shmps.torch.share(model, s, optimizer=shmps.Adam(lr=1e-3))
        opt = shmps.torch.Pusher(model, wait=False)
        for j in range(nsteps):
            train_step(model, opt, worker, j)
        opt.wait()
        return nsteps
    finally:
        s.close()


# ---- tests --------------------------------------------------------------------------

def test_params_are_views_of_the_store(store):
    """After share(), each parameter's memory is the shared tensor's (a push shows
    in the parameter at once); a second module sharing the same names adopts the
    stored values instead of its own initialisation."""
    model = make_model(0)
    before = [p.detach().clone() for p in model.parameters()]
    tensors = shmps.torch.share(model, store, optimizer=shmps.SGD(lr=1.0))
    assert list(tensors) == [n for n, _ in model.named_parameters()]
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    w = tensors["0.weight"]
    w.push(np.ones(w.shape, np.float32))
    assert torch.allclose(model[0].weight.detach(), before[0] - 1)
    other = make_model(1)
    shmps.torch.share(other, store)
    assert max_diff(model, other) == 0.0
    assert other[0].weight.data_ptr() == model[0].weight.data_ptr()  # one mapping
    other[0].weight.data[0, 0] = 42.0  # a direct write lands in the store
    assert float(store["0.weight"].pull()[0, 0]) == 42.0
    assert float(model[0].weight.detach()[0, 0]) == 42.0


def test_writable_view_spans_shards(store):
    """DenseTensor.view(writable=True) maps every shard read-write, back to back: a
    write lands in the right shard, pushes show through it, the plain view stays
    read-only."""
    t = store.dense("w", shape=(3000, 1024), shard_rows=1024)
    assert t.nshards == 3
    v = t.view(writable=True)
    assert v.flags.writeable and not t.view().flags.writeable
    v[2500, 7] = 5.0
    assert t.pull(rows=[2500])[0, 7] == 5.0
    t.push(np.ones(t.shape, np.float32))
    assert v[2999, 1023] == 1.0 and v[2500, 7] == 6.0


@pytest.mark.parametrize("name", ["SGD", "Momentum", "Adam"])
def test_single_process_matches_torch_optim(store, name):
    """Training through share()+Pusher gives the parameters torch.optim gives
    (same init, same batches, float32) to float tolerance."""
    upd, ref_opt = {
        "SGD": (shmps.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
        "Momentum": (shmps.Momentum(lr=0.05, momentum=0.9),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
        "Adam": (shmps.Adam(lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01)),
    }[name]
    model, ref = make_model(), make_model()
    shmps.torch.share(model, store, optimizer=upd)
    opt, ropt = shmps.torch.Pusher(model), ref_opt(ref.parameters())
    for j in range(STEPS):
        train_step(model, opt, 0, j)
        train_step(ref, ropt, 0, j)
    assert max_diff(model, ref) < 1e-5
    assert max_diff(make_model(), ref) > 1e-2  # the steps did move the parameters


def test_nonblocking_steps_match_blocking(store):
    """Pusher(wait=False) gives the same parameters as blocking pushes once waited."""
    model, ref = make_model(), make_model()
    shmps.torch.share(model, store, optimizer=shmps.Adam(lr=0.01))
    opt, ropt = shmps.torch.Pusher(model, wait=False), torch.optim.Adam(ref.parameters(), lr=0.01)
    for j in range(STEPS):
        train_step(model, opt, 0, j)
        opt.wait()  # before the next forward: each step sees the previous update
        train_step(ref, ropt, 0, j)
    assert max_diff(model, ref) < 1e-5


def test_a_timed_out_wait_keeps_the_pushes_it_did_not_wait_for(store):
    """Pusher.wait(timeout) that times out on one push keeps it and every later one
    pending: a next wait() waits for them all, and their gradients stay referenced
    while they run.  (It emptied the list first: after the Timeout, wait() returned at
    once with pushes still in flight, and a pull after it missed some.)  Three 32 MiB
    parameters pushed without waiting, on the store's one push thread, so the first
    is still running when wait(timeout=0) looks at it."""
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.zeros(2048, 4096)) for _ in range(3)])
    shmps.torch.share(model, store, optimizer=shmps.Sum())
    opt = shmps.torch.Pusher(model, wait=False)
    for _ in range(10):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        try:
            opt.wait(timeout=0)
        except shmps.Timeout:
            break
        opt.wait()
    else:
        pytest.skip("no push was still running at wait(timeout=0) in 10 steps")
    assert len(opt._pending) >= 1
    opt.wait()
    assert opt._pending == []
    got = {float(t.pull().min()) for t in opt.tensors} | {float(t.pull().max())
                                                          for t in opt.tensors}
    assert len(got) == 1, got   # every tensor holds every step's push


def test_sparse_embedding_gradients_push_rows(store):
    """An nn.Embedding(sparse=True) is trained through rows= pushes, like torch's
    SGD on the sparse gradient."""
    torch.manual_seed(3)
    emb = torch.nn.Embedding(50, 4, sparse=True)
    ref = copy.deepcopy(emb)
    shmps.torch.share(emb, store, optimizer=shmps.SGD(lr=0.5))
    opt, ropt = shmps.torch.Pusher(emb), torch.optim.SGD(ref.parameters(), lr=0.5)
    idx = torch.tensor([3, 7, 3, 49])
    for m, o in ((emb, opt), (ref, ropt)):
        o.zero_grad()
        m(idx).pow(2).sum().backward()
        o.step()
    assert max_diff(emb, ref) < 1e-6


def test_share_checks_schema(store):
    """share() of a module whose shapes differ from the stored tensors is a SchemaError."""
    shmps.torch.share(make_model(), store, optimizer=shmps.SGD(lr=0.1))
    wrong = torch.nn.Sequential(torch.nn.Linear(12, 8))
    with pytest.raises(shmps.SchemaError):
        shmps.torch.share(wrong, store)
    with pytest.raises(shmps.InvalidArgument, match="not shared"):
        shmps.torch.Pusher(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_optimizer_state_is_shared_across_processes(store, store_name):
    """Two processes taking Adam steps in strict alternation end exactly where one
    process taking all the steps with one Adam does (shared m, v and step), and far
    from two processes each with its own Adam over shared parameters (what
    model.share_memory() + a torch optimizer per process gives)."""
    lr, nsteps = 0.01, 6
    turn = CTX.RawArray("q", 1)
    with Workers(hard_timeout=90) as ws:
        for i in range(2):
            ws.start(alternating_trainer, store_name, i, turn, nsteps, lr)
        assert ws.results(90) == [nsteps, nsteps]
    got = make_model(5)
    shmps.torch.share(got, store)

    one = make_model()  # one process, one Adam, the same sequence of batches
    opt = torch.optim.Adam(one.parameters(), lr=lr)
    for s in range(2 * nsteps):
        train_step(one, opt, s % 2, s // 2)
    two = make_model()  # torch Hogwild: shared parameters, one Adam per process
    opts = [torch.optim.Adam(two.parameters(), lr=lr) for _ in range(2)]
    for s in range(2 * nsteps):
        train_step(two, opts[s % 2], s % 2, s // 2)

    assert max_diff(got, one) < 1e-5
    assert max_diff(got, two) > 100 * 1e-5
    assert store["0.weight"].stats()["step"] == 2 * nsteps


@pytest.mark.slow
def test_concurrent_nonblocking_training(store, store_name):
    """Two processes training at once with Pusher(wait=False): every push lands
    (each tensor's step count is the total number of steps)."""
    nsteps = 40
    with Workers(hard_timeout=90) as ws:
        for i in range(2):
            ws.start(hogwild_trainer, store_name, i, nsteps)
        assert ws.results(90) == [nsteps, nsteps]
    for desc in store.tensors():
        assert store[desc["name"]].stats()["step"] == 2 * nsteps


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_the_pushers_boolean_keywords_refuse_what_is_no_bool(store, bad):
    """Pusher(wait=) and zero_grad(set_to_none=) take True or False (np.bool_ too), as
    every boolean keyword of shmps does (checks.check_flag): wait="no" waited, and
    zero_grad(set_to_none="no") dropped the gradients.  Nothing changes."""
    model = torch.nn.Linear(3, 2)
    shmps.torch.share(model, store, optimizer=shmps.Sum())
    with pytest.raises(shmps.InvalidArgument, match="pass wait=True or wait=False"):
        shmps.torch.Pusher(model, wait=bad)
    opt = shmps.torch.Pusher(model, wait=np.bool_(True))
    model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(shmps.InvalidArgument, match="pass set_to_none=True or"):
        opt.zero_grad(set_to_none=bad)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_two_threads_waiting_for_a_pushers_steps_at_once_each_see_them_all_applied(store):
    """Pusher(wait=False): a training thread's wait() and another thread's (a checkpoint
    thread making sure the last step landed) at once: each returns only once every
    push of the step is applied, and neither raises.  Before, both waited for the
    same first push and each then popped the list's head: the second pop dropped a
    push nobody waited for (its wait returned with it still running, its gradient no
    longer referenced), or found the list empty (IndexError) (review H11 of
    2026-11-28)."""
    import sys
    import threading

    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.zeros(256, 1024)) for _ in range(12)])   # 1 MiB each
    shmps.torch.share(model, store, optimizer=shmps.Sum())
    opt = shmps.torch.Pusher(model, wait=False)
    bad: list = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # (thread switches between the wait and the pop)
    try:
        for _ in range(20):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            handles = [h for h, _ in opt._pending]
            go = threading.Barrier(2)

            def waiter() -> None:
                go.wait()
                try:
                    opt.wait()
                except BaseException as exc:   # (the test's failure, shown below)
                    bad.append(exc)
                    return
                running = sum(not h.done() for h in handles)
                if running:
                    bad.append(f"wait() returned with {running} of {len(handles)} "
                               "pushes still running")
            threads = [threading.Thread(target=waiter) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            opt.wait()
            if bad:
                break
    finally:
        sys.setswitchinterval(old)
    assert not bad, bad
    assert not opt._pending
    for name, t in shmps.torch.shared_tensors(model).items():
        assert t.stats()["pushes"] == 20, name


@pytest.mark.parametrize("wait", [True, False])
def test_a_step_with_one_nonfinite_gradient_changes_no_parameter(store, wait):
    """Pusher.step() with a NaN or Inf in one parameter's gradient (an AMP overflow, a
    diverged loss) raises NonFinite and pushes nothing: every parameter, and every
    tensor's step count, is as before, as a torch.optim step either happens or not.
    Before, the gradients were pushed one after the other and the bad one raised after
    the parameters before it had been updated (the first layer's weight and bias moved,
    the last did not); with wait=False the error came only at the next wait()."""
    model = make_model()
    shmps.torch.share(model, store, optimizer=shmps.Adam(lr=0.1))
    opt = shmps.torch.Pusher(model, wait=wait)
    before = [p.detach().clone() for p in model.parameters()]
    for bad in (float("nan"), float("inf")):
        opt.zero_grad()
        x, y = batch(0, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model[2].bias.grad[1] = bad    # the last parameter pushed
        with pytest.raises(shmps.NonFinite, match="'2.bias'"):
            opt.step()
        opt.wait()
        assert max(float((p.detach() - b).abs().max())
                   for p, b in zip(model.parameters(), before)) == 0.0
        assert {t.stats()["step"] for t in opt.tensors} == {0}
    model[2].bias.grad[1] = 0.0        # the same step with a finite gradient is taken
    opt.step()
    opt.wait()
    assert {t.stats()["step"] for t in opt.tensors} == {1}


def test_a_refused_share_leaves_the_module_and_the_store_as_they_were(store):
    """share() that refuses a parameter (its shape differs from the stored tensor, its
    dtype is not one shmps stores) changes no parameter of the module and creates no
    tensor.  Before, the parameters before the refused one were already shared: their
    values replaced by the stored ones (or new tensors made from them) and their
    memory the store's, while the call raised."""
    shmps.torch.share(make_model(), store, optimizer=shmps.SGD(lr=0.1))
    store["0.weight"].push(np.ones((16, 12), np.float32))   # stored values != a new model's
    wrong = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 8))     # its last layer differs
    before = [(p.data_ptr(), p.detach().clone()) for p in wrong.parameters()]
    with pytest.raises(shmps.SchemaError, match="'2.weight'"):
        shmps.torch.share(wrong, store)
    assert all(
        ptr == p.data_ptr() and torch.equal(b, p.detach())
        for (ptr, b), p in zip(before, wrong.parameters()))
    mixed = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2).bfloat16())
    names = sorted(store)
    with pytest.raises(shmps.SchemaError, match="bfloat16"):
        shmps.torch.share(mixed, store, prefix="mixed.")
    assert sorted(store) == names                            # no tensor made for layer 0
    with pytest.raises(shmps.InvalidArgument, match="not shared"):
        shmps.torch.Pusher(wrong)
