"""Micro-batches of one optimizer step, padded or packed, with the map back to the padded layout.

Whatever the model sees, the losses see the step's samples as the TrainBatch holds them: right-padded
rows [n, T-1] per micro-batch (`MicroBatch.index` says which samples), so every policy loss and
aggregation mode computes exactly what it computes without packing. Only the model input differs:
- padded (`padded_micro_batches`): `size` consecutive samples, rows tokens[:, :-1] as they are;
- packed (`packed_micro_batches`): each sample's tokens up to its last loss target (in a causal model
  later tokens change no loss position), placed best-fit decreasing into rows of `row_tokens`
  tokens; `segment_ids` number the samples of a row (0 = the row's padded tail), `position_ids`
  restart at 0 for each. Rows then fill micro-batches of at most `max_tokens` tokens.
Both give, for every loss position, `src` (its flat index in the forward's [R * L] tokens), `dst`
(its flat index in the micro-batch's [n * (T-1)] loss layout) and `targets` (the token it predicts).
When the batch carries the engine's routed experts (R3), `routing` holds them laid out exactly as
`input_ids` (gathered with the same index arithmetic; expert 0 on padding), ready to replay.
Several LoRA adapters: `adapter_ids` gives each row (padded, [R, 1]) or each token (packed, [R, L];
adapter 0 on a row's tail) its sample's adapter, the route of the forward (miles/models/lora.py);
prompts are shared only between samples of one adapter.
A vision-language model's micro-batch carries its mRoPE positions the same way (each sample's own,
computed on its whole sequence) and the images of the prompts it lays out, in layout order (a
prompt laid out once for its n samples, shared_prompt_micro_batches, brings its images once), so
every packing keeps each sample's images with it.
Plans are built on the host; `MicroBatch.to` moves one to the device without a host sync.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields, replace
from typing import Optional

import numpy as np
import torch

from miles.config.schema import TrainerCfg
from miles.models import CausalLM
from miles.models.attention import Attention
from miles.models.packed import uses_varlen
from miles.types import TrainBatch


@dataclass
class MicroBatch:
    index: torch.Tensor  # [n] long: which samples of the step, in the order of the loss layout's rows
    input_ids: torch.Tensor  # [R, L] long
    src: torch.Tensor  # [M] long: loss positions as flat indices into the R * L forward tokens
    dst: torch.Tensor  # [M] long: the same positions as flat indices into n * width
    targets: torch.Tensor  # [M] long: the token each loss position predicts
    width: int  # T - 1 of the step's batch
    segment_ids: Optional[torch.Tensor] = None  # [R, L] packed rows: 1..k per sample, 0 = tail
    position_ids: Optional[torch.Tensor] = None  # [R, L] packed rows: 0.. per sample
    branch_ids: Optional[torch.Tensor] = None  # [R, L] shared prompts: 0 = a prompt, 1..n its responses
    cu_seqlens: Optional[torch.Tensor] = None  # [S + 1] int32: row-major bounds of samples and tails
    max_seqlen: int = 0  # longest of those blocks
    # Packed rows: (flat index, sample, position) of every laid-out token, on the host (vision inputs are gathered by it).
    layout: Optional[tuple] = None
    routing: Optional[torch.Tensor] = None  # [R, L, moe_layers, k] the engine's experts per input token (R3)
    selected_keys: Optional[torch.Tensor] = None  # [R, L, index_layers, index_topk] DSA keys kept (R3; padded)
    mrope_position_ids: Optional[torch.Tensor] = None  # [3, R, L] a VLM's positions (miles.models.vlm)
    image_mask: Optional[torch.Tensor] = None  # [R, L] the prompts' image placeholders (not a response's image tokens)
    video_mask: Optional[torch.Tensor] = None  # [R, L] the prompts' video placeholders
    # The laid-out prompts' image and video inputs (miles.models.vlm.VisionLM's keys), in layout order.
    vision: Optional[dict] = None
    adapter_ids: Optional[torch.Tensor] = None  # [R, 1] or [R, L] long: several LoRA adapters, each row's / token's

    def vision_inputs(self) -> dict:
        """The keyword inputs of a VisionLM forward ({} for a text model)."""
        if self.mrope_position_ids is None:
            return {}
        return {"mrope_position_ids": self.mrope_position_ids, "image_mask": self.image_mask,
                "video_mask": self.video_mask, **(self.vision or {})}

    @property
    def num_samples(self) -> int:
        return len(self.index)

    def to(self, device: torch.device) -> "MicroBatch":
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        vision = None if self.vision is None else {k: to_device(v, device) for k, v in self.vision.items()}
        return replace(self, vision=vision,
                       **{k: to_device(v, device) for k, v in tensors.items() if isinstance(v, torch.Tensor)})

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-loss-position values [M] -> [n, width] (0 elsewhere); differentiable."""
        out = values.new_zeros(self.num_samples * self.width)
        return out.index_copy(0, self.dst, values).view(self.num_samples, self.width)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> CUDA from pinned memory, asynchronously: a plain .to() from pageable memory waits for
    the copy, and with it for all the work queued before it. Made contiguous first: a strided
    source would be staged through pageable memory again."""
    if t.device.type != "cpu" or device.type != "cuda":  # only host memory can be pinned
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """The batch's tensors on the device; its images stay where they are (the micro-batches move theirs)."""
    return replace(batch, **{f.name: to_device(getattr(batch, f.name), device) for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def select(batch: TrainBatch, index: torch.Tensor) -> TrainBatch:
    """The rows `index` of every per-sample tensor or list (optional fields left empty stay empty)."""
    def rows(t):
        if isinstance(t, list):
            return [t[i] for i in index.tolist()] if t else t
        return t.index_select(0, index) if len(t) else t

    return replace(batch, **{f.name: rows(getattr(batch, f.name)) for f in fields(batch)})


def plan_micro_batches(batch: TrainBatch, model: CausalLM, cfg: TrainerCfg, device: torch.device,
                       compute_dtype: torch.dtype) -> list[MicroBatch]:
    """The micro-batches of `batch` for `model` under `cfg` (pack_sequences, max_tokens_per_micro_batch,
    micro_batch_size), on the device. With the variable-length kernel a micro-batch is one row
    (attention costs sum len_i^2 however long the row is); with the masked kernel rows are as wide
    as the longest sample (a row of L costs L^2), several per micro-batch.
    A VLM's micro-batches carry their mRoPE positions and images (`with_vision`)."""
    if len(batch.images) and model.config.vision is None:
        raise ValueError(f"the batch carries images but the model ({model.config.family}) has no vision tower")
    if not (cfg.pack_sequences and model.supports_packing):
        plan = padded_micro_batches(batch, cfg.micro_batch_size)
    else:
        varlen = (all(type(layer.attn) is Attention for layer in model.layers)
                  and uses_varlen(device, compute_dtype, model.config.head_dim))
        max_tokens = cfg.max_tokens_per_micro_batch
        if cfg.share_prompts and not varlen:  # the masked kernel takes the prompt-sharing mask
            plan = shared_prompt_micro_batches(batch, max_tokens)
        else:
            plan = packed_micro_batches(batch, max_tokens, max_tokens if varlen else None)
    if model.config.vision is not None:
        masks = prompt_placeholders(batch, model.config)
        mrope = batch_mrope_positions(batch, model.config, masks)
        plan = [with_vision(mb, batch, mrope, masks) for mb in plan]
    return [mb.to(device) for mb in plan]


def prompt_placeholders(batch: TrainBatch, config) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, T] image, [N, T] video) placeholders of each sample's prompt (the tokens before its
    first loss target): an image or video token the policy sampled in a response is text."""
    from miles.models.vlm import placeholders

    mask = batch.loss_mask > 0
    prompt_len = torch.where(mask.any(-1), mask.int().argmax(-1) + 1, batch.tokens.shape[1])
    in_prompt = torch.arange(batch.tokens.shape[1]) < prompt_len[:, None]
    image, video = placeholders(batch.tokens, config)
    return image & in_prompt, video & in_prompt


def batch_mrope_positions(batch: TrainBatch, config, masks: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Each sample's mRoPE positions [N, 3, T] on its own right-padded row (pads after the sample
    change no position of it), as the engine gave its prompt and response."""
    from miles.models.vlm import mrope_positions

    def joined(key):
        parts = [im[key] for im in batch.images if im is not None and key in im]
        return torch.cat(parts) if parts else None

    return mrope_positions(batch.tokens, joined("image_grid_thw"), config, image_mask=masks[0],
                           video_grid_thw=joined("video_grid_thw"), second_per_grid_ts=joined("second_per_grid_ts"),
                           video_mask=masks[1]).transpose(0, 1)


