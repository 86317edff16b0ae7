"""knitdata.integrations.trl.cpu: the CPU stand-in for TRL's tree attention computes what plain attention does.

TRL packs the samples of a row into a prefix trie (``packing.TreeRow``): shared prompt tokens are forwarded once
and each segment attends to its root-to-segment path. With the reference attention registered under TRL's
``TREE_ATTENTION`` name, the log-probs of every trained token of a packed row must equal those of each sample run
alone through the same weights with transformers' own attention.
"""

from __future__ import annotations

import copy
import warnings

import pytest

pytest.importorskip("trl")
warnings.filterwarnings("ignore", message=".*experimental.*")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from trl.experimental.async_grpo import async_grpo_trainer  # noqa: E402
from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow  # noqa: E402

from knitdata.integrations.trl.cpu import cpu_stand_ins, register_reference_tree_attention  # noqa: E402


def _sample(ids: list[int], prompt: int, group: int) -> dict[str, object]:
    n = len(ids)
    return {"input_ids": np.array(ids), "completion_mask": np.array([0] * prompt + [1] * (n - prompt)),
            "old_log_probs": np.zeros(n, dtype=np.float32), "advantage": 1.0, "group_id": group}


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
def test_packed_tree_row_log_probs_equal_each_sample_alone(heads: int, kv_heads: int) -> None:
    register_reference_tree_attention()
    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)
    torch.manual_seed(0)
    plain = transformers.Qwen2ForCausalLM(cfg).eval()
    tree = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=TREE_ATTENTION).eval()
    assert plain.config._attn_implementation != TREE_ATTENTION
    tree.load_state_dict(plain.state_dict())
    samples = [_sample([1, 5, 6, 7, 9, 9, 2], 4, 0), _sample([1, 5, 6, 7, 11, 3], 4, 0),
               _sample([1, 5, 6, 7, 9, 12, 2], 4, 0), _sample([1, 8, 20, 21], 2, 1)]
    row = TreeRow()
    for s in samples:
        row.add(s)
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(len(s["input_ids"]) for s in samples)  # shared prefixes forwarded once
    with torch.no_grad():
        logits = tree(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                      tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
                      tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
                      tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
                      tree_max_seqlen_k=int(packed["tree_max_seqlens"][1])).logits[0]
        got = torch.log_softmax(logits, -1)[packed["token_index"], packed["shift_labels"][packed["token_index"]]]
        want = []
        for s in samples:
            ids = torch.tensor(s["input_ids"])[None]
            lp = torch.log_softmax(plain(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            want.append(lp[torch.tensor(s["completion_mask"][1:]).bool()])
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)


def test_cpu_stand_ins_replace_the_two_names_only_while_the_trainer_is_built() -> None:
    before = async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device
    with cpu_stand_ins():
        assert async_grpo_trainer.get_peak_flops_per_device(None, "float32") is None
        assert async_grpo_trainer.register_tree_attention is register_reference_tree_attention
    assert (async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device) == before
