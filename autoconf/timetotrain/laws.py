"""Scaling laws for planning a training run: predicted loss, batch size, steps, tokens, restarts.

Every constant is data with its source (:data:`LAWS`), and every function is the closed form of the
paper it cites. These laws were fitted on particular data, tokenizers and model families (WebText2
with GPT-2's BPE for Kaplan et al.; MassiveText with SentencePiece for Chinchilla; DeepSeek's own
2T-token corpus); they transfer to another setup only approximately, and the planner says so.

- **Loss.** Kaplan et al. 2020 (arXiv 2001.08361, eq. 1.5; the fit of section 4, Table 2):
  ``L(N, D) = [(N_c / N)^(alpha_N / alpha_D) + D_c / D]^alpha_D`` in nats per token, N the
  non-embedding parameters, D tokens. Hoffmann et al. 2022 ("Chinchilla", arXiv 2203.15556,
  eq. 10 / approach 3): ``L(N, D) = E + A / N^alpha + B / D^beta``, N all parameters.
- **Critical batch.** McCandlish et al. 2018 (arXiv 1812.06162) and Kaplan et al. (eq. 1.4):
  ``B_crit(L) = B* / L^(1/alpha_B)`` tokens, B* = 2e8, alpha_B = 0.21 (fitted to Kaplan's loss, in
  nats on WebText2). Around it, the steps and tokens needed to reach a given loss trade off as
  ``S = S_min (1 + B_crit / B)`` and ``E = E_min (1 + B / B_crit)``, with ``B_crit = E_min / S_min``
  (McCandlish et al. section 2.3; Kaplan et al. section 5.1): at B = B_crit a run takes twice the fewest steps
  and twice the fewest tokens.
- **Compute-based batch.** DeepSeek LLM 2024 (arXiv 2401.02954, eq. 1):
  ``B_opt = 0.2920 C^0.3271`` tokens and ``eta_opt = 0.3118 C^-0.1250``, C = M D in FLOPs with M
  the non-embedding FLOPs per token ``72 n_layer d^2 + 6 n_layer d l_seq`` for their shapes
  (:func:`deepseek_flops_per_token` generalises the matrix part to any block).
- **Compute-optimal tokens.** Chinchilla's rule of thumb: about 20 tokens per parameter (Hoffmann
  et al., Table 3: 70B parameters -> 1.4T tokens; 1T -> 21.2T).
- **Checkpoint interval.** Young 1974 (CACM 17(9)): ``tau = sqrt(2 delta M)`` for checkpoint write
  time delta and mean time between failures M; Daly 2006 (FGCS 22(3)) adds the ``- delta`` and
  the restart terms; :func:`expected_wall_time` is the first-order expected time with them.
- **Mixtures of experts.** Every law above was fitted on dense models. A mixture of experts enters
  them by what one token goes through: its active parameters (N) and active FLOPs (M), the top-k
  routed experts and the shared ones, not every expert. Routed models scale between their active
  and their total size (Clark et al. 2022, arXiv 2202.01169), so for them the predicted loss is
  an upper estimate, B_crit (which falls as the loss rises) a lower one, and the compute-optimal
  token count the one of a dense model of the active size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoconf.errors import UserError


@dataclass(frozen=True)
class Law:
    name: str
    constants: dict
    source: str
    fitted_on: str

    def to_dict(self) -> dict:
        return {"name": self.name, "constants": dict(self.constants), "source": self.source,
                "fitted_on": self.fitted_on}


KAPLAN_LOSS = Law("kaplan-loss", {"N_c": 6.4e13, "D_c": 1.8e13, "alpha_N": 0.076, "alpha_D": 0.103},
                  "Kaplan et al. 2020, arXiv 2001.08361, eq. 1.5 / section 4, Table 2",
                  "WebText2, GPT-2 BPE, nats/token; N = non-embedding parameters")
CHINCHILLA_LOSS = Law("chinchilla-loss", {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28},
                      "Hoffmann et al. 2022, arXiv 2203.15556, eq. 10 (approach 3)",
                      "MassiveText, SentencePiece; N = all parameters")
KAPLAN_BCRIT = Law("kaplan-bcrit", {"B_star_tokens": 2e8, "alpha_B": 0.21},
                   "Kaplan et al. 2020, arXiv 2001.08361, eq. 1.4; McCandlish et al. 2018, arXiv 1812.06162",
                   "WebText2, GPT-2 BPE: the loss must be Kaplan's (nats/token on WebText2)")
DEEPSEEK_BATCH = Law("deepseek-batch", {"batch_coef": 0.2920, "batch_exp": 0.3271, "lr_coef": 0.3118,
                                        "lr_exp": -0.1250},
                     "DeepSeek LLM 2024, arXiv 2401.02954, eq. 1",
                     "DeepSeek's corpus and tokenizer, C = M D with M non-embedding FLOPs/token; fitted on "
                     "small-compute runs, extrapolated to large ones")
CHINCHILLA_TOKENS = Law("chinchilla-tokens", {"tokens_per_param": 20.0},
                        "Hoffmann et al. 2022, arXiv 2203.15556, Table 3 (compute-optimal: ~20 tokens/parameter)",
                        "MassiveText")
LAWS = {law.name: law for law in (KAPLAN_LOSS, CHINCHILLA_LOSS, KAPLAN_BCRIT, DEEPSEEK_BATCH, CHINCHILLA_TOKENS)}

LOSS_LAWS = ("kaplan", "chinchilla")
BATCH_LAWS = ("kaplan", "deepseek", "fixed")


def _positive(x: float, what: str) -> float:
    if not (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0):
        raise UserError(f"{what}={x!r} must be a positive finite number")
    return float(x)


# -- loss ----------------------------------------------------------------------------------------

def kaplan_loss(n_non_embedding: float, tokens: float) -> float:
    """Kaplan's L(N, D) in nats/token (N non-embedding parameters, D tokens)."""
    n, d = _positive(n_non_embedding, "N"), _positive(tokens, "D")
    k = KAPLAN_LOSS.constants
    return ((k["N_c"] / n) ** (k["alpha_N"] / k["alpha_D"]) + k["D_c"] / d) ** k["alpha_D"]


