"""Native torch rollout engine: batched KV-cache generation with the trainer's own model modules.

Prompts are left-padded into one batch, prefilled once, then decoded a token at a time with a
preallocated KV cache; n samples per prompt are n rows of the batch. Plain class: `miles.orchestrate`
wraps it in a Ray actor, tests and the GPU machine call it directly.

    engine = NativeEngine("ckpt_dir", RolloutCfg(), DType.fp32)
    samples = engine.generate(["12+30="], ["42"], n=4)
"""

from __future__ import annotations

import torch

from miles.config.schema import DType, RolloutCfg
from miles.data.tokenizer import TokenizerInfo, encode_prompt
from miles.models import from_pretrained
from miles.orchestrate.weight_sync import TORCH_DTYPES, WeightSyncError, checksum
from miles.rollout.sampling import sample_next
from miles.types import FinishReason, Sample


class NativeEngine:
    def __init__(
        self,
        checkpoint_dir: str,
        cfg: RolloutCfg,
        dtype: DType = DType.fp32,
        device: str = "cpu",
        threads: int | None = None,
        seed: int = 0,
    ):
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[DType(dtype)]
        self.model = from_pretrained(checkpoint_dir, dtype=self.dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.tok = TokenizerInfo.load(checkpoint_dir)
        stop = {self.tok.eos_id} if self.tok.eos_id is not None else set()
        for text in cfg.stop_tokens:
            token_id = self.tok.tokenizer.token_to_id(text)
            if token_id is None:
                raise ValueError(f"rollout.stop_tokens: {text!r} is not a token of the tokenizer")
            stop.add(token_id)
        self.stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=self.device)
        self.pad_id = self.tok.pad_id if self.tok.pad_id is not None else 0
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def decode(self, ids: list[int]) -> str:
        return self.tok.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        labels: list[str],
        n: int = 1,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> list[Sample]:
        """n samples for each prompt, grouped: samples[i*n:(i+1)*n] answer prompts[i]."""
        cfg = self.cfg
        temperature = cfg.temperature if temperature is None else temperature
        max_new = max_new_tokens or cfg.max_new_tokens
        prompt_ids = [encode_prompt(self.tok, p) for p in prompts for _ in range(n)]
        batch, width = len(prompt_ids), max(len(p) for p in prompt_ids)
        limit = self.model.config.max_position_embeddings
        if width + max_new > limit:
            raise ValueError(
                f"prompt ({width} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                f"max_position_embeddings ({limit}); lower rollout.max_new_tokens"
            )
        tokens = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, ids in enumerate(prompt_ids):
            tokens[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        cache = self.model.new_cache(batch, width + max_new, dtype=self.dtype, device=self.device)
        logits = self.model(tokens, attention_mask=mask, position_ids=positions, cache=cache)[:, -1]
        out = torch.full((batch, max_new), self.pad_id, dtype=torch.long, device=self.device)
        out_lp = torch.zeros(batch, max_new, device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.full((batch,), max_new, dtype=torch.long, device=self.device)
        position = positions[:, -1:]
        for t in range(max_new):
            next_tok, next_lp = sample_next(logits, temperature, cfg.top_p, cfg.top_k, self.generator)
            next_tok = next_tok.masked_fill(finished, self.pad_id)
            out[:, t], out_lp[:, t] = next_tok, next_lp
            stopped = torch.isin(next_tok, self.stop_ids) & ~finished
            lengths[stopped] = t + 1
            finished |= stopped
            if bool(finished.all()) or t == max_new - 1:
                break
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=self.device)], dim=1)
            position = position + 1
            logits = self.model(next_tok[:, None], attention_mask=mask, position_ids=position, cache=cache)[:, -1]

        out, out_lp, lengths, finished = out.cpu().tolist(), out_lp.cpu().tolist(), lengths.tolist(), finished.tolist()
        samples = []
        for i, ids in enumerate(prompt_ids):
            resp = out[i][: lengths[i]]
            samples.append(
                Sample(
                    prompt=prompts[i // n],
                    label=labels[i // n],
                    prompt_ids=ids,
                    response_ids=resp,
                    rollout_logprobs=out_lp[i][: lengths[i]],
                    response=self.decode(resp),
                    finish_reason=FinishReason.stop if finished[i] else FinishReason.length,
                    group=i // n,
                )
            )
        return samples

    def update_weights(self, weights: dict[str, torch.Tensor], expected_checksum: str | None = None) -> str:
        """Load trainer weights (already in this engine's dtype); verify them when a checksum is given."""
        self.model.load_state_dict(weights, strict=True)
        if expected_checksum is None:
            return ""
        held = checksum(self.model.state_dict())
        if held != expected_checksum:
            raise WeightSyncError(f"engine weights checksum {held[:12]} != trainer's {expected_checksum[:12]}")
        return held
