"""Plain NumPy reference implementations of the numba kernels (independent, vectorised code)."""

import numpy as np
from scipy.special import logsumexp


def edge_normal_flux(velocity, normals, weights):
    return weights * np.einsum("ekd,ekd->ek", velocity, normals)


def cell_flow_rates(un, cell_edges, cell_edge_sign, inv_area):
    flows = cell_edge_sign[:, :, None] * un[cell_edges]  # (ncell, 4, nq), + = leaving the cell
    outflow = np.clip(flows, 0, None).sum(axis=(1, 2)) * inv_area
    divergence = flows.sum(axis=(1, 2)) * inv_area
    return outflow, divergence


def limited_gradients(f, neighbours, lsq_coef, cell_edges, edge_points, centroids, bounded):
    fn = f[neighbours]
    g = np.einsum("cjd,cj->cd", lsq_coef, fn - f[:, None])
    fmin = np.minimum(fn.min(axis=1), f)
    fmax = np.maximum(fn.max(axis=1), f)
    disp = edge_points[cell_edges] - centroids[:, None, None, :]  # (ncell, 4, nq, 3)
    delta = np.einsum("cjkd,cd->cjk", disp, g).reshape(len(f), -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        pos = np.where(np.abs(delta) > f[:, None], f[:, None] / np.abs(delta), 1.0)
        up = np.where((delta > 0) & (f[:, None] + delta > fmax[:, None]), (fmax - f)[:, None] / delta, 1.0)
        lo = np.where((delta < 0) & (f[:, None] + delta < fmin[:, None]), (fmin - f)[:, None] / delta, 1.0)
    phi = pos.min(axis=1)
    bj = np.minimum(up, lo).min(axis=1)
    phi = np.where(bounded, np.minimum(phi, bj), phi)
    phi = np.clip(phi, 0.0, 1.0)
    return phi[:, None] * g


def upwind_edge_fluxes(f, un, edge_cells):
    fp = f[edge_cells[:, 0]][:, None]
    fq = f[edge_cells[:, 1]][:, None]
    return np.sum(un * np.where(un > 0, fp, fq), axis=1)


def muscl_edge_fluxes(f, grad, un, edge_cells, edge_points, centroids):
    def edge_values(c):
        disp = edge_points - centroids[c][:, None, :]
        return f[c][:, None] + np.einsum("ekd,ed->ek", disp, grad[c])

    vp = edge_values(edge_cells[:, 0])
    vq = edge_values(edge_cells[:, 1])
    return np.sum(un * np.where(un > 0, vp, vq), axis=1)


def log_limited_gradients(f, neighbours, lsq_coef, cell_edges, edge_points, centroids, qpoints, qweights,
                          bounded, log_ratio):
    """(grad, log_shift) of the reconstruction in g = log f (vectorised; halving loop per cell as
    the kernel's)."""
    positive = f > 0
    g = np.log(np.where(positive, f, 1.0))
    gn = g[neighbours]
    ok = positive[neighbours]
    grad = np.einsum("cjd,cj->cd", lsq_coef, np.where(ok, gn - g[:, None], 0.0))
    gmin = np.minimum(np.where(ok, gn, np.inf).min(axis=1), g)
    gmax = np.maximum(np.where(ok, gn, -np.inf).max(axis=1), g)
    disp = edge_points[cell_edges] - centroids[:, None, None, :]
    delta = np.einsum("cjkd,cd->cjk", disp, grad).reshape(len(f), -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        pos = np.where(delta > log_ratio, log_ratio / delta, 1.0)
        up = np.where((delta > 0) & (g[:, None] + delta > gmax[:, None]), (gmax - g)[:, None] / delta, 1.0)
        lo = np.where((delta < 0) & (g[:, None] + delta < gmin[:, None]), (gmin - g)[:, None] / delta, 1.0)
    phi = pos.min(axis=1)
    phi = np.where(bounded, np.minimum(phi, np.minimum(up, lo).min(axis=1)), phi)
    phi = np.clip(phi, 0.0, 1.0)
    top = np.clip(delta.max(axis=1), 0.0, None)
    qdisp = qpoints - centroids[:, None, :]

    def shift_of(phi):
        return np.log(np.exp(phi[:, None] * np.einsum("cqd,cd->cq", qdisp, grad)) @ qweights)

    shift = shift_of(phi)
    for _ in range(60):
        over = phi * top - shift > log_ratio
        if not over.any():
            break
        phi = np.where(over, 0.5 * phi, phi)
        shift = shift_of(phi)
    grad = np.where(positive[:, None], phi[:, None] * grad, 0.0)
    return grad, np.where(positive, g - shift, -np.inf)


def log_muscl_edge_fluxes(f, grad, log_shift, un, edge_cells, edge_points, centroids):
    def edge_values(c):
        disp = edge_points - centroids[c][:, None, :]
        with np.errstate(invalid="ignore"):
            value = np.exp(log_shift[c][:, None] + np.einsum("ekd,ed->ek", disp, grad[c]))
        return np.where(f[c][:, None] > 0, value, f[c][:, None])

    return np.sum(un * np.where(un > 0, edge_values(edge_cells[:, 0]), edge_values(edge_cells[:, 1])), axis=1)


def polynomial_interpolate(values, stencil, fits, e1, e2, centroids, cells, points, degree=2, limited=False):
    """The local polynomial fit of the stencil's values of each point's cell, evaluated at it
    (limited: clipped to the range of the stencil's values)."""
    c = centroids[cells]
    d = np.sum(points * c, axis=1)
    u = np.sum(points * e1[cells], axis=1) / d
    v = np.sum(points * e2[cells], axis=1) / d
    terms = [np.ones_like(u), u, v, u * u, u * v, v * v, u ** 3, u * u * v, u * v * v, v ** 3]
    basis = np.stack(terms[:(degree + 1) * (degree + 2) // 2], axis=1)
    local = np.where(stencil[cells] >= 0, values[np.maximum(stencil[cells], 0)], 0.0)
    out = np.einsum("nk,nkj,nj->n", basis, fits[cells], local)
    if limited:
        present = np.where(stencil[cells] >= 0, values[np.maximum(stencil[cells], 0)], values[cells][:, None])
        out = np.clip(out, present.min(axis=1), present.max(axis=1))
    return out


def flux_divergence(flux, edge_cells, inv_area, ncell):
    """Scatter form (np.add.at), unlike the gather form of the kernel."""
    out = np.zeros(ncell)
    np.add.at(out, edge_cells[:, 0], -flux)
    np.add.at(out, edge_cells[:, 1], flux)
    return out * inv_area


def hardmax_field(targets, B, sources, weights, V):
    """β = ∞ token rule: m(x) = y_j*, j* = argmax over positive-weight sources of ⟨Bᵀx, y_j⟩."""
    scores = (targets @ B) @ sources.T  # ⟨Bᵀx, y⟩ = xᵀBy
    scores[:, np.asarray(weights) <= 0] = -np.inf
    m = sources[np.argmax(scores, axis=1)]
    u = m @ V.T
    return u - np.sum(u * targets, axis=1, keepdims=True) * targets


def unresolved_peaks(f, neighbours, centroids, divergence, area, tie=1e-12):
    """spherepde.solvers.atoms.unresolved_peaks with sets: (width σ/h, excess mass, centre, floor, patch
    as a set of cells) per cell, width inf and mass 0 off the representatives."""
    npix = f.size
    idx = np.arange(npix)
    maximal = ~(f[neighbours] > f[:, None] * (1 + tie)).any(axis=1)
    tied = (neighbours != idx[:, None]) & (f[neighbours] >= f[:, None] * (1 - tie))
    width = np.full(npix, np.inf)
    mass = np.zeros(npix)
    centre = np.zeros((npix, 3))
    floor = np.zeros(npix)
    patches = [set() for _ in range(npix)]
    for c in np.flatnonzero((f > 0) & (divergence < 0) & maximal):
        group = {c} | set(neighbours[c][tied[c]].tolist())
        if any(q < c and maximal[q] for q in group):
            continue
        ring1 = set(neighbours[list(group)].ravel().tolist()) | group
        ring2 = set(neighbours[list(ring1)].ravel().tolist()) | ring1
        outer = np.array(sorted(ring2 - ring1), dtype=int)
        patch = np.array(sorted(ring2), dtype=int)
        bg = f[outer].min() if outer.size else 0.0
        e = np.clip(f[patch] - bg, 0, None) * area
        if not e.sum() > 0:
            continue
        mean = e @ centroids[patch] / e.sum()
        var = e @ np.sum((centroids[patch] - mean) ** 2, axis=1) / e.sum()
        width[c] = np.sqrt(var / area)
        mass[c] = e.sum()
        centre[c] = mean / np.linalg.norm(mean)
        floor[c] = bg
        patches[c] = set(patch.tolist())
    return width, mass, centre, floor, patches


def log_partition(targets, B, beta, sources, masses, block=64):
    """log Z(x) = ln Σ_j μ_j e^{β⟨Bᵀx, y_j⟩} by a plain log-sum-exp in long double (x87 80-bit
    where numpy has it: 11 more bits than the kernels' float64), blocked over targets."""
    ld = np.longdouble
    masses = np.asarray(masses, dtype=float)
    keep = masses > 0
    y = np.asarray(sources, dtype=ld)[keep]
    log_mu = np.log(masses[keep].astype(ld))
    a = np.asarray(targets, dtype=ld) @ np.asarray(B, dtype=ld) * ld(beta)  # rows (Bᵀx)ᵀ·β
    out = np.empty(len(a), dtype=ld)
    for i0 in range(0, len(a), block):
        e = a[i0:i0 + block] @ y.T + log_mu
        top = e.max(axis=1, keepdims=True)
        out[i0:i0 + block] = top[:, 0] + np.log(np.exp(e - top).sum(axis=1))
    return out


def unnormalised_field(targets, B, V, beta, sources, masses, log_scale=0.0):
    """Unnormalised attention straight from its definition, in long double: n(x) = Σ_j μ_j
    e^{β⟨Bᵀx, y_j⟩ − c} y_j, S(x) = Σ_j μ_j e^{β⟨Bᵀx, y_j⟩ − c} y_j y_jᵀ (c = log_scale),
    v = P_x(V n), div_S v = β tr(P_x V S Bᵀ) − 2⟨x, V n⟩ (∂n/∂x = β S Bᵀ). Returns float64
    (v (T, 3), div (T,)). O(T·N) memory: small cases only."""
    ld = np.longdouble
    x = np.asarray(targets, dtype=ld)
    y = np.asarray(sources, dtype=ld)
    mu = np.asarray(masses, dtype=ld)
    Bl, Vl = np.asarray(B, dtype=ld), np.asarray(V, dtype=ld)
    w = mu * np.exp(ld(beta) * (x @ Bl) @ y.T - ld(log_scale))  # (T, N)
    n = w @ y
    S = np.einsum("tj,ja,jb->tab", w, y, y)
    u = n @ Vl.T
    xu = np.sum(x * u, axis=1)
    v = u - xu[:, None] * x
    P = np.eye(3, dtype=ld)[None] - x[:, :, None] * x[:, None, :]
    K = np.einsum("ab,tbc,dc->tad", Vl, S, Bl)  # V S Bᵀ
    div = ld(beta) * np.einsum("tab,tba->t", P, K) - 2 * xu
    return v.astype(float), div.astype(float)


def graph_laplacian(f, neighbours, rates):
    """(L f)_c = Σ_j q_cj (f_j − f_c), vectorised gather."""
    return np.sum(rates * (f[neighbours] - f[:, None]), axis=1)


def uniformization(f, neighbours, rates, poisson):
    """Σ_k poisson[k] P^k f with P = I + L/Λ, Λ = max row sum, applied as g + L g / Λ."""
    rate = rates.sum(axis=1).max()
    out = poisson[0] * f
    g = f.copy()
    for p in poisson[1:]:
        g = g + graph_laplacian(g, neighbours, rates) / rate
        out = out + p * g
    return out


def rotation_noise_step(x, s, xi):
    """exp_x(s P_x ξ) as a rotation (Rodrigues) of x about the axis x × η by the angle s|η|."""
    eta = xi - np.sum(xi * x, axis=1, keepdims=True) * x
    r = np.linalg.norm(eta, axis=1, keepdims=True)
    axis = np.cross(x, eta) / np.where(r > 0, r, 1.0)
    angle = s * r
    # Rodrigues: x cos θ + (k × x) sin θ + k (k·x)(1 − cos θ), with k ⊥ x
    return x * np.cos(angle) + np.cross(axis, x) * np.sin(angle)


def softmax_moments(targets, B, beta, sources, masses):
    """(m_β (T, 3), log Z (T,)) of Σ_j μ_j δ_{y_j} by a plain log-sum-exp in long double
    (the split sums' reference: rest and points summed in one)."""
    ld = np.longdouble
    masses = np.asarray(masses, dtype=float)
    keep = masses > 0
    y = np.asarray(sources, dtype=ld)[keep]
    e = (np.asarray(targets, dtype=ld) @ np.asarray(B, dtype=ld) * ld(beta)) @ y.T + np.log(masses[keep].astype(ld))
    top = e.max(axis=1, keepdims=True)
    w = np.exp(e - top)
    z = w.sum(axis=1)
    return ((w @ y) / z[:, None]).astype(float), (top[:, 0] + np.log(z)).astype(float)


def clustered_softmax(targets, B, beta, V, centres, log_mass, second, third):
    """(v (T, 3), m (T, 3), log Z (T,)) of grouped sources, each group the term M e^{⟨a, c⟩}P,
    P = 1 + ½aᵀSa + ⅙T(a, a, a), with first moment M e^{⟨a, c⟩}(P c + Sa + ½T(a, a, ·)), a = βBᵀx;
    S and T rebuilt as full symmetric tensors from their components."""
    a = beta * np.asarray(targets) @ np.asarray(B)  # rows aᵢ = βBᵀxᵢ
    s = np.asarray(second)
    S = np.zeros((s.shape[0], 3, 3))
    for (k, l), col in zip([(0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2)], s.T):
        S[:, k, l] = S[:, l, k] = col
    T = np.zeros((s.shape[0], 3, 3, 3))
    names = ("xxx", "yyy", "zzz", "xxy", "xxz", "xyy", "yyz", "xzz", "yzz", "xyz")
    for name, col in zip(names, np.asarray(third).T):
        idx = ["xyz".index(c) for c in name]
        for perm in {(idx[0], idx[1], idx[2]), (idx[0], idx[2], idx[1]), (idx[1], idx[0], idx[2]),
                     (idx[1], idx[2], idx[0]), (idx[2], idx[0], idx[1]), (idx[2], idx[1], idx[0])}:
            T[(slice(None),) + perm] = col
    Sa = np.einsum("gkl,tl->tgk", S, a)  # (T, G, 3)
    Taa = np.einsum("gijk,ti,tj->tgk", T, a, a)
    P = 1.0 + 0.5 * np.einsum("tk,tgk->tg", a, Sa) + np.einsum("tk,tgk->tg", a, Taa) / 6.0
    e = a @ np.asarray(centres).T + np.asarray(log_mass)[None, :]
    top = e.max(axis=1, keepdims=True)
    w = np.exp(e - top)
    z = np.sum(w * P, axis=1)
    m = (np.einsum("tg,gk->tk", w * P, centres) + np.einsum("tg,tgk->tk", w, Sa + 0.5 * Taa)) / z[:, None]
    u = m @ np.asarray(V).T
    v = u - np.sum(targets * u, axis=1, keepdims=True) * targets
    return v, m, top[:, 0] + np.log(z)


def random_points(n, seed):
    x = np.random.default_rng(seed).normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def reference_field(model, sources, masses, x):
    """NumPy logsumexp reference (forms T × N arrays: small sizes only)."""
    logits = model.beta * (x @ model.B) @ sources.T + np.log(masses)[None, :]
    w = np.exp(logits - logsumexp(logits, axis=1, keepdims=True))
    m = w @ sources
    second = np.einsum("tn,ni,nj->tij", w, sources, sources)
    C = second - np.einsum("ti,tj->tij", m, m)
    u = m @ model.V.T
    v = u - np.sum(u * x, axis=1, keepdims=True) * x
    K = np.einsum("ij,tjk,lk->til", model.V, C, model.B)  # V C Bᵀ
    tr = np.einsum("tii->t", K) - np.einsum("ti,tij,tj->t", x, K, x)
    div = model.beta * tr - 2 * np.sum(x * u, axis=1)
    return v, div, m


def batched_softmax(x, masses, B, V, beta):
    """Tokens of M systems x (M, n, d), each attending to its own system with masses (n,):
    (v = P_x(V m_β) (M, n, d), log Z (M, n)) by a plain log-sum-exp in long double."""
    ld = np.longdouble
    v = np.empty(x.shape)
    logz = np.empty(x.shape[:2])
    masses = np.asarray(masses, dtype=float)
    keep = masses > 0
    for k in range(x.shape[0]):
        xk = np.asarray(x[k], dtype=ld)
        e = ld(beta) * (xk @ np.asarray(B, dtype=ld)) @ xk[keep].T + np.log(masses[keep].astype(ld))
        top = e.max(axis=1, keepdims=True)
        w = np.exp(e - top)
        z = w.sum(axis=1)
        m = (w @ xk[keep]) / z[:, None]
        u = m @ np.asarray(V, dtype=ld).T
        v[k] = (u - np.sum(xk * u, axis=1)[:, None] * xk).astype(float)
        logz[k] = (top[:, 0] + np.log(z)).astype(float)
    return v, logz


def batched_hardmax(x, masses, B, V):
    """β = ∞ tokens of M systems: m(x) = the token of largest ⟨Bᵀx, y⟩ among those with mass."""
    v = np.empty(x.shape)
    for k in range(x.shape[0]):
        v[k] = hardmax_field(x[k], B, x[k], masses, V)
    return v


def threshold_components(x, threshold):
    """(counts (M,), labels (M, n)): connected components of the thresholded Gram matrix
    ⟨x_i, x_j⟩ ≥ threshold (scipy.sparse.csgraph; n × n: small n only), labelled by the smallest
    index in each component."""
    from scipy.sparse.csgraph import connected_components

    counts, labels = [], []
    for xk in x:
        count, lab = connected_components(xk @ xk.T >= threshold, directed=False)
        first = {c: np.flatnonzero(lab == c)[0] for c in range(count)}
        counts.append(count)
        labels.append(np.array([first[c] for c in lab]))
    return np.array(counts), np.array(labels)


def clustered_pair_counts(x, threshold):
    """(M,): per system the number of pairs i < j with ⟨x_i, x_j⟩ ≥ threshold, from the Gram
    matrix (n × n: small n only)."""
    gram = np.einsum("kid,kjd->kij", x, x)
    upper = np.triu(np.ones(gram.shape[1:], dtype=bool), k=1)
    return np.sum((gram >= threshold) & upper, axis=(1, 2))