def with_vision(mb: MicroBatch, batch: TrainBatch, mrope: torch.Tensor,
                masks: tuple[torch.Tensor, torch.Tensor]) -> MicroBatch:
    """`mb` with its mRoPE positions and image / video placeholders (each input token's, gathered
    from `mrope` [N, 3, T] and `masks` ([N, T] each) as the tokens were) and the images and videos
    of the prompts it lays out, in the order their tokens appear."""
    r, cols = mb.input_ids.shape
    if mb.segment_ids is None:  # padded: sample mb.index[k] in row k from column 0
        flat = torch.arange(r * cols)
        sample, pos = mb.index.repeat_interleave(cols), torch.arange(cols).repeat(r)
    else:
        flat, sample, pos = mb.layout
    positions = torch.zeros(3, r * cols, dtype=torch.long)
    positions[:, flat] = mrope[sample, :, pos].T
    laid_out = []
    for mask in masks:
        placeholders = torch.zeros(r * cols, dtype=torch.bool)
        placeholders[flat] = mask[sample, pos]
        laid_out.append(placeholders.view(r, cols))
    starts = pos == 0  # where a sample's prompt is laid out
    owners = sample[starts][flat[starts].argsort()].tolist()
    inputs = [batch.images[i] for i in owners if batch.images and batch.images[i] is not None]
    keys = sorted({key for im in inputs for key in im})
    vision = {key: torch.cat([im[key] for im in inputs if key in im]) for key in keys}
    return replace(mb, mrope_position_ids=positions.view(3, r, cols), image_mask=laid_out[0], video_mask=laid_out[1],
                   vision=vision or None)


