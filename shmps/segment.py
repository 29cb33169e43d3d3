"""One POSIX shared-memory segment mapped into this process.

Lifecycle as CPython's ``multiprocessing.shared_memory`` (without its
resource_tracker, which unlinks segments a process only attached to: gh-82300):
``close()`` is local and idempotent, ``unlink()`` global and explicit, a failed
create removes what it made, and the mapping outlives the descriptor (closed at once).
"""
from __future__ import annotations

import errno
import mmap
import os
import time
import weakref
from typing import Any, Callable, Optional

import numpy as np
import posix_ipc

from . import _native
from .errors import CapacityError, CorruptSegment, Error, InvalidArgument, NotFound

MODE = 0o600
HUGE_PAGE = 2 << 20   #: x86-64's transparent huge page: shard segments from this size ask for them
#: madvise(2) advice (Linux 5.14): fault every page of the range in for writing now, and
#: fail with EFAULT where a write would raise SIGBUS (tmpfs full); Python 3.11 lacks the name
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _shm(name: str, *args: Any, **kw: Any) -> Any:
    """``posix_ipc.SharedMemory(name, ...)``, refusing a name with a NUL in it
    (InvalidArgument): posix_ipc 1.3 dies of SIGSEGV on one (a store name read from a
    damaged manifest crashed shmps-tool ls)."""
    if "\0" in name:
        raise InvalidArgument(f"segment name {name!r} holds a NUL character")
    return posix_ipc.SharedMemory(name, *args, **kw)


