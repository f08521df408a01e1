"""rlctl/algos/losses.py against references written here from the papers' formulas, in plain floats."""

from __future__ import annotations

import math

import pytest
import torch

from rlctl.algos import losses
from rlctl.algos.objective import SUM_KEYS, Objective
from rlctl.recipe import AlgoConfig
from rlctl.recipe.choices import KlEstimator, LossAgg

F64 = torch.float64


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def approx(x):
    return pytest.approx(x, abs=1e-6)


def assert_rows(t: torch.Tensor, rows) -> None:
    """A [B, T] tensor equal to nested lists, to 1e-6."""
    assert len(t) == len(rows)
    for got, want in zip(t.tolist(), rows):
        assert got == approx(want)


# --- references, from the papers, on plain floats ---------------------------------------------

def ref_ppo_token(r: float, a: float, eps_low: float, eps_high: float, c: float = 0.0) -> tuple[float, bool, bool]:
    """PPO / DAPO / dual-clip loss of one token: (loss, clip binds, dual clip binds)."""
    unclipped = -a * r
    clipped = -a * min(max(r, 1.0 - eps_low), 1.0 + eps_high)
    loss = max(unclipped, clipped)
    dual = bool(c) and a < 0 and -c * a < loss
    if dual:
        loss = -c * a
    return loss, clipped > unclipped and not dual, dual


def ref_policy(ratios, advs, mask, eps_low, eps_high, c=0.0, isw=None):
    """Summed loss over the mask, and the stats, by loops over the tokens."""
    total, clip, dual, tokens, kl = 0.0, 0, 0, 0, 0.0
    for i, row in enumerate(ratios):
        for j, r in enumerate(row):
            if not mask[i][j]:
                continue
            a = advs[i][j] if isinstance(advs[i], list) else advs[i]
            loss, cb, db = ref_ppo_token(r, a, eps_low, eps_high, c)
            total += loss * (isw[i][j] if isw else 1.0)
            clip, dual, tokens = clip + cb, dual + db, tokens + 1
            kl += (r - 1.0) - math.log(r)
    return total, {"clip_tokens": clip, "dual_clip_tokens": dual, "tokens": tokens, "approx_kl": kl}


def policy_inputs(ratios):
    """old log-probs fixed, new log-probs = old + log r, so exp(new - old) = r."""
    old = [[-1.0 - 0.1 * j - 0.3 * i for j in range(len(row))] for i, row in enumerate(ratios)]
    new = [[o + math.log(r) for o, r in zip(orow, rrow)] for orow, rrow in zip(old, ratios)]
    return t64(new), t64(old)


def check_policy(ratios, advs, mask, eps_low, eps_high, c=0.0):
    new, old = policy_inputs(ratios)
    loss, st = losses.policy_loss(new, old, t64(advs), t64(mask), eps_low, eps_high, c)
    want, want_st = ref_policy(ratios, advs, mask, eps_low, eps_high, c)
    assert float(loss) == approx(want)
    for key, value in want_st.items():
        assert st[key] == approx(value), key
    return float(loss), st


# Prompt at position 0, right padding 0; the ratios off the mask are wild and must not count.
MASK = [[0, 1, 1, 1], [0, 1, 1, 0]]


def test_policy_loss_symmetric_clip_token_advantages():
    """PPO: l = max(-A r, -A clip(r, 1-eps, 1+eps)), per-token A [B,T], summed with stats."""
    ratios = [[4.0, 1.5, 0.7, 0.5], [0.1, 1.1, 1.3, 6.0]]
    advs = [[2.0, 1.0, 1.0, -2.0], [-3.0, 0.5, -1.0, 5.0]]
    loss, st = check_policy(ratios, advs, MASK, 0.2, 0.2)
    # hand values: -1*1.2 (clip), -1*0.7, 2*0.8 (clip), -0.5*1.1, 1*1.3
    assert loss == approx(-1.2 - 0.7 + 1.6 - 0.55 + 1.3)
    assert st["clip_tokens"] == 2 and st["tokens"] == 5 and st["dual_clip_tokens"] == 0