def chinchilla_loss(n_params: float, tokens: float) -> float:
    """Chinchilla's L(N, D) = E + A/N^alpha + B/D^beta (N all parameters)."""
    n, d = _positive(n_params, "N"), _positive(tokens, "D")
    k = CHINCHILLA_LOSS.constants
    return k["E"] + k["A"] / n ** k["alpha"] + k["B"] / d ** k["beta"]


def predicted_loss(model, tokens: float, law: str = "kaplan") -> float:
    """The loss the law predicts for ``model`` (a ModelSpec) trained on ``tokens`` (a mixture of
    experts by its active parameters)."""
    if law == "kaplan":
        return kaplan_loss(non_embedding_params(model), tokens)
    if law == "chinchilla":
        return chinchilla_loss(model.active_params(), tokens)
    raise UserError(f"--loss-law {law!r}; valid: {', '.join(LOSS_LAWS)}")


def non_embedding_params(model) -> float:
    """Kaplan's N: parameters of the transformer blocks (no embedding, position or output matrix);
    a mixture of experts' active ones (the top-k routed experts and the shared ones per block)."""
    if model.is_moe:
        return float(sum(model.active_layer_params(i) for i in range(model.num_layers)))
    return float(model.num_layers * model.layer_params())


# -- batch ---------------------------------------------------------------------------------------

def critical_batch_tokens(loss: float) -> float:
    """B_crit(L) = B* / L^(1/alpha_B), in tokens."""
    k = KAPLAN_BCRIT.constants
    return k["B_star_tokens"] / _positive(loss, "loss") ** (1.0 / k["alpha_B"])


def steps_for(batch: float, s_min: float, b_crit: float) -> float:
    """S = S_min (1 + B_crit / B): optimizer steps to reach the loss at batch B (tokens)."""
    return s_min * (1.0 + b_crit / _positive(batch, "batch"))


def tokens_for(batch: float, e_min: float, b_crit: float) -> float:
    """E = E_min (1 + B / B_crit): tokens processed to reach the loss at batch B (tokens)."""
    return e_min * (1.0 + _positive(batch, "batch") / b_crit)


def minima_from_tokens_at(tokens: float, batch: float, b_crit: float) -> tuple[float, float]:
    """(E_min, S_min) of a run that processes ``tokens`` at batch ``batch`` (tokens): from
    E = E_min (1 + B/B_crit) and B_crit = E_min / S_min. At B = B_crit: E_min = tokens / 2."""
    e_min = _positive(tokens, "tokens") / (1.0 + _positive(batch, "batch") / _positive(b_crit, "B_crit"))
    return e_min, e_min / b_crit


