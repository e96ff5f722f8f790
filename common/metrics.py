"""Train-rollout mismatch metrics from paired per-token logprobs (sampler vs learner).

All are computed on the sampled tokens only, as the RL frameworks log them
(docs/rl-anchors in the shared notes).  Inputs: per sequence, the sampler's ("rollout")
logprob of each sampled token and the learner's ("train") recomputed logprob of the same
token.  Let ``d = rollout - train`` and ``r = train - rollout = -d``, ``rho = exp(r)``.

=====================  =========================================================  ==================
name                   definition                                                 used by
=====================  =========================================================  ==================
``kl_k1``              mean(d): k1 estimate of KL(rollout || train)              verl rollout_corr/kl
``kl_k3``              mean(exp(r) - r - 1)  (>= 0, lower variance)               verl k3_kl
``chi2_token``         mean(rho^2) - 1                                            verl chi2_token
``chi2_seq``           mean over sequences of exp(2 sum r) - 1                    verl chi2_seq
``abs_diff``           mean |d|                                                   miles train_rollout_logprob_abs_diff
``token_mult_prob_err``mean exp(|d|)  (1.0 = identical)                          NeMo-RL token_mult_prob_error
``prob_diff``          mean |exp(train) - exp(rollout)|                          verl rollout_probs_diff
``log_ppl_diff``       mean over sequences of (mean d)  (rollout - train log-ppl) verl log_ppl_diff
``ppl_ratio``          mean over sequences of exp(-mean d)                       verl ppl_ratio
``frac_gt_ln2``        share of tokens with |d| > ln 2                            AReaL
=====================  =========================================================  ==================
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

NAMES = ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "abs_diff", "token_mult_prob_err", "prob_diff",
         "log_ppl_diff", "ppl_ratio", "frac_gt_ln2", "tokens")


def mismatch_metrics(rollout: Sequence[Sequence[float]], train: Sequence[Sequence[float]]) -> dict[str, float]:
    """The table above, from per-sequence lists of token logprobs (same lengths pairwise)."""
    if len(rollout) != len(train):
        raise ValueError(f"{len(rollout)} rollout sequences vs {len(train)} train sequences")
    seqs = []
    for i, (a, b) in enumerate(zip(rollout, train)):
        if len(a) != len(b):
            raise ValueError(f"sequence {i}: {len(a)} rollout logprobs vs {len(b)} train logprobs")
        if len(a):
            seqs.append((torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)))
    if not seqs:
        raise ValueError("no tokens")
    ro = torch.cat([s[0] for s in seqs])
    tr = torch.cat([s[1] for s in seqs])
    d = ro - tr
    r = -d
    seq_d = torch.stack([(a - b).mean() for a, b in seqs])
    seq_r_sum = torch.stack([(b - a).sum() for a, b in seqs])
    return {
        "kl_k1": d.mean().item(),
        "kl_k3": (torch.exp(r) - r - 1).mean().item(),
        "chi2_token": (torch.exp(2 * r).mean() - 1).item(),
        "chi2_seq": (torch.exp(2 * seq_r_sum).mean() - 1).item(),
        "abs_diff": d.abs().mean().item(),
        "token_mult_prob_err": torch.exp(d.abs()).mean().item(),
        "prob_diff": (torch.exp(tr) - torch.exp(ro)).abs().mean().item(),
        "log_ppl_diff": seq_d.mean().item(),
        "ppl_ratio": torch.exp(-seq_d).mean().item(),
        "frac_gt_ln2": (d.abs() > math.log(2)).double().mean().item(),
        "tokens": int(d.numel()),
    }