def test_policy_loss_symmetric_clip_sample_advantages():
    """PPO clipped surrogate with one advantage per sample [B] broadcast over its tokens."""
    ratios = [[4.0, 1.5, 0.7, 1.1], [0.1, 0.6, 1.3, 6.0]]
    advs = [1.0, -0.5]
    loss, st = check_policy(ratios, advs, MASK, 0.2, 0.2)
    # row 0 (A=1): 1.2 clip, 0.7, 1.1; row 1 (A=-0.5): 0.8 clip, 1.3
    assert loss == approx(-(1.2 + 0.7 + 1.1) + 0.5 * (0.8 + 1.3))
    assert st["clip_tokens"] == 2 and st["tokens"] == 5


def test_policy_loss_clip_higher():
    """DAPO clip-higher: ratio clipped to [1-0.2, 1+0.28], so 1.2 < r < 1.28 is not clipped for A > 0."""
    ratios = [[4.0, 1.25, 1.3, 0.75], [0.1, 1.25, 0.78, 6.0]]
    advs = [[2.0, 1.0, 1.0, -1.0], [-3.0, -1.0, 1.0, 5.0]]
    loss, st = check_policy(ratios, advs, MASK, 0.2, 0.28)
    # -1.25 (free), -1.28 (clip high), 0.8 (clip low), 1.25 (A<0 above: free), -0.78 (free)
    assert loss == approx(-1.25 - 1.28 + 0.8 + 1.25 - 0.78)
    assert st["clip_tokens"] == 2
    sym, sym_st = check_policy(ratios, advs, MASK, 0.2, 0.2)
    assert sym == approx(-1.2 - 1.2 + 0.8 + 1.25 - 0.78)
    assert sym_st["clip_tokens"] == 3


def test_policy_loss_dual_clip():
    """Dual clip (Ye et al. 2020): for A < 0, l = min(max(-A r, -A clip(r)), -c A) with c = 3."""
    ratios = [[4.0, 5.0, 2.0, 0.5], [0.1, 5.0, 5.0, 6.0]]
    advs = [[-2.0, -1.0, -1.0, -1.0], [-3.0, 1.0, -0.5, -5.0]]
    loss, st = check_policy(ratios, advs, MASK, 0.2, 0.2, c=3.0)
    # 3 (dual binds, 5 > 3), 2 (below -cA), 0.8 (low clip), -1.2 (A>0 clip), 1.5 (dual binds)
    assert loss == approx(3.0 + 2.0 + 0.8 - 1.2 + 1.5)
    assert st["dual_clip_tokens"] == 2 and st["clip_tokens"] == 2 and st["tokens"] == 5
    loss_s, st_s = check_policy(ratios, [-1.0, -0.5], MASK, 0.2, 0.2, c=3.0)
    # per-sample A: row 0: 3, 2, 0.8; row 1: 1.5, 1.5
    assert loss_s == approx(3.0 + 2.0 + 0.8 + 1.5 + 1.5)
    assert st_s["dual_clip_tokens"] == 3 and st_s["clip_tokens"] == 1


def test_policy_loss_approx_kl():
    """approx_kl = sum over weighted-in tokens of (r - 1) - log r, the k3 estimate of KL(old || new)."""
    ratios = [[9.0, 1.5, 0.7, 0.5], [0.01, 1.1, 1.3, 9.0]]
    _, st = check_policy(ratios, [1.0, -1.0], MASK, 0.2, 0.2)
    assert st["approx_kl"] == approx(sum((r - 1) - math.log(r) for r in (1.5, 0.7, 0.5, 1.1, 1.3)))


