"""EXPERIMENT (session 28, not used by `w4a16_matmul_packed`): the shared-x wgmma kernel with its three programs of an
SM folded into one program of three warpgroups (Gluon warp specialization), sharing one ring of x.

Why: session 21's timelines show the three programs an SM holds ending in launch order, 12.54 / 13.17 / 14.91 us
(median) at 12288->6144 M = 16, the youngest running its end alone. Warps of one program that wait at one barrier per
chunk progress together, so the SM's three 64-row tiles would end together. With SHARED the default partition copies
x into the ring and all 12 warps meet at a named barrier (`bar.sync 15, 384`) once per `step` chunks; without it each
partition keeps its own ring and barrier (three independent tiles in one program: the control).

Each partition runs the table's wgmma body (`_xshared_kernel` with WG, words in registers, no scaled_a) on its own
64 rows; the split-K fix-up is per 64-row tile, as the shared-x kernel's (the same tickets, the same bits).
"""

from __future__ import annotations

import torch

from glmq.kernels.w4a16_decode import _GLUON, DecodeConfig, xshared_tokens
from glmq.kernels.w4a16_dense import MMA_CHUNK, PackedW4, _tickets

if _GLUON:
    from glmq.kernels.w4a16_decode import (_advance_scales, _barrier, _cp_async, _dequant, _load_w, _pick,
                                           _prefetch_scales, _prefetch_w, _ring_buffer, _ring_slot, _rotate,
                                           _scale_pointers, _wg_retire, _xs_nat_frag, _xs_nat_pointers, async_copy,
                                           fence_async_shared, gl, gluon, mma_v2, warpgroup_mma)

    @gluon.jit
    def _bar_all(n: gl.constexpr):
        """All `n` threads of the program's partitions meet (named barrier 15, which Triton's own barriers do not
        use: they take 0 and one id per partition from 1)."""
        if n == 384:
            gl.inline_asm_elementwise("bar.sync 15, 384; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("bar.sync 15, 256; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _part(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om,
              r0, r1, r2, r3, CPP: gl.constexpr, TOK: gl.constexpr, D: gl.constexpr, XR: gl.constexpr,
              STEP: gl.constexpr, BF16: gl.constexpr, SPLIT: gl.constexpr, PART: gl.constexpr, NPART: gl.constexpr,
              SHARED: gl.constexpr, ONE: gl.constexpr = False, MS: gl.constexpr = False,
              ROLL: gl.constexpr = False):
        if ROLL:
            COPY_R: gl.constexpr = PART == 0 or not SHARED
            BAR_ALL: gl.constexpr = NPART * 128 if SHARED else 0
            _rolled(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om,
                    r0, r1, r2, r3, gl.program_id(0) * NPART + PART, COPY_R, CPP, TOK, D, BF16, SPLIT, BAR_ALL)
        elif ONE:  # one copy of the code for all partitions (a call): the partition index at run time
            part = gl.inline_asm_elementwise("{.reg .u32 t; mov.u32 t, %tid.x; shr.u32 $0, t, 7;}", "=r", [],
                                             dtype=gl.int32, is_pure=True, pack=1)
            _body(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om,
                  r0, r1, r2, r3, part, CPP, TOK, D, XR, STEP, BF16, SPLIT, NPART, SHARED, MS)
        else:
            COPY: gl.constexpr = PART == 0 or not SHARED
            _body_inl(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn,
                      stride_om, r0, r1, r2, r3, PART, COPY, CPP, TOK, D, XR, STEP, BF16, SPLIT, NPART, SHARED, MS)

    @gluon.jit(noinline=True)
    def _body(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om,
              r0, r1, r2, r3, part, CPP: gl.constexpr, TOK: gl.constexpr, D: gl.constexpr, XR: gl.constexpr,
              STEP: gl.constexpr, BF16: gl.constexpr, SPLIT: gl.constexpr, NPART: gl.constexpr,
              SHARED: gl.constexpr, MS: gl.constexpr):
        """One body for every partition. With SHARED every partition copies all of x's chunk into the one ring (the
        same bytes to the same addresses, each waiting for its own copies before the common barrier), so that the
        body has no branch on the partition (LLVM unswitched one into two copies of the body)."""
        COPY: gl.constexpr = True
        _body_inl(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om,
                  r0, r1, r2, r3, part, COPY, CPP, TOK, D, XR, STEP, BF16, SPLIT, NPART, SHARED, MS)

    @gluon.jit
    def _body_inl(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om,
                  r0, r1, r2, r3, part, COPY: gl.constexpr, CPP: gl.constexpr, TOK: gl.constexpr, D: gl.constexpr,
                  XR: gl.constexpr, STEP: gl.constexpr, BF16: gl.constexpr, SPLIT: gl.constexpr, NPART: gl.constexpr,
                  SHARED: gl.constexpr, MS: gl.constexpr):
        W: gl.constexpr = 4
        R: gl.constexpr = 16
        tile = gl.program_id(0) * NPART + part  # this partition's 64-row tile
        c0 = gl.program_id(1) * CPP
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
        w_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 8, 4],
                                             warps_per_cta=[W, 1, 1], order=[2, 1, 0])
        s_l: gl.constexpr = gl.SliceLayout(2, mma)
        wg_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, TOK, 16])
        wg_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=wg_mma, k_width=2)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        b_like = gl.full([W, 128, TOK], 0.0, x_ptr.dtype.element_ty, layout=b_l)
        zero = gl.zeros([W, R, TOK], gl.float32, layout=mma)

        wi = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_l)))
        ri = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_l)))
        vi = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_l)))
        rows = gl.minimum(tile * (W * R) + gl.expand_dims(wi * R, 1) + gl.expand_dims(ri, 0), N - 1)
        wp = w_ptr + c0 * stride_wc + gl.expand_dims(rows * 16, 2) + gl.expand_dims(gl.expand_dims(vi, 0), 1)
        sp = _scale_pointers(s_ptr, c0, tile * (W * R), N, stride_sn, W, R, 0, R)
        G: gl.constexpr = sp.shape[2]
        s_like = gl.full([W, R], 0.0, gl.float32, layout=s_l)
        acc = gl.zeros([W, R, TOK], gl.float32, layout=mma)

        w0, w1, w2, w3 = _prefetch_w(wp, stride_wc, D, CPP)
        sg0, sg1 = _prefetch_scales(sp, CPP)
        xp, x_mask = _xs_nat_pointers(x_ptr, c0, M, stride_xm, TOK, W)
        if COPY:
            for j in gl.static_range(XR - STEP):
                if j < CPP:
                    _cp_async(_ring_slot(r0, r1, r2, r3, r0, r0, r0, r0, j), xp + j * 128, mask=x_mask)
                    async_copy.commit_group()
        tk = acc
        a_prev = acc
        s_prev = s_like
        a = acc
        for i in gl.static_range(CPP):
            wn = w0
            if i + D < CPP:
                wn = _load_w(wp + (i + D) * stride_wc)
            sg0, sg1 = _advance_scales(sg0, sg1, sp, i, CPP)
            s0 = _pick(sg0, i % G, s_like)
            if MS:
                if i % STEP == 0:
                    if COPY:
                        async_copy.wait_group(max(0, min(i + XR - STEP - 1, CPP - 1) - (i + STEP - 1)))
                    if SHARED:
                        _bar_all(NPART * 128)
                    else:
                        _barrier()
                    if COPY:
                        for j in gl.static_range(XR - STEP, XR):
                            if i + j < CPP:
                                _cp_async(_ring_slot(r0, r1, r2, r3, r0, r0, r0, r0, (i + j) % XR),
                                          xp + (i + j) * 128, mask=x_mask)
                                async_copy.commit_group()
                xb = _xs_nat_frag(_ring_slot(r0, r1, r2, r3, r0, r0, r0, r0, i % XR), b_like)
                a = gl.convert_layout(_dequant(w0, W, R, BF16), a_l, assert_trivial=True)
                acc = acc + mma_v2(a, xb, zero) * gl.expand_dims(s0.to(gl.float32), 2)
            else:
                a = gl.convert_layout(gl.reshape(_dequant(w0, W, R, BF16), [W * R, 128]), wg_a, assert_trivial=True)
                if i % STEP == 0:
                    if i > 0:
                        acc, a = _wg_retire(tk, a_prev, a, 0, s_prev, mma, acc)
                    if COPY:
                        async_copy.wait_group(max(0, min(i + XR - STEP - 1, CPP - 1) - (i + STEP - 1)))
                        fence_async_shared()
                    if SHARED:
                        _bar_all(NPART * 128)
                    else:
                        _barrier()
                    if COPY:
                        for j in gl.static_range(XR - STEP, XR):
                            if i + j < CPP:
                                _cp_async(_ring_slot(r0, r1, r2, r3, r0, r0, r0, r0, (i + j) % XR),
                                          xp + (i + j) * 128, mask=x_mask)
                                async_copy.commit_group()
                xs = _ring_slot(r0, r1, r2, r3, r0, r0, r0, r0, i % XR).permute((1, 0))
                tk_i = warpgroup_mma(a, xs, gl.zeros([W * R, TOK], gl.float32, layout=wg_mma), use_acc=False,
                                     is_async=True)
                if i % STEP != 0:
                    acc, a = _wg_retire(tk, a_prev, a, 1, s_prev, mma, acc)
                tk = tk_i
                a_prev = a
                s_prev = s0
            w0, w1, w2, w3 = _rotate(w0, w1, w2, w3, wn, D)
        if not MS:
            acc, a = _wg_retire(tk, a_prev, a, 0, s_prev, mma, acc)

        _epilogue(acc, tile, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, TOK, SPLIT)

    @gluon.jit
    def _pin(v):
        """v through an asm copy with side effects: LLVM keeps it (and the adds before it) in program order, where it
        sank a runtime loop body's scaled adds to the end of the body (session 22: 8 MMA results live)."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _rolled(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om,
                r0, r1, r2, r3, tile, COPY: gl.constexpr, CPP: gl.constexpr, TOK: gl.constexpr, D: gl.constexpr,
                BF16: gl.constexpr, SPLIT: gl.constexpr, BAR_ALL: gl.constexpr, SWC: gl.constexpr = 0):
        """The wgmma body (ring of 4, a barrier a chunk) as a runtime loop over 8-chunk groups (one scale group each),
        so that its code is a third of the unrolled body's at 24 chunks: the warp-specialized kernel holds one copy
        per partition, and three unrolled copies overflowed the instruction cache (ncu: 7.2 cycles a warp
        instruction stalled on `no_instruction`, against 0.08). Each group's MMA chain is drained at its end, so
        its first chunk retires nothing; x's copies and the words past the last chunk are masked off (a copy group is
        still committed, so that every wait is `wait_group(2)`). BAR_ALL: the chunk's barrier is the program's named
        barrier over this many threads instead of the partition's own.

        Compiled, not timed: 200-208 registers against the unrolled body's 164 (LLVM hoists each chunk's word and x
        addresses out of the loop; carrying the pointers did not stop it, and making them opaque loses the alignment
        facts the 16-byte cp.async needs), too many for three tiles an SM."""
        W: gl.constexpr = 4
        R: gl.constexpr = 16
        U: gl.constexpr = 8
        XR: gl.constexpr = 4
        if SWC > 0:  # the words' chunk stride known at compile time: immediate offsets within an iteration
            stride_wc = SWC
        c0 = gl.program_id(1) * CPP
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
        w_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 8, 4],
                                             warps_per_cta=[W, 1, 1], order=[2, 1, 0])
        s_l: gl.constexpr = gl.SliceLayout(2, mma)
        wg_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, TOK, 16])
        wg_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=wg_mma, k_width=2)
        wi = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_l)))
        ri = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_l)))
        vi = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_l)))
        rows = gl.minimum(tile * (W * R) + gl.expand_dims(wi * R, 1) + gl.expand_dims(ri, 0), N - 1)
        wp = w_ptr + c0 * stride_wc + gl.expand_dims(rows * 16, 2) + gl.expand_dims(gl.expand_dims(vi, 0), 1)
        w_true = gl.expand_dims(gl.expand_dims(vi >= 0, 0), 1)  # [1, 1, 16] all true, for the words' masks
        sp = _scale_pointers(s_ptr, c0, tile * (W * R), N, stride_sn, W, R, 0, R)
        G: gl.constexpr = sp.shape[2]
        gl.static_assert(G == U, "one scale group per iteration (16 rows a warp: G = 8)")
        gl.static_assert(CPP % U == 0, "whole 8-chunk groups")
        s_true = gl.expand_dims(gl.expand_dims(gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, sp.type.layout))) >= 0, 0), 1)
        s_like = gl.full([W, R], 0.0, gl.float32, layout=s_l)
        acc = gl.zeros([W, R, TOK], gl.float32, layout=mma)

        w0, w1, w2, w3 = _prefetch_w(wp, stride_wc, D, CPP)
        sg1 = gl.load(sp)  # group 0 (moved into use at the first iteration's start)
        xp, x_mask = _xs_nat_pointers(x_ptr, c0, M, stride_xm, TOK, W)
        if COPY:
            for j in gl.static_range(XR - 1):
                _cp_async(_ring_slot(r0, r1, r2, r3, r0, r0, r0, r0, j), xp + j * 128, mask=x_mask)
                async_copy.commit_group()
        wq = wp  # the iteration's chunk 0 (its words, x and next scale group): pointers carried by the loop and
        xq = xp  # advanced at its end, so that LLVM does not hoist eight chunks' addresses out of it (64 registers)
        sq = sp + G
        for it in range(CPP // U):
            sg0 = sg1
            sg1 = gl.load(sq, mask=s_true & ((it + 1) * U < CPP), other=0.0)
            tk = acc
            a_prev = acc
            s_prev = s_like
            a = acc
            for j in gl.static_range(U):
                i = it * U + j
                wn = gl.load(wq + (j + D) * stride_wc, mask=w_true & (i + D < CPP), other=0,
                             eviction_policy="evict_first")
                s0 = _pick(sg0, j, s_like)
                a = gl.convert_layout(gl.reshape(_dequant(w0, W, R, BF16), [W * R, 128]), wg_a,
                                      assert_trivial=True)
                if j > 0:
                    acc, a = _wg_retire(tk, a_prev, a, 0, s_prev, mma, acc)
                    acc = _pin(acc)
                if COPY:
                    async_copy.wait_group(XR - 2)
                    fence_async_shared()
                if BAR_ALL > 0:
                    _bar_all(BAR_ALL)
                else:
                    _barrier()
                if COPY:
                    _cp_async(_ring_slot(r0, r1, r2, r3, r0, r0, r0, r0, (j + XR - 1) % XR),
                              xq + (j + XR - 1) * 128, mask=x_mask & (i + XR - 1 < CPP))
                    async_copy.commit_group()
                xs = _ring_slot(r0, r1, r2, r3, r0, r0, r0, r0, j % XR).permute((1, 0))
                tk = warpgroup_mma(a, xs, gl.zeros([W * R, TOK], gl.float32, layout=wg_mma), use_acc=False,
                                   is_async=True)
                a_prev = a
                s_prev = s0
                w0, w1, w2, w3 = _rotate(w0, w1, w2, w3, wn, D)
            acc, a = _wg_retire(tk, a_prev, a, 0, s_prev, mma, acc)
            wq += U * stride_wc
            xq += U * 128
            sq += G
        _epilogue(acc, tile, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, TOK, SPLIT)

    @gluon.jit
    def _rolled_plain_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn,
                             stride_om, CPP: gl.constexpr, TOK: gl.constexpr, D: gl.constexpr, BF16: gl.constexpr,
                             SPLIT: gl.constexpr, SWC: gl.constexpr = 0):
        """The control: `_rolled` as a plain 4-warp program per 64-row tile (grid (cdiv(N, 64), split)), as the
        shared-x kernel launches."""
        r0 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, True)
        r1 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, True)
        r2 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, True)
        r3 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, True)
        COPY: gl.constexpr = True
        NOB: gl.constexpr = 0
        _rolled(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om,
                r0, r1, r2, r3, gl.program_id(0), COPY, CPP, TOK, D, BF16, SPLIT, NOB, SWC)

    @gluon.jit
    def _epilogue(acc, tile, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, TOK: gl.constexpr, SPLIT: gl.constexpr):
        """Store a 64-row tile's result, or with SPLIT its partial and the ticket's fix-up (`_xshared_kernel`'s)."""
        W: gl.constexpr = 4
        R: gl.constexpr = 16
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
        wo = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
        ro = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
        to = gl.arange(0, TOK, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
        row = tile * (W * R) + gl.expand_dims(gl.expand_dims(wo * R, 1) + gl.expand_dims(ro, 0), 2)
        tok = gl.expand_dims(gl.expand_dims(to, 0), 1)
        o_mask = (row < N) & (tok < M)
        o_ptr = out_ptr + row + tok * stride_om
        if SPLIT:
            mn = M * N
            part = ws_ptr + row + tok * N
            gl.store(part + gl.program_id(1).to(gl.int64) * mn, acc, mask=o_mask)
            _barrier()  # this partition's partial precedes its one-thread release below
            ticket = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if ticket == gl.num_programs(1) - 1:
                total = gl.load(part, mask=o_mask, other=0.0, cache_modifier=".cg")
                for s in range(1, gl.num_programs(1)):
                    total += gl.load(part + s * mn, mask=o_mask, other=0.0, cache_modifier=".cg")
                gl.store(o_ptr, total.to(out_ptr.dtype.element_ty), mask=o_mask)
                gl.store(cnt_ptr + tile, 0)
        else:
            gl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=o_mask)

    @gluon.jit
    def _coupled_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn,
                        stride_om, CPP: gl.constexpr, TOK: gl.constexpr, D: gl.constexpr, XR: gl.constexpr,
                        STEP: gl.constexpr, BF16: gl.constexpr, SPLIT: gl.constexpr, SHARED: gl.constexpr,
                        REGS: gl.constexpr, ONE: gl.constexpr = False, MS: gl.constexpr = False,
                        ROLL: gl.constexpr = False):
        """grid = (cdiv(N, 192), split); program (p, k): 64-row tiles 3 p .. 3 p + 2 (one per partition), chunks
        [CPP k, CPP (k + 1))."""
        WGR: gl.constexpr = not MS  # the ring in the swizzle wgmma reads (else ldmatrix's)
        a0 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
        a1 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
        a2 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
        a3 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
        b0, b1, b2, b3 = a0, a1, a2, a3
        c0, c1, c2, c3 = a0, a1, a2, a3
        if not SHARED:  # a ring for each partition
            b0 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
            b1 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
            b2 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
            b3 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
            c0 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
            c1 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
            c2 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
            c3 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
        P0: gl.constexpr = 0
        P1: gl.constexpr = 1
        P2: gl.constexpr = 2
        NP: gl.constexpr = 3
        gl.warp_specialize([
            (_part, (x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om, a0,
                    a1, a2, a3, CPP, TOK, D, XR, STEP, BF16, SPLIT, P0, NP, SHARED, ONE, MS, ROLL)),
            (_part, (x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om, b0,
                    b1, b2, b3, CPP, TOK, D, XR, STEP, BF16, SPLIT, P1, NP, SHARED, ONE, MS, ROLL)),
            (_part, (x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om, c0,
                    c1, c2, c3, CPP, TOK, D, XR, STEP, BF16, SPLIT, P2, NP, SHARED, ONE, MS, ROLL)),
        ], [4, 4], [REGS, REGS])