class Segment:
    """A mapped segment: ``mm`` (mmap) and ``ptr`` (cffi ``char *`` for the C core)."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, ino: int = 0) -> None:
        self.name = name
        self.size = size
        self.ino = ino     #: the file's inode: is ``name`` still this segment? (is_named)
        self.mm: Optional[mmap.mmap] = mm
        self.ptr: Any = _native.pointer(mm)
        # dropped without close(): the C core forgets the mapping's private spec before
        # the pointer (which pins the mapping) goes, so before the unmap (see close)
        self._forget = weakref.finalize(self, _native.forget, self.ptr)

    @classmethod
    def create(cls, name: str, size: int, *, huge: bool = False,
               reserve: bool = True) -> "Segment":
        """Create a new segment (exclusive, mode 0600) of ``size`` zero bytes, every page
        of it backed now (:meth:`_reserve`; not with ``reserve=False``); ``huge``: ask for
        transparent huge pages first (:meth:`ask_huge_pages`).

        Raises FileExistsError if the name is taken, CapacityError (and creates
        nothing) if /dev/shm has no room for it."""
        try:
            shm = _shm(name, posix_ipc.O_CREX, mode=MODE, size=size)
        except posix_ipc.ExistentialError as exc:
            raise FileExistsError(errno.EEXIST, str(exc), name) from None
        try:
            seg = cls(name, mmap.mmap(shm.fd, size), size, os.fstat(shm.fd).st_ino)
            try:
                if huge:
                    seg.ask_huge_pages()
                if reserve:
                    seg._reserve(shm.fd)
            except BaseException:
                seg.close()
                raise
        except BaseException:
            shm.close_fd()
            unlink(name)
            raise
        shm.close_fd()
        return seg

    def reserve(self, start: int, length: int) -> None:
        """Back the pages of ``[start, start + length)`` now (see :meth:`_reserve`):
        CapacityError if /dev/shm has no room for them.  (The segment may be unlinked
        already, a destroyed store's: its mapping is still backed by madvise.)"""
        self._reserve(None, start, length)

    def _reserve(self, fd: Optional[int], start: int = 0, length: Optional[int] = None
                 ) -> None:
        """Back every page of the segment now, so that no later write can find /dev/shm
        full: tmpfs sizes a segment without reserving its pages, and a write to a page
        it then has no room for kills the writer with SIGBUS (a tensor larger than the
        free space was created without complaint, and its first push crashed).  The
        mapping is populated for writing (MADV_POPULATE_WRITE: huge pages where asked
        for, and cheaper than the page faults of the first writes: about 3 us a 4 KiB
        page here against 15), or, on a kernel before 5.14, the file is allocated
        (posix_fallocate).  CapacityError if there is no room."""
        assert self.mm is not None
        whole = start == 0 and length is None
        lo = start - start % mmap.PAGESIZE
        hi = self.size if length is None else min(self.size, start + length)
        try:
            try:
                self.mm.madvise(MADV_POPULATE_WRITE, lo, hi - lo)
            except OSError as exc:
                if exc.errno != errno.EINVAL:     # EINVAL: a kernel without the advice
                    raise
                if fd is not None:
                    os.posix_fallocate(fd, lo, hi - lo)
                else:
                    _fallocate(self.name, lo, hi - lo, self.ino)   # (unlinked or replaced: nothing)
        except OSError as exc:
            if exc.errno not in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):
                raise
            if whole and fd is not None:
                os.ftruncate(fd, 0)    # give back the pages it got, then say what is free
            raise NoRoom(f"/dev/shm has no room for segment {self.name} "
                         f"({hi - lo:,} bytes; {shm_free():,} bytes free)",
                         NO_ROOM_HINT) from None

    @classmethod
    def open(cls, name: str, *, expect_size: Optional[int] = None,
             size_if_empty: bool = False) -> "Segment":
        """Map an existing segment; NotFound if absent, CorruptSegment if empty (with
        ``size_if_empty``, an empty one is sized to ``expect_size`` first, as
        :meth:`open_or_create` does: its creator has not sized it yet, or died first)."""
        try:
            shm = _shm(name)
        except posix_ipc.ExistentialError:
            raise NotFound(f"no shared-memory segment {name}") from None
        try:
            size = shm.size
            if size == 0 and size_if_empty and expect_size:
                os.ftruncate(shm.fd, expect_size)
                size = os.fstat(shm.fd).st_size
            if size == 0 or (expect_size is not None and size != expect_size):
                raise CorruptSegment(f"segment {name} has size {size}"
                                     + (f", expected {expect_size}" if expect_size else ""))
            mm = mmap.mmap(shm.fd, size)
            ino = os.fstat(shm.fd).st_ino
        finally:
            shm.close_fd()
        return cls(name, mm, size, ino)

    @classmethod
    def open_or_create(cls, name: str, size: int, *, reserve: Optional[int] = None
                       ) -> tuple["Segment", bool]:
        """Open the segment, creating it (size ``size``, its first ``reserve`` bytes, or
        all of them, backed now: see :meth:`_reserve`) if absent; returns (seg, created).

        Safe to race: a creator sizes the segment; openers that find it still at
        size 0 size it too (ftruncate to the same size is idempotent)."""
        created = False
        try:
            shm = _shm(name, posix_ipc.O_CREX, mode=MODE, size=size)
            created = True
        except posix_ipc.ExistentialError:
            try:
                shm = _shm(name)
            except posix_ipc.ExistentialError:  # destroyed between the two calls
                return cls.open_or_create(name, size)
            if shm.size == 0:
                os.ftruncate(shm.fd, size)
        try:
            if shm.size != size:
                raise CorruptSegment(f"segment {name} has size {shm.size}, expected {size}")
            seg = cls(name, mmap.mmap(shm.fd, size), size, os.fstat(shm.fd).st_ino)
            if created:
                try:
                    seg._reserve(shm.fd, 0, reserve)   # the creator backs it (see create)
                except BaseException:
                    seg.close()
                    unlink(name)
                    raise
        finally:
            shm.close_fd()
        return seg, created

    def ask_huge_pages(self) -> bool:
        """A tensor shard's segment, before its first touch: ask the kernel to back it with
        transparent huge pages (MADV_HUGEPAGE) if it spans one; True if it accepted the
        advice, which says nothing of following it: only where /dev/shm is mounted with
        ``huge=advise`` does it (``within_size``/``always`` need no advice), and the
        default mount (no ``huge=``) ignores it.  A table's rows are read and written at
        random, one TLB miss a row in 4 KiB pages: with 2 MiB pages a 4096-key push of a
        64-dim float32 table took 0.8-1.0 ms instead of 1.2-1.4 ms here (docs/tables.md,
        "Huge pages").  Not the manifest: 8 MiB, of which a few KiB are used."""
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if self.mm is None or self.size < HUGE_PAGE or advice is None:
            return False
        try:
            self.mm.madvise(advice)
        except OSError:   # a kernel without transparent huge pages
            return False
        return True

    def array(self, dtype: Any, offset: int, count: int) -> np.ndarray:
        """A numpy array over ``count`` items at ``offset`` (pins the mapping)."""
        if self.mm is None:
            raise Error(f"segment {self.name} is closed")
        dt = np.dtype(dtype)
        if offset + count * dt.itemsize > self.size:
            raise CorruptSegment(f"array at {offset} + {count} x {dt} exceeds segment {self.name}")
        return np.frombuffer(memoryview(self.mm), dtype=dt, count=count, offset=offset)

    def is_named(self) -> bool:
        """True while ``name`` still names this segment (not unlinked, nor replaced by a
        new segment of that name)."""
        try:
            return os.stat("/dev/shm" + self.name).st_ino == self.ino
        except FileNotFoundError:
            return False

    def fd(self) -> int:
        """A new descriptor on the segment (caller closes it)."""
        shm = _shm(self.name)
        return shm.fd

    def close(self) -> None:
        """Unmap (local, idempotent).  Arrays still over the mapping keep it alive.  The
        C core forgets the shard's private spec first (_native.release): no C call may
        use the segment after this."""
        if self.ptr is not None:
            self._forget.detach()
            _native.release(self.ptr)
            self.ptr = None
        if self.mm is not None:
            mm, self.mm = self.mm, None
            try:
                mm.close()
            except BufferError:
                pass  # views exported to the user: unmapped when they are collected


