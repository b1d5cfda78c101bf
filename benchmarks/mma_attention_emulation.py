# benchmarks/mma_attention_emulation.py: the index math of cuda_attention_mma.cu's kernels (the
# forward, and the backward's key and query kernels), lane by lane in numpy, with mma.m16n8k16's fragment layouts as the kernel's header states them,
# against plain causal attention (bf16 inputs and probabilities). A development aid for the kernel
# (it runs without a GPU; it checks the kernel's indexing, not the hardware): /usr/bin/python3 with
# numpy. Expected: output errors ~2e-3 (the probabilities rounded to bf16), lse ~1e-7, gradient
# errors ~2e-3 of each gradient's largest element (P and dS rounded to bf16), no NaN.
import numpy as np
rng = np.random.default_rng(0)
def bf(x):  # round to bf16 (nearest even) and back
    x = np.asarray(x, np.float32); u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)

def a_matrix(regs):  # regs[lane][4] of (lo, hi) pairs -> 16x16
    A = np.zeros((16, 16), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r, (row, col) in enumerate([(g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8)]):
            A[row, col], A[row, col+1] = regs[lane][r]
    return A
def b_matrix(b0, b1):  # per lane pairs -> 16x8
    B = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        B[2*t, g], B[2*t+1, g] = b0[lane]; B[2*t+8, g], B[2*t+9, g] = b1[lane]
    return B
def mma(c, a_regs, b0, b1):  # c[lane][4]
    C = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1] = c[lane]
    C = C + a_matrix(a_regs) @ b_matrix(b0, b1)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane] = [C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1]]

