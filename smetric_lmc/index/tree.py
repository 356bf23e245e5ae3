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
from collections.abc import Iterable, Sequence
from itertools import repeat

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
        self._path: list[int] = []  # the garbage subtree a sweep slice stopped in (top first)
        self._again = False

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

    def _unlink(self, x: int) -> None:
        """Take row ``x`` out of its parent's list of children."""
        prv, nxt = self.prv, self.nxt
        a, b = prv[x], nxt[x]
        if a:
            nxt[a] = b
        else:
            self.kid[self.par[x]] = b
        if b:
            prv[b] = a

    def _free_subtree(self, x: int, bit: int = 0, drop: int = 0) -> tuple[int, int]:
        """Free row ``x`` and every row below it, which hold nothing but ``bit``/``drop`` (or
        nothing: garbage). Returns how many of them carried ``bit`` and ``drop``.

        Hot in the simulator (an eviction trims hundreds of blocks at once): the key map's entries
        go in one ``KeyIndex.drop_rows`` call at the end."""
        eng, mid, par, kid, nxt = self.eng, self.mid, self.par, self.kid, self.nxt
        free = self.free
        rows, alias = self.rows, self.alias
        if par[x]:  # only the top one is unlinked: the rows below go with it
            self._unlink(x)
        gone: list[int] = []
        aliased: list[int] = []
        n_bit = n_drop = dec = 0
        dec_id = -1  # mask refcounts drop by runs: a chain's rows share one mask id
        stack = [x]
        while stack:
            r = stack.pop()
            while r:  # down the first children; later siblings wait on the stack
                i = mid[r]
                if i != dec_id:
                    if dec:
                        nb, nd = self._unref_run(dec_id, dec, bit, drop)
                        n_bit, n_drop = n_bit + nb, n_drop + nd
                    dec_id, dec = i, 0
                dec += 1
                mid[r] = 0  # a free row holds no mask (its key goes with its map entry below)
                if eng[r]:  # rare here (the simulator has no engine hashes)
                    aliased.append(r)
                gone.append(r)
                c = kid[r]
                if c:
                    y = nxt[c]
                    while y:
                        stack.append(y)
                        y = nxt[y]
                r = c
        if dec:
            nb, nd = self._unref_run(dec_id, dec, bit, drop)
            n_bit, n_drop = n_bit + nb, n_drop + nd
        alias.drop_rows(aliased)  # all at once, while the rows still have their keys
        rows.drop_rows(gone, zero_keys=True)  # a free row (its eng column is reset when it is reused)
        free.extend(reversed(gone))  # a chain's rows come back lowest id last: reused as a run
        freed = len(gone)
        self.nodes -= freed
        return n_bit, n_drop

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

    def store(self, bit: int, drop: int, hashes: Sequence[int], prev: int,
              engine: Sequence[int] | None = None) -> list[tuple[int, int]] | None:
        """Give ``bit`` (clearing ``drop``, its stale bit) every block of ``hashes``, chained under
        row ``prev`` (0 = root), which the caller checked ``bit`` or ``drop`` holds. ``engine``:
        the engine's hash of each block, kept as the row's shared alias where the row has none and
        no other row has it. Returns the (engine hash, our hash) pairs that could not be (None if
        none): that engine hashes these blocks its own way.

        Blocks that exist already come first (a prefix other instances hold); once one is new,
        so is every later one (its chain hash descends from a new one), and :meth:`_new_chain`
        writes them in bulk."""
        if prev:
            self.refresh(prev, bit, drop)
        n = len(hashes)
        rows = self.rows
        rows.reserve(n)
        if engine is not None:
            self.alias.reserve(n)
        mval, mid, key, eng, run = self.mval, self.mid, self.key, self.eng, self.run
        rslots, rmask = rows.slots, rows.mask
        exc: list[tuple[int, int]] | None = None
        added = undropped = k = 0
        for h in hashes:
            i = h & rmask  # KeyIndex.locate, inlined: the ingest hot loop
            r = rslots[i]
            while r and key[r] != h:
                i += 1
                r = rslots[i]
            if not r:
                break
            q = self.par[r]
            if q != prev and q:
                # The block exists under another parent (ids that are not chain hashes, as a
                # trace's or the simulator's can be): the key names that row's prefix, so the
                # slot is taken to hold it. Without this its bit would sit on a row whose
                # ancestors lack it, and a clear of one of them would free a row the slot holds.
                self.refresh(q, bit, drop)
                mval = self.mval
            m = mval[mid[r]]
            if not m & bit or m & drop:
                if not m & bit:
                    added += 1
                if m & drop:
                    undropped += 1
                self._set(r, (m | bit) & ~drop)
                run[r] = n - k
            if engine is not None and eng[r] != engine[k] and not self.set_alias(r, engine[k]):
                exc = exc or []
                exc.append((engine[k], h))  # this engine hashes these tokens its own way
            prev = r
            k += 1
        count = self.count
        count[bit] = count.get(bit, 0) + added
        if undropped:
            count[drop] -= undropped
        if k < n:
            exc = self._new_chain(bit, drop, hashes, engine, k, prev, exc)
        return exc

    def _new_chain(self, bit: int, drop: int, hashes: Sequence[int], engine: Sequence[int] | None, k: int,
                   prev: int, exc: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
        """New rows for blocks ``k..`` of a store, under row ``prev``: allocated and written column
        by column (slices where the rows are contiguous, as rows freed by a tail-first eviction
        are), then put in the maps one probe each."""
        key, mid, par, kid, nxt, prv, run, eng, free = (
            self.key, self.mid, self.par, self.kid, self.nxt, self.prv, self.run, self.eng, self.free)
        m = len(hashes) - k
        new = hashes[k:] if k else hashes
        solo = self.intern(bit)
        nx = kid[prev] if prev else 0
        take = min(len(free), m)
        got = free[-take:] if take else array("I")
        if take:
            del free[-take:]
            got.reverse()  # the order pops would give
        # Runs of consecutive row ids (rows freed tail first, or a subtree's rows) are written by
        # slices, appended rows by extend; only a free list in shreds is written row by row.
        segs: list[tuple[int, int, int]] = []  # (first row, rows, offset in the chain)
        shreds = False
        if take:
            g0 = got[0]
            if got[-1] - g0 == take - 1 and got == array("I", range(g0, g0 + take)):
                segs.append((g0, take, 0))
            else:
                cut = (np.flatnonzero(np.diff(np.frombuffer(got, dtype=np.uint32).astype(np.int64)) != 1) + 1).tolist()
                if len(cut) * 8 < take:
                    bounds = [0, *cut, take]
                    segs += [(got[s], e - s, s) for s, e in zip(bounds, bounds[1:])]
                else:
                    shreds = True
        if m > take:
            segs.append((len(key), m - take, take))
        last = 0
        if shreds:
            for j, r in enumerate(got):
                key[r] = new[j]
                mid[r] = solo
                par[r] = last
                nxt[r] = prv[r] = kid[r] = eng[r] = 0
                run[r] = m - j
                if j:
                    kid[last] = r
                last = r
        for a, c, off in segs:
            b = a + c
            keys = array("Q", new[off:off + c] if c < m else new)
            mids = array("I", [solo]) * c
            zeros = array("I", bytes(4 * c))
            runs = array("I", range(m - off, m - off - c, -1))
            if a == len(key):  # appended
                key.extend(keys)
                mid.extend(mids)
                par.extend(range(a - 1, b - 1))
                kid.extend(range(a + 1, b + 1))
                nxt.extend(zeros)
                prv.extend(zeros)
                eng.extend(array("Q", bytes(8 * c)))
                run.extend(runs)
            else:
                key[a:b] = keys
                mid[a:b] = mids
                par[a:b] = array("I", range(a - 1, b - 1))
                kid[a:b] = array("I", range(a + 1, b + 1))
                nxt[a:b] = prv[a:b] = zeros
                eng[a:b] = array("Q", bytes(8 * c))  # a freed row's engine hash is left for its reuse to reset
                run[a:b] = runs
            if last:
                par[a] = last
                kid[last] = a
            last = b - 1
        if len(segs) == 1 and not shreds:
            rids: Sequence[int] = range(segs[0][0], segs[0][0] + m)
        else:
            rids = (got.tolist() if shreds else []) + [r for a, c, _ in segs for r in range(a, a + c)]
        kid[last] = 0
        par[rids[0]] = prev
        rows, alias = self.rows, self.alias
        rslots, rmask, rend = rows.slots, rows.mask, rows.end
        aslots, amask, aend = alias.slots, alias.mask, alias.end
        n_exc = len(exc) if exc else 0
        done = m
        for h, r, e in zip(new, rids, engine[k:] if engine is not None else repeat(0)):
            i = h & rmask
            x = rslots[i]
            while x and key[x] != h:
                i += 1
                x = rslots[i]
            if x:  # a later block exists after all (no chain: only made-up hashes do that)
                done = rids.index(r)
                break
            if i >= rend:  # a probe ran into the map's tail: grow (reserve saw to the load)
                i = rows.grow(h)
                rslots, rmask, rend = rows.slots, rows.mask, rows.end
            rslots[i] = r
            if e:
                j = e & amask
                y = aslots[j]
                while y and eng[y] != e:
                    j += 1
                    y = aslots[j]
                if y:
                    exc = exc or []
                    exc.append((e, h))
                else:
                    eng[r] = e
                    if j >= aend:
                        j = alias.grow(e)
                        aslots, amask, aend = alias.slots, alias.mask, alias.end
                    aslots[j] = r
        rows.n += done
        if engine is not None:  # each placed row with an engine hash got its alias or an exception
            alias.n += done - ((len(exc) if exc else 0) - n_exc) - engine[k:k + done].count(0)
        if done:
            first = rids[0]
            nxt[first] = nx
            if prev:
                if nx:
                    prv[nx] = first
                kid[prev] = first
            self.mref[solo] += done
            self.count[bit] = self.count.get(bit, 0) + done
            self.nodes += done
        if done < m:  # rows not placed go back; the rest is stored the general way
            for r in rids[done:]:
                key[r] = mid[r] = 0
                free.append(r)
            up = rids[done - 1] if done else prev
            if done:
                kid[up] = 0
            else:
                self._decref(solo, 0)
            more = self.store(bit, drop, hashes[k + done:], up, None if engine is None else engine[k + done:])
            if more:
                exc = (exc or []) + more
        return exc


    def remove_keys(self, hashes: Iterable[int], bit: int, drop: int) -> int:
        """Take ``bit`` and ``drop`` off the rows of ``hashes`` (our keys) and their subtrees.
        Returns how many of the hashes have a row (held by the slot or not)."""
        bits = bit | drop
        mval, mid, key = self.mval, self.mid, self.key
        slots, mask = self.rows.slots, self.rows.mask
        found = 0
        for h in hashes:
            i = h & mask  # KeyIndex.locate, inlined
            r = slots[i]
            while r and key[r] != h:
                i += 1
                r = slots[i]
            if r:
                found += 1
                if mval[mid[r]] & bits:
                    self.clear(r, bit, drop)
        return found

    def remove_engine(self, hashes: Iterable[int], bit: int, drop: int) -> tuple[int, list[int]]:
        """Take ``bit`` and ``drop`` off the rows of ``hashes`` (engine hashes, resolved through
        the shared map) and their subtrees. Returns (rows found, hashes not found); a row neither
        bit holds counts as not found.

        The ingest hot loop: a leaf only this slot's fresh bit holds (what vLLM's eviction, tail
        first, removes nearly always) is freed inline (its engine-hash entry at the slot the probe
        found, its key-map entry with the others at the end); anything else goes through
        :meth:`clear`."""
        bits = bit | drop
        mval, mid, kid, nxt, prv, par = self.mval, self.mid, self.kid, self.nxt, self.prv, self.par
        eng, free = self.eng, self.free
        alias, rows = self.alias, self.rows
        aslots, amask = alias.slots, alias.mask
        missing: list[int] = []
        gone: list[int] = []
        slow = dec = 0
        dec_id = -1  # mask refcounts drop by runs: a run of leaves shares one mask id
        f0 = len(free)
        for e in hashes:
            i = e & amask
            r = aslots[i]
            while r and eng[r] != e:
                i += 1
                r = aslots[i]
            if not r:
                missing.append(e)
                continue
            mi = mid[r]
            m = mval[mi]
            if m != bit or kid[r]:
                if m & bits:
                    f = len(free)
                    self.clear(r, bit, drop)
                    slow += 1
                    f0 += len(free) - f  # not the inline path's
                else:
                    missing.append(e)
                continue
            p = par[r]
            if p:
                if prv[r] or nxt[r]:
                    self._unlink(r)
                else:  # an only child, as a chain's tail is
                    kid[p] = 0
            alias.delete_at(i)
            mid[r] = 0  # a free row holds no mask
            gone.append(r)
            if mi != dec_id:
                if dec:
                    self._unref(dec_id, dec)
                dec_id, dec = mi, 0
            dec += 1
        if dec:
            self._unref(dec_id, dec)
        # The key map's deletes wait until here (one call): until then the rows keep their keys,
        # which its backward shifts read, and no row freed here is reused.
        rows.drop_rows(gone, zero_keys=True)  # a free row (its eng column is reset when it is reused)
        free.extend(gone)
        freed = len(free) - f0
        if freed:
            self.nodes -= freed
            self.count[bit] -= freed
        return freed + slow, missing

    def _unref_run(self, i: int, n: int, bit: int, drop: int) -> tuple[int, int]:
        """Release ``n`` rows of mask id ``i``; returns how many of them carried ``bit``, ``drop``."""
        m = self.mval[i]
        self._unref(i, n)
        return (n if m & bit else 0), (n if m & drop else 0)

    def _unref(self, i: int, n: int) -> None:
        left = self.mref[i] - n
        self.mref[i] = left
        if not left:
            self._decref(i, 0)

    def clear(self, r: int, bit: int, drop: int) -> int:
        """Take ``bit`` and ``drop`` off ``r`` and its subtree (a hole cuts the prefix below it).
        Returns how many rows the slot lost."""
        bits = bit | drop
        mval, mid, kid, nxt = self.mval, self.mid, self.kid, self.nxt
        stack = [r]
        n_bit = n_drop = 0
        while stack:
            x = stack.pop()
            m = mval[mid[x]]
            c = m & bits
            if not c:
                continue  # completeness: nothing below holds the slot either
            nm = m & ~bits
            if not nm:  # completeness: nothing below holds anything else either
                nb, nd = self._free_subtree(x, bit, drop)
                n_bit += nb
                n_drop += nd
                continue
            if c & bit:
                n_bit += 1
            if c & drop:
                n_drop += 1
            self._set(x, nm)
            ch = kid[x]
            while ch:
                stack.append(ch)
                ch = nxt[ch]
        count = self.count
        if n_bit:
            count[bit] -= n_bit
        if n_drop:
            count[drop] -= n_drop
        return n_bit + n_drop

    def sweep(self, budget: int = 1 << 16, work: int = 2048) -> int:
        """Free garbage rows (empty mask after a rewrite): scans at most ``budget`` rows for them
        and frees at most about ``work`` rows, then returns rows freed; the next call goes on
        where this one stopped. Rows are freed leaf first (post-order), so a slice that stops
        inside a garbage subtree leaves every remaining row linked under a live parent row and
        one slice costs O(budget + work) however long the chain below a garbage row is."""
        if not self.garbage:
            return 0
        nodes = self.nodes
        left = self._descend(work)
        if left > 0:
            dead_ids = np.fromiter((v == 0 for v in self.mval), dtype=bool, count=len(self.mval))
            dead_ids[0] = False  # id 0 is a free row's
            n = len(self.key)
            a = self.sweep_pos
            b = min(n, a + budget)
            col = np.frombuffer(self.mid, dtype=np.uint32)
            hits = (np.flatnonzero(dead_ids[col[a:b]]) + a).tolist()
            del col
            stop = b
            for r in hits:
                if self.key[r] and not self.mval[self.mid[r]]:
                    self._path = [r]
                    left = self._descend(left)
                    if left <= 0:
                        stop = r + 1  # its subtree may go on: _path holds the rest
                        break
            self.sweep_pos = stop
            if stop >= n and not self._path:
                self.sweep_pos = 1
                # A subtree given up on may have left garbage behind the scan: one more pass.
                self.garbage, self._again = self._again, False
        return nodes - self.nodes

    def _descend(self, work: int) -> int:
        """Go on freeing the garbage subtree whose path from its top is ``_path``, at most ``work``
        steps; returns the steps left. A row on the path that a store took back or another free
        took away (the tree changes between slices) ends this subtree: the scan finds what is left."""
        path = self._path
        key, mid, mval, kid = self.key, self.mid, self.mval, self.kid
        while path and work > 0:
            work -= 1
            r = path[-1]
            if not key[r] or mval[mid[r]]:
                path.clear()
                self._again = True
                break
            c = kid[r]
            if c:
                path.append(c)  # completeness: every row below a garbage row is garbage
            else:
                path.pop()
                self._free_subtree(r)  # a leaf: unlinked from its parent, which stays linked
        return work