def unlink(name: str) -> bool:
    """Remove a segment name (global); True if it existed."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


class NoRoom(CapacityError):
    """/dev/shm has no room for a segment or its pages (a CapacityError: callers catch
    that).  Told apart from the other capacity limits (a full catalog, a full table) by
    shmps-bridge, which leaves the cluster for it (Bridge._no_room)."""


NO_ROOM_HINT = ("remove stores nobody uses (`shmps-tool ls`, `shmps-tool gc`), make the "
                "tensor smaller, or enlarge /dev/shm (mount -o remount,size=... /dev/shm)")


def shm_free() -> int:
    """Bytes free in /dev/shm (-1 if it cannot be read)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def _fallocate(name: str, start: int, length: int, ino: int = 0) -> bool:
    """posix_fallocate the range of segment ``name`` through a new descriptor; False if
    the segment no longer exists, or (``ino``) is no longer the file of that inode: the
    name may hold a new, smaller segment by then, which fallocate would grow.  OSError
    (ENOSPC) if /dev/shm has no room."""
    try:
        fd = _shm(name).fd
    except posix_ipc.ExistentialError:
        return False
    try:
        if ino and os.fstat(fd).st_ino != ino:
            return False
        os.posix_fallocate(fd, start, length)
    finally:
        os.close(fd)
    return True


def unbacked_bytes(name: str, size: int, ino: int) -> int:
    """Bytes of segment ``name`` (``size`` bytes, inode ``ino``) whose pages /dev/shm has
    not allocated yet (0 if it is gone, or another segment is under its name): what
    backing it still takes from the free space."""
    try:
        st = os.stat("/dev/shm" + name)
    except OSError:
        return 0
    if st.st_ino != ino:
        return 0
    return max(0, size - st.st_blocks * 512)


def size_of(name: str) -> int:
    """Bytes of segment ``name`` (0 if it is gone)."""
    try:
        return os.stat("/dev/shm" + name).st_size
    except OSError:
        return 0


def age_of(name: str) -> float:
    """Seconds since segment ``name`` was last written to (its mtime: created or sized),
    0 if it is gone."""
    try:
        return time.time() - os.stat("/dev/shm" + name).st_mtime
    except OSError:
        return 0.0


def allocate(name: str, size: int, ino: int) -> bool:
    """Back every page of segment ``name`` (``size`` bytes, inode ``ino``) now, as a
    creation with reservation does (Segment._reserve), for one created without
    (``reserve=False``: shmps-bridge's).  Through the file (posix_fallocate), which runs
    without the GIL: a thread can do it while the event loop goes on.  False if the
    segment is gone (or another is under its name); CapacityError if /dev/shm has no
    room for it."""
    try:
        return _fallocate(name, 0, size, ino)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        raise NoRoom(f"/dev/shm has no room for segment {name} ({size:,} bytes; "
                     f"{shm_free():,} bytes free)", NO_ROOM_HINT) from None


def check_room(what: str, nbytes: int) -> None:
    """CapacityError if ``nbytes`` (what ``what`` needs at least) exceed the free space of
    /dev/shm: a quick refusal before the work of laying out an impossible tensor (a
    shape of 2**40 rows built one shard record per 16 MiB for minutes).  Only a first
    test: free space changes, and Segment.create's reservation is the real one."""
    free = shm_free()
    if free >= 0 and nbytes > free:
        raise NoRoom(f"{what} needs at least {nbytes:,} bytes of /dev/shm; "
                     f"{free:,} are free", NO_ROOM_HINT)


def list_names(prefix: str = "shmps.") -> list[str]:
    """Names (with leading '/') of segments in /dev/shm starting with ``prefix``."""
    try:
        return sorted("/" + n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


class Wait:
    """A bounded wait by polling, the one of every wait for a store's state (attach
    waiting for a store being created or removed, destroy() and restore waiting for a
    gc deciding about it).  Look; while not done, :meth:`again`.  Cost: the looks, and
    ``poll`` s of sleep (GIL released) between two."""

    def __init__(self, timeout: float, poll: float) -> None:
        """``timeout`` s at most from now (``math.inf``: no limit), a look every
        ``poll`` s."""
        self.timeout, self.poll = timeout, poll
        self._end = time.monotonic() + timeout

    def again(self, error: Callable[[], BaseException]) -> None:
        """Sleep ``poll`` s before the next look, or raise ``error()`` (which says what
        was waited for and what to do) once the time is up."""
        if time.monotonic() >= self._end:
            raise error() from None
        time.sleep(self.poll)