def padded_micro_batches(batch: TrainBatch, size: int) -> list[MicroBatch]:
    return [_padded(batch, start, min(start + size, len(batch))) for start in range(0, len(batch), size)]


def _padded(batch: TrainBatch, start: int, end: int) -> MicroBatch:
    tokens, mask = batch.tokens[start:end], batch.loss_mask[start:end]
    src = (mask.reshape(-1) > 0).nonzero().squeeze(1)
    routing = batch.routed_experts[start:end, :-1] if len(batch.routed_experts) else None
    keys = batch.selected_keys[start:end, :-1] if len(batch.selected_keys) else None
    adapters = batch.adapter_ids[start:end, None] if len(batch.adapter_ids) else None
    return MicroBatch(index=torch.arange(start, end), input_ids=tokens[:, :-1], src=src, dst=src,
                      targets=tokens[:, 1:].reshape(-1)[src], width=mask.shape[1], routing=routing,
                      selected_keys=keys, adapter_ids=adapters)


def _gather_routing(batch: TrainBatch, shape: tuple[int, int], flat: torch.Tensor, sample: torch.Tensor,
                    pos: torch.Tensor) -> Optional[torch.Tensor]:
    """The batch's routed experts in a packed layout of `shape` (R, L): token (sample, pos) goes to
    flat index `flat`, as input_ids; None when the batch has none."""
    if not len(batch.routed_experts):
        return None
    experts = batch.routed_experts
    out = experts.new_zeros(shape[0] * shape[1], *experts.shape[2:])
    out[flat] = experts[sample, pos]
    return out.view(*shape, *experts.shape[2:])


def _gather_adapters(batch: TrainBatch, shape: tuple[int, int], flat: torch.Tensor,
                     sample: torch.Tensor) -> Optional[torch.Tensor]:
    """Each laid-out token's adapter (its sample's) in a packed layout of `shape`; None without adapters."""
    if not len(batch.adapter_ids):
        return None
    out = torch.zeros(shape[0] * shape[1], dtype=torch.long)
    out[flat] = batch.adapter_ids[sample]
    return out.view(shape)