def test_policy_loss_importance_weights_no_grad():
    """Truncated IS: each token's loss times its weight, and no gradient flows into the weight."""
    ratios = [[4.0, 1.5, 0.7, 0.5], [0.1, 1.1, 1.3, 6.0]]
    advs = [[2.0, 1.0, 1.0, -2.0], [-3.0, 0.5, -1.0, 5.0]]
    isw_rows = [[7.0, 0.5, 2.0, 1.3], [7.0, 0.9, 1.5, 7.0]]
    new, old = policy_inputs(ratios)
    new.requires_grad_(True)
    isw = t64(isw_rows).requires_grad_(True)
    loss, _ = losses.policy_loss(new, old, t64(advs), t64(MASK), 0.2, 0.2, is_weights=isw)
    want, _ = ref_policy(ratios, advs, MASK, 0.2, 0.2, isw=isw_rows)
    assert float(loss.detach()) == approx(want)
    assert want == approx(0.5 * -1.2 + 2.0 * -0.7 + 1.3 * 1.6 + 0.9 * -0.55 + 1.5 * 1.3)
    loss.backward()
    assert isw.grad is None
    assert new.grad is not None
    # d l / d log r = -A r w where unclipped, 0 where clipped
    assert new.grad[0].tolist() == approx([0.0, 0.0, -1.0 * 0.7 * 2.0, 0.0])
    assert new.grad[1].tolist() == approx([0.0, -0.5 * 1.1 * 0.9, 1.0 * 1.3 * 1.5, 0.0])


def test_loss_aggregations():
    """token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum (Dr. GRPO) by loops over tokens."""
    mask_rows = [[0, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]
    per_token = [[50.0, 2.0, 40.0, 40.0, 40.0], [50.0, 50.0, 1.0, -3.0, 0.5], [50.0, 4.0, 6.0, 40.0, 40.0]]
    mask, lt = t64(mask_rows), t64(per_token)
    resp = [[v for v, m in zip(lrow, mrow) if m] for lrow, mrow in zip(per_token, mask_rows)]
    n_tokens = sum(len(r) for r in resp)
    want = {
        LossAgg.TOKEN_MEAN: sum(sum(r) for r in resp) / n_tokens,
        LossAgg.SEQ_MEAN_TOKEN_MEAN: sum(sum(r) / len(r) for r in resp) / len(resp),
        LossAgg.SEQ_MEAN_TOKEN_SUM: sum(sum(r) for r in resp) / len(resp),
    }
    assert want[LossAgg.TOKEN_MEAN] == approx(10.5 / 6)
    assert want[LossAgg.SEQ_MEAN_TOKEN_MEAN] == approx((2.0 - 1.5 / 3 + 5.0) / 3)
    assert want[LossAgg.SEQ_MEAN_TOKEN_SUM] == approx(10.5 / 3)
    for agg, value in want.items():
        norm = losses.loss_normalizer(agg, float(mask.sum()), 3.0)
        w = losses.token_weights(mask, agg)
        assert float((w * lt).sum()) / norm == approx(value), agg
        # summed over micro-batches of rows, divided once: the same
        pieces = sum(float((losses.token_weights(mask[s], agg) * lt[s]).sum()) for s in (slice(0, 1), slice(1, 3)))
        assert pieces / norm == approx(value), agg


def ref_kl(lp: float, ref: float, est: KlEstimator) -> float:
    """Schulman's estimators of KL(pi || ref) from one sample of pi."""
    if est is KlEstimator.K1:
        return lp - ref
    if est is KlEstimator.K2:
        return (lp - ref) ** 2 / 2
    if est is KlEstimator.K3:
        x = math.exp(ref - lp)  # ref / pi
        return x - 1 - math.log(x)
    d = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(d) - 1 - d, -10.0), 10.0)


