"""On-policy distillation (OPD): the student samples, a teacher scores the student's own tokens.

Agarwal et al. 2024 (GKD) train on the student's samples against the teacher; Thinking Machines
("On-Policy Distillation", 2025), Qwen3 and MiMo use the per-token reverse KL KL(student || teacher)
as the learning signal. Miles does it the way those reports and slime do: the negative per-token
log-ratio becomes a (per-token) advantage of the ordinary policy-gradient loss, so every policy
loss, clip, correction and aggregation mode works unchanged.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def reverse_kl_advantages(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, coef: float = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token advantages [B, T] = -coef * (log pi_student - log pi_teacher) on the sampled tokens.

    Tokens are sampled from the student, so the mean of the log-ratio over them is the k1 estimate
    of the reverse KL; a policy-gradient step with these advantages is a step down that KL with a
    discount of 0 (each token is credited with its own log-ratio only, as in the Thinking Machines
    recipe). Tokens the teacher finds likelier than the student get a positive advantage.
    `student_logp` must be the log-probs of the policy that sampled (the old policy), not a
    differentiable forward: these are constants, like any advantage. 0 outside `mask`.
    Metric `reverse_kl`: token mean of the log-ratio over `mask` (the k1 estimate).
    """
    log_ratio = torch.where(mask > 0, student_logp - teacher_logp, torch.zeros_like(student_logp))
    reverse_kl = log_ratio.sum() / mask.sum().clamp(min=1)
    return -coef * log_ratio, {"reverse_kl": reverse_kl}
