"""Two stand-ins that let TRL 1.16's ``AsyncGRPOTrainer`` run without CUDA (tests, a laptop), and nothing else.

``AsyncGRPOTrainer.__init__`` (``trl/experimental/async_grpo/async_grpo_trainer.py``) needs a GPU in two places:

* it loads the model with ``attn_implementation="tree_fa3"`` (``packing.TREE_ATTENTION``), registered by
  ``register_tree_attention()``, whose function calls the FlashAttention-3 kernel fetched from the hub
  (``kernels.get_kernel("kernels-community/flash-attn3")``): no hub and no CUDA here;
* it calls ``get_peak_flops_per_device(accelerator, dtype)``, which calls ``torch.cuda.get_device_name``
  unconditionally (for the MFU metrics): ``AssertionError: Torch not compiled with CUDA enabled`` on CPU.

TRL has no option for either. :func:`cpu_stand_ins` replaces, while the trainer is built, the two public names the
trainer module imported (``register_tree_attention`` and ``get_peak_flops_per_device``): the first registers
:func:`reference_tree_attention` (the same computation as the kernel call, written with
``scaled_dot_product_attention``, one segment at a time: slow, for tiny models) under TRL's own
``TREE_ATTENTION`` name through transformers' public ``AttentionInterface``; the second returns ``None`` (TRL then
skips the MFU metrics, as it does for an unknown GPU). Nothing else of the trainer changes. On a GPU, do not use it.

Example::

    from knitdata.integrations.trl.cpu import cpu_stand_ins
    with cpu_stand_ins():
        pass  # trainer = AsyncGRPOTrainer(...) here; docs/trl.md runs a whole one
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from trl.experimental.async_grpo import async_grpo_trainer
from trl.experimental.async_grpo.packing import TREE_ATTENTION

__all__ = ["reference_tree_attention", "register_reference_tree_attention", "cpu_stand_ins"]


def reference_tree_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, *, tree_kv_index: torch.Tensor, tree_cu_seqlens_q: torch.Tensor,
                             tree_cu_seqlens_k: torch.Tensor, tree_max_seqlen_q: int, tree_max_seqlen_k: int,
                             scaling: float | None = None, sliding_window: int | None = None,
                             softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """TRL's ``tree_attention`` (``packing.py``) with its kernel call done in plain PyTorch.

    Segment ``i`` of the packed row (queries ``cu_q[i]:cu_q[i+1]``) attends to the key/value rows
    ``tree_kv_index[cu_k[i]:cu_k[i+1]]`` (its root-to-segment path, ending with its own tokens), causally with the
    queries aligned to the end of the path (FlashAttention's ``causal=True`` for ``seqlen_q <= seqlen_k``).
    Grouped-query heads are repeated. ``softcap`` is refused (no model used here has it).
    """
    if softcap:
        raise NotImplementedError("reference_tree_attention does not implement softcap")
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # [tokens, heads, dim]
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.empty_like(q)
    cq, ck = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)
        ks, vs = k[ck[i]:ck[i + 1]].transpose(0, 1), v[ck[i]:ck[i + 1]].transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        if sliding_window:
            allowed &= ~torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq - sliding_window)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scaling)
        out[cq[i]:cq[i + 1]] = o.transpose(0, 1)
    return out.unsqueeze(0), None


def register_reference_tree_attention() -> None:
    """Register :func:`reference_tree_attention` under TRL's ``TREE_ATTENTION`` name (what TRL's
    ``register_tree_attention`` does with the kernel)."""
    AttentionInterface.register(TREE_ATTENTION, reference_tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, lambda **kwargs: None)


@contextlib.contextmanager
def cpu_stand_ins() -> Iterator[None]:
    """While the block runs (build ``AsyncGRPOTrainer`` in it), the trainer module's ``register_tree_attention``
    registers the reference attention and its ``get_peak_flops_per_device`` returns ``None``; restored after."""
    saved = async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device
    async_grpo_trainer.register_tree_attention = register_reference_tree_attention  # type: ignore[assignment]
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None  # type: ignore[assignment]
    try:
        yield
    finally:
        async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device = saved
