# benchmarks/mma_attention_emulation.py: the index math of cuda_attention_mma.cu's forward kernel,
# lane by lane in numpy, with mma.m16n8k16's fragment layouts as the kernel's header states them,
# against plain causal attention (bf16 inputs and probabilities). A development aid for the kernel
# (it runs without a GPU; it checks the kernel's indexing, not the hardware): /usr/bin/python3 with
# numpy. Expected: output errors ~2e-3 (the probabilities rounded to bf16), lse ~1e-7, no NaN.
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