def deepseek_flops_per_token(model) -> float:
    """DeepSeek's M: non-embedding FLOPs per token, forward + backward. Their ``72 n_layer d^2``
    is 3x the block's matrix multiplies (any block: GQA, SwiGLU, MLA) and their ``6 n_layer d l_seq``
    the causal attention core (half the full-square 4 s q, forward and backward: 6 d s where the
    query width q is d). A mixture of experts' MoE blocks count their active experts and router
    (``ModelSpec.moe_layer_forward_flops_per_token``)."""
    # block by block (a windowed block attends to fewer keys): the matrix part 3x; the causal
    # attention core (4 s q, MLA's own widths) at half its full-square FLOPs, 3x (6 d s for MHA)
    total = 0.0
    for i in range(model.num_layers):
        f = (model.moe_layer_forward_flops_per_token(i) if model.is_moe_layer(i)
             else model.layer_forward_flops_per_token(i))
        core = model.attention_core_flops(i)
        total += 3.0 * (f - core) + 1.5 * core
    return total


def deepseek_batch_tokens(compute_flops: float) -> float:
    """B_opt(C) = 0.2920 C^0.3271 tokens."""
    k = DEEPSEEK_BATCH.constants
    return k["batch_coef"] * _positive(compute_flops, "C") ** k["batch_exp"]


def deepseek_learning_rate(compute_flops: float) -> float:
    """eta_opt(C) = 0.3118 C^-0.1250."""
    k = DEEPSEEK_BATCH.constants
    return k["lr_coef"] * _positive(compute_flops, "C") ** k["lr_exp"]


def compute_optimal_tokens(model) -> float:
    """Chinchilla's ~20 tokens per parameter (a mixture of experts: per active parameter)."""
    return CHINCHILLA_TOKENS.constants["tokens_per_param"] * model.active_params()


# -- failures and checkpoints --------------------------------------------------------------------

def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints, sqrt(2 delta M)."""
    return math.sqrt(2.0 * _positive(checkpoint_s, "checkpoint time") * _positive(mtbf_s, "MTBF"))


@dataclass(frozen=True)
class Goodput:
    mtbf_s: float
    """The whole job's mean time between failures: a GPU's divided by the GPUs."""
    interval_s: float
    """Compute between checkpoints (Young/Daly)."""
    wall_s: float
    """Expected wall-clock time, restarts and checkpoints included."""
    failures: float
    """Expected number of failures (interruptions) during the run."""
    lost_s: float
    """wall_s - the failure-free time: checkpoint writes, recomputed work, restarts."""

    @property
    def goodput(self) -> float:
        return 1.0 - self.lost_s / self.wall_s if self.wall_s > 0 else 1.0

    def to_dict(self) -> dict:
        return {"mtbf_s": self.mtbf_s, "interval_s": self.interval_s, "wall_s": self.wall_s,
                "failures": self.failures, "lost_s": self.lost_s, "goodput": self.goodput}


def expected_wall_time(work_s: float, mtbf_s: float, checkpoint_s: float, restart_s: float,
                       interval_s: float | None = None) -> Goodput:
    """Expected wall time of ``work_s`` of failure-free training with failures at rate 1/M.

    First order (Young; Daly's restart term): every interval tau of work costs tau + delta; a
    failure loses on average half an interval and its checkpoint, (tau + delta)/2, plus the restart
    R. With n = W/M failures: W = work (1 + delta/tau) + n (R + (tau + delta)/2), so
    W = work (1 + delta/tau) / (1 - (R + (tau + delta)/2) / M). ``interval_s``: tau (default
    Young's sqrt(2 delta M)). Refused when failures come faster than the run can progress.
    """
    work = float(work_s)
    m = _positive(mtbf_s, "MTBF")
    delta = _positive(checkpoint_s, "checkpoint time")
    if restart_s < 0:
        raise UserError(f"restart time {restart_s!r} must be 0 or more")
    tau = young_daly_interval(delta, m) if interval_s is None else _positive(interval_s, "interval")
    loss_per_failure = restart_s + (tau + delta) / 2.0
    if loss_per_failure >= m:
        raise UserError(f"the job fails every {m / 3600:.2f} h on average, less than a restart plus half a "
                        f"checkpoint interval ({loss_per_failure / 3600:.2f} h): it would never finish")
    wall = work * (1.0 + delta / tau) / (1.0 - loss_per_failure / m)
    return Goodput(mtbf_s=m, interval_s=tau, wall_s=wall, failures=wall / m, lost_s=wall - work)
