"""The GPU-space prefix tree as array-backed columns: one row per block, no per-block objects.

Row columns (``array``; row 0 is a sentinel, so 0 means "none" in every link column):
``key`` our chain hash, ``eng`` the engine hash first reported for it (0 = none), ``mid`` the id
of its holder mask, ``par`` parent row, an intrusive doubly linked child list (``kid`` first
child, ``nxt``/``prv`` siblings), and ``run``, a hint for lookups: how many blocks from this
one to the end of the run stored (or re-masked) in the same call. A hint is only ever a place to
probe first, so a stale one costs probes, never correctness.
:class:`KeyIndex` maps keys -> rows and engine hashes -> rows.

Holder masks are interned: ``mval[id]`` is an int with one bit per slot, rows store the id. Few
distinct holder sets exist (a shared prefix, then one holder per session), so 1,024-instance masks
cost 4 bytes a row, and bulk changes to one slot's bit (mark stale, clear, drop) rewrite the mask
table in O(distinct masks) instead of touching rows. A rewrite may leave rows with an empty mask
("garbage"): lookups already treat them as absent, and :meth:`GpuTree.sweep` frees them a bounded
slice at a time.

Masks are *complete*: a slot's bit is on a row only while the slot also holds every ancestor, so
every slot's rows along a chain form a prefix (what the lookup's bisection relies on). Stale slots
shadow an instance slot; ``view`` folds them onto their owner for lookups and ``fresh`` leaves them
out, and both stay monotone because a fresh store refreshes its ancestors.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from smetric_lmc.index.table import KeyIndex


class GpuTree:
    def __init__(self) -> None:
        self.key = array("Q", [0])
        self.eng = array("Q", [0])
        self.mid = array("I", [0])
        self.par = array("I", [0])
        self.kid = array("I", [0])
        self.nxt = array("I", [0])
        self.prv = array("I", [0])
        self.run = array("I", [0])  # hint: blocks from this row to the end of the run stored with it
        self.free = array("I")
        self.rows = KeyIndex(self.key)
        self.alias = KeyIndex(self.eng)
        self.nodes = 0
        self.mval: list[int] = [0]
        self.mref: list[int] = [0]
        self.mids: dict[int, int] = {0: 0}
        self.mfree: list[int] = []
        self.view: list[int] = self.mval  # masks lookups bisect over: stale bits folded onto owners
        self.fresh: list[int] | None = None  # masks without stale bits (only while stale slots exist)
        self.stale_all = 0
        self.stale_owner: dict[int, int] = {}  # stale bit -> owner's bit
        self.count: dict[int, int] = {}  # slot bit -> rows carrying it
        self.garbage = False
        self.sweep_pos = 1

    # ---- masks ---------------------------------------------------------------------------------
    def intern(self, m: int) -> int:
        i = self.mids.get(m)
        if i is not None:
            return i
        if self.mfree:
            i = self.mfree.pop()
            self.mval[i] = m
        else:
            i = len(self.mval)
            self.mval.append(m)
            self.mref.append(0)
            if self.fresh is not None:
                self.view.append(0)
                self.fresh.append(0)
        self.mids[m] = i
        if self.fresh is not None:
            self.view[i] = self._fold(m)
            self.fresh[i] = m & ~self.stale_all
        return i

    def _decref(self, i: int, n: int = 1) -> None:
        left = self.mref[i] - n
        self.mref[i] = left
        if left == 0 and i:
            m = self.mval[i]
            if self.mids.get(m) == i:
                del self.mids[m]
            self.mval[i] = 0
            if self.fresh is not None:
                self.view[i] = self.fresh[i] = 0
            self.mfree.append(i)

    def _set(self, r: int, m: int) -> None:
        old = self.mid[r]
        i = self.intern(m)
        self.mid[r] = i
        self.mref[i] += 1
        self._decref(old)

    def mask(self, r: int) -> int:
        return self.mval[self.mid[r]]

    def _fold(self, m: int) -> int:
        s = m & self.stale_all
        if not s:
            return m
        m ^= s
        owner = self.stale_owner
        while s:
            low = s & -s
            m |= owner[low]
            s ^= low
        return m

    def rewrite(self, clear: int, move_from: int = 0, move_to: int = 0) -> None:
        """Clear bits ``clear`` and move ``move_from`` to ``move_to`` in every mask at once."""
        touch = clear | move_from
        mval, mref = self.mval, self.mref
        for i, v in enumerate(mval):
            if v & touch:
                nv = v & ~clear
                if nv & move_from:
                    nv = (nv & ~move_from) | move_to
                mval[i] = nv
                if not nv and mref[i]:
                    self.garbage = True
                    self.sweep_pos = 1
        mids = {v: i for i, v in enumerate(mval) if mref[i]}
        mids[0] = 0
        self.mids = mids
        self.refold()

    def refold(self) -> None:
        if not self.stale_all:
            self.view, self.fresh = self.mval, None
            return
        keep = ~self.stale_all
        self.view = [self._fold(v) for v in self.mval]
        self.fresh = [v & keep for v in self.mval]

    # ---- rows ----------------------------------------------------------------------------------
    def find(self, h: int) -> int:
        return self.rows.find(h)

    def _delete(self, r: int) -> None:
        """Free row ``r`` (its children are gone already). Link columns are reset on reuse."""
        p = self.par[r]
        if p:
            a, b = self.prv[r], self.nxt[r]
            if a:
                self.nxt[a] = b
            else:
                self.kid[p] = b
            if b:
                self.prv[b] = a
        self.rows.delete(self.key[r])
        e = self.eng[r]
        if e:
            self.alias.delete(e)
            self.eng[r] = 0
        i = self.mid[r]
        if i:
            left = self.mref[i] - 1
            self.mref[i] = left
            if not left:
                self._decref(i, 0)
            self.mid[r] = 0
        self.key[r] = 0
        self.free.append(r)
        self.nodes -= 1

    def _subtree(self, r: int) -> list[int]:
        """Rows of ``r``'s subtree, every parent before its children."""
        out, stack = [], [r]
        kid, nxt = self.kid, self.nxt
        while stack:
            x = stack.pop()
            out.append(x)
            c = kid[x]
            while c:
                stack.append(c)
                c = nxt[c]
        return out

    def set_alias(self, r: int, e: int) -> bool:
        """Record ``e`` as the shared engine hash of row ``r``; False if ``r`` has another one."""
        cur = self.eng[r]
        if cur:
            return cur == e
        self.eng[r] = e
        if self.alias.add(e, r):
            return True
        self.eng[r] = 0  # another row has that engine hash (another hash scheme's block)
        return False

    # ---- per-slot updates -------------------------------------------------------------------------
    def refresh(self, r: int, bit: int, drop: int) -> None:
        """``r`` and its ancestors are held fresh by ``bit`` (a store under them proves it)."""
        mval, mid, par = self.mval, self.mid, self.par
        count = self.count
        while r:
            m = mval[mid[r]]
            if m & bit and not m & drop:
                return
            if not m & bit:
                count[bit] = count.get(bit, 0) + 1
            if m & drop:
                count[drop] -= 1
            self._set(r, (m | bit) & ~drop)
            r = par[r]

    def store(self, bit: int, drop: int, hashes: Sequence[int], prev: int) -> list[int]:
        """Give ``bit`` (clearing ``drop``, its stale bit) every block of ``hashes``, chained under
        row ``prev`` (0 = root), which the caller checked ``bit`` or ``drop`` holds."""
        if prev:
            self.refresh(prev, bit, drop)
        mval, mid, mref = self.mval, self.mid, self.mref
        rows: list[int] = []
        add = rows.append
        solo = -1
        n_solo = added = undropped = 0
        key, par, kid, nxt, prv, eng = self.key, self.par, self.kid, self.nxt, self.prv, self.eng
        run, free = self.run, self.free
        locate, put = self.rows.locate, self.rows.put
        left = len(hashes)  # blocks from this one to the end of the call's run
        for h in hashes:
            i, r = locate(h)
            if not r:  # a new row: a free one or appended; inserted at the slot the probe ended on
                if free:
                    r = free.pop()
                    key[r] = h
                    par[r] = prev
                    kid[r] = prv[r] = 0
                    nxt[r] = kid[prev] if prev else 0
                    run[r] = left
                else:
                    r = len(key)
                    key.append(h)
                    eng.append(0)
                    mid.append(0)
                    par.append(prev)
                    nxt.append(kid[prev] if prev else 0)
                    kid.append(0)
                    prv.append(0)
                    run.append(left)
                put(i, h, r)
                if prev:
                    if kid[prev]:
                        prv[kid[prev]] = r
                    kid[prev] = r
                self.nodes += 1
                if solo < 0:
                    solo = self.intern(bit)
                    mval = self.mval
                mid[r] = solo
                n_solo += 1
            else:
                m = mval[mid[r]]
                if not m & bit or m & drop:
                    if not m & bit:
                        added += 1
                    if m & drop:
                        undropped += 1
                    self._set(r, (m | bit) & ~drop)
                    run[r] = left
            add(r)
            prev = r
            left -= 1
        if n_solo:
            mref[solo] += n_solo
        count = self.count
        count[bit] = count.get(bit, 0) + added + n_solo
        if undropped:
            count[drop] -= undropped
        return rows

    def clear(self, r: int, bit: int, drop: int) -> int:
        """Take ``bit`` and ``drop`` off ``r`` and its subtree (a hole cuts the prefix below it).
        Returns how many rows the slot lost."""
        bits = bit | drop
        mval, mid, kid, nxt = self.mval, self.mid, self.kid, self.nxt
        if not kid[r]:  # a leaf: what eviction (tail first) removes nearly always
            m = mval[mid[r]]
            c = m & bits
            if not c:
                return 0
            if c & bit:
                self.count[bit] -= 1
            if c & drop:
                self.count[drop] -= 1
            if m & ~bits:
                self._set(r, m & ~bits)
            else:
                self._delete(r)
            return 1
        stack, dead = [r], []
        n_bit = n_drop = 0
        while stack:
            x = stack.pop()
            m = mval[mid[x]]
            c = m & bits
            if not c:
                continue  # completeness: nothing below holds the slot either
            if c & bit:
                n_bit += 1
            if c & drop:
                n_drop += 1
            nm = m & ~bits
            self._set(x, nm)
            if not nm:
                dead.append(x)
            ch = kid[x]
            while ch:
                stack.append(ch)
                ch = nxt[ch]
        if dead:
            # An emptied row's whole subtree is empty (completeness), garbage rows included.
            emptied = set(dead)
            for x in [x for x in dead if self.par[x] not in emptied]:
                for y in reversed(self._subtree(x)):
                    self._delete(y)
        count = self.count
        if n_bit:
            count[bit] -= n_bit
        if n_drop:
            count[drop] -= n_drop
        return n_bit + n_drop

    def sweep(self, budget: int = 1 << 16) -> int:
        """Free garbage rows (empty mask after a rewrite) in the next ``budget`` rows."""
        if not self.garbage:
            return 0
        dead_ids = np.fromiter((v == 0 for v in self.mval), dtype=bool, count=len(self.mval))
        dead_ids[0] = False  # id 0 is a free row's
        n = len(self.key)
        a = self.sweep_pos
        b = min(n, a + budget)
        col = np.frombuffer(self.mid, dtype=np.uint32)
        hits = (np.flatnonzero(dead_ids[col[a:b]]) + a).tolist()
        del col
        freed = 0
        for r in hits:
            if self.key[r] and not self.mval[self.mid[r]]:
                sub = self._subtree(r)  # completeness: all of it is garbage too
                for x in reversed(sub):
                    self._delete(x)
                freed += len(sub)
        self.sweep_pos = b
        if b >= n:
            self.garbage = False
            self.sweep_pos = 1
        return freed
