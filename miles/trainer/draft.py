"""Online training of the speculative-decoding draft (rollout.speculative) on every step's batch.

    draft = DraftTrainer("mtp", policy, trainer_cfg, lr=spec.draft_lr)           # the policy's MTP modules
    draft = DraftTrainer.from_checkpoint(draft_dir, trainer_cfg, lr=spec.draft_lr)  # a separate small model
    metrics = draft.train(batch)   # one AdamW step: spec/draft_loss, spec/draft_accuracy, spec/draft_grad_norm

The engine proposes tokens with the draft and verifies them with the policy (miles/rollout/
speculative.py): the closer the draft's distribution is to the policy's, the more proposals are kept.
The policy moves every RL step, so the draft is fine-tuned on each step's batch, after the policy
update, toward the policy that samples the next rollout. The loss is the NLL of the batch's tokens
(samples of the policy, or the SFT data) at the positions the policy's loss mask scores (the response
tokens), under softmax(logits / temperature): the distribution the engine draws draft tokens from at
the rollout temperature, whose cross-entropy to the policy's samples is lowest at the policy's own
sampling distribution.

Two kinds of draft (TrainBatch positions: tokens[:, t + 1] is scored at loss_mask[:, t]):
- "draft_model": a separate CausalLM with the policy's tokenizer, fp32 master weights, every one of
  its parameters trained (it shares nothing with the policy). Position t predicts tokens[:, t + 1]:
  the next-token NLL at the loss mask's positions.
- "mtp": the policy's own multi-token-prediction modules (`policy.mtp`, DeepSeek-V3 / GLM-4.5 /
  Qwen3-Next); only their parameters are trained. Alignment, with h_t the policy's final-norm hidden
  state at position t (it predicts tokens[t + 1]):
    depth 0 at position t: mtp_forward(h_t, tokens[t + 1]) predicts tokens[t + 2]; it is scored
      where tokens[t + 2] is a loss token, loss_mask[t + 1], for t = 0 .. T - 3;
    depth j at position t: mtp_forward(g^{j-1}_t, tokens[t + 1 + j]) predicts tokens[t + 2 + j],
      scored at loss_mask[t + 1 + j], where g^{j-1}_t is depth j - 1's output hidden state at t (the
      chain of DeepSeek-V3's MTP: its k-th module combines h^{k-1}_i with Emb(t_{i+k})).
  In arrays: depth j runs on hidden [:, :T-1-j] and tokens[:, j+1:], and its first T-2-j outputs
  are scored against tokens[:, j+2:] under loss_mask[:, j+1:]. With several depths the loss is the
  mean over depths of each depth's token-mean NLL, as DeepSeek-V3's L_MTP = (1/D) sum_k L_MTP^k
  (lambda = 1 here: the MTP loss is the only loss this optimizer sees); gradients flow down the
  chain of MTP modules as in DeepSeek-V3.
  Gradients stay out of everything the MTP shares with the policy: the policy's hidden states come
  from a no-grad forward (detached), the MTP embeds its input tokens with the shared embedding
  detached (`detach_embedding=True`), and its logits use the shared head matrix detached; backward
  runs with `inputs=` the MTP parameters only, so no other tensor ever receives a gradient. Those
  shared parts belong to the policy, which the RL loss alone updates: a draft gradient there would
  change the sampling distribution outside the RL update (and leak into the policy optimizer's next
  step), and pulling the trunk toward a better MTP input would trade the policy's quality for
  acceptance. The policy's optimizer, for its part, holds no MTP parameter (TorchTrainer).

The step: micro-batches of `trainer.micro_batch_size` padded rows (cut after the micro-batch's last
loss target: later tokens change no scored position in a causal model), a backward per micro-batch
with the normalizer of the whole batch (each depth's number of scored positions), so the step's loss
is the token mean over the whole batch; then clipping at trainer.grad_clip and one AdamW step
(lr = rollout.speculative.draft_lr, trainer.adam_beta1 / adam_beta2 / weight_decay). Under the trainer's
autocast, through the chunked head (miles/trainer/chunked_ce.py). Metrics, of the draft before the
step: `spec/draft_loss` (the loss above), `spec/draft_accuracy` (the share of scored positions
whose draft argmax equals the batch's token; with several depths the mean over depths, and per
depth `spec/draft_{loss,accuracy}_depth{j}`), `spec/draft_grad_norm` (before clipping).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from miles.config.schema import TrainerCfg
from miles.models import CausalLM, from_pretrained
from miles.trainer.chunked_ce import CHUNK_TOKENS, hidden_logprobs
from miles.trainer.packing import to_device
from miles.types import TrainBatch

MTP_PREFIX = "mtp."  # state-dict names of the policy's MTP modules
KINDS = ("mtp", "draft_model")


class DraftTrainer:
    def __init__(self, kind: str, model: CausalLM, cfg: TrainerCfg, lr: float,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS,
                 policy_hidden: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """kind "mtp": `model` is the policy, whose `mtp` modules are trained; `policy_hidden(ids)`
        gives its final-norm hidden states [B, T, H] (default `model(ids, return_hidden=True)`; the
        trainer passes its precision recipe's forward). kind "draft_model": `model` is the draft
        itself (fp32), every parameter trained. `autocast()`: the context of every forward (the
        trainer's); `temperature`: the rollout's sampling temperature (0 counts as 1)."""
        if kind not in KINDS:
            raise ValueError(f"unknown draft kind {kind!r} (rollout.speculative.kind); valid: {', '.join(KINDS)}")
        self.kind, self.model, self.cfg = kind, model, cfg
        self.autocast, self.chunk_tokens = autocast, chunk_tokens
        self.temperature = temperature if temperature > 0 else 1.0
        if kind == "mtp":
            if getattr(model, "mtp", None) is None or len(model.mtp) == 0:
                raise ValueError("rollout.speculative.kind=mtp needs a policy with MTP modules (model.mtp_layers "
                                 f"> 0); this one (family {model.config.family}) has model.mtp_layers="
                                 f"{model.config.mtp_layers}: set model.mtp_layers, or speculative.kind=draft_model")
            self.params = [p for p in model.mtp.parameters() if p.requires_grad]
            self.depths = len(model.mtp)
            self.policy_hidden = policy_hidden or (lambda ids: model(ids, return_hidden=True))
        else:
            self.params = [p for p in model.parameters() if p.requires_grad]
            self.depths = 1
        device = self.params[0].device
        kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           weight_decay=cfg.weight_decay, **kernel)

    @classmethod
    def from_checkpoint(cls, draft_dir: str, cfg: TrainerCfg, lr: float, device: str | torch.device = "cpu",
                        **kwargs) -> "DraftTrainer":
        """A "draft_model" trainer of the HF checkpoint `draft_dir`, fp32 master weights on `device`."""
        model = from_pretrained(draft_dir, dtype=torch.float32).to(torch.device(device))
        return cls("draft_model", model.train(), cfg, lr, **kwargs)

    @property
    def owns_model(self) -> bool:
        """Whether `model` is the draft's own (draft_model), not the policy (mtp)."""
        return self.kind == "draft_model"

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def _shift(self, depth: int) -> int:
        """The loss-mask column of a depth's prediction at position t is t + shift: tokens[t + 1]
        for the draft model, tokens[t + 2 + depth] for MTP depth `depth` (see the module docstring)."""
        return 0 if self.kind == "draft_model" else 1 + depth

    # ----------------------------------------------------------------------------- the step
    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of the draft on `batch`; its metrics (see the module docstring)."""
        mask = batch.loss_mask > 0  # host [N, T-1]
        counts = [int(mask[:, self._shift(j):].sum()) for j in range(self.depths)]
        live = [j for j in range(self.depths) if counts[j] > 0]
        zero = torch.zeros((), device=self.device)
        nll, correct = {j: zero.clone() for j in live}, {j: zero.clone() for j in live}  # summed per depth
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(batch), self.cfg.micro_batch_size):
            rows = slice(start, start + self.cfg.micro_batch_size)
            m = mask[rows]
            scored = m.any(0).nonzero()
            if not live or len(scored) == 0:
                continue
            width = int(scored[-1]) + 2  # tokens up to the micro-batch's last scored target
            tokens, m = batch.tokens[rows, :width], m[:, :width - 1]
            loss = zero
            for depth, hidden, weight in self._heads(tokens, live):
                shift = self._shift(depth)
                at = m[:, shift:]  # [n, width - 1 - shift]: position t scores tokens[t + 1 + shift]
                src = at.reshape(-1).nonzero().squeeze(1)
                if len(src) == 0:
                    continue
                targets = to_device(tokens[:, 1 + shift:].reshape(-1)[src], self.device)
                h = hidden[:, :at.shape[1]].flatten(0, 1).index_select(0, to_device(src, self.device))
                with self.autocast():
                    logp, _ = hidden_logprobs(h, weight, targets, self.temperature, chunk_tokens=self.chunk_tokens)
                    hits = _argmax_hits(h.detach(), weight.detach(), targets, self.chunk_tokens)
                total = logp.sum()
                nll[depth] = nll[depth] - total.detach()
                correct[depth] = correct[depth] + hits
                loss = loss - total / (counts[depth] * len(live))
            if loss.requires_grad:
                loss.backward(inputs=self.params)  # the draft's parameters, nothing the policy owns
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        self.optimizer.step()
        per_loss = [nll[j] / counts[j] for j in live]
        per_acc = [correct[j] / counts[j] for j in live]
        mean = (lambda xs: torch.stack(xs).mean()) if live else (lambda xs: zero)  # noqa: E731
        names = ["spec/draft_loss", "spec/draft_accuracy", "spec/draft_grad_norm"]
        values = [mean(per_loss), mean(per_acc), grad_norm.to(self.device, torch.float32)]
        if self.depths > 1:
            names += [f"spec/draft_{what}_depth{j}" for what in ("loss", "accuracy") for j in live]
            values += per_loss + per_acc
        return dict(zip(names, torch.stack(values).tolist()))

    def _heads(self, tokens: torch.Tensor, depths: list[int]):
        """(depth, hidden states [n, width - 1 - depth', H] at positions 0.., head matrix) of one
        micro-batch's padded rows `tokens` [n, width] (host), for each trained depth in order;
        position t of depth j's hidden predicts tokens[t + 1 + shift(j)]."""
        ids = to_device(tokens, self.device)
        if self.kind == "draft_model":
            with self.autocast():
                hidden = self.model(ids[:, :-1], return_hidden=True)
            yield 0, hidden, self.model.output_weight
            return
        with torch.no_grad(), self.autocast():  # the policy's hidden states, detached
            hidden = self.policy_hidden(ids[:, :-1])  # [n, width - 1]: positions 0 .. width - 2
        weight = self.model.output_weight.detach()  # the shared head: no gradient into it
        for depth in range(max(depths) + 1):
            if hidden.shape[1] == 0:
                return
            with self.autocast():  # depth j: hidden at t with the token at t + 1 + j
                hidden = self.model.mtp_forward(hidden, ids[:, depth + 1:], depth=depth, return_hidden=True,
                                                detach_embedding=True)
            if depth in depths:
                yield depth, hidden, weight
            hidden = hidden[:, :-1]  # the last position's next input token lies past the row

    # ----------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """The optimizer state, and the draft model's weights for kind draft_model (the MTP modules'
        weights are the policy's: they are saved with it)."""
        state = {"kind": self.kind, "optimizer": self.optimizer.state_dict()}
        if self.owns_model:
            state["model"] = self.model.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind", self.kind) != self.kind:
            raise ValueError(f"a {state['kind']} draft's state cannot load into a {self.kind} draft "
                             "(rollout.speculative.kind changed)")
        if self.owns_model:
            self.model.load_state_dict(state["model"])  # in place: the optimizer's parameters stay
        self.optimizer.load_state_dict(state["optimizer"])


@torch.no_grad()
def _argmax_hits(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """How many rows of `hidden` [M, H] have argmax(hidden @ weight.T) == targets, chunk by chunk
    (under the caller's autocast: the head's matmul in its dtype)."""
    chunk = chunk if chunk > 0 else max(len(hidden), 1)
    hits = torch.zeros((), device=hidden.device)
    for start in range(0, len(hidden), chunk):
        best = F.linear(hidden[start:start + chunk], weight).argmax(-1)
        hits += (best == targets[start:start + chunk]).sum()
    return hits