def kernel(q, k, v, D):  # one head; q, k, v [seq, D]
    seq = q.shape[0]; scale2 = (1/np.sqrt(D)) * 1.4426950408889634
    out = np.full((seq, D), np.nan, np.float32); lse = np.full(seq, np.nan, np.float32)
    tiles = (seq + 63) // 64
    for qt in range(tiles):
        for warp in range(4):
            lanes = range(32)
            row0 = [qt*64 + warp*16 + l//4 for l in lanes]; row1 = [r + 8 for r in row0]
            def pair(x, row, col): return (0.0, 0.0) if row >= seq else tuple(bf(x[row, col:col+2]))
            qa = [[[pair(q, row0[l], kk*16+2*(l%4)), pair(q, row1[l], kk*16+2*(l%4)),
                    pair(q, row0[l], kk*16+2*(l%4)+8), pair(q, row1[l], kk*16+2*(l%4)+8)] for l in lanes]
                  for kk in range(D//16)]
            o = [[[0.0]*4 for l in lanes] for n in range(D//8)]
            m0 = [-np.inf]*32; m1 = [-np.inf]*32; l0 = [0.0]*32; l1 = [0.0]*32
            for kt in range(qt+1):
                k0 = kt*64
                ks = np.zeros((64, D), np.float32); vt = np.zeros((D, 64), np.float32)
                n_live = max(0, min(64, seq - k0))
                ks[:n_live] = bf(k[k0:k0+n_live]); vt[:, :n_live] = bf(v[k0:k0+n_live]).T
                sc = [[[0.0]*4 for l in lanes] for n in range(8)]
                for n in range(8):
                    for kk in range(D//16):
                        b0 = [tuple(ks[n*8 + l//4, kk*16 + 2*(l%4): kk*16 + 2*(l%4) + 2]) for l in lanes]
                        b1 = [tuple(ks[n*8 + l//4, kk*16 + 2*(l%4) + 8: kk*16 + 2*(l%4) + 10]) for l in lanes]
                        mma(sc[n], qa[kk], b0, b1)
                mx0 = [-np.inf]*32; mx1 = [-np.inf]*32
                for l in lanes:
                    t = l % 4
                    for n in range(8):
                        for j in range(2):
                            key = k0 + n*8 + 2*t + j; live = key < seq
                            sc[n][l][j] = sc[n][l][j]*scale2 if live and key <= row0[l] else -np.inf
                            sc[n][l][2+j] = sc[n][l][2+j]*scale2 if live and key <= row1[l] else -np.inf
                            mx0[l] = max(mx0[l], sc[n][l][j]); mx1[l] = max(mx1[l], sc[n][l][2+j])
                quad = lambda x: [max(x[(l//4)*4 + i] for i in range(4)) for l in lanes]
                mx0, mx1 = quad(mx0), quad(mx1)
                for l in lanes:
                    new0, new1 = max(m0[l], mx0[l]), max(m1[l], mx1[l])
                    base0 = 0.0 if new0 == -np.inf else new0; base1 = 0.0 if new1 == -np.inf else new1
                    corr0, corr1 = 2.0**(m0[l]-base0), 2.0**(m1[l]-base1)
                    m0[l], m1[l] = new0, new1
                    s0 = s1 = 0.0
                    for n in range(8):
                        for j in range(2):
                            sc[n][l][j] = 2.0**(sc[n][l][j]-base0); sc[n][l][2+j] = 2.0**(sc[n][l][2+j]-base1)
                            s0 += sc[n][l][j]; s1 += sc[n][l][2+j]
                    l0[l] = l0[l]*corr0 + s0; l1[l] = l1[l]*corr1 + s1
                    for n in range(D//8):
                        o[n][l][0] *= corr0; o[n][l][1] *= corr0; o[n][l][2] *= corr1; o[n][l][3] *= corr1
                for j in range(4):
                    pa = [[tuple(bf(sc[2*j][l][0:2])), tuple(bf(sc[2*j][l][2:4])),
                           tuple(bf(sc[2*j+1][l][0:2])), tuple(bf(sc[2*j+1][l][2:4]))] for l in lanes]
                    for n in range(D//8):
                        b0 = [tuple(vt[n*8 + l//4, j*16 + 2*(l%4): j*16 + 2*(l%4) + 2]) for l in lanes]
                        b1 = [tuple(vt[n*8 + l//4, j*16 + 2*(l%4) + 8: j*16 + 2*(l%4) + 10]) for l in lanes]
                        mma(o[n], pa, b0, b1)
            qs = lambda x: [sum(x[(l//4)*4 + i] for i in range(4)) for l in lanes]
            l0, l1 = qs(l0), qs(l1)
            for l in lanes:
                t = l % 4
                for (row, ll, m, hi) in ((row0[l], l0[l], m0[l], 0), (row1[l], l1[l], m1[l], 2)):
                    if row < seq:
                        for n in range(D//8):
                            out[row, n*8+2*t: n*8+2*t+2] = [o[n][l][hi] / ll, o[n][l][hi+1] / ll]
                        if t == 0: lse[row] = (m + np.log2(ll)) * np.log(2)
    return out, lse

for seq, D in ((100, 64), (3, 64), (70, 128)):
    q, k, v = (rng.standard_normal((seq, D)).astype(np.float32) for _ in range(3))
    out, lse = kernel(q, k, v, D)
    qr, kr, vr = bf(q).astype(np.float64), bf(k).astype(np.float64), bf(v).astype(np.float64)
    s = qr @ kr.T / np.sqrt(D); s[np.triu(np.ones((seq, seq), bool), 1)] = -np.inf
    ref_lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    ref = np.exp(s - ref_lse[:, None]) @ vr
    print(seq, D, "out max err", np.abs(out - ref).max(), "lse max err", np.abs(lse - ref_lse).max(),
          "nan", np.isnan(out).sum())


# ---- the backward kernels (MmaBackwardKeyKernel, MmaBackwardQueryKernel), one head ----------------
def a_from_rows(tile, r0, col0):  # A fragment of rows r0..r0+15, cols col0..col0+15 of a tile
    return [[tuple(tile[r0 + l//4, col0 + 2*(l%4): col0 + 2*(l%4) + 2]),
             tuple(tile[r0 + l//4 + 8, col0 + 2*(l%4): col0 + 2*(l%4) + 2]),
             tuple(tile[r0 + l//4, col0 + 2*(l%4) + 8: col0 + 2*(l%4) + 10]),
             tuple(tile[r0 + l//4 + 8, col0 + 2*(l%4) + 8: col0 + 2*(l%4) + 10])] for l in range(32)]
def b_from(tile, n, col0):  # B fragment: rows n*8+g of `tile` (row-major), cols col0 + 2t (+8)
    return ([tuple(tile[n*8 + l//4, col0 + 2*(l%4): col0 + 2*(l%4) + 2]) for l in range(32)],
            [tuple(tile[n*8 + l//4, col0 + 2*(l%4) + 8: col0 + 2*(l%4) + 10]) for l in range(32)])
def a_from_acc(acc, j):  # accumulators 2j, 2j+1 as an A fragment, rounded
    return [[tuple(bf(acc[2*j][l][0:2])), tuple(bf(acc[2*j][l][2:4])),
             tuple(bf(acc[2*j+1][l][0:2])), tuple(bf(acc[2*j+1][l][2:4]))] for l in range(32)]
def stage(x, first, seq, D):
    t = np.zeros((64, D), np.float32); n = max(0, min(64, seq - first))
    t[:n] = bf(x[first:first+n]); return t

def backward(q, k, v, out, lse, dout, D):
    seq = q.shape[0]; scale = 1/np.sqrt(D); scale2 = scale * 1.4426950408889634
    delta = (out * bf(dout)).sum(1).astype(np.float32)
    dq = np.full((seq, D), np.nan, np.float32); dk = dq.copy(); dv = dq.copy()
    tiles = (seq + 63) // 64
    for kt in range(tiles):  # keys kernel
        k0 = kt*64; ks = stage(k, k0, seq, D); vs = stage(v, k0, seq, D)
        for warp in range(4):
            dk_acc = [[[0.0]*4 for _ in range(32)] for _ in range(D//8)]; dv_acc = [[[0.0]*4 for _ in range(32)] for _ in range(D//8)]
            for qt in range(kt, tiles):
                q0 = qt*64; qs = stage(q, q0, seq, D); dos = stage(dout, q0, seq, D)
                qts, dots = qs.T.copy(), dos.T.copy()
                lse_s = [lse[q0+i]*1.4426950408889634 if q0+i < seq else 0.0 for i in range(64)]
                delta_s = [delta[q0+i] if q0+i < seq else 0.0 for i in range(64)]
                st = [[[0.0]*4 for _ in range(32)] for _ in range(8)]; dpt = [[[0.0]*4 for _ in range(32)] for _ in range(8)]
                for kk in range(D//16):
                    ka = a_from_rows(ks, warp*16, kk*16); va = a_from_rows(vs, warp*16, kk*16)
                    for n in range(8):
                        mma(st[n], ka, *b_from(qs, n, kk*16)); mma(dpt[n], va, *b_from(dos, n, kk*16))
                for l in range(32):
                    g, t = l//4, l % 4; key0 = k0 + warp*16 + g; key1 = key0 + 8
                    for n in range(8):
                        for j in range(2):
                            qi = n*8 + 2*t + j; query = q0 + qi; live = query < seq
                            p0 = 2.0**(st[n][l][j]*scale2 - lse_s[qi]) if live and key0 <= query else 0.0
                            p1 = 2.0**(st[n][l][2+j]*scale2 - lse_s[qi]) if live and key1 <= query else 0.0
                            dpt[n][l][j] = p0*(dpt[n][l][j] - delta_s[qi]); dpt[n][l][2+j] = p1*(dpt[n][l][2+j] - delta_s[qi])
                            st[n][l][j] = p0; st[n][l][2+j] = p1
                for jq in range(4):
                    pa, da = a_from_acc(st, jq), a_from_acc(dpt, jq)
                    for n in range(D//8):
                        mma(dv_acc[n], pa, *b_from(dots, n, jq*16)); mma(dk_acc[n], da, *b_from(qts, n, jq*16))
            for l in range(32):
                g, t = l//4, l % 4
                for key, hi in ((k0 + warp*16 + g, 0), (k0 + warp*16 + g + 8, 2)):
                    if key < seq:
                        for n in range(D//8):
                            dk[key, n*8+2*t: n*8+2*t+2] = [dk_acc[n][l][hi]*scale, dk_acc[n][l][hi+1]*scale]
                            dv[key, n*8+2*t: n*8+2*t+2] = [dv_acc[n][l][hi], dv_acc[n][l][hi+1]]
    for qt in range(tiles):  # queries kernel
        for warp in range(4):
            rows = [qt*64 + warp*16 + l//4 for l in range(32)]
            qpad = np.zeros((max(seq, (qt + 1)*64) + 16, D), np.float32); qpad[:seq] = bf(q)
            dpad = np.zeros_like(qpad); dpad[:seq] = bf(dout)
            qa = [a_from_rows(qpad, qt*64 + warp*16, kk*16) for kk in range(D//16)]
            da = [a_from_rows(dpad, qt*64 + warp*16, kk*16) for kk in range(D//16)]
            dq_acc = [[[0.0]*4 for _ in range(32)] for _ in range(D//8)]
            for kt in range(qt+1):
                k0 = kt*64; ks = stage(k, k0, seq, D); vs = stage(v, k0, seq, D); kts = ks.T.copy()
                sc = [[[0.0]*4 for _ in range(32)] for _ in range(8)]; dp = [[[0.0]*4 for _ in range(32)] for _ in range(8)]
                for n in range(8):
                    for kk in range(D//16):
                        mma(sc[n], qa[kk], *b_from(ks, n, kk*16)); mma(dp[n], da[kk], *b_from(vs, n, kk*16))
                for l in range(32):
                    t = l % 4
                    for n in range(8):
                        for j in range(2):
                            key = k0 + n*8 + 2*t + j
                            for r, e in ((rows[l], j), (rows[l] + 8, 2 + j)):
                                p = 2.0**(sc[n][l][e]*scale2 - lse[r]*1.4426950408889634) if r < seq and key <= r else 0.0
                                sc[n][l][e] = p*(dp[n][l][e] - (delta[r] if r < seq else 0.0))
                for jk in range(4):
                    dsa = a_from_acc(sc, jk)
                    for n in range(D//8):
                        mma(dq_acc[n], dsa, *b_from(kts, n, jk*16))
            for l in range(32):
                t = l % 4
                for r, hi in ((rows[l], 0), (rows[l] + 8, 2)):
                    if r < seq:
                        for n in range(D//8):
                            dq[r, n*8+2*t: n*8+2*t+2] = [dq_acc[n][l][hi]*scale, dq_acc[n][l][hi+1]*scale]
    return dq, dk, dv

for seq, D in ((100, 64), (3, 64), (70, 128)):
    q, k, v, dout = (rng.standard_normal((seq, D)).astype(np.float32) for _ in range(4))
    qr, kr, vr, dr = (bf(x).astype(np.float64) for x in (q, k, v, dout))
    s = qr @ kr.T / np.sqrt(D); s[np.triu(np.ones((seq, seq), bool), 1)] = -np.inf
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    P = np.exp(s - lse[:, None]); out = P @ vr
    dP = dr @ vr.T; dS = P * (dP - (dP * P).sum(1, keepdims=True))
    ref = (dS @ kr / np.sqrt(D), dS.T @ qr / np.sqrt(D), P.T @ dr)
    got = backward(q, k, v, out.astype(np.float32), lse.astype(np.float32), dout, D)
    print(seq, D, "backward max err / max |ref|:",
          " ".join(f"{n} {np.abs(g - r).max() / np.abs(r).max():.2e}" for n, g, r in zip(("dq", "dk", "dv"), got, ref)),
          "nan", sum(int(np.isnan(g).sum()) for g in got))
