"""Triton kernels of the Mamba-2 chunked SSD scan, forward and backward (`ssd_chunk_scan`).

Same signature and math as `reference.ssd_chunk_scan` (mamba_ssm's `mamba_chunk_scan_combined`). Per head h
(group g = h // (heads / groups)), with Δ = softplus(dt + dt_bias) and the in-chunk cumulative log decay
cs_t = sum_{s <= t in the chunk} Δ_s A_h:
  intra-chunk   y_t  = sum_{s <= t} (C_t . B_s) exp(cs_t - cs_s) Δ_s x_s
  chunk state   S_c  = sum_s exp(cs_end - cs_s) Δ_s x_s ⊗ B_s
  state passing h_c+1 = exp(cs_end) h_c + S_c           (h_0 = initial_states)
  inter-chunk   y_t += exp(cs_t) h_c C_t,  then y += D x and y *= silu(z).
Forward: chunk cumsum (`_cumsum_fwd`), chunk state fused with state passing (`_states_fwd`: one program walks
the chunks of a (batch, head, state tile) in order), chunk scan with the C.B block products computed in place
(`_scan_fwd`). Backward recomputes the states (as mamba_ssm does) and runs: the reverse state passing fused with
the chunk-scan state gradient (`_dstates_bwd`), dx / dΔ / dB (`_dx_db_bwd`, one program per group, heads in a
loop so dB is summed in registers), dC (`_dc_bwd`), and the reverse cumsum with the dt / A / dt_bias gradients
(`_cumsum_bwd`). The gradient of the cumulative decay at each step is C.dC - B.dB of that head (plus, at the
chunk end, the state gradient dotted with the state) so no kernel needs it in closed form. The chunk-state
part of that sum is taken as exp(cs_end) dS.h_c plus a forward cumsum of each step's own state term, not
as dS.h_c+1 minus a reverse cumsum: with a strong decay the two would nearly cancel in bf16.

fp32 inputs use IEEE fp32 products; bf16/fp16 products run in the input dtype with fp32 accumulation, decays,
cumsums and states. Defined only where Triton is installed, so importing this module never fails.
"""
import torch
import torch.nn.functional as F

from megatron.core.utils import module_available

_HAVE_TRITON = module_available("triton")
_BLOCK_M = 64  # rows of y (and of dC) per program in the chunk-scan kernels
_BLOCK_K = 64  # rows of x/B per inner step (and per program in the dx/dB kernel)
_STATE_BLOCK = 64  # head-dim and state-dim tile of the state kernels
# (num_warps, num_stages) per kernel; benchmarks/gpu/ssd_bench.py --sweep measures the alternatives and drops
# those whose bf16 gradients leave the GPU test's bound (on an H200 with Triton 3.6, dx_db and dc at 8 warps
# gave d dt errors of 0.27 of its max at the test's l200 / 3-group / state-32 shape; 4 warps are exact to bf16)
LAUNCH = {"states": (4, 2), "scan": (4, 1), "dstates": (4, 2), "dx_db": (4, 1), "dc": (4, 1)}

