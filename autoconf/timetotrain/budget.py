"""The training budget: tokens, batch and steps from a scaling law (``laws``), and the parsers
of counts and durations that ``plan``'s flags take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoconf.errors import UserError
from autoconf.timetotrain import laws as scaling

DEFAULT_FACTORS = (0.25, 0.5, 1.0, 2.0)



def round_batch(sequences: float) -> int:
    """The nearest batch of the form 2^k or 3 x 2^k sequences (so that data-parallel degrees, which
    are powers of two on power-of-two GPU counts, divide it, and interleaving finds micro-batch
    counts divisible by pp)."""
    if sequences <= 1:
        return 1
    cands = [c for k in range(0, 40) for c in (2 ** k, 3 * 2 ** k)]
    return min(cands, key=lambda c: (abs(math.log(c / sequences)), c))


@dataclass(frozen=True)
class BatchPlan:
    """How many steps and tokens a batch needs under the batch law."""

    batch: int
    """Sequences per step."""
    steps: float
    tokens: float
    """Tokens processed (steps x batch x sequence length)."""


@dataclass
class Budget:
    """The training budget and the law that turns it into steps at each batch."""

    law: str
    tokens: float
    """Tokens processed at the law's batch (B_crit, B_opt or the given batch)."""
    tokens_rule: str
    seq_length: int
    batches: tuple
    """Batches swept (sequences)."""
    b_crit_tokens: float
    loss: float
    loss_law: str
    notes: tuple = ()
    compute_flops: float | None = None
    """DeepSeek's C = M D."""
    learning_rate: float | None = None

    def plan(self, batch: int) -> BatchPlan:
        b_tok = batch * self.seq_length
        if self.law == "kaplan":
            # D is what a run processes at B = B_crit: E_min = D / 2, S_min = D / (2 B_crit)
            e_min, s_min = scaling.minima_from_tokens_at(self.tokens, self.b_crit_tokens, self.b_crit_tokens)
            steps = scaling.steps_for(b_tok, s_min, self.b_crit_tokens)
            return BatchPlan(batch, steps, steps * b_tok)
        return BatchPlan(batch, self.tokens / b_tok, self.tokens)

    def to_dict(self) -> dict:
        laws = {"kaplan": ["kaplan-bcrit"], "deepseek": ["deepseek-batch"], "fixed": []}[self.law]
        laws.append("kaplan-loss" if self.loss_law == "kaplan" else "chinchilla-loss")
        return {"law": self.law, "tokens": self.tokens, "tokens_rule": self.tokens_rule,
                "seq_length": self.seq_length, "batches": list(self.batches), "b_crit_tokens": self.b_crit_tokens,
                "b_crit_sequences": self.b_crit_tokens / self.seq_length, "loss": self.loss,
                "loss_law": self.loss_law, "compute_flops": self.compute_flops,
                "learning_rate": self.learning_rate, "notes": list(self.notes),
                "laws": [scaling.LAWS[n].to_dict() for n in laws]}


def make_budget(model, tokens: float | None = None, law: str = "kaplan", loss_law: str = "kaplan",
                global_batch: int | None = None, factors=DEFAULT_FACTORS) -> Budget:
    """The token budget (default: Chinchilla's compute-optimal 20 per parameter), the predicted
    loss, the critical batch, and the batches to sweep under ``law``."""
    if law not in scaling.BATCH_LAWS:
        raise UserError(f"--batch-law {law!r}; valid: {', '.join(scaling.BATCH_LAWS)}")
    if loss_law not in scaling.LOSS_LAWS:
        raise UserError(f"--loss-law {loss_law!r}; valid: {', '.join(scaling.LOSS_LAWS)}")
    if law == "fixed" and not global_batch:
        raise UserError("--batch-law fixed needs --global-batch N (sequences per step)")
    if law != "fixed" and global_batch:
        raise UserError(f"--global-batch is the fixed batch law's; with --batch-law {law} the law sets the batch "
                        "(give --batch-law fixed to use yours)")
    if tokens is None:
        tokens = scaling.compute_optimal_tokens(model)
        rule = (f"compute-optimal: {scaling.CHINCHILLA_TOKENS.constants['tokens_per_param']:g} tokens per "
                f"parameter (Chinchilla, Hoffmann et al. 2022, Table 3)")
    else:
        rule = "given (--tokens)"
    if tokens < model.seq_length:
        raise UserError(f"--tokens {tokens:g}: fewer than one sequence of {model.seq_length:,} tokens")
    loss = scaling.predicted_loss(model, tokens, loss_law)
    b_crit = scaling.critical_batch_tokens(loss)
    s = model.seq_length
    used = {"kaplan": scaling.KAPLAN_BCRIT, "deepseek": scaling.DEEPSEEK_BATCH,
            "fixed": scaling.KAPLAN_LOSS if loss_law == "kaplan" else scaling.CHINCHILLA_LOSS}[law]
    notes = [f"the scaling laws were fitted on particular data and tokenizers ({used.fitted_on}); "
             "for other data they give the order of magnitude, not the value"]
    if law == "kaplan" and loss_law == "chinchilla":
        notes.append("B_crit(L) was fitted to Kaplan's loss (nats on WebText2); a Chinchilla loss puts it on "
                     "another scale")
    compute = lr = None
    if law == "kaplan":
        if any(f <= 0 for f in factors):
            raise UserError(f"--batch-factors {factors}: must be positive")
        batches = tuple(sorted({round_batch(f * b_crit / s) for f in factors}))
        if batches[0] * s > tokens:
            raise UserError(f"--batch-factors {','.join(f'{f:g}' for f in factors)}: even the smallest batch, "
                            f"{batches[0] * s:,.0f} tokens ({min(factors):g} x B_crit), is more than the whole run "
                            f"({tokens:,.0f} tokens, --tokens): use smaller factors or more tokens")
        if batches[-1] * s > tokens:
            notes.append(f"batches over the whole run's {tokens:,.0f} tokens left out: "
                         + ", ".join(f"{b:,}" for b in batches if b * s > tokens))
            batches = tuple(b for b in batches if b * s <= tokens)
        notes.append("--tokens is what a run processes at B = B_crit; at batch B the same loss takes "
                     "S = S_min (1 + B_crit/B) steps and E = E_min (1 + B/B_crit) tokens, E_min = D/2, "
                     "S_min = D/(2 B_crit) (McCandlish et al. 2018)")
    elif law == "deepseek":
        compute = scaling.deepseek_flops_per_token(model) * tokens
        batches = (round_batch(scaling.deepseek_batch_tokens(compute) / s),)
        lr = scaling.deepseek_learning_rate(compute)
    else:
        batches = (int(global_batch),)
        if global_batch * s > b_crit:
            notes.append(f"the batch ({global_batch * s / 1e6:.3g}M tokens) is {global_batch * s / b_crit:.2g}x "
                         f"B_crit ({b_crit / 1e6:.3g}M): by the S/E trade-off it spends more tokens than needed")
    return Budget(law=law, tokens=float(tokens), tokens_rule=rule, seq_length=s, batches=batches,
                  b_crit_tokens=b_crit, loss=loss, loss_law=loss_law, notes=tuple(notes),
                  compute_flops=compute, learning_rate=lr)


