"""The planning laws against their closed forms and published constants (autoconf/scaling.py)."""

from __future__ import annotations

import math

import pytest

from autoconf.errors import UserError
from autoconf.specs.model import ModelSpec, preset
from autoconf.timetotrain import laws as scaling


def test_published_constants():
    assert scaling.KAPLAN_BCRIT.constants == {"B_star_tokens": 2e8, "alpha_B": 0.21}
    assert scaling.CHINCHILLA_LOSS.constants == {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
    assert scaling.KAPLAN_LOSS.constants == {"N_c": 6.4e13, "D_c": 1.8e13, "alpha_N": 0.076, "alpha_D": 0.103}
    assert scaling.DEEPSEEK_BATCH.constants == {"batch_coef": 0.2920, "batch_exp": 0.3271, "lr_coef": 0.3118,
                                                "lr_exp": -0.1250}
    for law in scaling.LAWS.values():
        assert "arXiv" in law.source and law.fitted_on


def test_critical_batch_closed_form():
    assert scaling.critical_batch_tokens(1.0) == pytest.approx(2e8)  # L = 1: B*
    assert scaling.critical_batch_tokens(2.0) == pytest.approx(2e8 / 2 ** (1 / 0.21))
    # a lower loss needs a larger batch: B_crit doubles when L falls by 2^-0.21
    assert scaling.critical_batch_tokens(2.0 * 2 ** -0.21) == pytest.approx(2 * scaling.critical_batch_tokens(2.0))
    with pytest.raises(UserError):
        scaling.critical_batch_tokens(0.0)


def test_loss_laws_closed_forms():
    n, d = 7e10, 1.4e12
    assert scaling.chinchilla_loss(n, d) == pytest.approx(1.69 + 406.4 / n ** 0.34 + 410.7 / d ** 0.28)
    assert scaling.kaplan_loss(n, d) == pytest.approx(((6.4e13 / n) ** (0.076 / 0.103) + 1.8e13 / d) ** 0.103)
    # infinite data: Kaplan's L(N) limit (N_c / N)^alpha_N
    assert scaling.kaplan_loss(n, 1e40) == pytest.approx((6.4e13 / n) ** 0.076, rel=1e-9)
    # more parameters or more data: lower loss
    assert scaling.kaplan_loss(2 * n, d) < scaling.kaplan_loss(n, d)
    assert scaling.chinchilla_loss(n, 2 * d) < scaling.chinchilla_loss(n, d)
    m = preset("llama-2-70b")
    assert scaling.predicted_loss(m, d, "chinchilla") == pytest.approx(scaling.chinchilla_loss(m.num_params(), d))
    assert scaling.predicted_loss(m, d, "kaplan") == pytest.approx(
        scaling.kaplan_loss(m.num_layers * m.layer_params(), d))
    with pytest.raises(UserError, match="valid: kaplan, chinchilla"):
        scaling.predicted_loss(m, d, "gpt4")


@pytest.mark.parametrize("b_over_crit", [0.1, 0.5, 1.0, 2.0, 7.0])
def test_steps_tokens_tradeoff(b_over_crit):
    b_crit, s_min = 4e6, 1e5
    e_min = b_crit * s_min  # McCandlish: B_crit = E_min / S_min
    b = b_over_crit * b_crit
    s = scaling.steps_for(b, s_min, b_crit)
    e = scaling.tokens_for(b, e_min, b_crit)
    assert (s / s_min - 1) * (e / e_min - 1) == pytest.approx(1.0)  # the hyperbola of McCandlish et al.
    assert e == pytest.approx(b * s)  # tokens = batch x steps
    if b_over_crit == 1.0:
        assert s == pytest.approx(2 * s_min) and e == pytest.approx(2 * e_min)


def test_minima_from_tokens_at_the_critical_batch():
    e_min, s_min = scaling.minima_from_tokens_at(2e12, 4e6, 4e6)
    assert e_min == pytest.approx(1e12) and s_min == pytest.approx(1e12 / 4e6)
    e_min, s_min = scaling.minima_from_tokens_at(3e12, 8e6, 4e6)  # B = 2 B_crit: E = 3 E_min
    assert e_min == pytest.approx(1e12)


def test_deepseek_batch_and_learning_rate():
    c = 1e21
    assert scaling.deepseek_batch_tokens(c) == pytest.approx(0.2920 * c ** 0.3271)
    assert scaling.deepseek_learning_rate(c) == pytest.approx(0.3118 * c ** -0.125)
    # their M for a GPT block: 72 n_layer d^2 + 6 n_layer d l_seq
    m = ModelSpec(name="g", num_layers=24, hidden_size=2048, num_attention_heads=16, num_kv_heads=16,
                  ffn_hidden_size=8192, vocab_size=50257, seq_length=2048)
    assert scaling.deepseek_flops_per_token(m) == pytest.approx(72 * 24 * 2048 ** 2 + 6 * 24 * 2048 * 2048)


def test_compute_optimal_tokens_is_twenty_per_parameter():
    m = preset("llama-2-70b")
    assert scaling.compute_optimal_tokens(m) == pytest.approx(20 * m.num_params())


def test_a_mixture_of_experts_enters_the_laws_by_its_active_size():
    """Mixtral 8x7B: 2 of 8 experts per token. Its N is the blocks' active parameters, its
    compute-optimal tokens 20 per active parameter, and DeepSeek's M counts the top-2 experts'
    three matrices and the router per block (GQA projections; causal core 6 d s)."""
    m = preset("mixtral-8x7b")
    h, f, L, s = 4096, 14336, 32, 4096
    attn = h * h + 2 * h * 1024 + h * h  # q, k, v (8 of 32 heads), out
    block = attn + 2 * 3 * h * f + 8 * h + 2 * h  # two experts, the router, two RMSNorms
    assert scaling.non_embedding_params(m) == pytest.approx(L * block)
    assert scaling.compute_optimal_tokens(m) == pytest.approx(20 * m.active_params())
    assert m.active_params() < m.num_params() / 3
    assert scaling.deepseek_flops_per_token(m) == pytest.approx(L * (3 * 2 * (attn + 2 * 3 * h * f + 8 * h)
                                                                   + 6 * h * s))
    # the loss at a given budget is a dense model's of the active size
    dense = ModelSpec(name="d", num_layers=L, hidden_size=h, num_attention_heads=32, num_kv_heads=8,
                      ffn_hidden_size=2 * f, vocab_size=32000, seq_length=s, activation="swiglu", norm="rmsnorm",
                      position_embedding="rope")
    assert scaling.predicted_loss(m, 1e12) == pytest.approx(scaling.predicted_loss(dense, 1e12), rel=1e-3)


def test_young_daly_interval_and_expected_time():
    delta, mtbf = 120.0, 3 * 3600.0
    tau = scaling.young_daly_interval(delta, mtbf)
    assert tau == pytest.approx(math.sqrt(2 * delta * mtbf))
    g = scaling.expected_wall_time(30 * 86400, mtbf, delta, 600.0)
    assert g.interval_s == pytest.approx(tau)
    loss = 600.0 + (tau + delta) / 2
    assert g.wall_s == pytest.approx(30 * 86400 * (1 + delta / tau) / (1 - loss / mtbf))
    assert g.failures == pytest.approx(g.wall_s / mtbf) and g.lost_s == pytest.approx(g.wall_s - 30 * 86400)
    assert 0 < g.goodput < 1
    # Young's interval is the first-order optimum: shorter or longer intervals lose more
    for k in (0.5, 0.8, 1.25, 2.0):
        other = scaling.expected_wall_time(30 * 86400, mtbf, delta, 600.0, interval_s=k * tau)
        assert other.wall_s > g.wall_s
    # no failures: no loss but the checkpoints themselves, which vanish as tau grows
    assert scaling.expected_wall_time(86400, 1e15, delta, 600.0).wall_s == pytest.approx(86400, rel=1e-4)
    with pytest.raises(UserError, match="never finish"):
        scaling.expected_wall_time(86400, 300.0, 120.0, 600.0)
