"""The verl adapter's data-parallel gather: the reduced presets' statistics of one actor update are fitted on every
data-parallel rank's rows, as one rank holding the whole rollout batch would fit them (issue 37, part 4)."""

from __future__ import annotations

from torch import Tensor

from ...reductions import EndOfSequence


def over_data_parallel_ranks(values: dict, dp_group) -> tuple[dict, slice]:
    """The statistics inputs of every rank of verl's data-parallel group (ppo_loss's dp_group), rows concatenated in
    rank order ([B, T] tensors zero-padded to the widest, eos None unless every rank has it, uid values joined), and
    this rank's rows among them: the leave-one-out statistics then come from the same rows as at world size 1 (a GRPO
    group split across ranks included). One rank, or no group: the values and all rows. Tensors travel through the
    CPU (all_gather_object would unpickle another rank's CUDA tensors onto its device index). Pinned by
    tests/verl/test_data_parallel.py."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rows = values["response_mask"].shape[0]
    if dp_group is None or not dist.is_initialized() or dist.get_world_size(dp_group) < 2:
        return values, slice(0, rows)
    eos = values["eos"]
    uid = values["uid"]
    local = {**values, "eos": None if eos is None else (eos.prob.cpu(), eos.is_eos.float().cpu()),
             "uid": None if uid is None else uid.tolist() if hasattr(uid, "tolist") else list(uid)}
    local = {k: v.cpu() if isinstance(v, Tensor) else v for k, v in local.items()}
    every = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(every, local, group=dp_group)
    width = max(v["response_mask"].shape[1] for v in every)
    device = values["response_mask"].device

    def cat(xs):
        return torch.cat([F.pad(x, (0, width - x.shape[1])) if x.dim() > 1 else x for x in xs]).to(device)

    out = {k: cat([v[k] for v in every]) for k in values if k not in ("eos", "uid")}
    out["uid"] = None if values["uid"] is None else [u for v in every for u in v["uid"]]
    out["eos"] = None if any(v["eos"] is None for v in every) else EndOfSequence(
        cat([v["eos"][0] for v in every]), cat([v["eos"][1] for v in every]) > 0.5, eos.horizon)
    start = sum(v["response_mask"].shape[0] for v in every[:dist.get_rank(dp_group)])
    return out, slice(start, start + rows)