def _install_ptx_hook() -> None:
    """With `ptx_options` holding --maxrregcount, drop the .maxnreg directive that Triton writes for a
    warp-specialized kernel: ptxas schedules up to the budget a .maxnreg names (a single partition's body: 164
    registers without it, 168 and 216 bytes of spills with .maxnreg 168, 255 and 72 bytes with .maxnreg 255). Without
    it the warp-specialized kernel compiled to 164-166 registers and no spills (ptxas: "'setmaxnreg' ignored"). The
    --maxrregcount itself has no effect on these kernels (164 / 208 registers whether it says 128 or 168); it only
    marks the compiles this hook rewrites."""
    import re

    from triton import knobs

    if getattr(knobs.runtime.add_stages_inspection_hook, "_glmq", False):
        return
    prev = knobs.runtime.add_stages_inspection_hook

    def hook(backend, stages, options, language, capability):
        if prev is not None:
            prev(backend, stages, options, language, capability)
        if "--maxrregcount" not in (options.ptx_options or ""):
            return
        make_ptx = stages["ptx"]
        stages["ptx"] = lambda src, metadata: re.sub(r"^\.maxnreg \d+\n", "", make_ptx(src, metadata), flags=re.M)

    hook._glmq = True
    knobs.runtime.add_stages_inspection_hook = hook