def packed_micro_batches(batch: TrainBatch, max_tokens: int, row_tokens: int | None = None) -> list[MicroBatch]:
    """Samples packed into rows of `row_tokens` tokens (None or less than the longest sample: the
    longest sample's length), rows grouped max_tokens // row length per micro-batch (at least one).
    Samples without loss tokens add nothing to any loss and are left out; a step with none at all
    gets the padded layout, so that it still runs one (zero) backward."""
    mask = batch.loss_mask > 0
    width = mask.shape[1]
    has_loss = mask.any(-1)
    if not has_loss.any():
        return padded_micro_batches(batch, len(batch))
    last = width - 1 - mask.flip(-1).int().argmax(-1)  # last loss position of each sample
    lengths = torch.where(has_loss, last + 1, 0).tolist()
    capacity = max(row_tokens or 0, max(lengths))
    rows = best_fit_decreasing(lengths, capacity)
    per_micro_batch = max(1, max_tokens // capacity)
    return [_packed(batch, rows[i:i + per_micro_batch], lengths) for i in range(0, len(rows), per_micro_batch)]


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of the non-empty lengths in bins of at most `capacity` (each length <= capacity):
    longest first, each into the fullest bin that still takes it. Within 11/9 of the fewest bins
    (as first-fit decreasing), so rows waste little; order inside a row does not change any loss."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), ascending
    for i in order:
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k == len(free):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = free.pop(k)
            bins[b].append(i)
            room -= lengths[i]
        bisect.insort(free, (room, b))
    return bins


def _packed(batch: TrainBatch, rows: list[list[int]], lengths: list[int]) -> MicroBatch:
    width = batch.loss_mask.shape[1]
    samples = [i for row in rows for i in row]
    n = torch.tensor([lengths[i] for i in samples])
    fill = [sum(lengths[i] for i in row) for row in rows]
    r, cols = len(rows), max(fill)
    # Where each sample starts in the flattened [R * L] rows, and each token's place within its sample.
    starts = torch.tensor([k * cols + sum(lengths[i] for i in row[:j]) for k, row in enumerate(rows)
                           for j in range(len(row))])
    owner = torch.repeat_interleave(torch.arange(len(samples)), n)  # token -> sample (rank in `samples`)
    pos = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)
    flat = starts[owner] + pos
    sample = torch.tensor(samples)[owner]
    input_ids = torch.zeros(r * cols, dtype=torch.long)
    input_ids[flat] = batch.tokens[sample, pos]
    segment_ids, position_ids = torch.zeros(r * cols, dtype=torch.long), torch.zeros(r * cols, dtype=torch.long)
    segment_ids[flat] = torch.tensor([j + 1 for row in rows for j in range(len(row))])[owner]
    position_ids[flat] = pos
    is_loss = batch.loss_mask[sample, pos] > 0
    # Blocks of the variable-length kernel: every sample, and each row's tail as a block of its own.
    tails = [k * cols + f for k, f in enumerate(fill) if f < cols]
    bounds = torch.cat([starts, torch.tensor(tails, dtype=torch.long), torch.tensor([r * cols])]).sort().values
    return MicroBatch(
        index=torch.tensor(samples), input_ids=input_ids.view(r, cols), src=flat[is_loss],
        dst=(owner * width + pos)[is_loss], targets=batch.tokens[sample, pos + 1][is_loss], width=width,
        segment_ids=segment_ids.view(r, cols), position_ids=position_ids.view(r, cols),
        cu_seqlens=bounds.to(torch.int32), max_seqlen=int((bounds[1:] - bounds[:-1]).max()),
        routing=_gather_routing(batch, (r, cols), flat, sample, pos), layout=(flat, sample, pos),
        adapter_ids=_gather_adapters(batch, (r, cols), flat, sample),
    )


