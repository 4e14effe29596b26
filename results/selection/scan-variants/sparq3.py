import sys, torch, os
from dual_cache.retrieval import group_attention_mass
B, n_sink, window, GRP = 256, 4, 64, 64
LZMODE = os.environ.get("LZ", "tok")
def maxlogp(l):
    if LZMODE == "tok": src = l[..., ::16]
    else:
        n = l.shape[-1] // 64 * 64
        src = l[..., :n].unflatten(-1, (-1, 64))[..., ::16, :].flatten(-2)
    lz = torch.logsumexp(src, -1, keepdim=True)
    return (l - lz).amax(-2)
res = {}
PHI = eval(os.environ.get("PHI", "(0.375, 0.5)"))
for f in sys.argv[1].split(","):
    rec = torch.load(f)
    for layer, (queries, keys, scaling) in sorted(rec.items()):
        if layer < 2: continue
        queries, keys = queries.float(), keys.float()
        k = keys[0]; H, n, D = k.shape; G = queries.shape[1] // H
        m = n // GRP * GRP
        x = k[:, :m].reshape(H, m // GRP, GRP, D)
        lo = x.amin(2); hi = x.amax(2); s = (hi - lo) / 3
        codes = torch.round((x - lo[:, :, None]) / s.clamp_min(1e-8)[:, :, None]).clamp(0, 3)
        deq = (codes * s[:, :, None] + lo[:, :, None]).reshape(H, m, D)
        mid = (lo + 1.5 * s)[:, :, None].expand(H, m // GRP, GRP, D).reshape(H, m, D)
        deq = torch.cat([deq, k[:, m:]], 1); mid = torch.cat([mid, k[:, m:]], 1)
        mstep = s.mean(1)
        for j in range(queries.shape[2]):
            hi_ = n - queries.shape[2] + j - window
            q = queries[:, :, j]
            mask = (torch.arange(hi_)[None, :] >= n_sink)
            mass = group_attention_mass(q, keys[:, :, :hi_], mask, scaling)
            best = torch.topk(mass, B, -1).values.sum(-1)
            qg = q.view(H, G, D)
            def rec_(name, cand):
                sel = torch.topk(torch.gather(mass[0], 1, cand), B, -1).values.sum(-1)
                res.setdefault(name, []).append(sel / best[0])
            imp = (qg.abs().sum(1) * mstep).view(H, D // 4, 4).sum(-1)
            order = torch.sort(imp, -1, descending=True)
            for phi in PHI:
                nq = max(1, round(phi * D / 4))
                if os.environ.get("PERGROUP"):
                    impg = (qg.abs().sum(1)[:, None, :] * s).view(H, -1, D // 4, 4).sum(-1)  # (H, ng, quads)
                    sel = torch.zeros_like(impg, dtype=torch.bool)
                    sel.scatter_(2, torch.topk(impg, nq, -1).indices, True)
                    selc = sel.repeat_interleave(4, -1)[:, :, None].expand(H, m // GRP, GRP, D).reshape(H, m, D)
                    selc = torch.cat([selc, torch.ones(H, n - m, D, dtype=torch.bool)], 1)[:, :hi_]
                    dq = deq[:, :hi_]; md = mid[:, :hi_]
                    comb = torch.where(selc, dq, md)
                    l = torch.einsum("hgd,hnd->hgn", qg, comb) * scaling
                    l[..., :n_sink] = -float("inf")
                    ps = maxlogp(l)
                    for fa in (3, 4, 6):
                        rec_(f"phi {phi} pergroup f{fa}", torch.topk(ps, fa * B, -1).indices)
                    continue
                chmask = torch.zeros(H, D // 4, dtype=torch.bool); chmask.scatter_(1, order.indices[:, :nq], True)
                chmask = chmask.repeat_interleave(4, 1)[:, None]
                part = torch.einsum("hgd,hnd->hgn", qg * chmask, deq[:, :hi_]) * scaling
                off = torch.einsum("hgd,hnd->hgn", qg * ~chmask, mid[:, :hi_]) * scaling
                for tag, l in ((" +mid", part + off),):
                    l[..., :n_sink] = -float("inf")
                    ps = maxlogp(l)
                    for fa in (3, 4, 6):
                        rec_(f"phi {phi}{tag} f{fa}", torch.topk(ps, fa * B, -1).indices)
    print("done", f, flush=True)
for name, v in res.items():
    r = torch.cat(v); print(f"{name:36s} {r.mean():.4f}/{r.quantile(0.1):.4f}")