def coupled_args(m: int, chunks: int, cfg: DecodeConfig, bf16: bool, shared: bool, regs: int, one: bool = False,
                 roll: bool = False) -> dict:
    cpp = chunks // cfg.split
    return dict(CPP=cpp, TOK=xshared_tokens(m), D=min(cfg.depth, cpp), XR=cfg.ring, STEP=cfg.step, BF16=bf16,
                SPLIT=cfg.split > 1, SHARED=shared, REGS=regs, ONE=one, MS=not cfg.wgmma,
                ROLL=roll)


def coupled_matmul(x: torch.Tensor, w: PackedW4, out: torch.Tensor, cfg: DecodeConfig, shared: bool = True,
                   regs: int = 168, strip: bool = True, one: bool = False, roll: bool = False,
                   plain: bool = False) -> torch.Tensor:
    """out = x @ dequant(w).T by `_coupled_kernel` (PAIRS, chunk-major weights; cfg: a wgmma shared-x config with 4
    warps of 16 rows, ring <= 4, no w_smem or scaled_a; N a multiple of 64)."""
    m, k = x.shape
    if not (cfg.warps == 4 and cfg.rows == 16 and cfg.ring <= 4 and not cfg.w_smem
            and not cfg.scaled_a and w.n % 64 == 0 and 1 <= m <= 16):
        raise ValueError(f"coupled_matmul takes a 4-warp config with ring <= 4 at M <= 16, got {cfg}, M = {m}")
    stride_wn, stride_wc = w.word_strides()
    blocks = -(-w.n // 192)
    scratch = torch.empty(cfg.split, m, w.n, dtype=torch.float32, device=x.device)
    tickets = _tickets(x.device, 3 * blocks)
    if plain:  # the rolled body as the shared-x kernel launches it
        _rolled_plain_kernel[(w.n // 64, cfg.split)](
            x, w.qweight, w.scale, out, scratch, tickets, m, w.n, x.stride(0), stride_wc, w.scale.stride(0),
            out.stride(0), CPP=k // MMA_CHUNK // cfg.split, TOK=xshared_tokens(m), D=min(cfg.depth, 3),
            BF16=x.dtype == torch.bfloat16, SPLIT=cfg.split > 1, num_warps=4)
        return out
    if strip:
        _install_ptx_hook()
    _coupled_kernel[(blocks, cfg.split)](
        x, w.qweight, w.scale, out, scratch, tickets, m, w.n, x.stride(0), stride_wc, w.scale.stride(0), out.stride(0),
        **coupled_args(m, k // MMA_CHUNK, cfg, x.dtype == torch.bfloat16, shared, regs, one, roll), num_warps=4, maxnreg=regs,
        **({"ptx_options": f"--maxrregcount {regs}"} if strip else {}),
    )  # fmt: skip
    return out


def compile_coupled_sm90(cfg: DecodeConfig, chunks: int, tok: int = 16, shared: bool = True, regs: int = 168,
                         strip: bool = True, one: bool = False, roll: bool = False) -> dict:
    """Compile `_coupled_kernel` for sm_90 without a GPU: {"registers", "spills", "shared", "sass", "ptx"}."""
    import os
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if strip:
        _install_ptx_hook()

    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wc": "i32", "stride_sn": "i32",
           "stride_om": "i32"}
    consts = coupled_args(tok, chunks, cfg, True, shared, regs, one, roll)
    sig.update({name: "constexpr" for name in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11)}
    src = GluonASTSource(_coupled_kernel, sig, consts, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **({"maxnreg": regs} if regs else {}),
                                                                      **({"ptx_options": f"--maxrregcount {regs}"}
                                                                         if strip and regs else {})})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tool), "--dump-sass", cubin], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([str(tool), "--dump-resource-usage", cubin], capture_output=True, text=True,
                             check=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", res)}
    return {"registers": usage.get("REG"), "spills": usage.get("STACK"), "shared": kernel.metadata.shared,
            "sass": sass, "ptx": kernel.asm["ptx"], "ttgir": kernel.asm.get("ttgir", "")}


if _GLUON:
    @gluon.jit
    def _single_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn,
                       stride_om, CPP: gl.constexpr, TOK: gl.constexpr, D: gl.constexpr, XR: gl.constexpr,
                       STEP: gl.constexpr, BF16: gl.constexpr, SPLIT: gl.constexpr, SHARED: gl.constexpr,
                       REGS: gl.constexpr):
        """Diagnosis: one partition's body as a plain 4-warp kernel."""
        lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        r0 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
        r1 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
        r2 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
        r3 = _ring_buffer(x_ptr, TOK, False, False, 4, 16, WGR)
        P0: gl.constexpr = 0
        NP: gl.constexpr = 1
        SH: gl.constexpr = False
        _part(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om, r0, r1,
              r2, r3, CPP, TOK, D, XR, STEP, BF16, SPLIT, P0, NP, SH)