if _HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _cumsum_fwd(dt_ptr, bias_ptr, a_ptr, dtout_ptr, cs_ptr, seqlen, nheads, s_db, s_dl, s_dh,
                    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, Q: tl.constexpr):
        """Δ and the in-chunk cumsum of Δ A for one (batch, head, chunk); zero Δ past the sequence end."""
        b, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = c * Q + tl.arange(0, Q)
        valid = t < seqlen
        v = tl.load(dt_ptr + b * s_db + t * s_dl + h * s_dh, mask=valid, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += tl.load(bias_ptr + h).to(tl.float32)
        if SOFTPLUS:
            v = tl.where(v <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))), v)
        v = tl.where(valid, v, 0.0)
        cs = tl.cumsum(v * tl.load(a_ptr + h).to(tl.float32), axis=0)
        base = (b * nheads + h).to(tl.int64) * tl.num_programs(2) * Q + t
        tl.store(dtout_ptr + base, v)
        tl.store(cs_ptr + base, cs)

    @triton.jit
    def _states_fwd(x_ptr, b_ptr, dt_ptr, cs_ptr, init_ptr, st_ptr, fin_ptr, seqlen, nheads, nchunks, hpg,
                    s_xb, s_xl, s_xh, s_xp, s_bb, s_bl, s_bg, s_bn, P: tl.constexpr, N: tl.constexpr,
                    HAS_INIT: tl.constexpr, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                    PREC: tl.constexpr):
        """Walk the chunks of one (batch, head, [BP, BN] state tile): store the state entering each chunk
        ([b, c, h, p, n], x's dtype), add the chunk's state, and store the final state ([b, h, p, n] fp32)."""
        bh = tl.program_id(0)
        b, h = bh // nheads, bh % nheads
        g = h // hpg
        p = tl.program_id(1) * BP + tl.arange(0, BP)
        n = tl.program_id(2) * BN + tl.arange(0, BN)
        pn = p[:, None] * N + n[None, :]
        pn_mask = (p[:, None] < P) & (n[None, :] < N)
        if HAS_INIT:
            state = tl.load(init_ptr + bh.to(tl.int64) * P * N + pn, mask=pn_mask, other=0.0).to(tl.float32)
        else:
            state = tl.zeros([BP, BN], dtype=tl.float32)
        q = tl.arange(0, Q)
        for c in range(nchunks):
            tl.store(st_ptr + ((b * nchunks + c) * nheads + h).to(tl.int64) * P * N + pn,
                     state.to(st_ptr.dtype.element_ty), mask=pn_mask)
            t = c * Q + q
            tm = t < seqlen
            xv = tl.load(x_ptr + b * s_xb + t[:, None].to(tl.int64) * s_xl + h * s_xh + p[None, :] * s_xp,
                         mask=tm[:, None] & (p[None, :] < P), other=0.0)
            bv = tl.load(b_ptr + b * s_bb + t[:, None].to(tl.int64) * s_bl + g * s_bg + n[None, :] * s_bn,
                         mask=tm[:, None] & (n[None, :] < N), other=0.0)
            row = (bh.to(tl.int64) * nchunks + c) * Q
            cs = tl.load(cs_ptr + row + q)
            cs_end = tl.load(cs_ptr + row + Q - 1)
            w = tl.exp(cs_end - cs) * tl.load(dt_ptr + row + q)
            xw = (xv * w[:, None]).to(bv.dtype)
            state = state * tl.exp(cs_end) + tl.dot(tl.trans(xw), bv, input_precision=PREC)
        tl.store(fin_ptr + bh.to(tl.int64) * P * N + pn, state, mask=pn_mask)

    @triton.jit
    def _scan_fwd(x_ptr, b_ptr, c_ptr, dt_ptr, cs_ptr, st_ptr, d_ptr, z_ptr, y_ptr, ypre_ptr, seqlen, nheads,
                  nchunks, hpg, s_xb, s_xl, s_xh, s_xp, s_bb, s_bl, s_bg, s_bn, s_cb, s_cl, s_cg, s_cn,
                  s_zb, s_zl, s_zh, s_zp, P: tl.constexpr, N: tl.constexpr, HAS_D: tl.constexpr,
                  HAS_Z: tl.constexpr, Q: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                  BN: tl.constexpr, PREC: tl.constexpr):
        """y for BM rows of one chunk and BP head dims: exp(cs) C h_c + the causal intra-chunk sum, D, z."""
        npb = tl.cdiv(P, BP)
        m0 = (tl.program_id(0) // npb) * BM
        p = (tl.program_id(0) % npb) * BP + tl.arange(0, BP)
        bc, h = tl.program_id(1), tl.program_id(2)
        b, c = bc // nchunks, bc % nchunks
        g = h // hpg
        n = tl.arange(0, BN)
        i = c * Q + m0 + tl.arange(0, BM)
        im = i < seqlen
        row = ((b * nheads + h).to(tl.int64) * nchunks + c) * Q
        cs_i = tl.load(cs_ptr + row + m0 + tl.arange(0, BM))
        cv = tl.load(c_ptr + b * s_cb + i[:, None].to(tl.int64) * s_cl + g * s_cg + n[None, :] * s_cn,
                     mask=im[:, None] & (n[None, :] < N), other=0.0)
        st = tl.load(st_ptr + ((b * nchunks + c) * nheads + h).to(tl.int64) * P * N + p[None, :] * N + n[:, None],
                     mask=(p[None, :] < P) & (n[:, None] < N), other=0.0)  # [BN, BP]
        acc = tl.dot(cv, st.to(cv.dtype), input_precision=PREC) * tl.exp(cs_i)[:, None]
        for j0 in range(0, m0 + BM, BK):
            j = c * Q + j0 + tl.arange(0, BK)
            jm = j < seqlen
            bv = tl.load(b_ptr + b * s_bb + j[:, None].to(tl.int64) * s_bl + g * s_bg + n[None, :] * s_bn,
                         mask=jm[:, None] & (n[None, :] < N), other=0.0)
            xv = tl.load(x_ptr + b * s_xb + j[:, None].to(tl.int64) * s_xl + h * s_xh + p[None, :] * s_xp,
                         mask=jm[:, None] & (p[None, :] < P), other=0.0)
            cs_j = tl.load(cs_ptr + row + j0 + tl.arange(0, BK))
            dt_j = tl.load(dt_ptr + row + j0 + tl.arange(0, BK))
            cb = tl.dot(cv, tl.trans(bv), input_precision=PREC)  # [BM, BK]
            decay = tl.exp(tl.where(i[:, None] >= j[None, :], cs_i[:, None] - cs_j[None, :], float("-inf")))
            acc += tl.dot((cb * decay * dt_j[None, :]).to(xv.dtype), xv, input_precision=PREC)
        io = i[:, None].to(tl.int64)
        om = im[:, None] & (p[None, :] < P)
        if HAS_D:
            xi = tl.load(x_ptr + b * s_xb + io * s_xl + h * s_xh + p[None, :] * s_xp, mask=om, other=0.0)
            acc += xi.to(tl.float32) * tl.load(d_ptr + h * P + p, mask=p < P, other=0.0)[None, :]
        out = (b * seqlen + io) * nheads * P + h * P + p[None, :]  # y and y_pre are contiguous [b, l, h, p]
        if HAS_Z:
            tl.store(ypre_ptr + out, acc.to(ypre_ptr.dtype.element_ty), mask=om)
            zv = tl.load(z_ptr + b * s_zb + io * s_zl + h * s_zh + p[None, :] * s_zp, mask=om,
                         other=0.0).to(tl.float32)
            acc = acc * zv * tl.sigmoid(zv)
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=om)

    @triton.jit
    def _dstates_bwd(g_ptr, c_ptr, cs_ptr, st_ptr, dfin_ptr, ds_ptr, dinit_ptr, dend_ptr, seqlen,
                     nheads, nchunks, hpg, s_gb, s_gl, s_gh, s_gp, s_cb, s_cl, s_cg, s_cn, P: tl.constexpr,
                     N: tl.constexpr, HAS_DFIN: tl.constexpr, Q: tl.constexpr, BP: tl.constexpr,
                     BN: tl.constexpr, PREC: tl.constexpr):
        """Walk the chunks backwards for one (batch, head, state tile): dS_c = the gradient of the state
        leaving chunk c; the decayed-entering-state part of d(cs_end), exp(cs_end) sum(dS_c * h_c) (the
        chunk's own additions to h_c+1 are counted per position by `_cumsum_bwd`); gradient of the state
        entering chunk c = exp(cs) g^T C + exp(cs_end) dS_c; the last one is d initial_states."""
        bh = tl.program_id(0)
        b, h = bh // nheads, bh % nheads
        g = h // hpg
        p = tl.program_id(1) * BP + tl.arange(0, BP)
        n = tl.program_id(2) * BN + tl.arange(0, BN)
        pn = p[:, None] * N + n[None, :]
        pn_mask = (p[:, None] < P) & (n[None, :] < N)
        tile = tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)
        ntiles = tl.num_programs(1) * tl.num_programs(2)
        if HAS_DFIN:
            run = tl.load(dfin_ptr + bh.to(tl.int64) * P * N + pn, mask=pn_mask, other=0.0).to(tl.float32)
        else:
            run = tl.zeros([BP, BN], dtype=tl.float32)
        q = tl.arange(0, Q)
        for k in range(nchunks):
            c = nchunks - 1 - k
            sidx = ((b * nchunks + c) * nheads + h).to(tl.int64) * P * N + pn
            tl.store(ds_ptr + sidx, run.to(ds_ptr.dtype.element_ty), mask=pn_mask)
            row = (bh.to(tl.int64) * nchunks + c) * Q
            cs_end = tl.load(cs_ptr + row + Q - 1)
            entering = tl.load(st_ptr + sidx, mask=pn_mask, other=0.0).to(tl.float32)  # h_c
            tl.store(dend_ptr + (bh.to(tl.int64) * nchunks + c) * ntiles + tile,
                     tl.exp(cs_end) * tl.sum(tl.sum(run * entering, 1), 0))
            t = c * Q + q
            tm = t < seqlen
            gv = tl.load(g_ptr + b * s_gb + t[:, None].to(tl.int64) * s_gl + h * s_gh + p[None, :] * s_gp,
                         mask=tm[:, None] & (p[None, :] < P), other=0.0)
            cv = tl.load(c_ptr + b * s_cb + t[:, None].to(tl.int64) * s_cl + g * s_cg + n[None, :] * s_cn,
                         mask=tm[:, None] & (n[None, :] < N), other=0.0)
            cs = tl.load(cs_ptr + row + q)
            gw = (gv.to(tl.float32) * tl.exp(cs)[:, None]).to(cv.dtype)
            run = tl.dot(tl.trans(gw), cv, input_precision=PREC) + tl.exp(cs_end) * run
        tl.store(dinit_ptr + bh.to(tl.int64) * P * N + pn, run, mask=pn_mask)

    @triton.jit
    def _dx_db_bwd(x_ptr, b_ptr, c_ptr, g_ptr, dt_ptr, cs_ptr, ds_ptr, d_ptr, dx_ptr, db_ptr, ddt_ptr, ddts_ptr,
                   dd_ptr, seqlen, nheads, nchunks, hpg, s_xb, s_xl, s_xh, s_xp, s_bb, s_bl, s_bg, s_bn,
                   s_cb, s_cl, s_cg, s_cn, s_gb, s_gl, s_gh, s_gp, P: tl.constexpr, N: tl.constexpr,
                   HAS_D: tl.constexpr, Q: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                   BN: tl.constexpr, PREC: tl.constexpr):
        """For BK rows j of one chunk and one group: per head dx_j, dΔ_j (direct part; its chunk-state part
        alone too) and dD;
        dB_j summed over the group's heads. Terms: the chunk state (through dS_c) and the rows i >= j."""
        k0 = tl.program_id(0) * BK
        bc, g = tl.program_id(1), tl.program_id(2)
        b, c = bc // nchunks, bc % nchunks
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        j = c * Q + k0 + tl.arange(0, BK)
        jm = j < seqlen
        jo = j[:, None].to(tl.int64)
        bv = tl.load(b_ptr + b * s_bb + jo * s_bl + g * s_bg + n[None, :] * s_bn,
                     mask=jm[:, None] & (n[None, :] < N), other=0.0)
        xm = jm[:, None] & (p[None, :] < P)
        db = tl.zeros([BK, BN], dtype=tl.float32)
        for h in range(g * hpg, g * hpg + hpg):
            row = ((b * nheads + h).to(tl.int64) * nchunks + c) * Q
            cs_j = tl.load(cs_ptr + row + k0 + tl.arange(0, BK))
            dt_j = tl.load(dt_ptr + row + k0 + tl.arange(0, BK))
            wj = tl.exp(tl.load(cs_ptr + row + Q - 1) - cs_j)
            xv = tl.load(x_ptr + b * s_xb + jo * s_xl + h * s_xh + p[None, :] * s_xp, mask=xm, other=0.0)
            ds = tl.load(ds_ptr + ((b * nchunks + c) * nheads + h).to(tl.int64) * P * N + p[:, None] * N
                         + n[None, :], mask=(p[:, None] < P) & (n[None, :] < N), other=0.0).to(bv.dtype)
            t = tl.dot(bv, tl.trans(ds), input_precision=PREC)  # [BK, BP]
            dx = t * (wj * dt_j)[:, None]
            ddt = wj * tl.sum(xv.to(tl.float32) * t, 1)
            tl.store(ddts_ptr + row + k0 + tl.arange(0, BK), ddt)
            dbh = tl.dot(xv, ds, input_precision=PREC) * (wj * dt_j)[:, None]  # [BK, BN]
            for i0 in range(k0, Q, BM):
                i = c * Q + i0 + tl.arange(0, BM)
                im = i < seqlen
                io = i[:, None].to(tl.int64)
                cv = tl.load(c_ptr + b * s_cb + io * s_cl + g * s_cg + n[None, :] * s_cn,
                             mask=im[:, None] & (n[None, :] < N), other=0.0)
                gv = tl.load(g_ptr + b * s_gb + io * s_gl + h * s_gh + p[None, :] * s_gp,
                             mask=im[:, None] & (p[None, :] < P), other=0.0).to(xv.dtype)
                cs_i = tl.load(cs_ptr + row + i0 + tl.arange(0, BM))
                decay = tl.exp(tl.where(i[None, :] >= j[:, None], cs_i[None, :] - cs_j[:, None], float("-inf")))
                pt = tl.dot(bv, tl.trans(cv), input_precision=PREC) * decay  # [BK, BM]
                gt = tl.dot(xv, tl.trans(gv), input_precision=PREC)  # [BK, BM]
                dx += tl.dot(pt.to(gv.dtype), gv, input_precision=PREC) * dt_j[:, None]
                ddt += tl.sum(pt * gt, 1)
                dbh += tl.dot((gt * decay).to(cv.dtype), cv, input_precision=PREC) * dt_j[:, None]
            if HAS_D:
                gj = tl.load(g_ptr + b * s_gb + jo * s_gl + h * s_gh + p[None, :] * s_gp, mask=xm,
                             other=0.0).to(tl.float32)
                dx += gj * tl.load(d_ptr + h * P + p, mask=p < P, other=0.0)[None, :]
                tl.store(dd_ptr + ((bc * tl.num_programs(0) + tl.program_id(0)) * nheads + h).to(tl.int64) * P + p,
                         tl.sum(gj * xv.to(tl.float32), 0), mask=p < P)
            tl.store(dx_ptr + (b * seqlen + jo) * nheads * P + h * P + p[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=xm)
            tl.store(ddt_ptr + row + k0 + tl.arange(0, BK), ddt)
            db += dbh
        tl.store(db_ptr + ((b * seqlen + jo) * tl.num_programs(2) + g) * N + n[None, :], db,
                 mask=jm[:, None] & (n[None, :] < N))

    @triton.jit
    def _dc_bwd(x_ptr, b_ptr, c_ptr, g_ptr, dt_ptr, cs_ptr, st_ptr, dc_ptr, cdc_ptr, seqlen, nheads, nchunks,
                hpg, s_xb, s_xl, s_xh, s_xp, s_bb, s_bl, s_bg, s_bn, s_cb, s_cl, s_cg, s_cn, s_gb, s_gl, s_gh,
                s_gp, P: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
        """For BM rows i of one chunk and one group: dC_i summed over the group's heads, and per head C_i.dC_i.
        Terms: exp(cs_i) g_i h_c (the entering state) and the rows j <= i."""
        m0 = tl.program_id(0) * BM
        bc, g = tl.program_id(1), tl.program_id(2)
        b, c = bc // nchunks, bc % nchunks
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        i = c * Q + m0 + tl.arange(0, BM)
        im = i < seqlen
        io = i[:, None].to(tl.int64)
        cm = im[:, None] & (n[None, :] < N)
        cv = tl.load(c_ptr + b * s_cb + io * s_cl + g * s_cg + n[None, :] * s_cn, mask=cm, other=0.0)
        dc = tl.zeros([BM, BN], dtype=tl.float32)
        for h in range(g * hpg, g * hpg + hpg):
            row = ((b * nheads + h).to(tl.int64) * nchunks + c) * Q
            cs_i = tl.load(cs_ptr + row + m0 + tl.arange(0, BM))
            gv = tl.load(g_ptr + b * s_gb + io * s_gl + h * s_gh + p[None, :] * s_gp,
                         mask=im[:, None] & (p[None, :] < P), other=0.0).to(cv.dtype)
            st = tl.load(st_ptr + ((b * nchunks + c) * nheads + h).to(tl.int64) * P * N + p[:, None] * N
                         + n[None, :], mask=(p[:, None] < P) & (n[None, :] < N), other=0.0)
            dch = tl.dot(gv, st.to(cv.dtype), input_precision=PREC) * tl.exp(cs_i)[:, None]  # [BM, BN]
            cdc = tl.sum(cv.to(tl.float32) * dch, 1)  # C.dC: the entering-state term, then each L_ij in fp32
            for j0 in range(0, m0 + BM, BK):
                j = c * Q + j0 + tl.arange(0, BK)
                jm = j < seqlen
                jo = j[:, None].to(tl.int64)
                xv = tl.load(x_ptr + b * s_xb + jo * s_xl + h * s_xh + p[None, :] * s_xp,
                             mask=jm[:, None] & (p[None, :] < P), other=0.0).to(cv.dtype)
                bv = tl.load(b_ptr + b * s_bb + jo * s_bl + g * s_bg + n[None, :] * s_bn,
                             mask=jm[:, None] & (n[None, :] < N), other=0.0)
                cs_j = tl.load(cs_ptr + row + j0 + tl.arange(0, BK))
                dt_j = tl.load(dt_ptr + row + j0 + tl.arange(0, BK))
                gx = tl.dot(gv, tl.trans(xv), input_precision=PREC)  # [BM, BK]
                decay = tl.exp(tl.where(i[:, None] >= j[None, :], cs_i[:, None] - cs_j[None, :], float("-inf")))
                lij = gx * decay * dt_j[None, :]
                dch += tl.dot(lij.to(bv.dtype), bv, input_precision=PREC)
                cdc += tl.sum(lij * tl.dot(cv, tl.trans(bv), input_precision=PREC), 1)
            tl.store(cdc_ptr + row + m0 + tl.arange(0, BM), cdc)
            dc += dch
        tl.store(dc_ptr + ((b * seqlen + io) * tl.num_programs(2) + g) * N + n[None, :], dc, mask=cm)

    @triton.jit
    def _cumsum_bwd(dt_ptr, bias_ptr, a_ptr, dtv_ptr, cdc_ptr, ddtd_ptr, ddts_ptr, dend_ptr, ddt_ptr, da_ptr,
                    dbias_ptr, seqlen, nheads, s_db, s_dl, s_dh, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                    Q: tl.constexpr):
        """One (batch, head, chunk): dΔA_k = sum_{t >= k} d cs_t with d cs = C.dC - B.dB (+ at the chunk end
        the gradient of h_c+1 dotted with it), B.dB being Δ times the direct dΔ. The chunk-state terms are
        summed without cancelling: h_c+1 = exp(cs_end) h_c + sum_s (state added at s), so their part of
        dΔA_k is exp(cs_end) dS.h_c + sum_{t < k} Δ_t (state part of dΔ_t), never a difference of two sums
        of the size of dS.h_c+1. dΔ = direct + dΔA A, through softplus to d dt; partial sums of dA and
        d dt_bias."""
        b, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        nchunks = tl.num_programs(2)
        q = tl.arange(0, Q)
        t = c * Q + q
        valid = t < seqlen
        row = ((b * nheads + h).to(tl.int64) * nchunks + c) * Q
        dtv = tl.load(dtv_ptr + row + q)
        ddt = tl.load(ddtd_ptr + row + q)
        added = dtv * tl.load(ddts_ptr + row + q)  # Δ_t times the chunk-state part of dΔ_t
        dcs = tl.load(cdc_ptr + row + q) - dtv * ddt + added  # the in-chunk terms of d cs
        dda = tl.sum(dcs, 0) - tl.cumsum(dcs, 0) + dcs  # reverse inclusive cumsum
        dda += tl.load(dend_ptr + (b * nheads + h) * nchunks + c) + tl.cumsum(added, 0) - added
        a = tl.load(a_ptr + h).to(tl.float32)
        ddt += dda * a
        pid = (b * nheads + h) * nchunks + c
        tl.store(da_ptr + pid, tl.sum(dda * dtv, 0))
        if SOFTPLUS:
            v = tl.load(dt_ptr + b * s_db + t * s_dl + h * s_dh, mask=valid, other=0.0).to(tl.float32)
            if HAS_BIAS:
                v += tl.load(bias_ptr + h).to(tl.float32)
            ddt = tl.where(v <= 20.0, ddt * tl.sigmoid(v), ddt)
        ddt = tl.where(valid, ddt, 0.0)
        out = (b * seqlen + t).to(tl.int64) * nheads + h  # d dt is contiguous [b, l, h]
        tl.store(ddt_ptr + out, ddt.to(ddt_ptr.dtype.element_ty), mask=valid)
        tl.store(dbias_ptr + pid, tl.sum(ddt, 0))


def _check(x, dt, A, B, C, chunk_size, D, z, initial_states):
    """Raise one ValueError naming every shape rule the operands break."""
    problems = []
    if x.dim() != 4:
        raise ValueError(f"ssd_chunk_scan: x must be [b, l, h, p], got shape {tuple(x.shape)}")
    b, seqlen, nheads, headdim = x.shape
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        problems.append(f"chunk_size={chunk_size}: must be a power of two >= 16 for the Triton kernels")
    if tuple(dt.shape) != (b, seqlen, nheads):
        problems.append(f"dt {tuple(dt.shape)}: must be [b, l, h] = {(b, seqlen, nheads)}")
    if tuple(A.shape) != (nheads,):
        problems.append(f"A {tuple(A.shape)}: must be [h] = ({nheads},)")
    if B.dim() != 4 or tuple(B.shape[:2]) != (b, seqlen) or B.shape != C.shape or nheads % B.shape[2]:
        problems.append(f"B {tuple(B.shape)} and C {tuple(C.shape)}: must both be [b, l, g, n] with h % g == 0")
    if D is not None and tuple(D.shape) not in ((nheads,), (nheads, headdim)):
        problems.append(f"D {tuple(D.shape)}: must be [h] or [h, p]")
    if z is not None and z.shape != x.shape:
        problems.append(f"z {tuple(z.shape)}: must be shaped like x {tuple(x.shape)}")
    if initial_states is not None and B.dim() == 4 and \
            tuple(initial_states.shape) != (b, nheads, headdim, B.shape[-1]):
        problems.append(f"initial_states {tuple(initial_states.shape)}: must be [b, h, p, n]")
    if problems:
        raise ValueError("ssd_chunk_scan: " + "; ".join(problems))


def _dims(x, B, chunk_size):
    """(b, l, h, p, g, n, chunks, heads per group, dot precision) of the operands."""
    b, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    return b, seqlen, nheads, headdim, ngroups, dstate, triton.cdiv(seqlen, chunk_size), nheads // ngroups, prec


def _launch(kernel):
    """The launch options of `kernel` from LAUNCH."""
    return {"num_warps": LAUNCH[kernel][0], "num_stages": LAUNCH[kernel][1]}


def _pow2(v):
    return max(16, triton.next_power_of_2(v))


def _chunk_cumsum(dt, A, dt_bias, dt_softplus, nchunks, chunk_size):
    """Δ and the in-chunk cumsum of Δ A, both [b, h, chunks * chunk_size] fp32 (Δ = 0 past the end)."""
    b, seqlen, nheads = dt.shape
    delta = torch.empty(b, nheads, nchunks * chunk_size, device=dt.device, dtype=torch.float32)
    cs = torch.empty_like(delta)
    bias = dt_bias if dt_bias is not None else A
    _cumsum_fwd[(b, nheads, nchunks)](dt, bias, A, delta, cs, seqlen, nheads, *dt.stride(),
                                      HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, Q=chunk_size)
    return delta, cs


def _states(x, B, delta, cs, initial_states, chunk_size):
    """States entering each chunk [b, c, h, p, n] in x's dtype (the products that read them run in it) and the
    final state [b, h, p, n] fp32."""
    b, seqlen, nheads, headdim, ngroups, dstate, nchunks, hpg, prec = _dims(x, B, chunk_size)
    states = torch.empty(b, nchunks, nheads, headdim, dstate, device=x.device, dtype=x.dtype)
    final = torch.empty(b, nheads, headdim, dstate, device=x.device, dtype=torch.float32)
    bp, bn = min(_STATE_BLOCK, _pow2(headdim)), min(_STATE_BLOCK, _pow2(dstate))
    init = initial_states.contiguous() if initial_states is not None else final
    grid = (b * nheads, triton.cdiv(headdim, bp), triton.cdiv(dstate, bn))
    _states_fwd[grid](x, B, delta, cs, init, states, final, seqlen, nheads, nchunks, hpg, *x.stride(),
                      *B.stride(), P=headdim, N=dstate, HAS_INIT=initial_states is not None, Q=chunk_size,
                      BP=bp, BN=bn, PREC=prec,
        **_launch("states"))
    return states, final


def _forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states):
    """(y, y before the z gate or None, final state, Δ, cs, states) of the forward pass."""
    b, seqlen, nheads, headdim, ngroups, dstate, nchunks, hpg, prec = _dims(x, B, chunk_size)
    delta, cs = _chunk_cumsum(dt, A, dt_bias, dt_softplus, nchunks, chunk_size)
    states, final = _states(x, B, delta, cs, initial_states, chunk_size)
    y = torch.empty(b, seqlen, nheads, headdim, device=x.device, dtype=x.dtype)
    y_pre = torch.empty_like(y) if z is not None else None
    bm = min(_BLOCK_M, chunk_size)
    bp = min(_STATE_BLOCK, _pow2(headdim))
    grid = (triton.cdiv(chunk_size, bm) * triton.cdiv(headdim, bp), b * nchunks, nheads)
    zz = z if z is not None else x
    _scan_fwd[grid](x, B, C, delta, cs, states, D if D is not None else A, zz, y,
                    y_pre if y_pre is not None else y, seqlen, nheads, nchunks, hpg, *x.stride(), *B.stride(),
                    *C.stride(), *zz.stride(), P=headdim, N=dstate, HAS_D=D is not None, HAS_Z=z is not None,
                    Q=chunk_size, BM=bm, BK=min(_BLOCK_K, chunk_size), BP=bp, BN=_pow2(dstate), PREC=prec,
        **_launch("scan"))
    return y, y_pre, final, delta, cs, states


def _backward_states(g, C, cs, states, final, dfinal, chunk_size):
    """(dS [b, c, h, p, n] in g's dtype, d initial state [b, h, p, n] fp32, the chunk-end d cs through the
    decayed entering state, exp(cs_end) dS.h_c [b, h, c] fp32)."""
    b, seqlen, nheads, headdim, ngroups, dstate, nchunks, hpg, prec = _dims(g, C, chunk_size)
    ds = torch.empty_like(states)
    dinit = torch.empty_like(final)  # fp32
    bp, bn = min(_STATE_BLOCK, _pow2(headdim)), min(_STATE_BLOCK, _pow2(dstate))
    grid = (b * nheads, triton.cdiv(headdim, bp), triton.cdiv(dstate, bn))
    dend = torch.empty(b, nheads, nchunks, grid[1] * grid[2], device=g.device, dtype=torch.float32)
    dfin = dfinal.contiguous() if dfinal is not None else final
    _dstates_bwd[grid](g, C, cs, states, dfin, ds, dinit, dend, seqlen, nheads, nchunks, hpg,
                       *g.stride(), *C.stride(), P=headdim, N=dstate, HAS_DFIN=dfinal is not None, Q=chunk_size,
                       BP=bp, BN=bn, PREC=prec,
        **_launch("dstates"))
    return ds, dinit, dend.sum(-1)


def _backward_inputs(x, B, C, g, delta, cs, states, ds, D, chunk_size):
    """(dx, dB fp32, dC fp32, direct dΔ, its chunk-state part and C.dC per head [b, h, L] fp32, dD partials or
    None)."""
    b, seqlen, nheads, headdim, ngroups, dstate, nchunks, hpg, prec = _dims(x, B, chunk_size)
    bm, bk = min(_BLOCK_M, chunk_size), min(_BLOCK_K, chunk_size)
    bp, bn = _pow2(headdim), _pow2(dstate)
    dx = torch.empty(b, seqlen, nheads, headdim, device=x.device, dtype=x.dtype)
    db = torch.empty(b, seqlen, ngroups, dstate, device=x.device, dtype=torch.float32)
    dc = torch.empty_like(db)
    ddt_direct, ddt_state, cdc = torch.empty_like(cs), torch.empty_like(cs), torch.empty_like(cs)
    nkb = triton.cdiv(chunk_size, bk)
    dd = torch.empty(b * nchunks * nkb, nheads, headdim, device=x.device, dtype=torch.float32) \
        if D is not None else None
    _dx_db_bwd[(nkb, b * nchunks, ngroups)](
        x, B, C, g, delta, cs, ds, D if D is not None else cs, dx, db, ddt_direct, ddt_state,
        dd if dd is not None else cs, seqlen, nheads, nchunks, hpg, *x.stride(), *B.stride(), *C.stride(),
        *g.stride(), P=headdim, N=dstate, HAS_D=D is not None, Q=chunk_size, BM=bm, BK=bk, BP=bp, BN=bn,
        PREC=prec,
        **_launch("dx_db"))
    _dc_bwd[(triton.cdiv(chunk_size, bm), b * nchunks, ngroups)](
        x, B, C, g, delta, cs, states, dc, cdc, seqlen, nheads, nchunks, hpg, *x.stride(), *B.stride(),
        *C.stride(), *g.stride(), P=headdim, N=dstate, Q=chunk_size, BM=bm, BK=bk, BP=bp, BN=bn, PREC=prec,
        **_launch("dc"))
    return dx, db, dc, ddt_direct, ddt_state, cdc, dd


def _backward_dt(dt, A, dt_bias, dt_softplus, delta, cdc, ddt_direct, ddt_state, dend, chunk_size):
    """(d dt [b, l, h] in dt's dtype, dA [h] fp32, d dt_bias [h] fp32 or None)."""
    b, seqlen, nheads = dt.shape
    nchunks = dend.shape[-1]
    ddt = torch.empty(b, seqlen, nheads, device=dt.device, dtype=dt.dtype)
    da = torch.empty(b, nheads, nchunks, device=dt.device, dtype=torch.float32)
    dbias = torch.empty_like(da)
    bias = dt_bias if dt_bias is not None else A
    _cumsum_bwd[(b, nheads, nchunks)](dt, bias, A, delta, cdc, ddt_direct, ddt_state, dend.contiguous(), ddt,
                                      da, dbias, seqlen, nheads, *dt.stride(), HAS_BIAS=dt_bias is not None,
                                      SOFTPLUS=dt_softplus, Q=chunk_size)
    return ddt, da.sum((0, 2)), dbias.sum((0, 2)) if dt_bias is not None else None


class _SSDChunkScan(torch.autograd.Function):
    """The SSD scan over the Triton kernels; the backward recomputes Δ, the cumsum and the states."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size, dt_softplus):
        d_full = None
        if D is not None:
            d_full = (D[:, None].expand(-1, x.shape[-1]) if D.dim() == 1 else D).float().contiguous()  # [h, p]
        y, y_pre, final, _, _, _ = _forward(x, dt, A, B, C, chunk_size, d_full, z, dt_bias, dt_softplus,
                                            initial_states)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, y_pre)
        ctx.chunk_size, ctx.dt_softplus = chunk_size, dt_softplus
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, z, dt_bias, initial_states, y_pre = ctx.saved_tensors
        q = ctx.chunk_size
        dz = None
        if z is not None:
            zf, dyf = z.float(), dy.float()
            sig = torch.sigmoid(zf)
            g = (dyf * zf * sig).to(x.dtype)
            dz = (dyf * y_pre.float() * sig * (1 + zf * (1 - sig))).to(z.dtype)
        else:
            g = dy
        nchunks = triton.cdiv(x.shape[1], q)
        delta, cs = _chunk_cumsum(dt, A, dt_bias, ctx.dt_softplus, nchunks, q)
        states, final = _states(x, B, delta, cs, initial_states, q)
        ds, dinit, dend = _backward_states(g, C, cs, states, final, dfinal, q)
        d_full = None
        if D is not None:
            d_full = (D[:, None].expand(-1, x.shape[-1]) if D.dim() == 1 else D).float().contiguous()  # [h, p]
        dx, db, dc, ddt_direct, ddt_state, cdc, dd = _backward_inputs(x, B, C, g, delta, cs, states, ds, d_full,
                                                                      q)
        ddt, da, dbias = _backward_dt(dt, A, dt_bias, ctx.dt_softplus, delta, cdc, ddt_direct, ddt_state, dend,
                                      q)
        dD = None
        if D is not None:
            dD = dd.sum(0)  # [h, p]
            dD = (dD.sum(-1) if D.dim() == 1 else dD).to(D.dtype)
        return (dx, ddt, da.to(A.dtype), db.to(B.dtype), dc.to(C.dtype), dD, dz,
                dbias.to(dt_bias.dtype) if dt_bias is not None else None,
                dinit.to(initial_states.dtype) if initial_states is not None else None, None, None)


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=True,
                   initial_states=None, return_final_states=False):
    """The chunked SSD scan on CUDA tensors by the Triton kernels (see `reference.ssd_chunk_scan`).

    x [b, l, h, p], dt [b, l, h], A [h], B and C [b, l, g, n], D [h] or [h, p], z [b, l, h, p], initial_states
    [b, h, p, n]; chunk_size a power of two >= 16. Returns y (dtype of x), and the final state (fp32) when
    asked. Differentiable in every tensor argument."""
    if not _HAVE_TRITON:
        raise ValueError("ssd_chunk_scan (Triton): triton is not installed; use the reference implementation")
    _check(x, dt, A, B, C, chunk_size, D, z, initial_states)
    A, dt_bias = A.contiguous(), dt_bias.contiguous() if dt_bias is not None else None  # read by head index
    y, final = _SSDChunkScan.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size, dt_softplus)
    return (y, final) if return_final_states else y