def test_kl_estimators():
    """k1 = log pi - log ref, k2 = (log pi - log ref)^2/2, k3 = ref/pi - 1 - log(ref/pi), low-var = clamped k3."""
    lp = [[-1.0, -2.0, -0.5, -3.0], [-0.2, -6.0, -1.5, -20.0]]
    ref = [[-1.5, -1.0, -0.5, 2.0], [-0.7, -2.0, -16.5, -19.0]]
    for est in KlEstimator:
        got = losses.kl_penalty(t64(lp), t64(ref), est).tolist()
        want = [[ref_kl(a, b, est) for a, b in zip(ra, rb)] for ra, rb in zip(lp, ref)]
        assert got[0] == approx(want[0]) and got[1] == approx(want[1]), est
    low = losses.kl_penalty(t64(lp), t64(ref), KlEstimator.LOW_VAR).tolist()
    k3 = losses.kl_penalty(t64(lp), t64(ref), KlEstimator.K3).tolist()
    # log ref - log pi = 5: e^5 - 6 = 142.41 for k3, clamped to 10 for low-var
    assert k3[0][3] == approx(math.exp(5) - 6) and low[0][3] == approx(10.0)
    # -15: e^-15 + 14, clamped to 10; 1: e - 2 unclamped
    assert low[1][2] == approx(10.0) and k3[1][2] == approx(math.exp(-15) + 14)
    assert low[0][1] == approx(math.e - 2)
    # an overflowing ratio stays finite under low-var
    huge = losses.kl_penalty(t64([0.0]), t64([1000.0]), KlEstimator.LOW_VAR)
    assert huge.tolist() == approx([10.0])


def test_kl_estimators_monte_carlo():
    """Sampled from p, the means of k1 and k3 approach the exact KL(p||q) = sum p log(p/q)."""
    p, q = [0.5, 0.3, 0.2], [0.3, 0.4, 0.3]
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    gen = torch.Generator().manual_seed(1234)
    x = torch.multinomial(torch.tensor(p, dtype=F64), 200_000, replacement=True, generator=gen)
    lp = torch.log(torch.tensor(p, dtype=F64))[x]
    lq = torch.log(torch.tensor(q, dtype=F64))[x]
    for est in (KlEstimator.K1, KlEstimator.K3):
        assert float(losses.kl_penalty(lp, lq, est).mean()) == pytest.approx(exact, abs=0.02), est
    assert exact == pytest.approx(0.0880, abs=1e-3)


def test_group_advantages():
    """GRPO: (r - mean) / (sample std + 1e-6); Dr. GRPO: r - mean; all-equal rewards give zeros."""
    rewards = [1.0, 0.0, 0.5, 2.5]
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)
    assert mean == 1.0 and std == approx(math.sqrt(3.5 / 3))
    assert losses.group_advantages(rewards, True) == approx([(r - mean) / (std + 1e-6) for r in rewards])
    assert losses.group_advantages(rewards, False) == approx([0.0, -1.0, -0.5, 1.5])
    for norm in (True, False):
        assert losses.group_advantages([0.7] * 4, norm) == approx([0.0] * 4)


GAE_MASK = [[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]]
GAE_VALUES = [[9.0, 9.0, 0.5, 0.2, -0.3, 9.0], [9.0, 0.4, 0.1, 9.0, 9.0, 9.0]]


def gae_inputs():
    """Outcome rewards 1.0 and -1.0 on each row's last response token, plus -0.1 at every response token."""
    mask = t64(GAE_MASK)
    token_rewards = losses.outcome_token_rewards(t64([1.0, -1.0]), mask) - 0.1 * mask
    assert_rows(token_rewards, [[0, 0, -0.1, -0.1, 0.9, 0], [0, -0.1, -1.1, 0, 0, 0]])
    return token_rewards, t64(GAE_VALUES), mask