def shared_prompt_micro_batches(batch: TrainBatch, max_tokens: int) -> list[MicroBatch]:
    """Packed rows where the samples of one prompt share its tokens: each group is laid out as the
    prompt once, then every sample's response tokens (positions continuing after the prompt), and
    `branch_ids` keep each response from seeing the others. The prompt's last token predicts every
    sample's first response token, so its hidden state serves n loss positions. Groups are samples
    whose tokens before their first loss target are equal (the n samples of a prompt); rows are as
    wide as the longest group, best-fit decreasing, max_tokens // width rows per micro-batch.
    Image prompts share only with the same images, and a prompt only with samples of its LoRA adapter."""
    mask = batch.loss_mask > 0
    width = mask.shape[1]
    has_loss = mask.any(-1)
    if not has_loss.any():
        return padded_micro_batches(batch, len(batch))
    last = (width - 1 - mask.flip(-1).int().argmax(-1)).tolist()
    first = mask.int().argmax(-1).tolist()
    # One host list of all tokens (and adapters): indexing the tensors per sample cost ~2 us a call.
    tokens = batch.tokens.tolist()
    adapters = batch.adapter_ids.tolist() if len(batch.adapter_ids) else None
    groups: dict[tuple, list[int]] = {}
    for i in has_loss.nonzero().squeeze(1).tolist():
        prompt = first[i] + 1  # tokens [0, prompt) are shared: the last of them predicts the first target
        adapter = int(adapters[i]) if adapters is not None else None  # a prompt computes under one adapter
        key = (prompt, tuple(tokens[i][:prompt]), _image_key(batch, i), adapter)
        groups.setdefault(key, []).append(i)
    units = [(key[0], members) for key, members in groups.items()]
    sizes = [prompt + sum(last[i] + 1 - prompt for i in members) for prompt, members in units]
    capacity = max(sizes)
    rows = best_fit_decreasing(sizes, capacity)
    per_micro_batch = max(1, max_tokens // capacity)
    return [_shared(batch, [[units[u] for u in row] for row in rows[k:k + per_micro_batch]], last)
            for k in range(0, len(rows), per_micro_batch)]


def _image_key(batch: TrainBatch, i: int):
    """What tells two prompts of equal tokens apart: their images (placeholders are the same ids)."""
    inputs = batch.images[i] if batch.images else None
    return None if inputs is None else hash(tuple(inputs[key].numpy().tobytes() for key in sorted(inputs)))


def _shared(batch: TrainBatch, rows: list[list[tuple[int, list[int]]]], last: list[int]) -> MicroBatch:
    width = batch.loss_mask.shape[1]
    sizes = [[prompt + sum(last[i] + 1 - prompt for i in members) for prompt, members in row] for row in rows]
    cols = max(sum(row) for row in sizes)
    # The layout as blocks of consecutive tokens (a group's prompt, then each member's response), in
    # layout order: (flat start, sample, first position, length, segment, branch). Python walks the
    # groups and samples only; every per-token index comes from array ops below (the per-token Python
    # loops cost 3 ms at 64 samples x 8 tokens and ~20-60 ms at 512: issue 28). Same tensors, same order.
    blocks: list[tuple[int, int, int, int, int, int]] = []
    samples, group_of, response_of, prompt_of = [], [], [], []  # per laid-out sample, in `samples` order
    for k, row in enumerate(rows):
        start = k * cols
        for j, ((prompt, members), size) in enumerate(zip(row, sizes[k])):
            blocks.append((start, members[0], 0, prompt, j + 1, 0))
            offset = start + prompt
            for b, i in enumerate(members, 1):
                n = last[i] + 1 - prompt
                blocks.append((offset, i, prompt, n, j + 1, b))
                samples.append(i)
                group_of.append(start)
                response_of.append(offset)
                prompt_of.append(prompt)
                offset += n
            start += size
    # The index arithmetic and the gathers run in numpy: single-threaded, where torch's
    # repeat_interleave splits even a few thousand elements over the OpenMP team (grain size 1) and
    # its index kernels waited 2-7 ms a call for a second thread on a busy 2-core machine.
    start_, sample_, pos_, length, segment_, branch_ = np.array(blocks, dtype=np.int64).T
    block = np.repeat(np.arange(len(blocks)), length)  # token -> its block
    within = np.arange(len(block)) - np.repeat(length.cumsum() - length, length)
    flat, sample, pos = start_[block] + within, sample_[block], pos_[block] + within
    tokens = batch.tokens.detach().cpu().numpy().astype(np.int64, copy=False)
    r = len(rows)
    input_ids, position_ids, segment_ids, branch_ids = np.zeros((4, r * cols), dtype=np.int64)
    input_ids[flat], position_ids[flat] = tokens[sample, pos], pos
    segment_ids[flat], branch_ids[flat] = segment_[block], branch_[block]
    # Loss positions of each sample (in its padded row, row-major: sample by sample, t ascending) and
    # where its forward computed them: t in its group's prompt, else in its own response.
    index = np.array(samples, dtype=np.int64)
    rank, t = (a.astype(np.int64) for a in np.nonzero(batch.loss_mask.detach().cpu().numpy()[index] > 0))
    group, response, prompt = (np.array(v, dtype=np.int64)[rank] for v in (group_of, response_of, prompt_of))
    src = np.where(t < prompt, group + t, response + t - prompt)
    flat, sample, pos, index = (torch.from_numpy(a) for a in (flat, sample, pos, index))
    input_ids, position_ids, segment_ids, branch_ids = (torch.from_numpy(a).view(r, cols) for a in
                                                        (input_ids, position_ids, segment_ids, branch_ids))
    return MicroBatch(
        index=index, input_ids=input_ids, src=torch.from_numpy(src), dst=torch.from_numpy(rank * width + t),
        targets=torch.from_numpy(tokens[index.numpy()[rank], t + 1]), width=width,
        segment_ids=segment_ids, position_ids=position_ids,
        branch_ids=branch_ids, routing=_gather_routing(batch, (r, cols), flat, sample, pos),
        layout=(flat, sample, pos), adapter_ids=_gather_adapters(batch, (r, cols), flat, sample),
    )
