r"""The block filter and its reverse mode on the host: NumPy with SciPy's BLAS/LAPACK, called from JAX.

The arithmetic of :mod:`.filter` (forward) and :mod:`.adjoint` (reverse) for the CPU. XLA:CPU runs a scan body one
operation at a time on one core; here

* each sub-step's covariance update is one in-place ``dgemm`` with ``beta = 1`` (:func:`gemm_acc`: no separate
  subtraction pass, and no GIL held while it runs);
* the absorb is the whitened form of :func:`.filter.white_values` (a Cholesky factor of ``I + R C Rᵀ``, one
  triangular solve, the covariance downdated by ``VᵀV``);
* a sub-step reads only its occupied slots: an empty slot (zero weights, zero information factor and data)
  changes neither the value nor a gradient, so it is left out of the update instead of being carried at rank K;
* a sub-step that does not predict skips the prediction instead of writing back what is there, and the
  prediction writes rows and copies them to the columns (the result is symmetric).

**Shared and separate.** What is the same maths on either array library is one function taking ``xp``, called
here with NumPy: the nodes' prior moments (:func:`.filter.node_moments`), the absorb's small part and its reverse
(:func:`.filter.white_values`, :func:`.filter.white_vjp`), the absorb's reverse over the state
(:func:`.filter.absorb_vjp`, :func:`.filter.weight_vjp`, which update NumPy adjoints in place) and the event code.
The covariance downdate and the prediction with its transpose are written twice on purpose. The XLA scan needs
one shape and no branch for every sub-step: block offsets are traced values read through dynamic slices, a
sub-step that does not predict writes back what is there, and empty slots are carried at rank K. Here a sub-step
reads only its occupied slots, skips what it does not do and updates the S x S covariance in place; written over
one namespace, either the scan would branch or the host would copy its covariance several times per sub-step.
Nor can the host run through ``jax.numpy``: per-call dispatch of these small operations is what it exists to avoid.

:func:`msrm.gp.state_space.loglik` calls this through ``jax.pure_callback`` when the run was prepared with
``method="callback"`` (the default on a CPU with at least two cores); the XLA scan stays the path for accelerators
and the reference it is tested against.

**BLAS threads.** :meth:`HostFilter.forward`, :meth:`HostFilter.value_and_grad` and :meth:`HostFilter.backward`
choose their count afresh at every call and hold it for the call's duration (restoring the count in force
around them afterwards): :func:`msrm.runtime.filter_thread_count` of the filter's largest product,

.. math::

    f = \max\bigl(2 S^2 R_{\max},\ 2 n_b \max(n_b, C)\, K S\bigr),

the covariance update of the S states at the largest update rank :math:`R_{\max}` (occupied slots times K) and
the bank move (:math:`n_b` bank states, blocks of C). With no explicit count
(:func:`msrm.runtime.fixed_step_threads`) that is one thread for :math:`f < F_0`
(:data:`msrm.runtime.DENSE_THREAD_MIN_FLOPS`), and otherwise a :func:`msrm.runtime.callback_threads` or
``configure(blas_threads=)`` count, else the idle cores when the call starts, :func:`msrm.runtime.idle_cores`: the
usable cores less the threads other processes are running.

Checkpointing is the same: the forward pass returns the state at the start of every chunk, and the reverse pass
recomputes one chunk at a time (keeping that chunk's states) before running the adjoint over it.
:meth:`HostFilter.value_and_grad` runs both passes in one call, so the last chunk (with a single chunk, the whole
run) is reversed from the states the forward pass kept instead of being recomputed. With
``pipeline=True`` (two or more CPUs, and sub-steps large enough: :func:`pipeline_pays`) the recomputation of
chunk c - 1 runs on a second thread while the adjoint walks back through chunk c; the adjoints are the same to
the last bit.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ... import runtime
from .blas import gemm_acc, one_blas_thread
from .filter import absorb_vjp, bank_block, event_code, node_moments, qy, weight_vjp, white_values
from .prepare import RunTables

__all__ = ["HostFilter", "gemm_acc", "one_blas_thread", "pipeline_pays", "largest_product_flops"]

# Whether the reverse pass recomputes on a second thread. Below some size a sub-step's BLAS work is too small to
# outweigh the GIL-held Python and small-array work the second thread contends for, so the one-thread pass is
# faster. None: decided by the block-length cost model's fixed coefficients (:func:`pipeline_pays`); a number: a
# fixed threshold on S^2 x (mean update rank).
PIPELINE_MIN_WORK: float | None = None
# the pass is pipelined when its dense products take at least this many times the sub-step's fixed cost: a ratio
# of two costs, so it carries across CPUs where an absolute size does not; it lies between the ratios of the
# one-eighth design with K = 3 (where one thread is faster) and of the x8 design with K = 5 (where two are)
PIPELINE_BLAS_OVER_FIXED = 2.5


def pipeline_pays(n_states: int, rank: float, K: int, coefficients=None) -> bool:
    """Whether recomputing on a second thread pays for a sub-step of ``n_states`` states at mean update rank
    ``rank``: the forward and reverse dense products (BLAS, without the GIL) take at least
    :data:`PIPELINE_BLAS_OVER_FIXED` times the sub-step's fixed cost (GIL-held calls), by the model of
    :mod:`.tuning` (``coefficients`` default to its fixed ones), or S^2 x rank reaches :data:`PIPELINE_MIN_WORK`
    when that is set."""
    if rank <= 0:
        return False
    if PIPELINE_MIN_WORK is not None:
        return n_states * n_states * rank >= PIPELINE_MIN_WORK
    from . import tuning

    c = tuning.machine_coefficients() if coefficients is None else coefficients
    blas = n_states * n_states * (tuning.PRODUCTS_PER_SUB_STEP * c.gemm(rank)
                                  + tuning.NARROW_PRODUCTS_PER_SUB_STEP * c.gemm(max(rank / max(K, 1), 1.0)))
    return blas >= PIPELINE_BLAS_OVER_FIXED * tuning.OPS_PER_SUB_STEP * c.call_s


def largest_product_flops(n_states: int, max_rank: int, K: int, n_bank: int = 0, block: int = 0) -> float:
    """Floating-point operations of the host filter's largest BLAS product: the covariance update
    ``2 S^2 R_max`` (S states, update rank ``R_max``) or the bank move ``2 n_b max(n_b, C) K S``, whichever is
    larger (the size :func:`msrm.runtime.filter_thread_count` chooses the BLAS threads by)."""
    S = float(n_states)
    return max(2.0 * S * S * max_rank, 2.0 * n_bank * max(n_bank, block) * K * S)


def _copy_into(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    np.copyto(out, x)
    return out


class HostFilter:
    """One run's block filter on the host (static tables bound once)."""

    def __init__(self, t: RunTables):
        self.t = t
        self.K, self.C, self.d, self.S = t.K, t.block, t.d, t.n_states
        self.s0, self.b0, self.n = t.sde_offset, t.bank_offset, t.n_bank
        self.nblk = t.n_ring // t.block
        self.block_index = np.asarray(t.block_index, dtype=np.int64)
        self.predict = np.asarray(t.predict, dtype=bool)
        # the occupied slots of each sub-step (None: all): an empty slot (a zero row of A, zero Λ and η) changes
        # neither the value nor any gradient, so the update skips it instead of carrying it at rank K
        occupied = np.concatenate([g.slot_local != g.n_g for g in t.groups], axis=1)
        self._occupied = [None if o.all() else np.flatnonzero(o) for o in occupied]
        counts = occupied.sum(axis=1)
        rank = float(counts[counts > 0].mean()) * self.K if counts.any() else 0.0
        # the size BLAS threads are chosen by (msrm.runtime.filter_thread_count)
        self.blas_flops = largest_product_flops(self.S, int(counts.max(initial=0)) * self.K, self.K, self.n,
                                                self.C)
        # the second thread pays off only when BLAS time, which runs without the GIL, outweighs the GIL-held
        # Python and small-array work of a sub-step
        self.pipeline_pays = pipeline_pays(self.S, rank, self.K)
        if self.n:
            bb = bank_block(t)
            self.Mc, self.Vc = bb["Mc"], bb["Vc"]

    def blas_threads(self) -> int:
        """The BLAS thread count a call would take now (:func:`msrm.runtime.filter_thread_count` of
        :attr:`blas_flops`)."""
        return runtime.filter_thread_count(self.blas_flops)

    def blas_limit(self):
        """Context: BLAS on :meth:`blas_threads` threads while it is open (from whichever thread enters it, JAX's
        callback threads included); yields the count."""
        return runtime.callback_blas_limit(context="state-space host filter", threads=self.blas_threads())

    # ------------------------------------------------------------------ pieces
    def occupied(self, i):
        """Sub-step i's occupied node slots (indices), or None when every slot is occupied."""
        return self._occupied[i]

    def ring_row(self, b):
        """First state row of block b's ring slots."""
        return int(b % self.nblk) * self.C * self.K

    def _blockdiag(self, Ls):
        M, K = Ls.shape[0], self.K
        Lb = np.zeros((M, K, M, K))
        idx = np.arange(M)
        Lb[idx, :, idx, :] = Ls
        return Lb.reshape(M * K, M * K)

    def _bank_rows(self, b, X):
        """Rows of X (S, r): bank <- Mc bank + Vc block(b) (in place)."""
        K, n, C, b0, rb = self.K, self.n, self.C, self.b0, self.ring_row(b)
        r = X.shape[1]
        Xb = X[b0 : b0 + n * K].reshape(n, K * r)
        Xr = X[rb : rb + C * K].reshape(C, K * r)
        X[b0 : b0 + n * K] = (self.Mc @ Xb + self.Vc @ Xr).reshape(n * K, r)

    def _bank_rows_transpose(self, b, X):
        """Eᵀ X for the bank move E (rows of X (S, r), in place)."""
        K, n, C, b0, rb = self.K, self.n, self.C, self.b0, self.ring_row(b)
        r = X.shape[1]
        Xb = X[b0 : b0 + n * K].reshape(n, K * r).copy()
        X[rb : rb + C * K] += (self.Vc.T @ Xb).reshape(C * K, r)
        X[b0 : b0 + n * K] = (self.Mc.T @ Xb).reshape(n * K, r)

    def predict_step(self, m, P, b, T, Qy):
        """Block b -> b + 1 in place: the bank move, then the SDE write (rows, columns, noise)."""
        K, C, d, S, s0 = self.K, self.C, self.d, self.S, self.s0
        Y = C + d
        if self.n:
            self._bank_rows(b, P)
            self._bank_rows(b, P.T)  # the columns (P.T is a view)
            mb = m[:, None]
            self._bank_rows(b, mb)
        r1 = self.ring_row(b + 1)
        rows = [slice(r1, r1 + C * K), slice(s0, s0 + d * K)]  # y in the state: the new ring slots, the SDE state
        ys = [slice(0, C * K), slice(C * K, Y * K)]  # the same in y's own order
        R = np.einsum("kyi,iks->yks", T, P[s0 : s0 + d * K].reshape(d, K, S)).reshape(Y * K, S)
        # the new (y, y) block T P[s, s] Tᵀ + Q_b, from R's SDE columns
        Rs = R[:, s0 : s0 + d * K].reshape(Y * K, d, K)
        Pyy = np.einsum("aik,kzi->azk", Rs, T).reshape(Y * K, Y * K) + Qy
        for ya, _ in zip(ys, rows):
            for yc, rc in zip(ys, rows):
                R[ya, rc] = Pyy[ya, yc]
        P[rows[0]] = R[: C * K]
        P[rows[1]] = R[C * K :]
        # the result is symmetric: the new columns are the new rows
        P[:, rows[0]] = P[rows[0]].T
        P[:, rows[1]] = P[rows[1]].T
        y = np.einsum("kyi,ik->yk", T, m[s0 : s0 + d * K].reshape(d, K))
        m[rows[0]] = y[:C].reshape(-1)
        m[rows[1]] = y[C:].reshape(-1)

    def _slots(self, i, A, Rs, ys):
        """Sub-step i's weights (M', Q), information factors (M', K, K) and whitened data (M' K,) over its
        occupied slots."""
        j = self._occupied[i]
        if j is None:
            return A[i], Rs[i], ys[i]
        return A[i][j], Rs[i][j], ys[i].reshape(-1, self.K)[j].reshape(-1)

    def _step(self, m, P, i, A, Rs, ys, T, Qy, keep=None, value=True, buf=None):
        """One sub-step in place; returns (log Z', bad, κ). ``keep`` (a dict) receives what the reverse pass reads
        (the covariance copied into ``buf`` when given); with ``value=False`` log Z' and bad are not computed and
        are returned as 0."""
        K = self.K
        Ai, Ri, yi = self._slots(i, A, Rs, ys)
        R = Ai.shape[0] * K
        Pk = None if keep is None else P.copy() if buf is None else _copy_into(buf, P)
        if R == 0:  # no node ends in this block: the prediction only
            if keep is not None:
                keep.update(m=m.copy(), P=Pk, R=0)
            self._maybe_predict(m, P, i, T, Qy, keep)
            return 0.0, 0, 1.0
        U, mu, Cm = node_moments(self.t, Ai, m, P, np)
        Rb = self._blockdiag(Ri)
        v = white_values(mu, Cm, Rb, yi, np, value=value)
        if keep is not None:
            keep.update(v)
            keep.update(m=m.copy(), P=Pk, R=R, A=Ai, y=yi, Rb=Rb, U=U, mu=mu, Cm=Cm)
        # m + U G⁻¹v and P - U G⁻¹Λ Uᵀ through V = W Uᵀ (see filter.absorb_state: the products that round with
        # the size of the posterior, not of the prior)
        V = v["W"] @ U.T
        m += V.T @ v["u"]
        # P <- P - Vᵀ V, in place: P.T is the same memory in Fortran order
        gemm_acc(-1.0, V.T, np.asfortranarray(V), P.T)
        self._maybe_predict(m, P, i, T, Qy, keep)
        if not value:
            return 0.0, 0, 1.0
        return v["logZ"], int(not v["ok"]), v["kappa"]

    def _maybe_predict(self, m, P, i, T, Qy, keep):
        """The prediction after sub-step i, if it predicts; ``keep`` also receives what the adjoint of the SDE
        write reads from the absorbed state (``F P`` on the SDE columns and the SDE mean), computed here on the
        recomputing thread instead of in the reverse pass."""
        if not self.predict[i]:
            return
        b = self.block_index[i]
        if keep is not None:
            K, C, d, s0 = self.K, self.C, self.d, self.s0
            FPs, ms = P[:, s0 : s0 + d * K].copy(), m[s0 : s0 + d * K].copy()
            if self.n:
                self._bank_rows(b, FPs)
            r1 = self.ring_row(b + 1)
            FX = np.einsum("kyi,ikc->ykc", T, FPs[s0 : s0 + d * K].reshape(d, K, d * K))
            FPs[r1 : r1 + C * K] = FX[:C].reshape(C * K, d * K)
            FPs[s0 : s0 + d * K] = FX[C:].reshape(d * K, d * K)
            keep.update(FPs=FPs, ms=ms)
        self.predict_step(m, P, b, T, Qy)

    # ------------------------------------------------------------------ passes
    def forward(self, A, Rs, ys, T, Qb, m0, P0, keep_starts: bool, keep_last: bool = False):
        """(log Z sum, event code[, chunk-start means (n_chunks, S), covariances (n_chunks, S, S)[, last]]); the
        event code (:func:`.filter.event_code`) counts the steps that lost definiteness and carries the accuracy
        level of the blocks.

        ``keep_last`` (with ``keep_starts``): also return what the reverse pass reads for each sub-step of the
        last chunk (as :meth:`recompute` would), so that :meth:`backward` need not recompute that chunk.
        ``Rs`` (T, M, K, K), ``ys`` (T, M K): the slots' information factors and whitened data
        (:func:`.filter.step_tables`).
        BLAS runs on :meth:`blas_threads` threads, chosen at the call."""
        with self.blas_limit():
            return self._forward(A, Rs, ys, T, Qb, m0, P0, keep_starts, keep_last)

    def _forward(self, A, Rs, ys, T, Qb, m0, P0, keep_starts: bool, keep_last: bool = False):
        t = self.t
        Qy = qy(Qb, np)
        m, P = np.array(m0, dtype=np.float64), np.array(P0, dtype=np.float64, order="C")
        ll, bad, kap, last = 0.0, 0, 1.0, []
        if keep_starts:
            sm, sP = np.empty((t.n_chunks, self.S)), np.empty((t.n_chunks, self.S, self.S))
        for c in range(t.n_chunks):
            if keep_starts:
                sm[c], sP[c] = m, P
            keep = keep_starts and keep_last and c == t.n_chunks - 1
            for i in range(c * t.chunk, (c + 1) * t.chunk):
                k = {} if keep else None
                lz, bd, kp = self._step(m, P, i, A, Rs, ys, T, Qy, keep=k)
                if keep:
                    last.append(k)
                ll += lz
                bad += bd
                kap = max(kap, kp)
        bad = event_code(bad, kap, np)
        if not keep_starts:
            return ll, bad
        return (ll, bad, sm, sP, last) if keep_last else (ll, bad, sm, sP)

    def value_and_grad(self, A, Rs, ys, T, Qb, m0, P0, pipeline: bool = False):
        """(log Z' sum, event code, adjoints of the log Z' sum (Ā, R̄ blocks, ỹ̄, T̄, Q̄_b, m̄0, P̄0)) in one call.

        The log Z sum is a scalar and its reverse pass is linear in the cotangent, so the adjoints at cotangent 1
        serve every cotangent, scaled. Computed here, straight after the forward pass, they need no recomputation
        of the last chunk, and with a single chunk (every sub-step kept) none at all. BLAS runs on
        :meth:`blas_threads` threads, chosen once for both passes."""
        with self.blas_limit():
            ll, bad, sm, sP, last = self._forward(A, Rs, ys, T, Qb, m0, P0, keep_starts=True, keep_last=True)
            grads = self._backward(A, Rs, ys, T, Qb, sm, sP, 1.0, pipeline=pipeline, last=last)
        return ll, bad, grads

    def recompute(self, c, A, Rs, ys, T, Qy, sm, sP, bufs=None):
        """Chunk c's sub-steps again from its start state; what each one's reverse step reads, in order.
        ``bufs``: one S x S array per sub-step to keep its covariance in (see :meth:`backward`)."""
        t = self.t
        m, P = sm[c].copy(), sP[c].copy()
        kept = []
        for j, i in enumerate(range(c * t.chunk, (c + 1) * t.chunk)):
            k = {}
            self._step(m, P, i, A, Rs, ys, T, Qy, keep=k, value=False, buf=None if bufs is None else bufs[j])
            kept.append(k)
        return kept

    def buffers(self):
        """One chunk's S x S arrays for :meth:`recompute` on the helper thread, allocated on the calling one.

        glibc gives each thread its own malloc arena, and a helper thread's arena hands freed memory back to the
        system; covariances allocated there were faulted in again at every chunk. Allocated here they come from
        the main heap, which keeps them: page faults per value+grad call went from about 9 000 to 1 700 at x1
        and from 23 000 to 4 000 at x8 (K = 5); the time changed by less than the machine's noise."""
        return [np.empty((self.S, self.S)) for _ in range(self.t.chunk)]

    def backward(self, A, Rs, ys, T, Qb, sm, sP, gll, pipeline: bool = False, last=None):
        """Adjoints (Ā, R̄ blocks, ỹ̄, T̄, Q̄_b, m̄0, P̄0) of the log Z' sum, scaled by ``gll``.

        ``pipeline``: recompute chunk c - 1 on a second thread while the reverse pass runs over chunk c (two
        chunks' states are then held at once). BLAS and most NumPy loops release the GIL, so on two cores the
        recomputation mostly hides behind the reverse pass; Ā (which nothing later reads) is then also formed on
        that thread. The result is the same to the last bit.
        ``last``: the last chunk's kept sub-steps from :meth:`forward` (``keep_last``), used instead of
        recomputing that chunk. BLAS runs on :meth:`blas_threads` threads, chosen at the call (the count is
        process-wide, so the second thread's calls run on it too).
        """
        with self.blas_limit():
            return self._backward(A, Rs, ys, T, Qb, sm, sP, gll, pipeline, last)

    def _backward(self, A, Rs, ys, T, Qb, sm, sP, gll, pipeline: bool = False, last=None):
        t, S = self.t, self.S
        Qy = qy(Qb, np)
        Ab, Rsb, yb = np.zeros_like(A), np.zeros_like(Rs), np.zeros_like(ys)
        Tb, Qbb = np.zeros_like(T), np.zeros_like(Qb)
        mb, Pb = np.zeros(S), np.zeros((S, S))
        args = (A, Rs, ys, T, Qy, sm, sP)
        start = t.n_chunks - 1 if last is None else t.n_chunks - 2  # the last chunk to recompute
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="msrm-recompute") if (
            pipeline and t.n_chunks > 1) else None
        weights = []
        try:
            nxt = None if pool is None or start < 0 else pool.submit(self.recompute, start, *args, self.buffers())
            for c in reversed(range(t.n_chunks)):
                if c > start:
                    kept = last
                elif pool is None:
                    kept = self.recompute(c, *args)
                else:
                    kept = nxt.result()
                    nxt = pool.submit(self.recompute, c - 1, *args, self.buffers()) if c > 0 else None
                deferred = self.reverse_chunk(c, kept, T, gll, Rsb, yb, Tb, Qbb, mb, Pb)
                if pool is None:
                    self._weight_adjoints(deferred, Ab)
                else:
                    weights.append(pool.submit(self._weight_adjoints, deferred, Ab))
            for w in weights:
                w.result()
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        return Ab, Rsb, yb, Tb, Qbb, mb, Pb

    def reverse_chunk(self, c, kept, T, gll, Rsb, yb, Tb, Qbb, mb, Pb):
        """The reverse pass over chunk c (in place on the adjoint accumulators except Ā); returns what
        :meth:`_weight_adjoints` needs for Ā."""
        t, K = self.t, self.K
        deferred = []
        for i in reversed(range(c * t.chunk, (c + 1) * t.chunk)):
            k = kept[i - c * t.chunk]
            mi, Pi, R, b = k["m"], k["P"], k["R"], self.block_index[i]
            kept[i - c * t.chunk] = None
            if self.predict[i]:
                dT, dQ = self._sde_write_transpose(b, mb, Pb, T, k["FPs"], k["ms"])
                Tb += dT
                Qbb += dQ
                if self.n:
                    self._bank_rows_transpose(b, Pb)
                    self._bank_rows_transpose(b, Pb.T)
                    self._bank_rows_transpose(b, mb[:, None])
            if not R:
                continue
            M = k["A"].shape[0]
            _, _, parts, Rbb, ybi = absorb_vjp(t, k, mb, Pb, gll, np)  # mb and Pb in place
            idx = np.arange(M)
            j = self._occupied[i]
            if j is None:
                Rsb[i], yb[i] = Rbb.reshape(M, K, M, K)[idx, :, idx, :], ybi
            else:
                Rsb[i][j] = Rbb.reshape(M, K, M, K)[idx, :, idx, :]
                yb[i].reshape(-1, K)[j] = ybi.reshape(M, K)
            deferred.append((i, parts, k["U"], mi, Pi))
        return deferred

    def _weight_adjoints(self, deferred, Ab):
        """Ā of the sub-steps of one chunk (writes Ab rows, :func:`.filter.weight_vjp`) from the adjoints the
        reverse pass left. Nothing later in the reverse pass reads Ā, so this runs on the helper thread when the
        pass is pipelined."""
        for i, parts, U, mi, Pi in deferred:
            Ab_i = weight_vjp(self.t, parts, U, mi, Pi)
            j = self._occupied[i]
            if j is None:
                Ab[i] = Ab_i
            else:
                Ab[i][j] = Ab_i

    def _sde_write_transpose(self, b, mb, Pb, T, FPs, ms):
        """Adjoint of the SDE write (in place on mb, Pb); returns (T̄, Q̄_b). FPs: ``F P`` on the SDE columns of
        the absorbed (and bank-moved) state; ms: its SDE mean."""
        K, C, d, S, s0 = self.K, self.C, self.d, self.S, self.s0
        Y = C + d
        r1 = self.ring_row(b + 1)
        Wy = np.concatenate([Pb[r1 : r1 + C * K], Pb[s0 : s0 + d * K]])  # (Y K, S)
        G = (Wy @ FPs).reshape(Y, K, d, K)
        my = np.concatenate([mb[r1 : r1 + C * K], mb[s0 : s0 + d * K]]).reshape(Y, K)
        Tb = 2.0 * np.einsum("ykik->kyi", G) + np.einsum("yk,ik->kyi", my, ms.reshape(d, K))
        Wyy = np.concatenate([Wy[:, r1 : r1 + C * K], Wy[:, s0 : s0 + d * K]], axis=1).reshape(Y, K, Y, K)
        Qbb = np.einsum("ykzk->kyz", Wyy)
        # Fᵀ P̄ F is symmetric: its SDE rows are Tᵀ P̄[y, :] with the y columns replaced (ring -> 0, SDE ->
        # Tᵀ P̄[y, y] T); its ring rows are 0; the columns are the rows transposed
        Wy3 = Wy.reshape(Y, K, S)
        new = np.einsum("kyi,yks->iks", T, Wy3).reshape(d * K, S)
        Vs = new[:, s0 : s0 + d * K].copy()  # Tᵀ P̄[y, s]: columns s are then (Tᵀ P̄[y, y] T) via the y columns
        Vy = np.concatenate([new[:, r1 : r1 + C * K], Vs], axis=1).reshape(d * K, Y, K)
        new[:, r1 : r1 + C * K] = 0.0
        new[:, s0 : s0 + d * K] = np.einsum("ayk,kyi->aik", Vy, T).reshape(d * K, d * K)
        Pb[r1 : r1 + C * K] = 0.0
        Pb[:, r1 : r1 + C * K] = 0.0
        Pb[s0 : s0 + d * K] = new
        Pb[:, s0 : s0 + d * K] = new.T
        mb[r1 : r1 + C * K] = 0.0
        mb[s0 : s0 + d * K] = np.einsum("kyi,yk->ik", T, my).reshape(-1)
        return Tb, Qbb