def test_gae_hand_computed():
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after the last token), A_t = delta_t + gamma lam A_{t+1}."""
    g, lam = 0.9, 0.8
    # row 0, response at 2..4: values 0.5, 0.2, -0.3; rewards -0.1, -0.1, 0.9
    d4 = 0.9 + g * 0.0 - (-0.3)
    d3 = -0.1 + g * (-0.3) - 0.2
    d2 = -0.1 + g * 0.2 - 0.5
    a4 = d4
    a3 = d3 + g * lam * a4
    a2 = d2 + g * lam * a3
    # row 1, response at 1..2: values 0.4, 0.1; rewards -0.1, -1.1
    e2 = -1.1 + g * 0.0 - 0.1
    e1 = -0.1 + g * 0.1 - 0.4
    b2 = e2
    b1 = e1 + g * lam * b2
    assert (a4, a3, a2) == approx((1.2, 0.294, -0.20832))
    assert (b2, b1) == approx((-1.2, -1.274))
    adv, ret = losses.gae(*gae_inputs(), g, lam)
    assert adv[0].tolist() == approx([0, 0, a2, a3, a4, 0])
    assert adv[1].tolist() == approx([0, b1, b2, 0, 0, 0])
    assert ret[0].tolist() == approx([0, 0, a2 + 0.5, a3 + 0.2, a4 - 0.3, 0])
    assert ret[1].tolist() == approx([0, b1 + 0.4, b2 + 0.1, 0, 0, 0])
    # each row alone gives the same: rows do not mix
    rewards, values, mask = gae_inputs()
    for i in range(2):
        adv_i, ret_i = losses.gae(rewards[i:i + 1], values[i:i + 1], mask[i:i + 1], g, lam)
        assert adv_i[0].tolist() == approx(adv[i].tolist()) and ret_i[0].tolist() == approx(ret[i].tolist())


def test_gae_gamma_lambda_one():
    """With gamma = lam = 1, A_t = (sum of rewards from t to the end) - V_t and returns = that sum."""
    rewards, values, mask = gae_inputs()
    adv, ret = losses.gae(rewards, values, mask, 1.0, 1.0)
    r_rows, v_rows = rewards.tolist(), GAE_VALUES
    for i in range(2):
        want_adv, want_ret = [0.0] * 6, [0.0] * 6
        for t in range(6):
            if GAE_MASK[i][t]:
                future = sum(r_rows[i][k] for k in range(t, 6) if GAE_MASK[i][k])
                want_adv[t], want_ret[t] = future - v_rows[i][t], future
        assert adv[i].tolist() == approx(want_adv)
        assert ret[i].tolist() == approx(want_ret)
    assert ret[0].tolist() == approx([0, 0, 0.7, 0.8, 0.9, 0])
    assert adv[1].tolist() == approx([0, -1.6, -1.2, 0, 0, 0])


def ref_value_loss(v, v_old, r, w, c):
    """PPO critic: sum w * 0.5 * max((V-R)^2, (Vclip-R)^2), Vclip = Vold + clip(V - Vold, -c, c)."""
    total, binds = 0.0, 0
    for i in range(len(v)):
        for j in range(len(v[i])):
            if w[i][j] <= 0:
                continue
            err = (v[i][j] - r[i][j]) ** 2
            if c:
                vc = v_old[i][j] + min(max(v[i][j] - v_old[i][j], -c), c)
                err_c = (vc - r[i][j]) ** 2
                binds += err_c > err
                err = max(err, err_c)
            total += w[i][j] * 0.5 * err
    return total, binds


def test_value_loss():
    """PPO value clipping: 0.5 max((V-R)^2, (Vclip-R)^2), weighted sum; clip 0 gives 0.5 (V-R)^2."""
    mask_rows = [[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]]
    v = [[7.0, 0.5, 0.1, 0.5, 7.0], [7.0, 0.5, 1.6, 7.0, 7.0]]
    v_old = [[-7.0, 0.0, 0.0, 0.0, -7.0], [-7.0, 1.0, 1.0, -7.0, -7.0]]
    r = [[3.0, 1.0, 1.0, 0.0, 3.0], [3.0, 0.9, 2.0, 3.0, 3.0]]
    mask = t64(mask_rows)
    w = losses.token_weights(mask, LossAgg.SEQ_MEAN_TOKEN_MEAN)
    loss, st = losses.value_loss(t64(v), t64(v_old), t64(r), w, 0.2)
    want, binds = ref_value_loss(v, v_old, r, w.tolist(), 0.2)
    assert float(loss) == approx(want)
    # clip binds at (0,1): 0.64 > 0.25 and (1,2): 0.64 > 0.16; not at (0,2) (equal), (0,3), (1,1)
    assert binds == 2 and st["clip_tokens"] == 2 and st["tokens"] == 5
    assert want == approx((0.5 * 0.64 + 0.5 * 0.81 + 0.5 * 0.25) / 3 + (0.5 * 0.16 + 0.5 * 0.64) / 2)
    loss0, st0 = losses.value_loss(t64(v), t64(v_old), t64(r), mask, 0.0)
    want0, _ = ref_value_loss(v, v_old, r, mask_rows, 0.0)
    assert float(loss0) == approx(want0)
    assert want0 == approx(0.5 * (0.25 + 0.81 + 0.25 + 0.16 + 0.16))
    assert st0["clip_tokens"] == 0 and st0["tokens"] == 5


def test_truncated_is_weights():
    """Truncated IS (Yao et al.): min(exp(lp_trainer - lp_server), cap)."""
    trainer = [[-1.0, -0.5, -2.0], [-0.1, -3.0, -0.7]]
    server = [[-1.0 + math.log(2.0), -0.5 - math.log(1.5), -2.0 - math.log(3.0)], [-0.1, -1.0, -0.7 - math.log(2.0)]]
    got = losses.truncated_is_weights(t64(trainer), t64(server), 2.0).tolist()
    for i in range(2):
        assert got[i] == approx([min(math.exp(a - b), 2.0) for a, b in zip(trainer[i], server[i])])
    assert got == [approx([0.5, 1.5, 2.0]), approx([1.0, math.exp(-2.0), 2.0])]


def test_overlong_penalty():
    """DAPO soft overlong penalty: 0 up to L_max - L_cache, ((L_max - L_cache) - n) / L_cache up to L_max, then -1."""
    l_max, l_cache, pen = 20, 4, 1.0
    for n in range(0, 26):
        if n <= l_max - l_cache:
            want = 0.0
        elif n <= l_max:
            want = pen * ((l_max - l_cache) - n) / l_cache
        else:
            want = -pen
        assert losses.overlong_penalty(n, l_max, l_cache, pen) == approx(want), n
    assert [losses.overlong_penalty(n, 20, 4, 1.0) for n in (16, 17, 18, 19, 20)] == approx([0, -0.25, -0.5, -0.75, -1])
    assert all(losses.overlong_penalty(n, 20, 0, 1.0) == 0.0 for n in (0, 16, 19, 20, 25))


def test_objective_explained_variance():
    """PPO explained variance: 1 - Var(R - V) / Var(R) over the response tokens (population variance)."""
    obj = Objective(AlgoConfig(name="ppo"))
    mask_rows = [[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 0]]
    rewards = [1.0, 0.0, 2.0]
    mask = t64(mask_rows)
    server = t64([[-1.0, -0.5, -0.7, -1.0], [-1.0, -0.2, -0.3, -0.4], [-1.0, -1.0, -0.6, -1.0]])
    old_values = t64([[5.0, 0.2, 0.4, 5.0], [5.0, 0.1, -0.2, 0.3], [5.0, 5.0, 1.5, 5.0]])
    values = [[9.0, 0.8, 0.7, 9.0], [9.0, -0.1, 0.4, 0.2], [9.0, 9.0, 1.2, 9.0]]
    p = obj.prepare(mask, server, torch.zeros(3, dtype=F64), t64(rewards), old_values=old_values)
    # gamma = lam = 1 and only the outcome reward: the return at every response token is that reward
    assert_rows(p.returns, [[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 2, 0]])
    acc = dict.fromkeys(SUM_KEYS, 0.0)
    obj.policy_loss(server.clone(), p, acc)
    obj.value_loss(t64(values), p, acc)
    rets, res = [], []
    for i in range(3):
        for j in range(4):
            if mask_rows[i][j]:
                rets.append(rewards[i])
                res.append(rewards[i] - values[i][j])

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    out = obj.finish(acc, losses.loss_normalizer(obj.algo.loss_agg, float(mask.sum()), 3.0))
    assert out["explained_var"] == approx(1.0 - var(res) / var(rets))
    assert out["values_mean"] == approx(sum(values[i][j] for i in range(3) for j in range(4) if mask_rows[i][j]) / 6)
